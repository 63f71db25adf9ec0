// The Jinja engine (jinja.hpp): values, lexer, parser, evaluator. Semantics follow Python's jinja2 3.1
// in transformers' environment; where jinja2 leans on Python (printing, arithmetic, str methods), this
// file does what Python does.
//
// Filters: abs, capitalize, count, d/default, dictsort, first, float, indent, int, items, join, last,
// length, list, lower, map, max, min, reject, rejectattr, replace, reverse, round, safe, select,
// selectattr, sort, string, sum, title, tojson (transformers': ensure_ascii=False, indent, separators,
// sort_keys), trim, unique, upper, wordcount.
// Tests: boolean, callable, defined, divisibleby, eq/equalto/==, even, false, float, ge/>=, gt/>, in,
// integer, iterable, le/<=, lower, lt/<, mapping, ne/!=, none, number, odd, sameas, sequence, string,
// true, undefined, upper.
// Methods: str capitalize, count, endswith, find, isalnum, isalpha, isdigit, islower, isspace, isupper,
// join, lower, lstrip, replace, rfind, rsplit, rstrip, split, splitlines, startswith, strip, title,
// upper; dict get, items, keys, values.
// Globals: dict, namespace, raise_exception, range, strftime_now.
#include "lora_trainer/data/jinja.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <unordered_map>

namespace lt::jinja {

namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------------
// Errors while evaluating: the statement that ran it adds the template's name and line.
struct EvalError {
  std::string message;
  bool raised = false;
};
[[noreturn]] void fail(const std::string& msg) { throw EvalError{msg, false}; }

// Control flow of {% break %} and {% continue %}.
struct BreakLoop {};
struct ContinueLoop {};

// ---------------------------------------------------------------------------------------------------
// UTF-8 by code point, as Python's str.

std::vector<uint32_t> decode(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string encode(const std::vector<uint32_t>& cps, size_t begin = 0, size_t end = std::string::npos) {
  std::string out;
  end = std::min(end, cps.size());
  for (size_t i = begin; i < end; ++i) append_utf8(out, cps[i]);
  return out;
}

bool is_space(uint32_t c) {  // Python's str.isspace
  return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Python's str.upper/lower for Latin (Basic, Latin-1, Extended-A), Greek and Cyrillic; other
// scripts are left as they are.
bool latin_a_odd_pairs(uint32_t c) { return (c >= 0x100 && c <= 0x137) || (c >= 0x14a && c <= 0x177); }
bool latin_a_even_pairs(uint32_t c) { return (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e); }

uint32_t upper_cp(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0xb5) return c;
  if (c == 0xb5) return 0x39c;
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 32;
  if (c == 0xff) return 0x178;
  if (c == 0x131) return 'I';
  if (c == 0x17f) return 'S';
  if (latin_a_odd_pairs(c)) return c % 2 ? c - 1 : c;
  if (latin_a_even_pairs(c)) return c % 2 ? c : c - 1;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x3b1 && c <= 0x3cb) return c - 32;
  if (c == 0x3ac) return 0x386;
  if (c >= 0x3ad && c <= 0x3af) return c - 37;
  if (c == 0x3cc) return 0x38c;
  if (c == 0x3cd || c == 0x3ce) return c - 63;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}

uint32_t lower_cp(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0xc0) return c;
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 32;
  if (c == 0x178) return 0xff;
  if (latin_a_odd_pairs(c)) return c % 2 ? c : c + 1;
  if (latin_a_even_pairs(c)) return c % 2 ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3ab && c != 0x3a2) return c + 32;
  if (c == 0x386) return 0x3ac;
  if (c >= 0x388 && c <= 0x38a) return c + 37;
  if (c == 0x38c) return 0x3cc;
  if (c == 0x38e || c == 0x38f) return c + 63;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}

bool cased(uint32_t c) { return upper_cp(c) != c || lower_cp(c) != c || c == 0xdf; }

// 0 lower, 1 upper, 2 title (first cased letter of each run upper, the rest lower), 3 capitalize.
std::string change_case(const std::string& s, int mode) {
  std::string out;
  bool prev_cased = false;
  size_t k = 0;
  for (uint32_t c : decode(s)) {
    const bool up = mode == 1 || (mode == 2 && !prev_cased) || (mode == 3 && k == 0);
    if (up && c == 0xdf) out += "SS";  // ß
    else append_utf8(out, up ? upper_cp(c) : lower_cp(c));
    prev_cased = cased(c);
    ++k;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Values

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(Args&, Kwargs&)>;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Tuple, Dict, Namespace, Function };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                    // String; Undefined: the missing name (for errors)
  std::shared_ptr<List> list;       // List, Tuple
  std::shared_ptr<Dict> dict;       // Dict, Namespace
  std::shared_ptr<Function> fn;     // Function
  bool markup = false;              // a macro's output (printing as is)

  static Value undefined(std::string name = "") { Value v; v.s = std::move(name); return v; }
  static Value none() { Value v; v.kind = Kind::None; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = Kind::Int; v.i = x; return v; }
  static Value real(double x) { Value v; v.kind = Kind::Float; v.f = x; return v; }
  static Value string(std::string x) { Value v; v.kind = Kind::String; v.s = std::move(x); return v; }
  static Value of_list(List l, bool tuple = false) {
    Value v; v.kind = tuple ? Kind::Tuple : Kind::List; v.list = std::make_shared<List>(std::move(l)); return v;
  }
  static Value of_dict(Dict d, bool ns = false) {
    Value v; v.kind = ns ? Kind::Namespace : Kind::Dict; v.dict = std::make_shared<Dict>(std::move(d)); return v;
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
    for (const auto& [k, v] : *dict)
      if (k == key) return &v;
    return nullptr;
  }
};

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::None: return "NoneType";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Int: return "int";
    case Value::Kind::Float: return "float";
    case Value::Kind::String: return "str";
    case Value::Kind::List: return "list";
    case Value::Kind::Tuple: return "tuple";
    case Value::Kind::Dict: return "dict";
    case Value::Kind::Namespace: return "Namespace";
    case Value::Kind::Function: return "function";
  }
  return "?";
}

[[noreturn]] void undefined_error(const Value& v) {
  fail(v.s.empty() ? "a value is undefined" : "'" + v.s + "' is undefined");
}

Value from_json(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null: return Value::none();
    case ojson::value_t::boolean: return Value::boolean(j.get<bool>());
    case ojson::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case ojson::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      Value v = Value::integer(static_cast<int64_t>(u));
      if (u > static_cast<uint64_t>(INT64_MAX)) v.s = std::to_string(u);  // printed as it is; arithmetic wraps
      return v;
    }
    case ojson::value_t::number_float: return Value::real(j.get<double>());
    case ojson::value_t::string: return Value::string(j.get<std::string>());
    case ojson::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::of_list(std::move(l));
    }
    case ojson::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), from_json(it.value()));
      return Value::of_dict(std::move(d));
    }
    default: return Value::none();
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: case Value::Kind::None: return false;
    case Value::Kind::Bool: return v.b;
    case Value::Kind::Int: return v.i != 0;
    case Value::Kind::Float: return v.f != 0;
    case Value::Kind::String: return !v.s.empty();
    case Value::Kind::List: case Value::Kind::Tuple: return !v.list->empty();
    case Value::Kind::Dict: return !v.dict->empty();
    default: return true;
  }
}

// Python's repr of a float: the shortest digits that read back the same, positional from 1e-4 to 1e16.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*e", p - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string e = buf;  // [-]d.ddde[+-]XX
  const bool neg = e[0] == '-';
  if (neg) e = e.substr(1);
  const size_t epos = e.find('e');
  std::string digits = e.substr(0, epos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::atoi(e.c_str() + epos + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp >= -4 && exp < 16) {  // Python: repr is positional when -4 <= exp < 16
    if (exp < 0) {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out = digits + std::string(static_cast<size_t>(exp + 1) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(exp + 1)) + "." + digits.substr(static_cast<size_t>(exp + 1));
    }
    return (neg ? "-" : "") + out;
  }
  out = digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ex[16];
  std::snprintf(ex, sizeof ex, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return (neg ? "-" : "") + out + ex;
}

std::string str_repr(const std::string& s) {  // Python's repr of a str
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (uint32_t c : decode(s)) {
    if (c == static_cast<uint32_t>(q) || c == '\\') { out += '\\'; out += static_cast<char>(c); }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else append_utf8(out, c);
  }
  return out + q;
}

std::string repr(const Value& v);

// str(v), as {{ v }} prints it.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.b ? "True" : "False";
    case Value::Kind::Int: return v.s.empty() ? std::to_string(v.i) : v.s;
    case Value::Kind::Float: return float_repr(v.f);
    case Value::Kind::String: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::String: return str_repr(v.s);
    case Value::Kind::List: case Value::Kind::Tuple: {
      const bool t = v.kind == Value::Kind::Tuple;
      std::string out = t ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      if (t && v.list->size() == 1) out += ",";
      return out + (t ? ")" : "]");
    }
    case Value::Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : *v.dict) { out += (first ? "" : ", ") + str_repr(k) + ": " + repr(x); first = false; }
      return out + "}";
    }
    case Value::Kind::Namespace: return "<Namespace>";
    case Value::Kind::Function: return "<function>";
    case Value::Kind::Undefined: return "Undefined";
    default: return to_str(v);
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Float || b.kind == Value::Kind::Float) return a.number() == b.number();
    return a.integer_value() == b.integer_value();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined: case Value::Kind::None: return true;
    case Value::Kind::String: return a.s == b.s;
    case Value::Kind::List: case Value::Kind::Tuple:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, x] : *a.dict) {
        const Value* y = b.find(k);
        if (!y || !equal(x, *y)) return false;
      }
      return true;
    default: return a.dict == b.dict && a.fn == b.fn;
  }
}

