// Bounds on the work and memory of a render (docs/chat.md, "Limits"). A chat template is input: one that
// loops, recurses or grows a string without end must stop with an error naming the template, its line
// and the limit, not run until the machine kills it. The defaults are far above what real templates
// need (the tests render the Llama 3, Qwen and Mistral templates over conversations of thousands of
// messages), and each can be raised: `--chat-limit NAME=N` (tokenize, sample).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lt::jinja {

struct Limits {
  // Work: a statement, an expression, a loop iteration, an item a filter or comparison goes through, or
  // 16 bytes of text made, searched or written, is one step. Counted over every render of one conversation.
  int64_t steps = 100'000'000;
  int64_t output = int64_t{1} << 28;  // bytes of the rendered text (256 MiB)
  int64_t string = int64_t{1} << 26;  // bytes of any one string the template makes (64 MiB)
  int64_t list = int64_t{1} << 20;    // items of any one list or dict it makes
  int64_t depth = 200;                // macros calling macros (jinja2 stops near 190: Python's recursion limit)

  // "NAME=N" (steps, output, string, list, depth; N a positive integer) sets one; a UserError naming
  // `option` otherwise.
  void set(const std::string& assignment, const std::string& option = "--chat-limit");
};

namespace detail {

// The limits and the counts of the render running on this thread.
struct Budget {
  Limits limits;
  int64_t steps = 0;
  int64_t depth = 0;                  // macro calls in progress
  const char* stack_floor = nullptr;  // recursion below this address is refused (the thread's stack, less a margin)
};

// The budget of the render running on this thread; null outside a render (nothing is counted then).
inline Budget*& active_budget() {
  thread_local Budget* b = nullptr;
  return b;
}

// Makes `b` the thread's budget while alive (renders do not nest, but the previous one is restored).
class ActiveBudget {
 public:
  explicit ActiveBudget(Budget& b);
  ~ActiveBudget();
  ActiveBudget(const ActiveBudget&) = delete;
  ActiveBudget& operator=(const ActiveBudget&) = delete;

 private:
  Budget* saved_;
};

[[noreturn]] void over_steps(const Budget& b);
[[noreturn]] void over_stack();
[[noreturn]] void over_depth(const Budget& b, const std::string& macro);

// One step of work (or n); an error past the limit.
inline void step(int64_t n = 1) {
  Budget* b = active_budget();
  if (b && (b->steps += n) > b->limits.steps) over_steps(*b);
}
// Text made, searched or written: a step per 16 bytes.
inline void charge_bytes(size_t n) {
  if (n >= 16) step(static_cast<int64_t>(n >> 4));
}
// Recursion while rendering (macros within macros, each with nested expressions): refused before the
// thread's stack runs out.
inline void check_stack() {
  Budget* b = active_budget();
  if (b && static_cast<const char*>(__builtin_frame_address(0)) < b->stack_floor) over_stack();
}
// A string of n bytes, a list or dict of n items, or output of n bytes, about to be made: an error past
// its limit (before the memory is taken).
void check_string(size_t n);
void check_list(size_t n);
void check_output(size_t n);
// a * b for sizes, saturating (a size that overflows is past every limit anyway).
inline size_t times(size_t a, size_t b) { return b != 0 && a > SIZE_MAX / b ? SIZE_MAX : a * b; }
inline size_t plus(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

// Where a needle is in a haystack at or after `from`, in time linear in their lengths (glibc's memmem),
// counted as steps; std::string::npos when it is not.
size_t find(const std::string& hay, const std::string& needle, size_t from = 0);

}  // namespace detail
}  // namespace lt::jinja
