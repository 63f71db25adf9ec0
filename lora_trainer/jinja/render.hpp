// The state of a Jinja render (jinja.hpp): where it writes, and its variables. The syntax tree's
// evaluation (ast.hpp) is in render.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja::detail {

// Where a render writes, and its variables.
struct Renderer {
  std::string out;
  int capture = 0;  // > 0 while `out` is a macro's, a {% set %} block's or a {% filter %} block's own text
  std::vector<std::pair<size_t, size_t>> generation;
  std::function<std::string(const std::string&)> strftime_now;
  std::string name;
  std::unordered_map<std::string, Value> globals;
  std::unordered_map<const Dict*, size_t> message_index;  // the context's messages, by identity
  std::vector<int64_t> message_starts;                    // Rendered::message_starts
  // Every namespace made, so that one holding itself (ns.x = [ns]) is emptied, and freed, at the end.
  std::vector<std::weak_ptr<Dict>> namespaces;
  ~Renderer() {
    for (auto& w : namespaces)
      if (auto d = w.lock()) d->clear();
  }
};

// The variables of a template, a for loop or a macro call. Shared: a macro sees the frames around its
// definition as they are when it is called (itself, and macros and names set later at the top level
// included), as jinja2's closures do.
using Frame = std::unordered_map<std::string, Value>;

struct Scope {
  Renderer* r;
  std::vector<std::shared_ptr<Frame>> frames;

  Value lookup(const std::string& n) const {
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
      auto f = (*it)->find(n);
      if (f != (*it)->end()) return f->second;
    }
    auto g = r->globals.find(n);
    return g != r->globals.end() ? g->second : Value::undefined(n);
  }
  void set(const std::string& n, Value v) { (*frames.back())[n] = std::move(v); }
  void push() { frames.push_back(std::make_shared<Frame>()); }
};

// Globals: raise_exception, namespace, range, dict, strftime_now.
void add_globals(Renderer& r);

}  // namespace lt::jinja::detail