// a < b (Python's ordering of numbers, strings and sequences; anything else is a TypeError).
bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Float || b.kind == Value::Kind::Float) return a.number() < b.number();
    return a.integer_value() < b.integer_value();
  }
  if (a.is_string() && b.is_string()) return a.s < b.s;  // UTF-8 byte order is code point order
  if (a.is_sequence() && b.is_sequence()) {
    const size_t n = std::min(a.list->size(), b.list->size());
    for (size_t k = 0; k < n; ++k) {
      if (less((*a.list)[k], (*b.list)[k])) return true;
      if (less((*b.list)[k], (*a.list)[k])) return false;
    }
    return a.list->size() < b.list->size();
  }
  fail(std::string("'<' not supported between instances of '") + type_name(a) + "' and '" + type_name(b) + "'");
}

// The items `for` iterates: a list's, a dict's keys, a string's characters; Undefined is empty.
List iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List: case Value::Kind::Tuple: return *v.list;
    case Value::Kind::Dict: {
      List keys;
      for (const auto& [k, x] : *v.dict) keys.push_back(Value::string(k));
      return keys;
    }
    case Value::Kind::String: {
      List chars;
      for (uint32_t c : decode(v.s)) { std::string s; append_utf8(s, c); chars.push_back(Value::string(s)); }
      return chars;
    }
    default: fail(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::String:
      if (!item.is_string()) fail(std::string("'in <string>' requires string as left operand, not ") + type_name(item));
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::List: case Value::Kind::Tuple:
      return std::any_of(container.list->begin(), container.list->end(), [&](const Value& x) { return equal(x, item); });
    case Value::Kind::Dict: return item.is_string() && container.find(item.s) != nullptr;
    case Value::Kind::Undefined: return false;
    default: fail(std::string("argument of type '") + type_name(container) + "' is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String: return static_cast<int64_t>(decode(v.s).size());
    case Value::Kind::List: case Value::Kind::Tuple: return static_cast<int64_t>(v.list->size());
    case Value::Kind::Dict: return static_cast<int64_t>(v.dict->size());
    default: fail(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

// ---------------------------------------------------------------------------------------------------
// JSON out: transformers' tojson = json.dumps(x, ensure_ascii=False, indent, separators, sort_keys).

struct JsonStyle {
  int indent = -1;  // -1: none
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false, ensure_ascii = false;
};

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (uint32_t c : decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c > 0x7e)) {
          char buf[16];
          if (c >= 0x10000) {
            const uint32_t v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
          }
          out += buf;
        } else {
          append_utf8(out, c);
        }
    }
  }
  out += '"';
}

void to_json(std::string& out, const Value& v, const JsonStyle& st, int depth) {
  auto newline = [&](int d) {
    if (st.indent < 0) return;
    out += '\n';
    out += std::string(static_cast<size_t>(st.indent * d), ' ');
  };
  switch (v.kind) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.b ? "true" : "false"; return;
    case Value::Kind::Int: out += v.s.empty() ? std::to_string(v.i) : v.s; return;
    case Value::Kind::Float:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : float_repr(v.f);
      return;
    case Value::Kind::String: json_string(out, v.s, st.ensure_ascii); return;
    case Value::Kind::List: case Value::Kind::Tuple: {
      if (v.list->empty()) { out += "[]"; return; }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += st.item_sep;
        newline(depth + 1);
        to_json(out, (*v.list)[k], st, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::Dict: {
      if (v.dict->empty()) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : *v.dict) items.push_back(&kv);
      if (st.sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += st.item_sep;
        newline(depth + 1);
        json_string(out, items[k]->first, st.ensure_ascii);
        out += st.key_sep;
        to_json(out, items[k]->second, st, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default: fail(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

// ---------------------------------------------------------------------------------------------------
// Lexer: the template into text and tags, with jinja2's whitespace rules applied to the text.

struct Segment {
  enum class Kind { Text, Output, Statement } kind;
  std::string text;  // Text: the text; else the tag's inside
  int line;
};

std::vector<Segment> lex(std::string src, const std::string& name) {
  // jinja2 reads "\r\n" and "\r" as "\n" and drops one trailing newline (keep_trailing_newline=False).
  {
    std::string norm;
    for (size_t k = 0; k < src.size(); ++k) {
      if (src[k] == '\r') { norm += '\n'; if (k + 1 < src.size() && src[k + 1] == '\n') ++k; }
      else norm += src[k];
    }
    if (!norm.empty() && norm.back() == '\n') norm.pop_back();
    src = std::move(norm);
  }
  std::vector<Segment> out;
  size_t pos = 0;
  int line = 1;
  bool line_starting = true, strip_next = false;
  auto count_lines = [](const std::string& s, size_t a, size_t b) {
    return static_cast<int>(std::count(s.begin() + static_cast<std::ptrdiff_t>(a), s.begin() + static_cast<std::ptrdiff_t>(b), '\n'));
  };
  while (pos <= src.size()) {
    size_t open = pos;
    while (true) {
      open = src.find('{', open);
      if (open == std::string::npos || open + 1 >= src.size()) { open = std::string::npos; break; }
      const char c = src[open + 1];
      if (c == '{' || c == '%' || c == '#') break;
      ++open;
    }
    std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (strip_next) {
      size_t k = 0;
      while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k]))) ++k;
      text = text.substr(k);
    }
    const int text_line = line;
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({Segment::Kind::Text, text, text_line});
      break;
    }
    line += count_lines(src, pos, open);
    const char kind = src[open + 1];
    const char flag = open + 2 < src.size() ? src[open + 2] : '\0';
    if (flag == '-') {
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    } else if (flag != '+' && kind != '{') {  // lstrip_blocks: a tag alone after indentation takes it
      const size_t l = text.rfind('\n');
      const size_t from = l == std::string::npos ? 0 : l + 1;
      if ((l != std::string::npos || line_starting) &&
          text.find_first_not_of(" \t", from) == std::string::npos)
        text.erase(from);
    }
    if (!text.empty()) out.push_back({Segment::Kind::Text, text, text_line});
    // The tag's end, past string literals in it.
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t k = open + 2 + ((flag == '-' || flag == '+') ? 1 : 0);
    const size_t inner_begin = k;
    size_t end = std::string::npos;
    char quote = 0;
    int depth = 0;  // open brackets: "}}" inside {'a': {'b': 1}} does not end the tag
    for (; k < src.size(); ++k) {
      const char c = src[k];
      if (kind != '#' && quote) {
        if (c == '\\') ++k;
        else if (c == quote) quote = 0;
        continue;
      }
      if (kind != '#' && (c == '\'' || c == '"')) { quote = c; continue; }
      if (kind != '#' && (c == '(' || c == '[' || c == '{')) { ++depth; continue; }
      if (kind != '#' && depth > 0 && (c == ')' || c == ']' || c == '}')) { --depth; continue; }
      if (src.compare(k, 2, close) == 0) { end = k; break; }
    }
    if (end == std::string::npos)
      throw TemplateError(name + " line " + std::to_string(line) + ": a tag opened with '{" + kind + "' is never closed", "", false);
    bool strip_after = false, keep_newline = false;
    size_t inner_end = end;
    if (end > inner_begin && src[end - 1] == '-') { strip_after = true; --inner_end; }
    else if (end > inner_begin && src[end - 1] == '+' && kind != '{') { keep_newline = true; --inner_end; }
    const std::string inner = src.substr(inner_begin, inner_end - inner_begin);
    if (kind == '{') out.push_back({Segment::Kind::Output, inner, line});
    else if (kind == '%') out.push_back({Segment::Kind::Statement, inner, line});
    line += count_lines(src, open, end + 2);
    pos = end + 2;
    line_starting = false;
    if (kind != '{' && !strip_after && !keep_newline && pos < src.size() && src[pos] == '\n') {  // trim_blocks
      ++pos;
      ++line;
      line_starting = true;
    }
    strip_next = strip_after;
    // {% raw %}: the text up to {% endraw %} as it is.
    if (kind == '%') {
      std::string t = inner;
      t.erase(0, t.find_first_not_of(" \t\n"));
      t.erase(t.find_last_not_of(" \t\n") + 1);
      if (t == "raw") {
        out.pop_back();
        size_t e = pos;
        while (true) {
          e = src.find("{%", e);
          if (e == std::string::npos)
            throw TemplateError(name + " line " + std::to_string(line) + ": {% raw %} is never closed by {% endraw %}", "", false);
          size_t q = e + 2;
          if (q < src.size() && (src[q] == '-' || src[q] == '+')) ++q;
          while (q < src.size() && std::isspace(static_cast<unsigned char>(src[q]))) ++q;
          if (src.compare(q, 6, "endraw") == 0) break;
          e += 2;
        }
        std::string raw = src.substr(pos, e - pos);
        if (strip_after) raw.erase(0, raw.find_first_not_of(" \t\n\r"));
        if (src[e + 2] == '-') { while (!raw.empty() && std::isspace(static_cast<unsigned char>(raw.back()))) raw.pop_back(); }
        if (!raw.empty()) out.push_back({Segment::Kind::Text, raw, line});
        line += count_lines(src, pos, e);
        pos = e;
        strip_next = false;
        line_starting = false;
        continue;  // the {% endraw %} tag itself is lexed next, as a statement the parser skips
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Expression tokens

struct Token {
  enum class Kind { Name, String, Int, Float, Op, End } kind;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

std::vector<Token> tokenize(const std::string& s, const std::function<void(const std::string&)>& error) {
  std::vector<Token> out;
  size_t k = 0;
  static const char* ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                              "=", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|"};
  while (k < s.size()) {
    const char c = s[k];
    if (std::isspace(static_cast<unsigned char>(c))) { ++k; continue; }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Token::Kind::Name, s.substr(k, e - k)});
      k = e;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = k;
      bool real = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        real = true;
        ++e;
        while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      }
      if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
        size_t q = e + 1;
        if (q < s.size() && (s[q] == '+' || s[q] == '-')) ++q;
        if (q < s.size() && std::isdigit(static_cast<unsigned char>(s[q]))) {
          real = true;
          e = q;
          while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
        }
      }
      std::string num = s.substr(k, e - k);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Token t{real ? Token::Kind::Float : Token::Kind::Int, num};
      if (real) t.f = std::strtod(num.c_str(), nullptr);
      else t.i = std::strtoll(num.c_str(), nullptr, 10);
      out.push_back(t);
      k = e;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      size_t e = k + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] != '\\' || e + 1 >= s.size()) { v += s[e]; continue; }
        const char x = s[++e];
        switch (x) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case '0': v += '\0'; break;
          case 'a': v += '\a'; break;
          case 'b': v += '\b'; break;
          case 'f': v += '\f'; break;
          case 'v': v += '\v'; break;
          case '\\': v += '\\'; break;
          case '\'': v += '\''; break;
          case '"': v += '"'; break;
          case '\n': break;
          case 'x': case 'u': case 'U': {
            const size_t n = x == 'x' ? 2 : x == 'u' ? 4 : 8;
            if (e + n >= s.size()) error("a truncated \\" + std::string(1, x) + " escape in a string");
            append_utf8(v, static_cast<uint32_t>(std::strtoul(s.substr(e + 1, n).c_str(), nullptr, 16)));
            e += n;
            break;
          }
          default: v += '\\'; v += x;
        }
      }
      if (e >= s.size()) error("a string is never closed");
      out.push_back({Token::Kind::String, v});
      k = e + 1;
      continue;
    }
    bool matched = false;
    for (const char* op : ops) {
      const size_t n = std::char_traits<char>::length(op);
      if (s.compare(k, n, op) == 0) {
        out.push_back({Token::Kind::Op, op});
        k += n;
        matched = true;
        break;
      }
    }
    if (!matched) error(std::string("unexpected character '") + c + "'");
  }
  out.push_back({Token::Kind::End, ""});
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Syntax tree

