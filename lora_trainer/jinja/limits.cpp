// Bounds on a render's work and memory (jinja/limits.hpp), and the freeing of lists and dicts without
// recursion (value.hpp's shared_list, shared_dict).
#include "lora_trainer/jinja/limits.hpp"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/jinja/value.hpp"

namespace lt::jinja {

void Limits::set(const std::string& assignment, const std::string& option) {
  const size_t eq = assignment.find('=');
  const std::string name = assignment.substr(0, eq), value = eq == std::string::npos ? "" : assignment.substr(eq + 1);
  int64_t* slot = name == "steps"    ? &steps
                  : name == "output" ? &output
                  : name == "string" ? &string
                  : name == "list"   ? &list
                  : name == "depth"  ? &depth
                                     : nullptr;
  if (!slot || eq == std::string::npos)
    throw UserError(option + " " + assignment + ": expected NAME=N with NAME one of steps, output, string, list, depth "
                    "(e.g. " + option + " steps=200000000)");
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE || n < 1)
    throw UserError(option + " " + assignment + ": " + name + " must be a positive integer (at most 9223372036854775807)");
  *slot = n;
}

namespace detail {

namespace {

// The lowest address this thread's recursion may reach: its stack's end plus a margin for the frames
// that run after the check (the error's own, a builtin's). Looked up once per thread.
const char* stack_floor() {
  thread_local const char* floor = [] {
    pthread_attr_t attr;
    void* low = nullptr;
    size_t size = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      pthread_attr_getstack(&attr, &low, &size);
      pthread_attr_destroy(&attr);
    }
    if (!low || size < (size_t{1} << 20)) {  // unknown or small: allow 256 KiB below here
      const char* here = static_cast<const char*>(__builtin_frame_address(0));
      return here - (size_t{256} << 10);
    }
    // A quarter of the stack (at least 512 KiB) stays free; ASan's frames are several times larger.
    const size_t margin = std::max(size / 4, size_t{512} << 10);
    return static_cast<const char*>(low) + margin;
  }();
  return floor;
}

std::string raise_hint(const char* name) {
  return std::string("; raise it with --chat-limit ") + name + "=N";
}

}  // namespace

ActiveBudget::ActiveBudget(Budget& b) : saved_(active_budget()) {
  b.stack_floor = stack_floor();
  active_budget() = &b;
}
ActiveBudget::~ActiveBudget() { active_budget() = saved_; }

void over_steps(const Budget& b) {
  throw EvalError{"the template did more than " + std::to_string(b.limits.steps) +
                      " steps of work (statements, expressions, loop iterations, items, 16-byte pieces of text made, "
                      "searched or written; the limit steps, counted over the renders of one conversation): it may loop "
                      "without end" +
                      raise_hint("steps"),
                  false, "steps"};
}

void over_stack() {
  throw EvalError{"the template recurses deeper than the stack allows (macros calling macros, with nested expressions "
                  "and blocks)",
                  false, "stack"};
}

void over_depth(const Budget& b, const std::string& macro) {
  throw EvalError{"macro '" + macro + "' called " + std::to_string(b.limits.depth) +
                      " macros deep (the limit depth; jinja2 stops near 190, at Python's recursion limit)" +
                      raise_hint("depth"),
                  false, "depth"};
}

void check_string(size_t n) {
  Budget* b = active_budget();
  if (b && n > static_cast<uint64_t>(b->limits.string))
    throw EvalError{"a string of " + std::to_string(n) + " bytes, longer than the limit string (" +
                        std::to_string(b->limits.string) + " bytes)" + raise_hint("string"),
                    false, "string"};
}

void check_list(size_t n) {
  Budget* b = active_budget();
  if (b && n > static_cast<uint64_t>(b->limits.list))
    throw EvalError{"a list of " + std::to_string(n) + " items, more than the limit list (" + std::to_string(b->limits.list) +
                        " items)" + raise_hint("list"),
                    false, "list"};
}

void check_output(size_t n) {
  Budget* b = active_budget();
  if (b && n > static_cast<uint64_t>(b->limits.output))
    throw EvalError{"the rendered text is longer than the limit output (" + std::to_string(b->limits.output) + " bytes)" +
                        raise_hint("output"),
                    false, "output"};
}

// ---------------------------------------------------------------------------------------------------
// Lists and dicts (value.hpp): counted against the limits, freed without recursion.

namespace {

// Lists and dicts whose last reference went while another one was being freed: the outermost deleter
// frees them in a loop, so that freeing a deeply nested value does not recurse.
struct Graveyard {
  std::vector<List*> lists;
  std::vector<Dict*> dicts;
  bool freeing = false;
};

template <class T>
void bury(T* p, std::vector<T*> Graveyard::*pile) {
  thread_local Graveyard g;
  (g.*pile).push_back(p);
  if (g.freeing) return;
  g.freeing = true;
  while (!g.lists.empty() || !g.dicts.empty()) {
    if (!g.lists.empty()) {
      List* l = g.lists.back();
      g.lists.pop_back();
      delete l;
    } else {
      Dict* d = g.dicts.back();
      g.dicts.pop_back();
      delete d;
    }
  }
  g.freeing = false;
}

// An item's memory, in steps of 16 bytes.
constexpr int64_t kItemSteps = static_cast<int64_t>(sizeof(Value) / 16);

}  // namespace

std::shared_ptr<List> shared_list(List l) {
  check_list(l.size());
  step(static_cast<int64_t>(l.size()) * kItemSteps);
  return std::shared_ptr<List>(new List(std::move(l)), [](List* p) { bury(p, &Graveyard::lists); });
}

std::shared_ptr<Dict> shared_dict(Dict d) {
  check_list(d.size());
  step(static_cast<int64_t>(d.size()) * kItemSteps);
  return std::shared_ptr<Dict>(new Dict(std::move(d)), [](Dict* p) { bury(p, &Graveyard::dicts); });
}

// ---------------------------------------------------------------------------------------------------

size_t find(const std::string& hay, const std::string& needle, size_t from) {
  if (from > hay.size()) return std::string::npos;
  if (needle.empty()) return from;
  const void* at = memmem(hay.data() + from, hay.size() - from, needle.data(), needle.size());
  const size_t pos = at ? static_cast<size_t>(static_cast<const char*>(at) - hay.data()) : std::string::npos;
  charge_bytes((at ? pos + needle.size() : hay.size()) - from);  // what was searched
  return pos;
}

}  // namespace detail
}  // namespace lt::jinja
