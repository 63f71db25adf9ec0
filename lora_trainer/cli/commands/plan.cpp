// `lora_trainer plan CONFIG [--restore BASE] [--nproc N] [--machines M] [--host-memory SIZE] [--gpu-memory SIZE]
// [--json] [key=value ...]`: the memory plan of the job CONFIG describes (training/memory_plan.hpp), as
// `run` with the same arguments would check it before allocating; from the config and the base's
// headers only, in seconds. Exit status 0 when it fits, 5 when it does not (the refusal `run` would
// give is printed), 2 for a mistake in the arguments.
#include <cstdio>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {
namespace {

struct PlanArgs {
  std::string config_path, restore, host_memory, gpu_memory;
  int nproc = 1, machines = 1;
  bool json = false;
  std::vector<std::string> overrides;
};

int64_t size_option(const std::string& text, const char* flag) {
  try {
    return parse_bytes(text);
  } catch (const std::invalid_argument& e) {
    throw UserError(std::string(flag) + ": " + e.what());
  }
}

int plan(const PlanArgs& a) {
  const std::vector<std::string> overrides = with_model_dir_architecture(a.restore, a.overrides, a.json ? nullptr : stdout);
  Trainer::plan_only = true;  // the job is built to be planned: nothing drawn, allocated or written
  auto job = make_job("plan", a.config_path, "/nonexistent-lora-trainer-out", overrides);
  auto* t = dynamic_cast<Trainer*>(job.get());
  if (!t) throw UserError(a.config_path + ": a " + job->spec().kind + " job has no memory plan");
  const int ranks_here = (a.nproc + a.machines - 1) / a.machines;
  std::optional<int> source_bytes;
  if (!a.restore.empty() && t->has_lora_phase() && t->boundary_step() == 0) {  // the base it would load: its dtype
    const NamedTensors expected = base_params(*t->model());
    const auto src = is_checkpoint(a.restore) ? BaseWeights::open_checkpoint(CheckpointMeta::read(a.restore), expected)
                                              : BaseWeights::open_hf(a.restore, t->model()->options().family, expected);
    source_bytes = src->dtype() == "bfloat16" ? 2 : 4;
  }
  t->check_memory(a.nproc, ranks_here, source_bytes);
  MemoryPlanInputs in = t->memory_plan().inputs;
  if (!a.host_memory.empty()) in.host_memory = size_option(a.host_memory, "--host-memory");
  if (!a.gpu_memory.empty()) in.device_memory = size_option(a.gpu_memory, "--gpu-memory");
  const MemoryPlan p = plan_memory(in);
  if (a.json) {
    std::printf("%s\n", p.to_json().dump(2).c_str());
  } else {
    int64_t params = 0;
    for (const auto& q : in.params) params += q.numel;
    std::printf("memory plan of %s: a %s job, %s model of %.3g parameters, %d rank%s%s\n", a.config_path.c_str(),
                job->spec().kind.c_str(), to_string(in.model.family), static_cast<double>(params), in.ranks,
                in.ranks == 1 ? "" : "s",
                a.machines > 1 ? (" on " + std::to_string(a.machines) + " machines").c_str() : "");
    std::printf("%s", p.text().c_str());
    if (!p.fits()) std::printf("%s\n", p.refusal().c_str());
  }
  return p.fits() ? 0 : 5;
}

}  // namespace

Command add_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  auto* sub = app.add_subcommand("plan", "the memory a job will need, item by item, beside this machine's (docs/memory.md)");
  sub->add_option("CONFIG", a->config_path, "config file (JSON; `configure` writes one)")->required()->check(CLI::ExistingFile);
  sub->add_option("--restore", a->restore,
                  "the base the job would start from, as `run --restore` takes it (a checkpoint, or a Hugging Face model "
                  "directory, whose architecture is applied): only its headers are read");
  sub->add_option("--nproc", a->nproc, "data-parallel ranks, as `run --nproc` starts them")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  sub->add_option("--machines", a->machines, "machines the ranks are spread over (the host memory is each machine's)")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  sub->add_option("--host-memory", a->host_memory, "plan for a machine with this much memory (e.g. 24GB) instead of this one");
  sub->add_option("--gpu-memory", a->gpu_memory, "plan for GPUs with this much memory each (e.g. 24GB; with runtime/device=cuda)");
  sub->add_flag("--json", a->json, "the plan as JSON (items in bytes) on stdout");
  sub->add_option("overrides", a->overrides, "key=value settings over the config file");
  return {sub, [a] { return plan(*a); }};
}

}  // namespace lt