struct Scope;

struct Expr {
  virtual ~Expr() = default;
  virtual Value eval(Scope& sc) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct CallArgs {
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

}  // namespace

struct Node {
  virtual ~Node() = default;
  int line = 0;
  virtual void run(Scope& sc) const = 0;
};

namespace {

using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

// Where a render writes, and its variables.
struct Renderer {
  std::string out;
  std::vector<std::pair<size_t, size_t>> generation;
  std::function<std::string(const std::string&)> strftime_now;
  std::string name;
  std::unordered_map<std::string, Value> globals;
  int macro_depth = 0;  // macros calling macros: bounded, as Python's recursion limit bounds jinja2
};

struct Scope {
  Renderer* r;
  std::vector<std::unordered_map<std::string, Value>> frames;

  Value lookup(const std::string& n) const {
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
      auto f = it->find(n);
      if (f != it->end()) return f->second;
    }
    auto g = r->globals.find(n);
    return g != r->globals.end() ? g->second : Value::undefined(n);
  }
  void set(const std::string& n, Value v) { frames.back()[n] = std::move(v); }
};

void run_body(const Body& body, Scope& sc) {
  for (const auto& n : body) n->run(sc);
}

// Runs `f` for the statement at `line`: an EvalError becomes a TemplateError naming the template and line.
template <typename F>
void at_line(const Scope& sc, int line, F&& f) {
  try {
    f();
  } catch (const EvalError& e) {
    const std::string where = sc.r->name + " line " + std::to_string(line);
    throw TemplateError(e.raised ? where + ": the template raised an error: " + e.message : where + ": " + e.message,
                        e.message, e.raised);
  }
}

// --- expressions ---

struct Literal : Expr {
  Value v;
  explicit Literal(Value v) : v(std::move(v)) {}
  Value eval(Scope&) const override { return v; }
};

struct Name : Expr {
  std::string name;
  explicit Name(std::string n) : name(std::move(n)) {}
  Value eval(Scope& sc) const override { return sc.lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Scope& sc) const override {
    List l;
    for (const auto& e : items) l.push_back(e->eval(sc));
    return Value::of_list(std::move(l), tuple);
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Scope& sc) const override {
    Dict d;
    for (const auto& [k, v] : items) {
      Value key = k->eval(sc);
      if (!key.is_string()) fail("dict keys other than strings are not supported");
      Value val = v->eval(sc);
      auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == key.s; });
      if (it != d.end()) it->second = val;
      else d.emplace_back(key.s, val);
    }
    return Value::of_dict(std::move(d));
  }
};

Value get_attr(const Value& obj, const std::string& attr);
Value get_item(const Value& obj, const Value& key);

struct GetAttr : Expr {
  ExprPtr obj;
  std::string attr;
  Value eval(Scope& sc) const override { return get_attr(obj->eval(sc), attr); }
};

struct GetItem : Expr {
  ExprPtr obj, key;
  Value eval(Scope& sc) const override { return get_item(obj->eval(sc), key->eval(sc)); }
};

struct Slice : Expr {
  ExprPtr obj, start, stop, step;
  Value eval(Scope& sc) const override;
};

Value call(const Value& f, Args& args, Kwargs& kwargs) {
  if (f.kind != Value::Kind::Function) {
    if (f.is_undefined()) undefined_error(f);
    fail(std::string("'") + type_name(f) + "' object is not callable");
  }
  return (*f.fn)(args, kwargs);
}

void eval_args(const CallArgs& a, Scope& sc, Args& args, Kwargs& kwargs) {
  for (const auto& e : a.args) args.push_back(e->eval(sc));
  for (const auto& [k, e] : a.kwargs) kwargs.emplace_back(k, e->eval(sc));
}

struct Call : Expr {
  ExprPtr fn;
  CallArgs a;
  Value eval(Scope& sc) const override {
    Value f = fn->eval(sc);
    Args args;
    Kwargs kwargs;
    eval_args(a, sc, args, kwargs);
    return call(f, args, kwargs);
  }
};

using FilterFn = Value (*)(Value, Args&, Kwargs&);
using TestFn = bool (*)(const Value&, Args&);
const std::unordered_map<std::string, FilterFn>& filters();
const std::unordered_map<std::string, TestFn>& tests();

struct Filter : Expr {
  ExprPtr value;
  std::string name;
  FilterFn f;
  CallArgs a;
  Value eval(Scope& sc) const override {
    Value v = value->eval(sc);
    Args args;
    Kwargs kwargs;
    eval_args(a, sc, args, kwargs);
    return f(std::move(v), args, kwargs);
  }
};

struct Test : Expr {
  ExprPtr value;
  TestFn f;
  CallArgs a;
  bool negated = false;
  Value eval(Scope& sc) const override {
    Value v = value->eval(sc);
    Args args;
    Kwargs kwargs;
    eval_args(a, sc, args, kwargs);
    return Value::boolean(f(v, args) != negated);
  }
};

struct Unary : Expr {
  char op;  // '!' not, '-', '+'
  ExprPtr e;
  Value eval(Scope& sc) const override {
    Value v = e->eval(sc);
    if (op == '!') return Value::boolean(!truthy(v));
    if (v.is_undefined()) undefined_error(v);
    if (!v.is_number()) fail(std::string("bad operand type for unary ") + op + ": '" + type_name(v) + "'");
    if (v.kind == Value::Kind::Float) return Value::real(op == '-' ? -v.f : v.f);
    return Value::integer(op == '-' ? -v.integer_value() : v.integer_value());
  }
};

Value binary(const std::string& op, const Value& a, const Value& b);

struct Binary : Expr {
  std::string op;
  ExprPtr l, r;
  Value eval(Scope& sc) const override {
    if (op == "and") { Value x = l->eval(sc); return truthy(x) ? r->eval(sc) : x; }
    if (op == "or") { Value x = l->eval(sc); return truthy(x) ? x : r->eval(sc); }
    return binary(op, l->eval(sc), r->eval(sc));
  }
};

struct Conditional : Expr {
  ExprPtr cond, yes, no;  // no: may be null (Undefined)
  Value eval(Scope& sc) const override {
    if (truthy(cond->eval(sc))) return yes->eval(sc);
    return no ? no->eval(sc) : Value::undefined();
  }
};

