// The Jinja engine's builtins (jinja.hpp): the filters, tests, str and dict methods that chat templates
// use, attribute and item access as jinja2's sandbox does them, and calls. Internal to the engine.
//
// Filters: abs, batch, capitalize, center, count, default, dictsort, first, float, indent, int, items,
// join, last, length, list, lower, map, max, min, reject, rejectattr, replace, reverse, round, safe,
// select, selectattr, sort, string, sum, title, tojson (transformers': ensure_ascii=False, indent,
// separators, sort_keys), trim, unique, upper, wordcount.
// Tests: boolean, callable, defined, divisibleby, eq/equalto/==, even, false, float, ge/>=, gt/>, in,
// integer, iterable, le/<=, lower, lt/<, mapping, ne/!=, none, number, odd, sameas, sequence, string,
// true, undefined, upper.
// Methods: str capitalize, count, endswith, find, format, isalnum, isalpha, isdigit, islower, isspace,
// isupper, join, lower, lstrip, replace, rfind, rsplit, rstrip, split, splitlines, startswith, strip,
// title, upper; dict get, items, keys, values (the mutating ones refused, as the sandbox refuses them).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja::detail {

using FilterFn = Value (*)(Value, Args&, Kwargs&);
using TestFn = bool (*)(const Value&, Args&);
const std::unordered_map<std::string, FilterFn>& filters();
const std::unordered_map<std::string, TestFn>& tests();

Value call(const Value& f, Args& args, Kwargs& kwargs);
Value get_attr(const Value& obj, const std::string& attr);  // jinja2's getattr: an attribute (method) first
Value get_item(const Value& obj, const Value& key);          // jinja2's getitem: the item first
int64_t int_arg(const Value& v, int64_t dflt);               // an integer argument, or dflt for None/Undefined

// What the filters share with the methods (methods.cpp).
Value kwarg(Kwargs& kw, Args& args, size_t pos, const char* name, Value dflt = Value::undefined());
const Value& need_string(const Value& v, const char* what);
std::string strip(const std::string& s, const Value& chars, bool left, bool right);
List split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right);
Value string_method(const Value& obj, const std::string& m);

}  // namespace lt::jinja::detail
