// The Jinja engine's builtins (jinja/builtins.hpp).
#include "lora_trainer/jinja/builtins.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace lt::jinja::detail {

// ---------------------------------------------------------------------------------------------------
// Filters, tests

// An attribute path as selectattr/map/sort take it ("a.b", or "0").
Value attribute_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t b = 0;
  while (true) {
    const size_t e = path.find('.', b);
    const std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    if (cur.is_undefined()) return cur;
    if (digits && part.size() > 18) return Value::undefined(part);  // no list is that long
    cur = digits ? get_item(cur, Value::integer(std::stoll(part))) : get_item(cur, Value::string(part));
    if (e == std::string::npos) return cur;
    b = e + 1;
  }
}

bool run_test(const std::string& name, const Value& v, Args& args) {
  auto it = tests().find(name);
  if (it == tests().end()) fail("unknown test '" + name + "'");
  return it->second(v, args);
}

// select/reject/selectattr/rejectattr
Value select(const Value& seq, Args& args, bool attr, bool keep) {
  size_t k = 0;
  std::string path;
  if (attr) {
    if (args.empty()) fail("selectattr/rejectattr need an attribute name");
    path = need_string(args[0], "selectattr").s;
    k = 1;
  }
  std::string test;
  if (k < args.size()) test = need_string(args[k], "the test name").s;
  Args rest(args.begin() + static_cast<std::ptrdiff_t>(std::min(args.size(), k + 1)), args.end());
  List out;
  for (const auto& x : iterate(seq)) {
    const Value subject = attr ? attribute_path(x, path) : x;
    const bool pass = test.empty() ? truthy(subject) : run_test(test, subject, rest);
    if (pass == keep) out.push_back(x);
  }
  return Value::of_list(std::move(out));
}

Value sorted(const Value& seq, bool reverse, bool case_sensitive, const std::string& path) {
  List items = iterate(seq);
  auto key = [&](const Value& v) {
    Value k = path.empty() ? v : attribute_path(v, path);
    if (!case_sensitive && k.is_string()) k = Value::string(change_case(k.s, 0));
    return k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? less(key(b), key(a)) : less(key(a), key(b));
  });
  return Value::of_list(std::move(items));
}

