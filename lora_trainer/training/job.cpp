#include "lora_trainer/training/job.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

json JobSpec::to_json() const {
  return {{"name", name}, {"project", project}, {"group", group}, {"kind", kind}};
}

JobSpec JobSpec::from_json(const json& j) {
  JobSpec s;
  s.name = j.value("name", std::string());
  s.project = j.value("project", std::string("general"));
  s.group = j.value("group", std::string("default"));
  s.kind = j.value("kind", std::string());
  return s;
}

// job/*, each bound to the JobSpec field it sets; job/kind's default is the kind of the schema's job.
static OptionGroup<JobSpec> job_options(const std::string& kind) {
  return OptionGroup<JobSpec>()
      .add("job/kind", OptType::String, kind, "the registered job class that runs this config (`lora_trainer jobs`)",
           &JobSpec::kind)
      .add("job/project", OptType::String, "general", "project: the first level of the checkpoint path", &JobSpec::project)
      .add("job/group", OptType::String, "default", "group: the second level of the checkpoint path", &JobSpec::group);
}

void add_job_options(ConfigSchema& s, const std::string& kind) { job_options(kind).declare(s); }

JobSpec JobSpec::from_config(const Config& cfg, std::string name) {
  JobSpec s;
  s.name = std::move(name);
  job_options(s.kind).read_into(cfg, s);
  return s;
}

static void check_name_part(const std::string& what, const std::string& v) {
  const std::string problem = name_problem(v);
  if (!problem.empty()) throw UserError(what + " " + problem);
}

RestorableJob::RestorableJob(JobSpec spec, Config cfg, std::string out_dir)
    : spec_(std::move(spec)), cfg_(std::move(cfg)), out_dir_(std::move(out_dir)) {
  job_options(spec_.kind).read_into(cfg_, spec_);  // the name is the command line's
  check_name_part("job name", spec_.name);
  check_name_part("job/project", spec_.project);
  check_name_part("job/group", spec_.group);
}

std::string job_dir_path(const std::string& out_dir, const std::string& project, const std::string& group,
                         const std::string& name) {
  check_name_part("job name", name);
  check_name_part("job/project", project);
  check_name_part("job/group", group);
  return (fs::path(out_dir) / "checkpoints" / project / group / name).string();
}

std::string RestorableJob::job_dir() const { return job_dir_path(out_dir_, spec_.project, spec_.group, spec_.name); }

JobDirLock::JobDirLock(const std::string& job_dir) : job_dir_(job_dir) {
  std::error_code ec;
  for (fs::path p = fs::absolute(job_dir); !p.empty() && p != p.parent_path() && !fs::exists(p); p = p.parent_path())
    created_ = p.string();
  fs::create_directories(job_dir, ec);
  if (ec) throw UserError("cannot create the job directory " + job_dir + ": " + ec.message());
  const std::string path = job_dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw UserError("cannot open " + path + ": " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {0};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw UserError("job directory " + job_dir + " is in use by another run of this job (PID " +
                      (holder.empty() ? std::string("unknown") : holder) +
                      "): two runs would interleave their checkpoints and metrics. Wait for it to end or stop it, "
                      "or give this run another name or OUT_DIR");
    throw UserError("cannot lock " + path + ": " + std::strerror(err));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    // The PID is only for the message a second run prints; the lock itself holds.
  }
  remove_interrupted_saves(job_dir);  // prints each path it removes or puts back
}

JobDirLock::~JobDirLock() {
  if (fd_ < 0) return;
  // Nothing but the lock in a directory the lock made: take it all back (rmdir stops at anything else).
  bool only_lock = true;
  walk_tree(job_dir_, [&](const std::string& p, bool) {
    if (fs::path(p).filename() != ".lock") only_lock = false;
    return false;
  });
  if (!created_.empty() && only_lock) {
    ::unlink((job_dir_ + "/.lock").c_str());
    for (fs::path p = fs::absolute(job_dir_); ::rmdir(p.c_str()) == 0 && p.string() != created_; p = p.parent_path()) {
    }
  }
  ::close(fd_);
}

bool JobDirLock::held_by_launcher() {
  const char* v = std::getenv("LT_JOB_LOCK_HELD");
  return v && *v && std::string(v) != "0";
}

std::string RestorableJob::run_dir() const {
  return (fs::path(out_dir_) / "runs" / spec_.project / spec_.group / spec_.name).string();
}

std::string RestorableJob::checkpoint_path(const std::string& p) const {
  if (is_checkpoint(p)) return p;
  fs::path rel = fs::path(job_dir()) / p;
  if (is_checkpoint(rel.string())) return rel.string();
  return p;  // the reader reports it as missing, naming the path
}

void RestorableJob::restore_from_model_dir(const std::string& dir) {
  throw UserError(dir + " is a Hugging Face model directory; a " + spec_.kind + " job cannot start from one. Import "
                  "it with `lora_trainer import-hf " + dir + " OUT` and restore OUT");
}

void RestorableJob::restore_from_path(const std::string& path) {
  if (!is_checkpoint(path) && is_hf_model_dir(path)) return restore_from_model_dir(path);
  const std::string dir = checkpoint_path(path);
  json_context(dir + "/metadata.json", [&] { restore_from_checkpoint(CheckpointMeta::read(dir)); });
}

std::string RestorableJob::restore_latest() {
  auto latest = read_latest(job_dir());
  if (!latest) return "";
  std::string path = (fs::path(job_dir()) / *latest).string();
  if (!is_checkpoint(path))
    throw UserError(job_dir() + "/latest names \"" + *latest + "\", which is not a complete checkpoint. "
                    "Point `latest` at one listed by `lora_trainer checkpoints " + spec_.name + " " + out_dir_ +
                    "`, or delete it to start over");
  restore_from_path(path);
  return *latest;
}

void JobRegistry::add(JobClass c) { classes_.push_back(std::move(c)); }

const JobClass& JobRegistry::find(const std::string& kind) const {
  std::vector<std::string> kinds;
  for (const auto& c : classes_) {
    if (c.kind == kind) return c;
    kinds.push_back(c.kind);
  }
  std::string msg = "unknown job kind \"" + kind + "\"";
  std::string near = closest_match(kind, kinds);
  if (!near.empty()) msg += "; did you mean \"" + near + "\"?";
  throw UserError(msg + " (known: " + join(kinds) + ")");
}

}  // namespace lt
