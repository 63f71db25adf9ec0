// `lora_trainer restore NAME CHECKPOINT OUT_DIR [key=value ...]`: a job rebuilt from a checkpoint's saved
// config, resumed under a new name.
#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {
namespace {

struct RestoreArgs {
  std::string name, checkpoint, out_dir;
  std::vector<std::string> overrides;
};

int restore(const RestoreArgs& a) {
  check_out_dir(a.out_dir);
  if (Distributed::requested_by_env())
    throw UserError("`restore` runs as one process; for data-parallel ranks use `run NAME CONFIG OUT_DIR --restore " +
                    a.checkpoint + "`");
  auto job = from_checkpoint_path(a.checkpoint, a.name, a.out_dir, a.overrides);
  JobDirLock lock(job->job_dir());
  job->run();
  return 0;
}

}  // namespace

Command add_restore(CLI::App& app) {
  auto a = std::make_shared<RestoreArgs>();
  auto* sub = app.add_subcommand("restore", "rebuild a job from a checkpoint's saved config and resume it");
  sub->add_option("NAME", a->name, "name for the resumed run")->required();
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  sub->add_option("OUT_DIR", a->out_dir, "output root")->required();
  sub->add_option("overrides", a->overrides, "key=value settings over the saved config");
  return {sub, [a] { return restore(*a); }};
}

}  // namespace lt
