// The Jinja engine's values (jinja.hpp): Python's None, bool, int, float, str (UTF-8, by code point),
// list, tuple, dict (insertion order), jinja2's Undefined and namespace, and functions; their printing
// (str and repr), truth, comparisons and operators, and transformers' tojson. Internal to the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/jinja/limits.hpp"
#include "lora_trainer/jinja/unicode.hpp"

namespace lt::jinja::detail {

// An error while evaluating: the statement that ran it adds the template's name and line.
struct EvalError {
  std::string message;
  bool raised = false;
  std::string limit;  // the limit that was hit (limits.hpp: steps, output, string, list, depth, stack), or ""
};
[[noreturn]] void fail(const std::string& msg);

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(Args&, Kwargs&)>;

// A list or dict to share between values, counted against the limits (its items), and freed without
// recursion: a list built around itself 100,000 times in a loop is freed a level at a time, not by
// 100,000 nested destructors (limits.cpp).
std::shared_ptr<List> shared_list(List l);
std::shared_ptr<Dict> shared_dict(Dict d);

// A str's text, shared by the values that hold it (Python's str is immutable): copying a value copies
// a pointer, so that a long string put in a list 100,000 times, or read from a variable in a loop,
// takes neither memory nor time.
class Text {
 public:
  Text() = default;
  Text(std::string s) : p_(s.empty() ? nullptr : std::make_shared<const std::string>(std::move(s))) {}  // NOLINT: implicit
  Text(const char* s) : Text(std::string(s)) {}                                                            // NOLINT: implicit
  const std::string& str() const { return p_ ? *p_ : empty_string(); }
  operator const std::string&() const { return str(); }  // NOLINT: implicit
  size_t size() const { return str().size(); }
  bool empty() const { return str().empty(); }
  const char* c_str() const { return str().c_str(); }
  friend bool operator==(const Text& a, const Text& b) { return a.str() == b.str(); }
  friend bool operator==(const Text& a, const std::string& b) { return a.str() == b; }
  friend bool operator!=(const Text& a, const std::string& b) { return a.str() != b; }
  friend std::string operator+(const std::string& a, const Text& b) { return a + b.str(); }
  friend std::string operator+(const Text& a, const std::string& b) { return a.str() + b; }
  friend std::string operator+(const char* a, const Text& b) { return a + b.str(); }
  friend std::string operator+(const Text& a, const char* b) { return a.str() + b; }

 private:
  static const std::string& empty_string() {
    static const std::string e;
    return e;
  }
  std::shared_ptr<const std::string> p_;
};

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Tuple, Dict, Namespace, Function };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  Text s;                           // String; Undefined: the missing name (for errors); Int: digits past int64
  std::shared_ptr<List> list;       // List, Tuple
  std::shared_ptr<Dict> dict;       // Dict, Namespace
  std::shared_ptr<Function> fn;     // Function
  bool markup = false;              // a macro's output (printing as is)

  static Value undefined(std::string name = "") { Value v; v.s = std::move(name); return v; }
  static Value none() { Value v; v.kind = Kind::None; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = Kind::Int; v.i = x; return v; }
  static Value real(double x) { Value v; v.kind = Kind::Float; v.f = x; return v; }
  static Value string(std::string x) {
    check_string(x.size());
    charge_bytes(x.size());
    Value v; v.kind = Kind::String; v.s = std::move(x); return v;
  }
  static Value of_list(List l, bool tuple = false) {
    Value v; v.kind = tuple ? Kind::Tuple : Kind::List; v.list = shared_list(std::move(l)); return v;
  }
  static Value of_dict(Dict d, bool ns = false) {
    Value v; v.kind = ns ? Kind::Namespace : Kind::Dict; v.dict = shared_dict(std::move(d)); return v;
  }
  static Value function(Function f) { Value v; v.kind = Kind::Function; v.fn = std::make_shared<Function>(std::move(f)); return v; }

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool is_string() const { return kind == Kind::String; }
  bool is_sequence() const { return kind == Kind::List || kind == Kind::Tuple; }
  bool is_mapping() const { return kind == Kind::Dict; }
  double number() const { return kind == Kind::Float ? f : kind == Kind::Bool ? (b ? 1 : 0) : static_cast<double>(i); }
  int64_t integer_value() const { return kind == Kind::Bool ? (b ? 1 : 0) : i; }

  const Value* find(const std::string& key) const {
    if (!dict) return nullptr;
    step(static_cast<int64_t>(dict->size() >> 4));  // a scan: a dict built 100,000 long is no hash table
    for (const auto& [k, v] : *dict)
      if (k == key) return &v;
    return nullptr;
  }
};

const char* type_name(const Value& v);
[[noreturn]] void undefined_error(const Value& v);
Value from_json(const nlohmann::ordered_json& j);
bool truthy(const Value& v);
std::string float_repr(double x);  // Python's repr of a float
int64_t float_to_int(double x);    // int(x), truncating; an error for inf, nan and values past 64 bits
std::string str_repr(const std::string& s);
std::string to_str(const Value& v);  // str(v), as {{ v }} prints it
std::string repr(const Value& v);
bool equal(const Value& a, const Value& b);
bool less(const Value& a, const Value& b);  // Python's <; a TypeError otherwise
List iterate(const Value& v);               // what `for` iterates: items, keys, characters; Undefined is empty
bool contains(const Value& container, const Value& item);
int64_t length(const Value& v);

// transformers' tojson: json.dumps(x, ensure_ascii, indent, separators, sort_keys).
struct JsonStyle {
  int indent = -1;  // -1: none
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false, ensure_ascii = false;
};
void to_json(std::string& out, const Value& v, const JsonStyle& st, int depth);

std::string percent_format(const std::string& fmt, const Value& values);  // 'fmt' % values
Value binary(const std::string& op, const Value& a, const Value& b);      // + - * / // % ** ~ == < in ...
Value slice(const Value& v, const Value& start, const Value& stop, const Value& step);

}  // namespace lt::jinja::detail
