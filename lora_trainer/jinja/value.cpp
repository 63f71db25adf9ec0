// The Jinja engine's values (jinja/value.hpp): printing, comparisons and operators as Python does them.
#include "lora_trainer/jinja/value.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace lt::jinja::detail {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------------
// Errors while evaluating: the statement that ran it adds the template's name and line.
[[noreturn]] void fail(const std::string& msg) { throw EvalError{msg, false, ""}; }

// ---------------------------------------------------------------------------------------------------
// Values


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

namespace {

// from_json, repr, equal, less and to_json recurse into lists and dicts: a value nested deeper than this (a list
// built around itself in a loop, or one holding itself) is an error, not a stack overflow.
constexpr int kMaxValueDepth = 512;
struct Recursion {
  Recursion() {
    step();
    if (++level() > kMaxValueDepth) {
      --level();
      fail("a value nested more than " + std::to_string(kMaxValueDepth) + " levels deep, or holding itself");
    }
  }
  ~Recursion() { --level(); }
  Recursion(const Recursion&) = delete;
  Recursion& operator=(const Recursion&) = delete;
  static int& level() {
    thread_local int n = 0;
    return n;
  }
};

}  // namespace

std::string repr(const Value& v);

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
      Recursion guard;
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::of_list(std::move(l));
    }
    case ojson::value_t::object: {
      Recursion guard;
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), from_json(it.value()));
      return Value::of_dict(std::move(d));
    }
    default: return Value::none();
  }
}

int64_t float_to_int(double x) {
  // -2^63 and 2^63 are exact as doubles; NaN fails both comparisons.
  if (!(x >= -9223372036854775808.0 && x < 9223372036854775808.0))
    fail("cannot convert the float " + float_repr(x) + " to an integer (this engine's integers are 64-bit)");
  return static_cast<int64_t>(x);
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


// str(v), as {{ v }} prints it.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.b ? "True" : "False";
    case Value::Kind::Int: return v.s.empty() ? std::to_string(v.i) : v.s.str();
    case Value::Kind::Float: return float_repr(v.f);
    case Value::Kind::String: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  Recursion guard;
  switch (v.kind) {
    case Value::Kind::String: return str_repr(v.s);
    case Value::Kind::List: case Value::Kind::Tuple: {
      const bool t = v.kind == Value::Kind::Tuple;
      std::string out = t ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        const size_t before = out.size();
        out += (k ? ", " : "") + repr((*v.list)[k]);
        charge_bytes(out.size() - before);
        check_string(out.size());
      }
      if (t && v.list->size() == 1) out += ",";
      return out + (t ? ")" : "]");
    }
    case Value::Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : *v.dict) {
        const size_t before = out.size();
        out += (first ? "" : ", ") + str_repr(k) + ": " + repr(x);
        charge_bytes(out.size() - before);
        check_string(out.size());
        first = false;
      }
      return out + "}";
    }
    case Value::Kind::Namespace: return "<Namespace>";
    case Value::Kind::Function: return "<function>";
    case Value::Kind::Undefined: return "Undefined";
    default: return to_str(v);
  }
}