// Python's 'fmt' % values for %s, %r, %d, %i, %f and %%; a tuple gives several values.
std::string percent_format(const std::string& fmt, const Value& values) {
  const List args = values.kind == Value::Kind::Tuple ? *values.list : List{values};
  std::string out;
  size_t next = 0;
  for (size_t k = 0; k < fmt.size(); ++k) {
    if (fmt[k] != '%') { out += fmt[k]; continue; }
    if (++k >= fmt.size()) fail("incomplete format: a '%' at the end of the string");
    const char c = fmt[k];
    if (c == '%') { out += '%'; continue; }
    if (next >= args.size()) fail("not enough arguments for format string");
    const Value& v = args[next++];
    if (c == 's') out += to_str(v);
    else if (c == 'r') out += repr(v);
    else if ((c == 'd' || c == 'i') && v.is_number()) out += std::to_string(v.kind == Value::Kind::Float ? static_cast<int64_t>(v.f) : v.integer_value());
    else if (c == 'f' && v.is_number()) { char buf[64]; std::snprintf(buf, sizeof buf, "%f", v.number()); out += buf; }
    else fail(std::string("unsupported format %") + c + " for a " + type_name(v) + " (supported: %s %r %d %i %f %%)");
  }
  if (next < args.size() && values.kind == Value::Kind::Tuple) fail("not all arguments converted during string formatting");
  return out;
}

Value binary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::string(to_str(a) + to_str(b));
  if (op == "==") return Value::boolean(equal(a, b));
  if (op == "!=") return Value::boolean(!equal(a, b));
  if (op == "<") return Value::boolean(less(a, b));
  if (op == ">") return Value::boolean(less(b, a));
  if (op == "<=") return Value::boolean(!less(b, a));
  if (op == ">=") return Value::boolean(!less(a, b));
  if (op == "in") return Value::boolean(contains(b, a));
  if (op == "not in") return Value::boolean(!contains(b, a));
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
    if (a.is_sequence() && b.kind == a.kind) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::of_list(std::move(l), a.kind == Value::Kind::Tuple);
    }
  }
  if (op == "*" && (a.is_string() || a.is_sequence()) && (b.kind == Value::Kind::Int || b.kind == Value::Kind::Bool)) {
    const int64_t n = std::max<int64_t>(0, b.integer_value());
    if (a.is_string()) { std::string s; for (int64_t k = 0; k < n; ++k) s += a.s; return Value::string(s); }
    List l;
    for (int64_t k = 0; k < n; ++k) l.insert(l.end(), a.list->begin(), a.list->end());
    return Value::of_list(std::move(l), a.kind == Value::Kind::Tuple);
  }
  if (op == "%" && a.is_string()) return Value::string(percent_format(a.s, b));
  if (!a.is_number() || !b.is_number())
    fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  const bool real = a.kind == Value::Kind::Float || b.kind == Value::Kind::Float;
  if (op == "/") {
    if (b.number() == 0) fail("division by zero");
    return Value::real(a.number() / b.number());
  }
  if (real) {
    const double x = a.number(), y = b.number();
    if (op == "+") return Value::real(x + y);
    if (op == "-") return Value::real(x - y);
    if (op == "*") return Value::real(x * y);
    if (op == "**") return Value::real(std::pow(x, y));
    if (y == 0) fail("float division by zero");
    if (op == "//") return Value::real(std::floor(x / y));
    if (op == "%") { double m = std::fmod(x, y); if (m != 0 && ((m < 0) != (y < 0))) m += y; return Value::real(m); }
  } else {
    const int64_t x = a.integer_value(), y = b.integer_value();
    if (op == "+") return Value::integer(x + y);
    if (op == "-") return Value::integer(x - y);
    if (op == "*") return Value::integer(x * y);
    if (op == "**") {
      if (y < 0) return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));
      int64_t p = 1;
      for (int64_t k = 0; k < y; ++k) p *= x;
      return Value::integer(p);
    }
    if (y == 0) fail("integer division or modulo by zero");
    int64_t q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) { --q; m += y; }
    if (op == "//") return Value::integer(q);
    if (op == "%") return Value::integer(m);
  }
  fail("unsupported operator " + op);
}

// Python's slice of a list or string.
Value slice(const Value& v, const Value& start, const Value& stop, const Value& step) {
  auto opt = [](const Value& x, const char* what) -> std::pair<bool, int64_t> {
    if (x.is_undefined() || x.is_none()) return {false, 0};
    if (x.kind != Value::Kind::Int && x.kind != Value::Kind::Bool) fail(std::string("slice ") + what + " must be an integer or None");
    return {true, x.integer_value()};
  };
  const auto [has_step, st] = opt(step, "step");
  const int64_t stp = has_step ? st : 1;
  if (stp == 0) fail("slice step cannot be zero");
  std::vector<uint32_t> cps;
  int64_t n;
  if (v.is_string()) { cps = decode(v.s); n = static_cast<int64_t>(cps.size()); }
  else if (v.is_sequence()) n = static_cast<int64_t>(v.list->size());
  else if (v.is_undefined()) undefined_error(v);
  else fail(std::string("'") + type_name(v) + "' object is not subscriptable");
  auto clamp = [&](std::pair<bool, int64_t> x, int64_t dflt) {
    if (!x.first) return dflt;
    int64_t k = x.second;
    if (k < 0) k += n;
    if (stp > 0) return std::min(std::max<int64_t>(k, 0), n);
    return std::min(std::max<int64_t>(k, -1), n - 1);
  };
  const int64_t b = clamp(opt(start, "start"), stp > 0 ? 0 : n - 1), e = clamp(opt(stop, "stop"), stp > 0 ? n : -1);
  std::vector<int64_t> idx;
  for (int64_t k = b; stp > 0 ? k < e : k > e; k += stp) idx.push_back(k);
  if (v.is_string()) {
    std::string s;
    for (int64_t k : idx) append_utf8(s, cps[static_cast<size_t>(k)]);
    return Value::string(s);
  }
  List l;
  for (int64_t k : idx) l.push_back((*v.list)[static_cast<size_t>(k)]);
  return Value::of_list(std::move(l), v.kind == Value::Kind::Tuple);
}

Value Slice::eval(Scope& sc) const {
  Value v = obj->eval(sc);
  auto ev = [&](const ExprPtr& e) { return e ? e->eval(sc) : Value::none(); };
  return slice(v, ev(start), ev(stop), ev(step));
}

// --- statements ---

struct TextNode : Node {
  std::string text;
  void run(Scope& sc) const override { sc.r->out += text; }
};

struct OutputNode : Node {
  ExprPtr e;
  void run(Scope& sc) const override {
    at_line(sc, line, [&] { sc.r->out += to_str(e->eval(sc)); });
  }
};

struct IfNode : Node {
  std::vector<std::pair<ExprPtr, Body>> branches;  // else: a null condition
  void run(Scope& sc) const override {
    for (const auto& [cond, body] : branches) {
      bool take = true;
      if (cond) at_line(sc, line, [&] { take = truthy(cond->eval(sc)); });
      if (take) { run_body(body, sc); return; }
    }
  }
};

// Assigns `v` to the target names (one name, or a tuple of names unpacking a sequence).
void assign(Scope& sc, const std::vector<std::string>& names, const Value& v) {
  if (names.size() == 1) { sc.set(names[0], v); return; }
  List items = iterate(v);
  if (items.size() != names.size())
    fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(names.size()) + " names");
  for (size_t k = 0; k < names.size(); ++k) sc.set(names[k], items[k]);
}

