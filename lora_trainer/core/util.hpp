// Small shared pieces with no torch dependency: the user-facing error type, JSON
// reading that turns bad input into a UserError, closest-name suggestions, a scoped signal handler, a
// terminal progress line and a wall clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace lt {

// An error caused by the user's input (a config key, a file, a checkpoint). The launcher prints its
// message and exits with status 2, never a stack trace. The message says what was wrong and what to do.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The first `shown` of a list of problems for an error message, "a; b; c", with "; ..." when there are
// more (the message says how many).
std::string first_problems(const std::vector<std::string>& problems, size_t shown = 12);

// Refuses (UserError naming it) a path that is not a regular file, or a link to one: a FIFO, a device
// or a directory given where a file is read would block or fail obscurely. `what` says what it is for.
void require_regular_file(const std::string& path, const std::string& what = "");

// Opens a file for reading (O_RDONLY | O_CLOEXEC) and returns its descriptor and size; refuses, like
// require_regular_file, anything but a regular file, without blocking on a FIFO. UserError naming it.
int open_regular_file(const std::string& path, uint64_t* size, const std::string& what = "");

// How an error about a damaged checkpoint ends: "use another checkpoint (`lora_trainer checkpoints JOB
// OUT_DIR` lists them)", with the job's name when it is known.
std::string use_another_checkpoint(const std::string& job = "JOB");

// Reads a whole file; UserError naming the file if it cannot be read.
std::string read_file(const std::string& path);

// The deepest nesting of arrays and objects a JSON input may have (nlohmann's tree is freed recursively).
inline constexpr int kMaxJsonDepth = 512;

// Parses JSON text. A syntax error, a number out of range (1e999, an integer wider than 64 bits),
// nesting deeper than kMaxJsonDepth or a key given twice in one object (the second would silently win)
// is a UserError naming `what` (a file, an override), the key's path, and saying what to do: `hint`.
nlohmann::json parse_json(const std::string& text, const std::string& what, const std::string& hint = "");
// parse_json, the objects' keys kept in their order (what a template or a chat record needs).
nlohmann::ordered_json parse_ordered_json(const std::string& text, const std::string& what, const std::string& hint = "");
// read_file + parse_json.
nlohmann::json read_json_file(const std::string& path, const std::string& hint = "");

// When `e` is a nlohmann::json type or missing-key error, throws it as a UserError naming `what` (the
// file), the key path and the type expected ("config.json: /vocab_size: must be a number, not a
// string"); otherwise returns.
void rethrow_json_error(const std::string& what, const std::exception& e);

// Runs `read` (code reading JSON that came from `what`): its type and missing-key errors become
// UserErrors naming `what`, never a raw "[json.exception...]".
template <class F>
decltype(auto) json_context(const std::string& what, F&& read) {
  try {
    return read();
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    rethrow_json_error(what, e);
    throw;
  }
}

// fsyncs a directory so that renames inside it are durable.
void fsync_dir(const std::string& dir);

// Deleting and walking directory trees with POSIX calls rather than std::filesystem::remove_all and
// recursive_directory_iterator: PyTorch's pip and pytorch.org LibTorch builds export their own
// statically linked copies of those functions, which then serve this program's calls and crash (seen
// with PyTorch 2.11: a null call inside remove_all; pytorch/pytorch#133437).
// remove_tree deletes a file, link or directory tree (links are removed, never followed); a missing
// path is not an error. Returns false, with errno's text in *error when given, on the first failure.
bool remove_tree(const std::string& path, std::string* error = nullptr);
// The names in `dir` (not "." and ".."), sorted; none when it cannot be read.
std::vector<std::string> sorted_entries(const std::string& dir);
// Calls visit(path, is_directory) for everything below dir (not dir itself), a directory before its
// contents, children in name order; descends into a directory only when visit returns true. Links
// are reported (is_directory false) and not followed; unreadable directories are skipped.
void walk_tree(const std::string& dir, const std::function<bool(const std::string& path, bool is_directory)>& visit);

// The candidate closest to `name` by edit distance, or "" when none is reasonably close.
std::string closest_match(const std::string& name, const std::vector<std::string>& candidates);

// ", "-joined list, for error messages.
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");

// Why `name` cannot be one directory level of ours (a job, project, group or dataset name): "" when it
// can. Empty, "/" inside or a leading "." would put files outside the directory meant for them.
std::string name_problem(const std::string& name);

// A tensor shape as messages write it: "(3, 32)".
std::string shape_text(const std::vector<int64_t>& shape);

bool ends_with(const std::string& s, const std::string& suffix);

// 64-bit FNV-1a over raw bytes: the per-tensor digest shown by `inspect`.
uint64_t fnv1a64(const void* data, size_t size, uint64_t seed = 1469598103934665603ULL);
std::string hex64(uint64_t v);

// The integer value of environment variable `name`, or `fallback` when it is unset or empty;
// UserError naming the variable when it is not an integer.
int env_int(const char* name, int fallback);

// Installs `handler` for SIGINT and SIGTERM and puts the previous handlers back when it goes out of
// scope, on every way out (a return, an exception).
class SignalGuard {
 public:
  explicit SignalGuard(void (*handler)(int));
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  void (*prev_int_)(int);
  void (*prev_term_)(int);
};

// A one-line progress display on stderr for long work (tokenizing, loading). Redraws at most a few
// times per second when stderr is a terminal, and prints a line every ~10% otherwise.
class Progress {
 public:
  Progress(std::string label, uint64_t total, std::string unit = "");
  void update(uint64_t done);
  void finish();

 private:
  std::string label_, unit_;
  uint64_t total_, last_decile_ = 0;
  bool tty_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

inline double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace lt