#define FILTER(name) [](Value v, Args& a, Kwargs& kw) -> Value
const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> f = {
      {"trim", FILTER(trim) { return Value::string(strip(to_str(v), kwarg(kw, a, 0, "chars"), true, true)); }},
      {"length", FILTER(length) { (void)a; (void)kw; return Value::integer(length(v)); }},
      {"count", FILTER(count) { (void)a; (void)kw; return Value::integer(length(v)); }},
      {"string", FILTER(string) { (void)a; (void)kw; return v.is_string() ? v : Value::string(to_str(v)); }},
      {"safe", FILTER(safe) { (void)a; (void)kw; return v; }},
      {"list", FILTER(list) { (void)a; (void)kw; return Value::of_list(iterate(v)); }},
      {"upper", FILTER(upper) { (void)a; (void)kw; return Value::string(change_case(to_str(v), 1)); }},
      {"lower", FILTER(lower) { (void)a; (void)kw; return Value::string(change_case(to_str(v), 0)); }},
      {"title", FILTER(title) { (void)a; (void)kw; return Value::string(change_case(to_str(v), 2)); }},
      {"capitalize", FILTER(capitalize) { (void)a; (void)kw; return Value::string(change_case(to_str(v), 3)); }},
      {"tojson", FILTER(tojson) {
         JsonStyle st;
         // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
         const Value indent = kwarg(kw, a, 1, "indent");
         if (!indent.is_undefined() && !indent.is_none()) st.indent = static_cast<int>(int_arg(indent, 0));
         if (st.indent >= 0) st.item_sep = ",";
         const Value seps = kwarg(kw, a, 2, "separators");
         if (seps.is_sequence() && seps.list->size() == 2) {
           st.item_sep = need_string((*seps.list)[0], "tojson separators").s;
           st.key_sep = need_string((*seps.list)[1], "tojson separators").s;
         }
         st.sort_keys = truthy(kwarg(kw, a, 3, "sort_keys"));
         st.ensure_ascii = truthy(kwarg(kw, a, 0, "ensure_ascii"));
         if (v.is_undefined()) fail("Object of type Undefined is not JSON serializable");
         std::string out;
         to_json(out, v, st, 0);
         return Value::string(out);
       }},
      {"default", FILTER(default) {
         const Value d = kwarg(kw, a, 0, "default_value", Value::string(""));
         const bool boolean = truthy(kwarg(kw, a, 1, "boolean"));
         return (v.is_undefined() || (boolean && !truthy(v))) ? d : v;
       }},
      {"first", FILTER(first) { (void)a; (void)kw; List l = iterate(v); return l.empty() ? Value::undefined("first") : l.front(); }},
      {"last", FILTER(last) { (void)a; (void)kw; List l = iterate(v); return l.empty() ? Value::undefined("last") : l.back(); }},
      {"reverse", FILTER(reverse) {
         (void)a; (void)kw;
         if (v.is_string()) { std::vector<uint32_t> c = decode(v.s); std::reverse(c.begin(), c.end()); return Value::string(encode(c)); }
         List l = iterate(v);
         std::reverse(l.begin(), l.end());
         return Value::of_list(std::move(l));
       }},
      {"join", FILTER(join) {
         const std::string sep = to_str(kwarg(kw, a, 0, "d", Value::string("")));
         const Value attr = kwarg(kw, a, 1, "attribute");
         std::string out;
         bool first = true;
         for (const auto& x : iterate(v)) {
           if (!first) out += sep;
           out += to_str(attr.is_undefined() ? x : attribute_path(x, to_str(attr)));
           check_string(out.size());
           first = false;
         }
         return Value::string(out);
       }},
      {"map", FILTER(map) {
         const Value attr = kwarg(kw, a, 99, "attribute");
         List out;
         if (!attr.is_undefined()) {
           const Value dflt = kwarg(kw, a, 99, "default");
           for (const auto& x : iterate(v)) {
             Value y = attribute_path(x, to_str(attr));
             out.push_back(y.is_undefined() && !dflt.is_undefined() ? dflt : y);
           }
           return Value::of_list(std::move(out));
         }
         if (a.empty()) fail("map needs a filter name or attribute=");
         const std::string name = need_string(a[0], "map").s;
         auto it = filters().find(name);
         if (it == filters().end()) fail("unknown filter '" + name + "' in map");
         Args rest(a.begin() + 1, a.end());
         for (const auto& x : iterate(v)) {
           Args r = rest;
           Kwargs k = kw;
           out.push_back(it->second(x, r, k));
         }
         return Value::of_list(std::move(out));
       }},
      {"select", FILTER(select) { (void)kw; return select(v, a, false, true); }},
      {"reject", FILTER(reject) { (void)kw; return select(v, a, false, false); }},
      {"selectattr", FILTER(selectattr) { (void)kw; return select(v, a, true, true); }},
      {"rejectattr", FILTER(rejectattr) { (void)kw; return select(v, a, true, false); }},
      {"unique", FILTER(unique) {
         (void)a; (void)kw;
         List out;
         for (const auto& x : iterate(v)) {
           auto norm = [](const Value& y) { return y.is_string() ? Value::string(change_case(y.s, 0)) : y; };
           if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return equal(norm(o), norm(x)); })) out.push_back(x);
         }
         return Value::of_list(std::move(out));
       }},
      {"sort", FILTER(sort) {
         const Value attr = kwarg(kw, a, 2, "attribute");
         return sorted(v, truthy(kwarg(kw, a, 0, "reverse")), truthy(kwarg(kw, a, 1, "case_sensitive")),
                       attr.is_undefined() ? "" : to_str(attr));
       }},
      {"dictsort", FILTER(dictsort) {
         if (!v.is_mapping()) fail("dictsort expects a dict");
         const bool by_value = to_str(kwarg(kw, a, 1, "by", Value::string("key"))) == "value";
         const bool reverse = truthy(kwarg(kw, a, 2, "reverse"));
         const bool cs = truthy(kwarg(kw, a, 0, "case_sensitive"));
         List items;
         for (const auto& [k, x] : *v.dict) items.push_back(Value::of_list({Value::string(k), x}, true));
         return sorted(Value::of_list(std::move(items)), reverse, cs, by_value ? "1" : "0");
       }},
      {"items", FILTER(items) {
         (void)a; (void)kw;
         if (v.is_undefined()) return Value::of_list({});
         if (!v.is_mapping()) fail("items expects a dict");
         List items;
         for (const auto& [k, x] : *v.dict) items.push_back(Value::of_list({Value::string(k), x}, true));
         return Value::of_list(std::move(items));
       }},
      {"sum", FILTER(sum) {
         const Value attr = kwarg(kw, a, 0, "attribute");
         Value total = kwarg(kw, a, 1, "start", Value::integer(0));
         for (const auto& x : iterate(v)) total = binary("+", total, attr.is_undefined() ? x : attribute_path(x, to_str(attr)));
         return total;
       }},
      {"min", FILTER(min) {
         const Value attr = kwarg(kw, a, 1, "attribute");
         Value s = sorted(v, false, truthy(kwarg(kw, a, 0, "case_sensitive")), attr.is_undefined() ? "" : to_str(attr));
         return s.list->empty() ? Value::undefined("min") : s.list->front();
       }},
      {"max", FILTER(max) {
         const Value attr = kwarg(kw, a, 1, "attribute");
         Value s = sorted(v, true, truthy(kwarg(kw, a, 0, "case_sensitive")), attr.is_undefined() ? "" : to_str(attr));
         return s.list->empty() ? Value::undefined("max") : s.list->front();
       }},
      {"int", FILTER(int) {
         const Value d = kwarg(kw, a, 0, "default", Value::integer(0));
         if (v.kind == Value::Kind::Int || v.kind == Value::Kind::Bool) return Value::integer(v.integer_value());
         if (v.kind == Value::Kind::Float) return Value::integer(float_to_int(v.f));
         if (v.is_string()) {
           const std::string t = strip(v.s, Value::undefined(), true, true);
           char* end = nullptr;
           errno = 0;
           const long long n = std::strtoll(t.c_str(), &end, 10);
           if (!t.empty() && *end == '\0') {
             if (errno == ERANGE) fail("int: " + str_repr(t) + " does not fit 64 bits (this engine's integers are 64-bit)");
             return Value::integer(n);
           }
           const double x = std::strtod(t.c_str(), &end);
           if (!t.empty() && *end == '\0') return Value::integer(float_to_int(x));
         }
         return d;
       }},
      {"float", FILTER(float) {
         const Value d = kwarg(kw, a, 0, "default", Value::real(0));
         if (v.is_number()) return Value::real(v.number());
         if (v.is_string()) {
           const std::string t = strip(v.s, Value::undefined(), true, true);
           char* end = nullptr;
           const double x = std::strtod(t.c_str(), &end);
           if (!t.empty() && *end == '\0') return Value::real(x);
         }
         return d;
       }},
      {"abs", FILTER(abs) {
         (void)a; (void)kw;
         if (v.kind == Value::Kind::Float) return Value::real(std::fabs(v.f));
         if (v.is_number()) {
           if (v.integer_value() == INT64_MIN) fail("abs: -9223372036854775808 has no 64-bit absolute value");
           return Value::integer(std::llabs(v.integer_value()));
         }
         fail(std::string("bad operand type for abs(): '") + type_name(v) + "'");
       }},
      {"round", FILTER(round) {
         const int64_t precision = int_arg(kwarg(kw, a, 0, "precision"), 0);
         const std::string method = to_str(kwarg(kw, a, 1, "method", Value::string("common")));
         if (!v.is_number()) fail("round expects a number");
         const double p = std::pow(10.0, static_cast<double>(precision)), x = v.number() * p;
         const double r = method == "floor" ? std::floor(x) : method == "ceil" ? std::ceil(x) : std::round(x);
         return Value::real(r / p);
       }},
      {"replace", FILTER(replace) {
         Value m = string_method(Value::string(to_str(v)), "replace");
         return call(m, a, kw);
       }},
      {"indent", FILTER(indent) {
         const Value w = kwarg(kw, a, 0, "width", Value::integer(4));
         const size_t width = w.is_string() ? 0 : static_cast<size_t>(std::max<int64_t>(0, int_arg(w, 4)));
         check_string(width);
         const std::string pad = w.is_string() ? w.s.str() : std::string(width, ' ');
         const bool first = truthy(kwarg(kw, a, 1, "first")), blank = truthy(kwarg(kw, a, 2, "blank"));
         const std::string s = to_str(v);
         std::string out;
         size_t b = 0;
         bool is_first = true;
         while (true) {
           const size_t e = s.find('\n', b);
           const std::string line = s.substr(b, e == std::string::npos ? std::string::npos : e - b);
           if ((is_first ? first : true) && (blank || !strip(line, Value::undefined(), true, true).empty())) out += pad;
           out += line;
           check_string(out.size());
           if (e == std::string::npos) break;
           out += '\n';
           b = e + 1;
           is_first = false;
         }
         return Value::string(out);
       }},
      {"center", FILTER(center) {
         const std::string str = to_str(v);
         const int64_t width = int_arg(kwarg(kw, a, 0, "width", Value::integer(80)), 80), n = length(Value::string(str));
         if (width <= n) return Value::string(str);
         check_string(plus(str.size(), static_cast<size_t>(width - n)));
         const int64_t marg = width - n, left = marg / 2 + (marg & width & 1);  // CPython's str.center
         return Value::string(std::string(static_cast<size_t>(left), ' ') + str + std::string(static_cast<size_t>(marg - left), ' '));
       }},
      {"batch", FILTER(batch) {
         const int64_t n = int_arg(kwarg(kw, a, 0, "linecount"), 1);
         if (n <= 0) fail("batch needs a positive count");
         const Value fill = kwarg(kw, a, 1, "fill_with");
         List out, cur;
         for (const auto& x : iterate(v)) {
           cur.push_back(x);
           if (static_cast<int64_t>(cur.size()) == n) { out.push_back(Value::of_list(cur)); cur.clear(); }
         }
         if (!cur.empty()) {
           if (!fill.is_undefined()) {
             check_list(static_cast<size_t>(n));
             while (static_cast<int64_t>(cur.size()) < n) cur.push_back(fill);
           }
           out.push_back(Value::of_list(cur));
         }
         return Value::of_list(std::move(out));
       }},
      {"wordcount", FILTER(wordcount) { (void)a; (void)kw; return Value::integer(static_cast<int64_t>(split(to_str(v), Value::undefined(), -1, false).size())); }},
  };
  return f;
}
#undef FILTER

