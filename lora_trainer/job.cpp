#include "lora_trainer/job.hpp"

#include <filesystem>

#include "lora_trainer/checkpoint.hpp"
#include "lora_trainer/util.hpp"

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

void add_job_options(ConfigSchema& s, const std::string& kind) {
  s.add("job/kind", OptType::String, kind, "the registered job class that runs this config (`lora_trainer jobs`)");
  s.add("job/project", OptType::String, "general", "project: the first level of the checkpoint path");
  s.add("job/group", OptType::String, "default", "group: the second level of the checkpoint path");
}

static void check_name_part(const std::string& what, const std::string& v) {
  if (v.empty() || v == "." || v == ".." || v.find('/') != std::string::npos || v[0] == '.')
    throw UserError(what + " \"" + v + "\" is not a valid name: use letters, digits, '-', '_' (no '/', no leading '.')");
}

RestoreableJob::RestoreableJob(JobSpec spec, Config cfg, std::string out_dir)
    : spec_(std::move(spec)), cfg_(std::move(cfg)), out_dir_(std::move(out_dir)) {
  spec_.project = cfg_.get_string("job/project");
  spec_.group = cfg_.get_string("job/group");
  spec_.kind = cfg_.get_string("job/kind");
  check_name_part("job name", spec_.name);
  check_name_part("job/project", spec_.project);
  check_name_part("job/group", spec_.group);
}

std::string RestoreableJob::job_dir() const {
  return (fs::path(out_dir_) / "checkpoints" / spec_.project / spec_.group / spec_.name).string();
}

std::string RestoreableJob::run_dir() const {
  return (fs::path(out_dir_) / "runs" / spec_.project / spec_.group / spec_.name).string();
}

std::string RestoreableJob::checkpoint_path(const std::string& p) const {
  if (is_checkpoint(p)) return p;
  fs::path rel = fs::path(job_dir()) / p;
  if (is_checkpoint(rel.string())) return rel.string();
  return p;  // the reader reports it as missing, naming the path
}

std::string RestoreableJob::restore_latest() {
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
