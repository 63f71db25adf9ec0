// The Jinja engine's str and dict methods, and attribute and item access as jinja2's sandbox does them
// (jinja/builtins.hpp); the argument helpers the filters share.
#include "lora_trainer/jinja/builtins.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace lt::jinja::detail {

Value kwarg(Kwargs& kw, Args& args, size_t pos, const char* name, Value dflt) {
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
      check_list(words.size());
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
      const size_t f = (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) ? detail::find(s, d, b) : std::string::npos;
      if (f == std::string::npos) { parts.push_back(s.substr(b)); break; }
      parts.push_back(s.substr(b, f - b));
      check_list(parts.size());
      b = f + d.size();
    }
  } else {
    charge_bytes(times(s.size(), d.size()));  // rfind compares at each position
    size_t e = s.size();
    while (true) {
      size_t f = std::string::npos;
      if ((maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) && e >= d.size()) f = s.rfind(d, e - d.size());
      if (f == std::string::npos) { parts.push_back(s.substr(0, e)); break; }
      parts.push_back(s.substr(f + d.size(), e - f - d.size()));
      check_list(parts.size());
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
  const Text text = obj.s;  // shared, not copied
  return Value::function([text, m](Args& a, Kwargs& kw) -> Value {
    const std::string& s = text.str();
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
          check_string(out.size());
        }
        return Value::string(out);
      }
      while (count != 0) {
        const size_t f = detail::find(s, from, b);
        if (f == std::string::npos) break;
        out.append(s, b, f - b);
        out += to;
        check_string(out.size());
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
        for (size_t f = detail::find(s, x); f != std::string::npos; f = detail::find(s, x, f + x.size())) ++n;
        return Value::integer(n);
      }
      if (m == "rfind") charge_bytes(times(s.size(), x.size()));
      const size_t f = m == "find" ? detail::find(s, x) : s.rfind(x);
      return Value::integer(f == std::string::npos ? -1 : static_cast<int64_t>(decode(s.substr(0, f)).size()));
    }
    if (m == "join") {
      std::string out;
      bool first = true;
      for (const auto& v : iterate(arg(0, "iterable"))) {
        if (!first) out += s;
        out += need_string(v, "join").s;
        check_string(out.size());
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
          const size_t i = field.empty() ? auto_index++ : field.size() > 9 ? SIZE_MAX : std::stoul(field);
          if (i >= a.size()) fail("Replacement index " + std::to_string(i) + " out of range for positional args tuple");
          v = a[i];
        } else {
          auto it = std::find_if(kw.begin(), kw.end(), [&](const auto& p) { return p.first == field; });
          if (it == kw.end()) fail("KeyError: '" + field + "'");
          v = it->second;
        }
        out += to_str(v);
        check_string(out.size());
      }
      return Value::string(out);
    }
    if (m == "splitlines") {
      List out;
      std::string cur;
      for (size_t k = 0; k < s.size(); ++k) {
        if (s[k] == '\n' || s[k] == '\r') {
          check_list(out.size() + 1);
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

}  // namespace lt::jinja::detail
