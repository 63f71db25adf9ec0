// A Jinja template engine: the subset that Hugging Face chat templates use, rendering as Python's
// jinja2 does in the environment transformers builds for `apply_chat_template` (an immutable sandbox,
// trim_blocks, lstrip_blocks, the loop-controls extension, no autoescape, Undefined for missing
// names). No Debian release the project builds on packages a Jinja-compatible C++ engine (minja is in
// sid only, and differs from jinja2 on whitespace, none, division and Unicode: docs/chat.md).
//
// What is here: text, {{ }}, {% %} and {# #} with `-`/`+` whitespace control; if/elif/else, for (tuple
// targets, `if` filter, else, loop.*, break/continue), set (names, tuples, namespace attributes, blocks),
// macros, {% generation %} (transformers' assistant-span tag); Python values (None, bool, int, float,
// str by code point, list, tuple, dict in insertion order) with Python's printing, arithmetic and
// comparisons; the filters, tests, string/dict methods and globals that chat templates use
// (jinja/builtins.hpp lists them). Anything else is refused when the template is parsed, or when it runs, with
// the template's name and line; so is a render past its limits of work and memory (jinja/limits.hpp). Checked byte for byte against python3-jinja2 (tests/jinja/test_jinja.cpp,
// scripts/jinja_golden.py).
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/jinja/limits.hpp"

namespace lt::jinja {

// A template that could not be parsed or failed while rendering, as "NAME line N: reason"; a template's
// own raise_exception(msg) is one of these too (`raised` true, `message` msg), and so is a render
// stopped by its limits (`limit`: which one, limits.hpp).
class TemplateError : public UserError {
 public:
  TemplateError(const std::string& what, std::string message, bool raised, std::string limit = "")
      : UserError(what), message(std::move(message)), raised(raised), limit(std::move(limit)) {}
  std::string message;
  bool raised;
  std::string limit;
};

// How a render is bounded (limits.hpp).
struct RenderOptions {
  Limits limits;
  // Steps spent by earlier renders of the same task (the renders of one conversation), counted against
  // limits.steps with this render's own.
  int64_t steps_spent = 0;
};

// What a render produced: the text, and the [begin, end) byte ranges of text written inside
// {% generation %} blocks, in order.
struct Rendered {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
  // For each item of the context's `messages`: where in `text` the last `for` iteration over it began
  // (while writing the text itself, not a macro's or a {% set %} block's), or -1. ChatTemplate finds
  // the turns of a conversation from them.
  std::vector<int64_t> message_starts;
  int64_t steps = 0;  // steps_spent and this render's
};

struct Node;

class Template {
 public:
  // Parses `source` (a syntax error throws TemplateError naming `name` and the line).
  Template(const std::string& source, std::string name);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the variables of `context` (an object; key order is kept, as in Python's dicts, for
  // tojson and items()). `now` formats strftime_now(fmt): the current local time when not given.
  // A render that passes options.limits stops with a TemplateError naming the template, the line and the
  // limit.
  Rendered render(const nlohmann::ordered_json& context,
                  const std::function<std::string(const std::string&)>& strftime_now = nullptr,
                  const RenderOptions& options = {}) const;

  const std::string& name() const { return name_; }
  // Whether the template has {% generation %} blocks (outside comments and raw text).
  bool has_generation() const { return has_generation_; }

 private:
  std::string name_;
  std::shared_ptr<const Node> root_;
  bool has_generation_ = false;
};

// `source` for renderers without transformers' {% generation %} tag (jinja2 without its extension,
// llama.cpp's minja): each {% generation %} and {% endgeneration %} outside comments and raw text made
// {% if true %} and {% endif %}, their whitespace control kept, so every render is the same text. As
// jinja2 reads it ("\r\n" as "\n"), ending with the one newline jinja2 drops. A syntax error throws
// TemplateError naming `name`.
std::string without_generation_tags(const std::string& source, const std::string& name);

}  // namespace lt::jinja
