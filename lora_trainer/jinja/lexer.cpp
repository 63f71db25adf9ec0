// The Jinja engine's lexer (jinja/lexer.hpp).
#include "lora_trainer/jinja/lexer.hpp"

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <cstdlib>

#include "lora_trainer/jinja/jinja.hpp"
#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja::detail {

// ---------------------------------------------------------------------------------------------------
// Lexer: the template into text and tags, with jinja2's whitespace rules applied to the text.


std::string normalized_source(const std::string& src) {
  // jinja2 reads "\r\n" and "\r" as "\n" and drops one trailing newline (keep_trailing_newline=False).
  std::string norm;
  for (size_t k = 0; k < src.size(); ++k) {
    if (src[k] == '\r') { norm += '\n'; if (k + 1 < src.size() && src[k + 1] == '\n') ++k; }
    else norm += src[k];
  }
  if (!norm.empty() && norm.back() == '\n') norm.pop_back();
  return norm;
}

std::vector<Segment> lex(std::string src, const std::string& name) {
  src = normalized_source(src);
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
    if (kind == '{') out.push_back({Segment::Kind::Output, inner, line, inner_begin, inner_end});
    else if (kind == '%') out.push_back({Segment::Kind::Statement, inner, line, inner_begin, inner_end});
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
      errno = 0;
      if (real) t.f = std::strtod(num.c_str(), nullptr);
      else t.i = std::strtoll(num.c_str(), nullptr, 10);
      if (!real && errno == ERANGE) error("the integer " + num + " does not fit 64 bits (this engine's integers are 64-bit)");
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

}  // namespace lt::jinja::detail
