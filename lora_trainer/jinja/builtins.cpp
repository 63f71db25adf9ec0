// The Jinja engine's builtins (jinja/builtins.hpp).
#include "lora_trainer/jinja/builtins.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace lt::jinja::detail {

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