#define TEST(name) [](const Value& v, Args& a) -> bool
const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> t = {
      {"defined", TEST(defined) { (void)a; return !v.is_undefined(); }},
      {"undefined", TEST(undefined) { (void)a; return v.is_undefined(); }},
      {"none", TEST(none) { (void)a; return v.is_none(); }},
      {"boolean", TEST(boolean) { (void)a; return v.kind == Value::Kind::Bool; }},
      {"true", TEST(true) { (void)a; return v.kind == Value::Kind::Bool && v.b; }},
      {"false", TEST(false) { (void)a; return v.kind == Value::Kind::Bool && !v.b; }},
      {"integer", TEST(integer) { (void)a; return v.kind == Value::Kind::Int; }},
      {"float", TEST(float) { (void)a; return v.kind == Value::Kind::Float; }},
      {"number", TEST(number) { (void)a; return v.is_number(); }},
      {"string", TEST(string) { (void)a; return v.is_string(); }},
      {"mapping", TEST(mapping) { (void)a; return v.is_mapping(); }},
      {"sequence", TEST(sequence) { (void)a; return v.is_sequence() || v.is_string() || v.is_mapping(); }},
      {"iterable", TEST(iterable) { (void)a; return v.is_sequence() || v.is_string() || v.is_mapping() || v.is_undefined(); }},
      {"callable", TEST(callable) { (void)a; return v.kind == Value::Kind::Function; }},
      {"odd", TEST(odd) { (void)a; return v.is_number() && v.integer_value() % 2 != 0; }},
      {"even", TEST(even) { (void)a; return v.is_number() && v.integer_value() % 2 == 0; }},
      {"divisibleby", TEST(divisibleby) {
         if (a.empty() || a[0].integer_value() == 0) return false;
         return a[0].integer_value() == -1 || v.integer_value() % a[0].integer_value() == 0;  // INT64_MIN % -1 traps
       }},
      {"eq", TEST(eq) { return !a.empty() && equal(v, a[0]); }},
      {"equalto", TEST(equalto) { return !a.empty() && equal(v, a[0]); }},
      {"==", TEST(==) { return !a.empty() && equal(v, a[0]); }},
      {"ne", TEST(ne) { return !a.empty() && !equal(v, a[0]); }},
      {"!=", TEST(!=) { return !a.empty() && !equal(v, a[0]); }},
      {"lt", TEST(lt) { return !a.empty() && less(v, a[0]); }},
      {"<", TEST(<) { return !a.empty() && less(v, a[0]); }},
      {"gt", TEST(gt) { return !a.empty() && less(a[0], v); }},
      {">", TEST(>) { return !a.empty() && less(a[0], v); }},
      {"le", TEST(le) { return !a.empty() && !less(a[0], v); }},
      {"<=", TEST(<=) { return !a.empty() && !less(a[0], v); }},
      {"ge", TEST(ge) { return !a.empty() && !less(v, a[0]); }},
      {">=", TEST(>=) { return !a.empty() && !less(v, a[0]); }},
      {"in", TEST(in) { return !a.empty() && contains(a[0], v); }},
      {"sameas", TEST(sameas) {
         if (a.empty()) return false;
         const Value& o = a[0];
         if (v.kind != o.kind) return false;
         if (v.is_none() || v.is_undefined()) return true;
         if (v.kind == Value::Kind::Bool) return v.b == o.b;
         return (v.list && v.list == o.list) || (v.dict && v.dict == o.dict);
       }},
      {"lower", TEST(lower) { (void)a; return v.is_string() && change_case(v.s, 0) == v.s; }},
      {"upper", TEST(upper) { (void)a; return v.is_string() && change_case(v.s, 1) == v.s; }},
  };
  return t;
}
#undef TEST

Value call(const Value& f, Args& args, Kwargs& kwargs) {
  if (f.kind != Value::Kind::Function) {
    if (f.is_undefined()) undefined_error(f);
    fail(std::string("'") + type_name(f) + "' object is not callable");
  }
  return (*f.fn)(args, kwargs);
}

}  // namespace lt::jinja::detail