struct ForNode : Node {
  std::vector<std::string> targets;
  ExprPtr iter, filter;
  Body body, else_body;
  void run(Scope& sc) const override {
    List items;
    at_line(sc, line, [&] { items = iterate(iter->eval(sc)); });
    sc.frames.emplace_back();
    if (filter) {
      List kept;
      for (const auto& x : items) {
        bool keep = false;
        at_line(sc, line, [&] { assign(sc, targets, x); keep = truthy(filter->eval(sc)); });
        if (keep) kept.push_back(x);
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      Dict loop{{"index", Value::integer(k + 1)},
                {"index0", Value::integer(k)},
                {"revindex", Value::integer(n - k)},
                {"revindex0", Value::integer(n - k - 1)},
                {"first", Value::boolean(k == 0)},
                {"last", Value::boolean(k == n - 1)},
                {"length", Value::integer(n)},
                {"depth", Value::integer(1)},
                {"depth0", Value::integer(0)},
                {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("previtem")},
                {"nextitem", k + 1 < n ? items[static_cast<size_t>(k + 1)] : Value::undefined("nextitem")}};
      loop.emplace_back("cycle", Value::function([k](Args& args, Kwargs&) {
        if (args.empty()) fail("loop.cycle() needs at least one value");
        return args[static_cast<size_t>(k) % args.size()];
      }));
      sc.set("loop", Value::of_dict(std::move(loop), true));
      at_line(sc, line, [&] { assign(sc, targets, items[static_cast<size_t>(k)]); });
      try {
        run_body(body, sc);
      } catch (const BreakLoop&) {
        break;
      } catch (const ContinueLoop&) {
        continue;
      }
    }
    sc.frames.pop_back();
    if (n == 0) run_body(else_body, sc);
  }
};

struct SetNode : Node {
  std::vector<std::string> targets;  // or one namespace attribute: `ns_name`.`attr`
  std::string ns_name, attr;
  ExprPtr value;
  Body block;  // {% set x %}...{% endset %}
  void run(Scope& sc) const override {
    at_line(sc, line, [&] {
      Value v;
      if (value) {
        v = value->eval(sc);
      } else {
        std::string saved;
        std::swap(saved, sc.r->out);
        run_body(block, sc);
        std::swap(saved, sc.r->out);
        v = Value::string(saved);
      }
      if (!ns_name.empty()) {
        Value ns = sc.lookup(ns_name);
        if (ns.kind != Value::Kind::Namespace) fail("cannot assign attribute on non-namespace object '" + ns_name + "'");
        for (auto& [k, x] : *ns.dict)
          if (k == attr) { x = v; return; }
        ns.dict->emplace_back(attr, v);
        return;
      }
      assign(sc, targets, v);
    });
  }
};

struct FilterBlockNode : Node {  // {% filter name(args) %}...{% endfilter %}
  FilterFn f;
  CallArgs a;
  Body body;
  void run(Scope& sc) const override {
    std::string saved;
    std::swap(saved, sc.r->out);
    run_body(body, sc);
    std::swap(saved, sc.r->out);
    at_line(sc, line, [&] {
      Args args;
      Kwargs kwargs;
      eval_args(a, sc, args, kwargs);
      sc.r->out += to_str(f(Value::string(saved), args, kwargs));
    });
  }
};

struct LoopControl : Node {
  bool is_break;
  void run(Scope&) const override {
    if (is_break) throw BreakLoop{};
    throw ContinueLoop{};
  }
};

struct GenerationNode : Node {
  Body body;
  void run(Scope& sc) const override {
    const size_t begin = sc.r->out.size();
    run_body(body, sc);
    sc.r->generation.emplace_back(begin, sc.r->out.size());
  }
};

struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default: may be null
  Body body;
  void run(Scope& sc) const override {
    const MacroNode* self = this;
    Renderer* r = sc.r;
    auto outer = std::make_shared<std::vector<std::unordered_map<std::string, Value>>>(sc.frames);
    sc.set(name, Value::function([self, r, outer](Args& args, Kwargs& kwargs) {
      if (r->macro_depth >= 100) fail("macro '" + self->name + "' calls itself more than 100 deep");
      struct Depth {
        int& d;
        explicit Depth(int& x) : d(x) { ++d; }
        ~Depth() { --d; }
      } depth(r->macro_depth);
      Scope inner{r, *outer};
      inner.frames.emplace_back();
      if (args.size() > self->params.size()) fail("macro '" + self->name + "' takes no more than " + std::to_string(self->params.size()) + " arguments");
      for (size_t k = 0; k < self->params.size(); ++k) {
        const auto& [pname, dflt] = self->params[k];
        auto kw = std::find_if(kwargs.begin(), kwargs.end(), [&](const auto& p) { return p.first == pname; });
        if (k < args.size()) inner.set(pname, args[k]);
        else if (kw != kwargs.end()) inner.set(pname, kw->second);
        else inner.set(pname, dflt ? dflt->eval(inner) : Value::undefined(pname));
      }
      for (const auto& [k, v] : kwargs)
        if (std::none_of(self->params.begin(), self->params.end(), [&](const auto& p) { return p.first == k; }))
          fail("macro '" + self->name + "' takes no keyword argument '" + k + "'");
      std::string saved;
      std::swap(saved, r->out);
      run_body(self->body, inner);
      std::swap(saved, r->out);
      Value v = Value::string(saved);
      v.markup = true;
      return v;
    }));
  }
};

// ---------------------------------------------------------------------------------------------------
// Parser

class Parser {
 public:
  Parser(const std::vector<Segment>& segs, std::string name) : segs_(segs), name_(std::move(name)) {}

  Body parse_all() {
    Body b = parse_body({});
    if (pos_ < segs_.size()) error(segs_[pos_].line, "unexpected '" + first_word(segs_[pos_].text) + "'");
    return b;
  }
  bool saw_generation() const { return saw_generation_; }

 private:
  const std::vector<Segment>& segs_;
  std::string name_;
  size_t pos_ = 0;
  // The tokens of the tag being parsed.
  std::vector<Token> toks_;
  size_t t_ = 0;
  int line_ = 0;
  int loop_depth_ = 0;
  bool saw_generation_ = false;
  int nesting_ = 0;  // expressions within expressions, bounded (the parser recurses)

  [[noreturn]] void error(int line, const std::string& msg) const {
    throw TemplateError(name_ + " line " + std::to_string(line) + ": " + msg, msg, false);
  }
  [[noreturn]] void error(const std::string& msg) const { error(line_, msg); }

  static std::string first_word(const std::string& s) {
    std::istringstream in(s);
    std::string w;
    in >> w;
    return w;
  }

  void start(const Segment& s) {
    line_ = s.line;
    toks_ = tokenize(s.text, [&](const std::string& m) { error(m); });
    t_ = 0;
  }
  const Token& peek(size_t ahead = 0) const { return toks_[std::min(t_ + ahead, toks_.size() - 1)]; }
  bool at_op(const char* op) const { return peek().kind == Token::Kind::Op && peek().text == op; }
  bool at_name(const char* n) const { return peek().kind == Token::Kind::Name && peek().text == n; }
  Token next() { Token t = peek(); if (t_ < toks_.size() - 1) ++t_; return t; }
  std::string describe(const Token& t) const { return t.kind == Token::Kind::End ? "the end of the tag" : "'" + t.text + "'"; }
  void expect_op(const char* op) {
    if (!at_op(op)) error(std::string("expected '") + op + "', found " + describe(peek()));
    next();
  }
  std::string expect_name() {
    if (peek().kind != Token::Kind::Name) error("expected a name, found " + describe(peek()));
    return next().text;
  }
  void expect_end() {
    if (peek().kind != Token::Kind::End) error("unexpected " + describe(peek()) + " at the end of the tag");
  }

  // Nodes up to a statement whose first word is in `ends` (left unconsumed), or the end.
  Body parse_body(const std::vector<std::string>& ends) {
    Body body;
    while (pos_ < segs_.size()) {
      const Segment& s = segs_[pos_];
      if (s.kind == Segment::Kind::Text) {
        auto n = std::make_unique<TextNode>();
        n->line = s.line;
        n->text = s.text;
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      start(s);
      if (s.kind == Segment::Kind::Output) {
        auto n = std::make_unique<OutputNode>();
        n->line = s.line;
        n->e = parse_expr();
        expect_end();
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      const std::string word = peek().kind == Token::Kind::Name ? peek().text : "";
      if (std::find(ends.begin(), ends.end(), word) != ends.end()) return body;
      if (word == "endraw") { ++pos_; continue; }
      ++pos_;
      next();
      body.push_back(parse_statement(word, s.line));
    }
    if (!ends.empty()) error(segs_.empty() ? 1 : segs_.back().line, "the template ends inside a block: expected {% " + ends.back() + " %}");
    return body;
  }

  // Consumes the statement `word` that closes a block (after parse_body stopped at it).
  void close(const char* word) {
    start(segs_[pos_]);
    next();
    expect_end();
    (void)word;
    ++pos_;
  }

  NodePtr parse_statement(const std::string& word, int line) {
    Nest nest(*this);
    if (word == "if") return parse_if(line);
    if (word == "for") return parse_for(line);
    if (word == "set") return parse_set(line);
    if (word == "macro") return parse_macro(line);
    if (word == "filter") {
      auto n = std::make_unique<FilterBlockNode>();
      n->line = line;
      const std::string fname = expect_name();
      auto it = filters().find(fname);
      if (it == filters().end()) error("unknown or unsupported filter '" + fname + "'");
      n->f = it->second;
      if (at_op("(")) { next(); n->a = parse_call_args(); }
      expect_end();
      n->body = parse_body({"endfilter"});
      close("endfilter");
      return n;
    }
    if (word == "generation") {
      expect_end();
      auto n = std::make_unique<GenerationNode>();
      n->line = line;
      saw_generation_ = true;
      n->body = parse_body({"endgeneration"});
      close("endgeneration");
      return n;
    }
    if (word == "break" || word == "continue") {
      expect_end();
      if (loop_depth_ == 0) error(line, "{% " + word + " %} outside a for loop");
      auto n = std::make_unique<LoopControl>();
      n->line = line;
      n->is_break = word == "break";
      return n;
    }
    if (word.empty()) error(line, "a statement tag with no statement");
    if (word == "else" || word == "elif" || word.compare(0, 3, "end") == 0)
      error(line, "unexpected {% " + word + " %}: no block that it closes is open here");
    error(line, "unknown or unsupported statement '" + word +
                    "' (supported: if, for, set, macro, filter, generation, break, continue, raw)");
  }

  NodePtr parse_if(int line) {
    auto n = std::make_unique<IfNode>();
    n->line = line;
    ExprPtr cond = parse_expr();
    expect_end();
    while (true) {
      Body body = parse_body({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(body));
      start(segs_[pos_]);
      const std::string w = next().text;
      ++pos_;
      if (w == "endif") { expect_end(); break; }
      if (w == "else") {
        expect_end();
        n->branches.emplace_back(nullptr, parse_body({"endif"}));
        close("endif");
        break;
      }
      cond = parse_expr();  // elif
      expect_end();
    }
    return n;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = at_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (at_op(",")) { next(); names.push_back(expect_name()); }
    if (paren) expect_op(")");
    return names;
  }

  NodePtr parse_for(int line) {
    auto n = std::make_unique<ForNode>();
    n->line = line;
    n->targets = parse_targets();
    if (!at_name("in")) error("expected 'in' in the for loop, found " + describe(peek()));
    next();
    n->iter = parse_expr(false);
    if (at_name("if")) { next(); n->filter = parse_expr(false); }
    if (at_name("recursive")) error("recursive for loops are not supported");
    expect_end();
    ++loop_depth_;
    n->body = parse_body({"else", "endfor"});
    --loop_depth_;
    start(segs_[pos_]);
    const std::string w = next().text;
    ++pos_;
    expect_end();
    if (w == "else") {
      n->else_body = parse_body({"endfor"});
      close("endfor");
    }
    return n;
  }

  NodePtr parse_set(int line) {
    auto n = std::make_unique<SetNode>();
    n->line = line;
    if (peek().kind == Token::Kind::Name && peek(1).kind == Token::Kind::Op && peek(1).text == ".") {
      n->ns_name = next().text;
      next();
      n->attr = expect_name();
    } else {
      n->targets = parse_targets();
    }
    if (at_op("=")) {
      next();
      n->value = parse_tuple_or_expr();
      expect_end();
      return n;
    }
    if (!n->ns_name.empty() || n->targets.size() != 1) error("a {% set %} block assigns one name");
    if (at_op("|")) error("filters on {% set %} blocks are not supported");
    expect_end();
    n->block = parse_body({"endset"});
    close("endset");
    return n;
  }

  NodePtr parse_macro(int line) {
    auto n = std::make_unique<MacroNode>();
    n->line = line;
    n->name = expect_name();
    expect_op("(");
    while (!at_op(")")) {
      std::string p = expect_name();
      ExprPtr dflt;
      if (at_op("=")) { next(); dflt = parse_expr(); }
      n->params.emplace_back(p, std::move(dflt));
      if (!at_op(")")) expect_op(",");
    }
    next();
    expect_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    n->body = parse_body({"endmacro"});
    loop_depth_ = saved;
    close("endmacro");
    return n;
  }

  // --- expressions (jinja2's precedence) ---

  ExprPtr parse_tuple_or_expr() {
    ExprPtr first = parse_expr();
    if (!at_op(",")) return first;
    auto t = std::make_unique<ListExpr>();
    t->tuple = true;
    t->items.push_back(std::move(first));
    while (at_op(",")) {
      next();
      if (peek().kind == Token::Kind::End) break;
      t->items.push_back(parse_expr());
    }
    return t;
  }

  // Counts one level of the parser's recursion while alive: templates nested past 600 levels are refused.
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.nesting_ > 600) p.error("blocks or expressions nested too deep (the parser allows 600 levels)");
    }
    ~Nest() { --p.nesting_; }
  };