bool equal(const Value& a, const Value& b) {
  step();
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Float || b.kind == Value::Kind::Float) return a.number() == b.number();
    return a.integer_value() == b.integer_value();
  }
  if (a.kind != b.kind) return false;
  Recursion guard;
  switch (a.kind) {
    case Value::Kind::Undefined: case Value::Kind::None: return true;
    case Value::Kind::String: charge_bytes(std::min(a.s.size(), b.s.size())); return a.s == b.s;
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
  step();
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Float || b.kind == Value::Kind::Float) return a.number() < b.number();
    return a.integer_value() < b.integer_value();
  }
  if (a.is_string() && b.is_string()) {  // UTF-8 byte order is code point order
    charge_bytes(std::min(a.s.size(), b.s.size()));
    return a.s.str() < b.s.str();
  }
  if (a.is_sequence() && b.is_sequence()) {
    Recursion guard;
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
    case Value::Kind::List: case Value::Kind::Tuple: step(static_cast<int64_t>(v.list->size())); return *v.list;
    case Value::Kind::Dict: {
      List keys;
      for (const auto& [k, x] : *v.dict) keys.push_back(Value::string(k));
      return keys;
    }
    case Value::Kind::String: {
      const std::vector<uint32_t> cps = decode(v.s);
      check_list(cps.size());
      List chars;
      for (uint32_t c : cps) { std::string s; append_utf8(s, c); chars.push_back(Value::string(s)); }
      return chars;
    }
    default: fail(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::String:
      if (!item.is_string()) fail(std::string("'in <string>' requires string as left operand, not ") + type_name(item));
      return detail::find(container.s, item.s) != std::string::npos;
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
    case Value::Kind::String: {  // decode's count, without its copy (4 bytes a character)
      const std::string& t = v.s;
      charge_bytes(t.size());
      int64_t n = 0;
      for (size_t i = 0; i < t.size(); ++n) {
        const auto c = static_cast<unsigned char>(t[i]);
        const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
        i += i + len > t.size() ? 1 : len;
      }
      return n;
    }
    case Value::Kind::List: case Value::Kind::Tuple: return static_cast<int64_t>(v.list->size());
    case Value::Kind::Dict: return static_cast<int64_t>(v.dict->size());
    default: fail(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

// ---------------------------------------------------------------------------------------------------
// JSON out: transformers' tojson = json.dumps(x, ensure_ascii=False, indent, separators, sort_keys).


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
  Recursion guard;
  auto newline = [&](int d) {
    if (st.indent < 0) return;
    const size_t pad = times(static_cast<size_t>(st.indent), static_cast<size_t>(d));
    check_string(plus(out.size(), pad));
    charge_bytes(pad);
    out += '\n';
    out.append(pad, ' ');
  };
  switch (v.kind) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.b ? "true" : "false"; return;
    case Value::Kind::Int: out += v.s.empty() ? std::to_string(v.i) : v.s.str(); return;
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
        check_string(out.size());
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
        check_string(out.size());
      }
      newline(depth);
      out += '}';
      return;
    }
    default: fail(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

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
    else if ((c == 'd' || c == 'i') && v.is_number()) out += std::to_string(v.kind == Value::Kind::Float ? float_to_int(v.f) : v.integer_value());
    else if (c == 'f' && v.is_number()) { char buf[400]; std::snprintf(buf, sizeof buf, "%f", v.number()); out += buf; }
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
    if (a.is_string() && b.is_string()) return Value::string(a.s.str() + b.s.str());
    if (a.is_sequence() && b.kind == a.kind) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::of_list(std::move(l), a.kind == Value::Kind::Tuple);
    }
  }
  if (op == "*" && (a.is_string() || a.is_sequence()) && (b.kind == Value::Kind::Int || b.kind == Value::Kind::Bool)) {
    const auto n = static_cast<size_t>(std::max<int64_t>(0, b.integer_value()));
    if (a.is_string()) {
      check_string(times(a.s.size(), n));  // before the memory is taken: 'x' * 10**12 is refused, not attempted
      std::string s;
      s.reserve(a.s.size() * n);
      for (size_t k = 0; k < n; ++k) s += a.s;
      return Value::string(s);
    }
    check_list(times(a.list->size(), n));
    List l;
    for (size_t k = 0; k < n; ++k) l.insert(l.end(), a.list->begin(), a.list->end());
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
    if (op == "**") {  // Python: an overflow and 0.0 to a negative power are errors, not inf
      if (x == 0 && y < 0) fail("0.0 cannot be raised to a negative power");
      const double r = std::pow(x, y);
      if (std::isinf(r) && std::isfinite(x) && std::isfinite(y))
        fail("(34, 'Numerical result out of range'): " + to_str(a) + " ** " + to_str(b) + " overflows a float");
      return Value::real(r);
    }
    if (y == 0) fail("float division by zero");
    if (op == "//") return Value::real(std::floor(x / y));
    if (op == "%") { double m = std::fmod(x, y); if (m != 0 && ((m < 0) != (y < 0))) m += y; return Value::real(m); }
  } else {
    // Python's integers have no bound; this engine's are 64-bit, and a result past them is an error
    // rather than a wrapped number (or, for 2 ** 4000000000000000000, a loop of that many steps).
    const int64_t x = a.integer_value(), y = b.integer_value();
    int64_t r = 0;
    auto overflow = [&]() -> Value {
      fail("integer overflow: " + to_str(a) + " " + op + " " + to_str(b) +
           " does not fit 64 bits (this engine's integers are 64-bit; jinja2's have no bound)");
    };
    if (op == "+") return __builtin_add_overflow(x, y, &r) ? overflow() : Value::integer(r);
    if (op == "-") return __builtin_sub_overflow(x, y, &r) ? overflow() : Value::integer(r);
    if (op == "*") return __builtin_mul_overflow(x, y, &r) ? overflow() : Value::integer(r);
    if (op == "**") {
      if (y < 0) {
        if (x == 0) fail("0.0 cannot be raised to a negative power");
        return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));
      }
      int64_t p = 1, base = x;  // by squaring: 64 multiplications at most
      for (int64_t e = y; e > 0; e >>= 1) {
        if ((e & 1) && __builtin_mul_overflow(p, base, &p)) return overflow();
        if (e > 1 && __builtin_mul_overflow(base, base, &base)) return overflow();
      }
      return Value::integer(p);
    }
    if (y == 0) fail("integer division or modulo by zero");
    if (x == INT64_MIN && y == -1) {
      if (op == "%") return Value::integer(0);
      return overflow();
    }
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
  std::vector<int64_t> idx;  // b, b + step, ... short of e: counted first, so that a huge step cannot overflow
  const uint64_t dist = static_cast<uint64_t>(stp > 0 ? e - b : b - e);
  const uint64_t mag = stp > 0 ? static_cast<uint64_t>(stp) : static_cast<uint64_t>(-(stp + 1)) + 1;
  const uint64_t count = (stp > 0 ? e > b : b > e) ? (dist - 1) / mag + 1 : 0;
  for (uint64_t j = 0; j < count; ++j) idx.push_back(b + static_cast<int64_t>(j) * stp);
  if (v.is_string()) {
    std::string s;
    for (int64_t k : idx) append_utf8(s, cps[static_cast<size_t>(k)]);
    return Value::string(s);
  }
  List l;
  for (int64_t k : idx) l.push_back((*v.list)[static_cast<size_t>(k)]);
  return Value::of_list(std::move(l), v.kind == Value::Kind::Tuple);
}

}  // namespace lt::jinja::detail
