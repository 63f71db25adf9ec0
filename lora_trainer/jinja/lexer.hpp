// The Jinja engine's lexer (jinja.hpp): a template into text and tags with jinja2's whitespace rules
// (trim_blocks, lstrip_blocks, `-` and `+`, newlines normalised, one trailing newline dropped, raw
// blocks), and a tag's inside into tokens. Internal to the engine.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace lt::jinja::detail {

struct Segment {
  enum class Kind { Text, Output, Statement } kind;
  std::string text;  // Text: the text; else the tag's inside
  int line;
  size_t begin = 0, end = 0;  // Output, Statement: where the inside is in normalized_source(src)
};

// The source as jinja2 reads it: "\r\n" and "\r" as "\n", one trailing newline dropped.
std::string normalized_source(const std::string& src);

// Throws TemplateError naming `name` and the line of a tag that is never closed.
std::vector<Segment> lex(std::string src, const std::string& name);

struct Token {
  enum class Kind { Name, String, Int, Float, Op, End } kind;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

// The tokens of an expression, ending with an End token; `error` is called (and must throw) on a
// character or string it cannot read.
std::vector<Token> tokenize(const std::string& s, const std::function<void(const std::string&)>& error);

}  // namespace lt::jinja::detail