  ExprPtr parse_expr(bool with_condexpr = true) {
    Nest nest(*this);
    ExprPtr e = parse_or();
    if (!with_condexpr) return e;
    while (at_name("if")) {
      next();
      auto c = std::make_unique<Conditional>();
      c->cond = parse_or();
      c->yes = std::move(e);
      if (at_name("else")) { next(); c->no = parse_expr(); }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr make_binary(const std::string& op, ExprPtr l, ExprPtr r) {
    auto b = std::make_unique<Binary>();
    b->op = op;
    b->l = std::move(l);
    b->r = std::move(r);
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (at_name("or")) { next(); e = make_binary("or", std::move(e), parse_and()); }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (at_name("and")) { next(); e = make_binary("and", std::move(e), parse_not()); }
    return e;
  }
  ExprPtr parse_not() {
    Nest nest(*this);
    if (at_name("not")) {
      next();
      auto u = std::make_unique<Unary>();
      u->op = '!';
      u->e = parse_not();
      return u;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    while (true) {
      const Token& t = peek();
      if (t.kind == Token::Kind::Op && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" || t.text == "<=" || t.text == ">=")) {
        const std::string op = next().text;
        e = make_binary(op, std::move(e), parse_math1());
      } else if (at_name("in")) {
        next();
        e = make_binary("in", std::move(e), parse_math1());
      } else if (at_name("not") && peek(1).kind == Token::Kind::Name && peek(1).text == "in") {
        next();
        next();
        e = make_binary("not in", std::move(e), parse_math1());
      } else {
        return e;
      }
    }
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (at_op("+") || at_op("-")) {
      const std::string op = next().text;
      e = make_binary(op, std::move(e), parse_concat());
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (at_op("~")) { next(); e = make_binary("~", std::move(e), parse_math2()); }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const std::string op = next().text;
      e = make_binary(op, std::move(e), parse_pow());
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (at_op("**")) { next(); e = make_binary("**", std::move(e), parse_unary()); }
    return e;
  }
  ExprPtr parse_unary(bool with_filter = true) {
    Nest nest(*this);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      auto u = std::make_unique<Unary>();
      u->op = next().text[0];
      u->e = parse_unary(false);
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    Token t = next();
    switch (t.kind) {
      case Token::Kind::Name:
        if (t.text == "true" || t.text == "True") return std::make_unique<Literal>(Value::boolean(true));
        if (t.text == "false" || t.text == "False") return std::make_unique<Literal>(Value::boolean(false));
        if (t.text == "none" || t.text == "None") return std::make_unique<Literal>(Value::none());
        return std::make_unique<Name>(t.text);
      case Token::Kind::String: {
        std::string s = t.text;
        while (peek().kind == Token::Kind::String) s += next().text;  // adjacent literals join
        return std::make_unique<Literal>(Value::string(s));
      }
      case Token::Kind::Int: return std::make_unique<Literal>(Value::integer(t.i));
      case Token::Kind::Float: return std::make_unique<Literal>(Value::real(t.f));
      case Token::Kind::Op:
        if (t.text == "(") {
          if (at_op(")")) { next(); auto l = std::make_unique<ListExpr>(); l->tuple = true; return l; }
          ExprPtr e = parse_expr();
          if (at_op(",")) {
            auto l = std::make_unique<ListExpr>();
            l->tuple = true;
            l->items.push_back(std::move(e));
            while (at_op(",")) {
              next();
              if (at_op(")")) break;
              l->items.push_back(parse_expr());
            }
            e = std::move(l);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          auto l = std::make_unique<ListExpr>();
          while (!at_op("]")) {
            l->items.push_back(parse_expr());
            if (!at_op("]")) expect_op(",");
          }
          next();
          return l;
        }
        if (t.text == "{") {
          auto d = std::make_unique<DictExpr>();
          while (!at_op("}")) {
            ExprPtr k = parse_expr();
            expect_op(":");
            d->items.emplace_back(std::move(k), parse_expr());
            if (!at_op("}")) expect_op(",");
          }
          next();
          return d;
        }
        break;
      default: break;
    }
    error("unexpected " + describe(t) + " in an expression");
  }

  CallArgs parse_call_args() {  // after '('
    CallArgs a;
    while (!at_op(")")) {
      if (peek().kind == Token::Kind::Name && peek(1).kind == Token::Kind::Op && peek(1).text == "=") {
        std::string k = next().text;
        next();
        a.kwargs.emplace_back(k, parse_expr());
      } else {
        if (at_op("*") || at_op("**")) error("*args and **kwargs in calls are not supported");
        a.args.push_back(parse_expr());
      }
      if (!at_op(")")) expect_op(",");
    }
    next();
    return a;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (at_op(".")) {
        next();
        auto g = std::make_unique<GetAttr>();
        g->obj = std::move(e);
        if (peek().kind == Token::Kind::Int) {  // foo.0: an index
          auto gi = std::make_unique<GetItem>();
          gi->obj = std::move(g->obj);
          gi->key = std::make_unique<Literal>(Value::integer(next().i));
          e = std::move(gi);
          continue;
        }
        g->attr = expect_name();
        e = std::move(g);
      } else if (at_op("[")) {
        next();
        ExprPtr a, b, c;
        bool is_slice = false;
        if (!at_op(":")) a = parse_expr();
        if (at_op(":")) {
          is_slice = true;
          next();
          if (!at_op("]") && !at_op(":")) b = parse_expr();
          if (at_op(":")) { next(); if (!at_op("]")) c = parse_expr(); }
        }
        expect_op("]");
        if (is_slice) {
          auto s = std::make_unique<Slice>();
          s->obj = std::move(e);
          s->start = std::move(a);
          s->stop = std::move(b);
          s->step = std::move(c);
          e = std::move(s);
        } else {
          auto g = std::make_unique<GetItem>();
          g->obj = std::move(e);
          g->key = std::move(a);
          e = std::move(g);
        }
      } else if (at_op("(")) {
        next();
        auto c = std::make_unique<Call>();
        c->fn = std::move(e);
        c->a = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_filters(ExprPtr e) {
    while (true) {
      if (at_op("|")) {
        next();
        auto f = std::make_unique<Filter>();
        f->name = expect_name();
        auto it = filters().find(f->name);
        if (it == filters().end()) error("unknown or unsupported filter '" + f->name + "'");
        f->f = it->second;
        f->value = std::move(e);
        if (at_op("(")) { next(); f->a = parse_call_args(); }
        e = std::move(f);
      } else if (at_name("is")) {
        next();
        auto t = std::make_unique<Test>();
        if (at_name("not")) { next(); t->negated = true; }
        std::string name;
        if (peek().kind == Token::Kind::Name) name = next().text;
        else if (at_op("==") || at_op("!=") || at_op("<") || at_op(">") || at_op("<=") || at_op(">=")) name = next().text;
        else error("expected a test name after 'is', found " + describe(peek()));
        if (name == "none" || name == "None") name = "none";
        if (name == "true" || name == "True") name = "true";
        if (name == "false" || name == "False") name = "false";
        auto it = tests().find(name);
        if (it == tests().end()) error("unknown or unsupported test '" + name + "'");
        t->f = it->second;
        t->value = std::move(e);
        if (at_op("(")) {
          next();
          t->a = parse_call_args();
        } else if (peek().kind == Token::Kind::String || peek().kind == Token::Kind::Int || peek().kind == Token::Kind::Float ||
                   (peek().kind == Token::Kind::Name && !at_name("and") && !at_name("or") && !at_name("if") && !at_name("else") &&
                    !at_name("is") && !at_name("in") && !at_name("not"))) {
          t->a.args.push_back(parse_primary());  // `is divisibleby 3`, `is sameas x`
        }
        e = std::move(t);
      } else if (at_op("(") ) {
        next();
        auto c = std::make_unique<Call>();
        c->fn = std::move(e);
        c->a = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// Filters, tests, methods

Value kwarg(Kwargs& kw, Args& args, size_t pos, const char* name, Value dflt = Value::undefined()) {
  for (const auto& [k, v] : kw)
    if (k == name) return v;
  return pos < args.size() ? args[pos] : dflt;
}

const Value& need_string(const Value& v, const char* what) {
  if (!v.is_string()) fail(std::string(what) + " expects a string, not " + type_name(v));
  return v;
}

std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<uint32_t> cps = decode(s);
  std::vector<uint32_t> set;
  const bool ws = chars.is_undefined() || chars.is_none();
  if (!ws) set = decode(need_string(chars, "strip").s);
  auto strip_it = [&](uint32_t c) { return ws ? is_space(c) : std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left) while (b < e && strip_it(cps[b])) ++b;
  if (right) while (e > b && strip_it(cps[e - 1])) --e;
  return encode(cps, b, e);
}

List split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  List out;
  if (sep.is_undefined() || sep.is_none()) {  // runs of whitespace, no empty parts
    std::vector<uint32_t> cps = decode(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t k = 0;
    while (k < cps.size()) {
      while (k < cps.size() && is_space(cps[k])) ++k;
      if (k >= cps.size()) break;
      size_t e = k;
      while (e < cps.size() && !is_space(cps[e])) ++e;
      words.emplace_back(k, e);
      k = e;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit) {  // a remainder after maxsplit splits
      if (!from_right) {  // the rest as it is, but its leading whitespace
        const size_t rest = words[static_cast<size_t>(maxsplit)].first;
        words.resize(static_cast<size_t>(maxsplit));
        words.emplace_back(rest, cps.size());
      } else {  // the first part as it is, but its trailing whitespace
        const size_t keep_from = words.size() - static_cast<size_t>(maxsplit);
        std::vector<std::pair<size_t, size_t>> w{{0, words[keep_from - 1].second}};
        w.insert(w.end(), words.begin() + static_cast<std::ptrdiff_t>(keep_from), words.end());
        words = w;
      }
    }
    for (auto [b, e] : words) out.push_back(Value::string(encode(cps, b, e)));
    return out;
  }
  const std::string& d = need_string(sep, "split").s;
  if (d.empty()) fail("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t b = 0;
    while (true) {
      const size_t f = (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) ? s.find(d, b) : std::string::npos;
      if (f == std::string::npos) { parts.push_back(s.substr(b)); break; }
      parts.push_back(s.substr(b, f - b));
      b = f + d.size();
    }
  } else {
    size_t e = s.size();
    while (true) {
      size_t f = std::string::npos;
      if ((maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) && e >= d.size()) f = s.rfind(d, e - d.size());
      if (f == std::string::npos) { parts.push_back(s.substr(0, e)); break; }
      parts.push_back(s.substr(f + d.size(), e - f - d.size()));
      e = f;
    }
    std::reverse(parts.begin(), parts.end());
  }
  for (auto& p : parts) out.push_back(Value::string(p));
  return out;
}

bool startswith(const std::string& s, const Value& prefix, bool ends) {
  auto one = [&](const Value& p) {
    const std::string& x = need_string(p, ends ? "endswith" : "startswith").s;
    return ends ? s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0;
  };
  if (prefix.kind == Value::Kind::Tuple) return std::any_of(prefix.list->begin(), prefix.list->end(), one);
  return one(prefix);
}

int64_t int_arg(const Value& v, int64_t dflt) {
  if (v.is_undefined() || v.is_none()) return dflt;
  if (v.kind != Value::Kind::Int && v.kind != Value::Kind::Bool) fail(std::string("expected an integer, not ") + type_name(v));
  return v.integer_value();
}

Value string_method(const Value& obj, const std::string& m) {
  static const char* known[] = {"capitalize", "count", "endswith", "find", "format", "isalnum", "isalpha", "isdigit", "islower",
                                "isspace", "isupper", "join", "lower", "lstrip", "replace", "rfind", "rsplit", "rstrip",
                                "split", "splitlines", "startswith", "strip", "title", "upper"};
  if (std::find(std::begin(known), std::end(known), m) == std::end(known)) return Value::undefined(m);
  const std::string s = obj.s;
  return Value::function([s, m](Args& a, Kwargs& kw) -> Value {
    auto arg = [&](size_t k, const char* name) { return kwarg(kw, a, k, name); };
    if (m == "strip") return Value::string(strip(s, arg(0, "chars"), true, true));
    if (m == "lstrip") return Value::string(strip(s, arg(0, "chars"), true, false));
    if (m == "rstrip") return Value::string(strip(s, arg(0, "chars"), false, true));
    if (m == "split" || m == "rsplit") return Value::of_list(split(s, arg(0, "sep"), int_arg(arg(1, "maxsplit"), -1), m == "rsplit"));
    if (m == "startswith" || m == "endswith") return Value::boolean(startswith(s, arg(0, "prefix"), m == "endswith"));
    if (m == "lower") return Value::string(change_case(s, 0));
    if (m == "upper") return Value::string(change_case(s, 1));
    if (m == "title") return Value::string(change_case(s, 2));
    if (m == "capitalize") return Value::string(change_case(s, 3));
    if (m == "replace") {
      const std::string from = need_string(arg(0, "old"), "replace").s;
      const std::string to = need_string(arg(1, "new"), "replace").s;
      int64_t count = int_arg(arg(2, "count"), -1);
      std::string out;
      size_t b = 0;
      if (from.empty()) {  // Python inserts between every character
        std::vector<uint32_t> cps = decode(s);
        for (size_t k = 0; k <= cps.size(); ++k) {
          if (count < 0 || static_cast<int64_t>(k) < count) out += to;
          if (k < cps.size()) append_utf8(out, cps[k]);
        }
        return Value::string(out);
      }
      while (count != 0) {
        const size_t f = s.find(from, b);
        if (f == std::string::npos) break;
        out += s.substr(b, f - b) + to;
        b = f + from.size();
        if (count > 0) --count;
      }
      return Value::string(out + s.substr(b));
    }
    if (m == "find" || m == "rfind" || m == "count") {
      const std::string x = need_string(arg(0, "sub"), m.c_str()).s;
      if (m == "count") {
        if (x.empty()) return Value::integer(static_cast<int64_t>(decode(s).size()) + 1);
        int64_t n = 0;
        for (size_t f = s.find(x); f != std::string::npos; f = s.find(x, f + x.size())) ++n;
        return Value::integer(n);
      }
      const size_t f = m == "find" ? s.find(x) : s.rfind(x);
      return Value::integer(f == std::string::npos ? -1 : static_cast<int64_t>(decode(s.substr(0, f)).size()));
    }
    if (m == "join") {
      std::string out;
      bool first = true;
      for (const auto& v : iterate(arg(0, "iterable"))) {
        out += (first ? "" : s) + need_string(v, "join").s;
        first = false;
      }
      return Value::string(out);
    }
    if (m == "format") {  // fields {}, {0}, {name}; no format specs
      std::string out;
      size_t auto_index = 0;
      for (size_t k = 0; k < s.size(); ++k) {
        const char c = s[k];
        if ((c == '{' || c == '}') && k + 1 < s.size() && s[k + 1] == c) { out += c; ++k; continue; }
        if (c == '}') fail("single '}' encountered in format string");
        if (c != '{') { out += c; continue; }
        const size_t e = s.find('}', k);
        if (e == std::string::npos) fail("single '{' encountered in format string");
        const std::string field = s.substr(k + 1, e - k - 1);
        k = e;
        if (field.find_first_of(":!") != std::string::npos) fail("format specs and conversions in str.format are not supported");
        Value v;
        if (field.empty() || std::all_of(field.begin(), field.end(), [](char d) { return std::isdigit(static_cast<unsigned char>(d)); })) {
          const size_t i = field.empty() ? auto_index++ : std::stoul(field);
          if (i >= a.size()) fail("Replacement index " + std::to_string(i) + " out of range for positional args tuple");
          v = a[i];
        } else {
          auto it = std::find_if(kw.begin(), kw.end(), [&](const auto& p) { return p.first == field; });
          if (it == kw.end()) fail("KeyError: '" + field + "'");
          v = it->second;
        }
        out += to_str(v);
      }
      return Value::string(out);
    }
    if (m == "splitlines") {
      List out;
      std::string cur;
      for (size_t k = 0; k < s.size(); ++k) {
        if (s[k] == '\n' || s[k] == '\r') {
          out.push_back(Value::string(cur));
          cur.clear();
          if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
        } else cur += s[k];
      }
      if (!cur.empty()) out.push_back(Value::string(cur));
      return Value::of_list(std::move(out));
    }
    // is*: over the string's characters (ASCII classes; non-ASCII letters count as alpha)
    std::vector<uint32_t> cps = decode(s);
    if (cps.empty()) return Value::boolean(false);
    auto all = [&](auto pred) { return Value::boolean(std::all_of(cps.begin(), cps.end(), pred)); };
    if (m == "isdigit") return all([](uint32_t c) { return c >= '0' && c <= '9'; });
    if (m == "isalpha") return all([](uint32_t c) { return c >= 0x80 || std::isalpha(static_cast<int>(c)); });
    if (m == "isalnum") return all([](uint32_t c) { return c >= 0x80 || std::isalnum(static_cast<int>(c)); });
    if (m == "isspace") return all([](uint32_t c) { return is_space(c); });
    const bool any_cased = std::any_of(cps.begin(), cps.end(), cased);
    if (m == "islower") return Value::boolean(any_cased && std::none_of(cps.begin(), cps.end(), [](uint32_t c) { return lower_cp(c) != c; }));
    return Value::boolean(any_cased && std::none_of(cps.begin(), cps.end(), [](uint32_t c) { return upper_cp(c) != c; }));
  });
}

Value dict_method(const Value& obj, const std::string& m) {
  auto d = obj.dict;
  if (m == "items")
    return Value::function([d](Args&, Kwargs&) {
      List l;
      for (const auto& [k, v] : *d) l.push_back(Value::of_list({Value::string(k), v}, true));
      return Value::of_list(std::move(l));
    });
  if (m == "keys")
    return Value::function([d](Args&, Kwargs&) {
      List l;
      for (const auto& kv : *d) l.push_back(Value::string(kv.first));
      return Value::of_list(std::move(l));
    });
  if (m == "values")
    return Value::function([d](Args&, Kwargs&) {
      List l;
      for (const auto& kv : *d) l.push_back(kv.second);
      return Value::of_list(std::move(l));
    });
  if (m == "get")
    return Value::function([d](Args& a, Kwargs& kw) {
      const Value key = kwarg(kw, a, 0, "key");
      if (key.is_string())
        for (const auto& [k, v] : *d)
          if (k == key.s) return v;
      return kwarg(kw, a, 1, "default", Value::none());
    });
  static const char* unsafe[] = {"update", "pop", "popitem", "setdefault", "clear", "append", "extend", "insert", "remove"};
  if (std::find(std::begin(unsafe), std::end(unsafe), m) != std::end(unsafe))
    fail("access to attribute '" + m + "' of 'dict' object is unsafe (the template may not change its data)");
  return Value::undefined(m);
}

// jinja2's getattr: an attribute (a method) first, then the item.
Value get_attr(const Value& obj, const std::string& attr) {
  switch (obj.kind) {
    case Value::Kind::Undefined: undefined_error(obj);
    case Value::Kind::Dict: {
      Value m = dict_method(obj, attr);
      if (!m.is_undefined()) return m;
      const Value* v = obj.find(attr);
      return v ? *v : Value::undefined(attr);
    }
    case Value::Kind::Namespace: {
      const Value* v = obj.find(attr);
      return v ? *v : Value::undefined(attr);
    }
    case Value::Kind::String: return string_method(obj, attr);
    case Value::Kind::List: case Value::Kind::Tuple: {
      static const char* unsafe[] = {"append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse"};
      if (std::find(std::begin(unsafe), std::end(unsafe), attr) != std::end(unsafe))
        fail("access to attribute '" + attr + "' of '" + type_name(obj) + "' object is unsafe (the template may not change its data)");
      return Value::undefined(attr);
    }
    default: return Value::undefined(attr);
  }
}

// jinja2's getitem: the item first, then an attribute.
Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Value::Kind::Undefined: undefined_error(obj);
    case Value::Kind::Dict: case Value::Kind::Namespace:
      if (key.is_string()) {
        const Value* v = obj.find(key.s);
        if (v) return *v;
        return obj.kind == Value::Kind::Dict ? dict_method(obj, key.s) : Value::undefined(key.s);
      }
      return Value::undefined();
    case Value::Kind::List: case Value::Kind::Tuple: case Value::Kind::String: {
      if (key.is_string()) return get_attr(obj, key.s);
      if (key.kind != Value::Kind::Int && key.kind != Value::Kind::Bool) return Value::undefined();
      int64_t k = key.integer_value();
      if (obj.is_string()) {
        std::vector<uint32_t> cps = decode(obj.s);
        const int64_t n = static_cast<int64_t>(cps.size());
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::undefined();
        std::string c;
        append_utf8(c, cps[static_cast<size_t>(k)]);
        return Value::string(c);
      }
      const int64_t n = static_cast<int64_t>(obj.list->size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undefined();
      return (*obj.list)[static_cast<size_t>(k)];
    }
    default: return Value::undefined();
  }
}

// An attribute path as selectattr/map/sort take it ("a.b", or "0").
Value attribute_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t b = 0;
  while (true) {
    const size_t e = path.find('.', b);
    const std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    if (cur.is_undefined()) return cur;
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
           out += (first ? "" : sep) + to_str(attr.is_undefined() ? x : attribute_path(x, to_str(attr)));
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
         if (v.kind == Value::Kind::Float) return Value::integer(static_cast<int64_t>(v.f));
         if (v.is_string()) {
           const std::string t = strip(v.s, Value::undefined(), true, true);
           char* end = nullptr;
           const long long n = std::strtoll(t.c_str(), &end, 10);
           if (!t.empty() && *end == '\0') return Value::integer(n);
           const double x = std::strtod(t.c_str(), &end);
           if (!t.empty() && *end == '\0') return Value::integer(static_cast<int64_t>(x));
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
         if (v.is_number()) return Value::integer(std::llabs(v.integer_value()));
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
         const std::string pad = w.is_string() ? w.s : std::string(static_cast<size_t>(std::max<int64_t>(0, int_arg(w, 4))), ' ');
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
           if (!fill.is_undefined()) while (static_cast<int64_t>(cur.size()) < n) cur.push_back(fill);
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
      {"divisibleby", TEST(divisibleby) { return !a.empty() && a[0].integer_value() != 0 && v.integer_value() % a[0].integer_value() == 0; }},
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

// Globals: raise_exception, namespace, range, dict, strftime_now.
void add_globals(Renderer& r) {
  r.globals["raise_exception"] = Value::function([](Args& a, Kwargs&) -> Value {
    throw EvalError{a.empty() ? std::string("(no message)") : to_str(a[0]), true};
  });
  r.globals["namespace"] = Value::function([](Args& a, Kwargs& kw) {
    Dict d;
    for (const auto& x : a) {
      if (!x.is_mapping()) fail("namespace() takes keyword arguments or a dict");
      for (const auto& kv : *x.dict) d.push_back(kv);
    }
    for (const auto& kv : kw) d.push_back(kv);
    return Value::of_dict(std::move(d), true);
  });
  r.globals["dict"] = Value::function([](Args& a, Kwargs& kw) {
    Dict d;
    for (const auto& x : a)
      if (x.is_mapping())
        for (const auto& kv : *x.dict) d.push_back(kv);
    for (const auto& kv : kw) d.push_back(kv);
    return Value::of_dict(std::move(d));
  });
  r.globals["range"] = Value::function([](Args& a, Kwargs&) {
    if (a.empty() || a.size() > 3) fail("range() takes 1 to 3 integers");
    int64_t b = 0, e, st = 1;
    if (a.size() == 1) e = int_arg(a[0], 0);
    else { b = int_arg(a[0], 0); e = int_arg(a[1], 0); if (a.size() == 3) st = int_arg(a[2], 1); }
    if (st == 0) fail("range() step must not be zero");
    List l;
    for (int64_t k = b; st > 0 ? k < e : k > e; k += st) {
      l.push_back(Value::integer(k));
      if (l.size() > 100000) fail("range() of more than 100000 items");
    }
    return Value::of_list(std::move(l));
  });
  Renderer* rp = &r;
  r.globals["strftime_now"] = Value::function([rp](Args& a, Kwargs&) {
    const std::string fmt = a.empty() ? "" : to_str(a[0]);
    if (rp->strftime_now) return Value::string(rp->strftime_now(fmt));
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
    return Value::string(std::string(buf, n));
  });
}

struct Root : Node {
  Body body;
  void run(Scope& sc) const override { run_body(body, sc); }
};

}  // namespace

Template::Template(const std::string& source, std::string name) : name_(std::move(name)) {
  const std::vector<Segment> segs = lex(source, name_);
  auto root = std::make_shared<Root>();
  Parser parser(segs, name_);
  root->body = parser.parse_all();
  has_generation_ = parser.saw_generation();
  root_ = root;
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

Rendered Template::render(const nlohmann::ordered_json& context, const std::function<std::string(const std::string&)>& strftime_now) const {
  Renderer r;
  r.name = name_;
  r.strftime_now = strftime_now;
  add_globals(r);
  Scope sc{&r, {{}}};
  if (context.is_object())
    for (auto it = context.begin(); it != context.end(); ++it) sc.set(it.key(), from_json(it.value()));
  try {
    root_->run(sc);
  } catch (const EvalError& e) {  // outside any statement (should not happen)
    throw TemplateError(name_ + ": " + e.message, e.message, e.raised);
  }
  return {std::move(r.out), std::move(r.generation)};
}

}  // namespace lt::jinja
