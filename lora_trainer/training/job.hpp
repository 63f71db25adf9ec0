// Jobs: a named, restorable unit of work, and the registry that maps job kinds to classes.
//
// A job's files live under one output root:
//   <out>/checkpoints/<project>/<group>/<name>/<suffix>/   checkpoints (checkpoint.hpp), and `latest`
//   <out>/runs/<project>/<group>/<name>/                   config.json, metrics.jsonl, reports
// Running a job whose `latest` exists continues from it; a finished job says so and does nothing.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/core/config.hpp"

namespace lt {

struct CheckpointMeta;  // checkpoint.hpp

struct JobSpec {
  std::string name;               // the run's name, given on the command line
  std::string project = "general";
  std::string group = "default";
  std::string kind;               // the registered job class ("train", "lora/train", ...)
  json to_json() const;
  static JobSpec from_json(const json& j);
  // The job `name` of a config: its job/kind, job/project and job/group, as the job itself reads them.
  static JobSpec from_config(const Config& cfg, std::string name);
};

// <out>/checkpoints/<project>/<group>/<name>: where a job keeps its checkpoints and `latest`.
std::string job_dir_path(const std::string& out_dir, const std::string& project, const std::string& group,
                         const std::string& name);

// One writer per job directory: an exclusive flock on <job_dir>/.lock, which the kernel releases when
// the process ends, however it ends. A second run of the same job and OUT_DIR is refused with a
// UserError naming the holder's PID. Holding the lock, it removes what interrupted saves of this job
// left behind (hidden `.NAME.tmp-TAG`, `.NAME.old-TAG`, `.NAME.del-TAG` whose TAG proves them ours: no
// other writer can be making them), printing each; anything that only looks like one is left alone.
// `run --nproc` takes it in the launcher and sets LT_JOB_LOCK_HELD for its ranks, which then skip it.
// A run that ends having written nothing (a mistake found after the lock was taken) leaves nothing:
// the lock file and the directories the lock made are removed again.
class JobDirLock {
 public:
  explicit JobDirLock(const std::string& job_dir);
  ~JobDirLock();
  JobDirLock(const JobDirLock&) = delete;
  JobDirLock& operator=(const JobDirLock&) = delete;
  // True when this process runs under a launcher that holds the lock already.
  static bool held_by_launcher();

 private:
  int fd_ = -1;
  std::string job_dir_, created_;  // created_: the outermost directory the lock made, if any
};

class RestorableJob {
 public:
  RestorableJob(JobSpec spec, Config cfg, std::string out_dir);
  virtual ~RestorableJob() = default;

  virtual void run() = 0;
  // True when the job has reached its end (its final checkpoint exists or its counters say so).
  virtual bool done() const = 0;
  // Restores the whole state from a checkpoint: `path` is a checkpoint directory, or a suffix relative
  // to this job's checkpoint directory ("ntoks/4096"). Reads its metadata once and calls
  // restore_from_checkpoint; a Hugging Face model directory goes to restore_from_model_dir.
  void restore_from_path(const std::string& path);
  // Restores from a checkpoint whose metadata has been read (CheckpointMeta::read).
  virtual void restore_from_checkpoint(const CheckpointMeta& ck) = 0;
  // Starts from a Hugging Face model directory's weights (restore_from_path calls it for a directory
  // with a config.json and no metadata.json). By default a UserError: the job kind takes none.
  virtual void restore_from_model_dir(const std::string& dir);
  // Restores from `latest` when it exists; returns the suffix restored, or "" when there was none.
  std::string restore_latest();

  const JobSpec& spec() const { return spec_; }
  const Config& config() const { return cfg_; }
  const std::string& out_dir() const { return out_dir_; }
  std::string job_dir() const;   // <out>/checkpoints/<project>/<group>/<name>
  std::string run_dir() const;   // <out>/runs/<project>/<group>/<name>
  std::string checkpoint_path(const std::string& suffix_or_path) const;

 protected:
  JobSpec spec_;
  Config cfg_;
  std::string out_dir_;
};

struct JobClass {
  std::string kind;
  std::string description;
  std::function<ConfigSchema()> schema;
  std::function<std::unique_ptr<RestorableJob>(JobSpec, Config, std::string)> make;
};

class JobRegistry {
 public:
  void add(JobClass c);
  const JobClass& find(const std::string& kind) const;  // UserError with the known kinds
  const std::vector<JobClass>& all() const { return classes_; }

 private:
  std::vector<JobClass> classes_;
};

// Options every job has: job/kind, job/project, job/group.
void add_job_options(ConfigSchema& s, const std::string& kind);

}  // namespace lt
