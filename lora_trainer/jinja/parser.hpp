// The Jinja engine's parser: a template's segments (lexer.hpp) to its syntax tree (ast.hpp).
#pragma once

#include <string>
#include <vector>

#include "lora_trainer/jinja/ast.hpp"
#include "lora_trainer/jinja/lexer.hpp"

namespace lt::jinja::detail {

// A template's statements, and whether it has {% generation %} blocks.
struct Parsed {
  Body body;
  bool has_generation = false;
};

// Parses the segments of template `name` (a syntax error throws TemplateError naming `name` and the line).
Parsed parse(const std::vector<Segment>& segs, const std::string& name);

}  // namespace lt::jinja::detail
