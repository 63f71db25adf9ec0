// What a command writes, and what it may delete: files and directories written atomically (a
// temporary beside the final name, then one rename), the record each directory write leaves of its
// files and writer, the temporaries' names that prove them ours, and the clearing of an interrupted
// write's leftovers. A command deletes only what it can prove it wrote (docs/design.md, "Files from
// outside, and what the commands write"). No torch; uses util.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lt {

// Writes `contents` to `path` through a temporary file in the same directory, fsyncs and renames, so
// `path` is either the old file or the complete new one.
void write_file_atomic(const std::string& path, const std::string& contents);
// The same from pieces written one after another (no joined copy of them in memory: a model's tensors).
void write_file_atomic(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces);

// Appends `bytes` to `path` (created if missing), all of them or none: a failed write (a full disk, an
// I/O error, the file size limit) cuts the file back to its size before and is a UserError naming the
// file and the error, then `hint` (what to do). A run's logs (metrics.jsonl, TensorBoard's events)
// lose no figure silently this way, and keep no torn record.
void append_file(const std::string& path, const std::string& bytes, const std::string& hint = "");

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

}  // namespace lt
