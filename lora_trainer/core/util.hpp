// Small shared pieces with no torch dependency: the user-facing error type, atomic file writes, JSON
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

// Writes `contents` to `path` through a temporary file in the same directory, fsyncs and renames, so
// `path` is either the old file or the complete new one.
void write_file_atomic(const std::string& path, const std::string& contents);
// The first `shown` of a list of problems for an error message, "a; b; c", with "; ..." when there are
// more (the message says how many).
std::string first_problems(const std::vector<std::string>& problems, size_t shown = 12);

// The same from pieces written one after another (no joined copy of them in memory: a model's tensors).
void write_file_atomic(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces);

// Who writes a directory, recorded in it (kWriteRecord): what it is (`kind`: "checkpoint", "export" for
// an export's or import's OUT, "dataset"), the command (`by`: "run", "export", "import-hf", "tokenize")
// and what for (`of`: the job "project/group/name", the exported checkpoint). An earlier write's
// recorded files are dropped only by a later write of the same kind.
struct WriteOwner {
  std::string kind, by, of;
};

// The record publish_dir writes into every directory it writes: {"writer": "lora_trainer", "path": the
// directory's canonical path, "kind", "by", "of", "files": the names that write produced}. It is the
// proof that those files are ours: a later write drops an earlier one's files only when they are listed
// there, and logging/keep_checkpoints deletes only checkpoints whose record names the job.
inline constexpr const char* kWriteRecord = ".lora_trainer_write.json";
struct WriteRecord {
  std::string path, kind, by, of;
  std::vector<std::string> files;
};
// DIR's record when lora_trainer wrote DIR at that place: nullopt for a directory without one (written
// by somebody else, or by a lora_trainer before records), with a damaged one, or with one naming another
// path (a copy of one of ours).
std::optional<WriteRecord> read_write_record(const std::string& dir);

// Writes a directory atomically: `fill` writes its files into a hidden sibling `.NAME.tmp-TAG` (TAG:
// temp_tag), which then takes the place of `dir` in one step (renameat2's exchange where the file system
// has it), so `dir` is always either the old directory or the complete new one; the record of the write
// (kWriteRecord, `owner`) is added to it. Nothing of anyone else's is lost: every entry of an existing
// `dir` that `fill` does not write is kept (hard-linked, or copied, into the new directory), except the
// regular files an earlier write of the same kind recorded there and this one does not write again; for a
// `dir` without a record (written before records were kept), the names in `ours` instead (the caller's
// proof from the files an older version of the write left). Each file dropped is printed. Leftovers of an
// interrupted write of `dir` are cleared first, and a `dir` lost between two renames is put back
// (recover_interrupted_writes). A file-system error (a full disk) is a UserError "could not <what>: ..."
// with the temporary removed; `what` defaults to "write <dir>".
void publish_dir(const std::string& dir, const std::function<void(const std::filesystem::path& tmp)>& fill,
                 const std::string& what = "", const std::vector<std::string>& ours = {}, const WriteOwner& owner = {});

// The temporaries of a write are named for the path they write: a file's `PATH.tmp-TAG`, a directory's
// `.NAME.tmp-TAG` and `.NAME.old-TAG` (publish_dir), `.NAME.del-TAG` (delete_checkpoint), with TAG =
// PID-N-CHECK: the writer's process id, a random number and 16 hex digits of a digest of the target's
// canonical path, PID and N. The CHECK is the record that the name was made by lora_trainer for that
// path: only a name whose CHECK fits is ever removed or put back; one that merely looks like it (a
// user's `.x.tmp-1`, an older lora_trainer's `.NAME.tmp-PID-N`, a temporary of another path) is left
// alone. `pid` 0: this process.
std::string temp_tag(const std::string& target, long pid = 0);
// The path `path` (a file or directory) is a temporary of, by the CHECK in its name; "" when it is not a
// temporary of ours.
std::string temporary_target(const std::string& path);

// Clears what an interrupted write of `path` left behind, written by a process that is no longer
// running: a file's `PATH.tmp-TAG`, a directory's `.NAME.tmp-TAG`, `.NAME.old-TAG` and `.NAME.del-TAG`,
// each only when its TAG proves it ours (temp_tag); each path removed is printed, and a name that only
// looks like one is left alone, with a note. When the directory itself is missing and an `.old` copy of
// it is left (a kill between the two renames of a replace), that copy is put back. `locked`: the caller
// holds a lock that excludes every other writer (a job directory's), so every leftover is stale whatever
// its process id. Returns how many leftovers were handled.
int recover_interrupted_writes(const std::string& path, bool locked = false);

// Prints "note: TEXT" on stderr, once per process for each `key`: a file left alone is noted once, not
// at every write beside it.
void note_once(const std::string& key, const std::string& text);

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
