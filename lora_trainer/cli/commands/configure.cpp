// `lora_trainer configure JOB OUT [key=value ...]`: a config file with every key of a job kind.
#include <cstdio>
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {
namespace {

struct ConfigureArgs {
  std::string kind, out;
  std::vector<std::string> overrides;
  bool force = false;
};

int configure(const ConfigureArgs& a) {
  const JobClass& cls = job_registry().find(a.kind);
  Config cfg(cls.schema());
  for (const auto& o : a.overrides) cfg.apply_override(o);
  // A config is often edited by hand after `configure`: never replace one unasked.
  const fs::path parent = fs::path(a.out).parent_path();
  if (!parent.empty() && !fs::is_directory(parent))
    throw UserError("configure: OUT " + a.out + ": directory " + parent.string() + " does not exist; create it first");
  if (fs::is_directory(a.out))
    throw UserError("configure: OUT " + a.out + " is a directory; give a file name (e.g. " +
                    (fs::path(a.out) / "job.json").string() + ")");
  if (fs::exists(a.out) && !a.force)
    throw UserError("configure: OUT " + a.out + " already exists; give another name, or --force to replace it. Nothing was written");
  write_file_atomic(a.out, cfg.to_json().dump(2) + "\n");
  std::printf("wrote %s (%zu keys, job/kind %s)\n", a.out.c_str(), cfg.schema().options().size(), a.kind.c_str());
  return 0;
}

}  // namespace

Command add_configure(CLI::App& app) {
  auto a = std::make_shared<ConfigureArgs>();
  auto* sub = app.add_subcommand("configure", "write a config with every key of JOB at its default");
  sub->add_option("JOB", a->kind, "job kind (see `jobs`)")->required();
  sub->add_option("OUT", a->out, "config file to write (JSON)")->required();
  sub->add_flag("--force", a->force, "replace OUT if it exists");
  sub->add_option("overrides", a->overrides, "key=value settings (e.g. training/batch_size=32)");
  return {sub, [a] { return configure(*a); }};
}

}  // namespace lt
