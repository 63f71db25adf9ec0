// `lora_trainer run NAME CONFIG OUT_DIR [--restore CKPT] [--nproc N] [key=value ...]`: run a job, or continue
// it from its latest checkpoint; with --nproc, start N data-parallel ranks of this program that do so.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/cli/local_ranks.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/frozen_base.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/training/job.hpp"

namespace fs = std::filesystem;

namespace lt {
namespace {

struct RunArgs {
  std::string program, name, config_path, out_dir, restore;
  int nproc = 1;
  std::vector<std::string> overrides;
};

// Continuing a job under a config that differs from the one its checkpoint was saved with is allowed (a
// larger token budget continues a finished job), but a changed step size or schedule silently changes
// what the counters mean: say which keys differ.
void note_config_changes(const RestorableJob& job, const std::string& checkpoint) {
  using nlohmann::json;
  if (distributed().rank() != 0) return;
  const json saved = CheckpointMeta::read(checkpoint).config.flatten();
  const json now = job.config().to_json().flatten();
  std::vector<std::string> changed;
  for (auto it = now.begin(); it != now.end(); ++it) {
    const std::string key = it.key().substr(1);  // flatten() writes "/a/b"
    if (key.rfind("runtime/", 0) == 0 || key.rfind("logging/", 0) == 0) continue;  // how it runs, not what
    auto was = saved.find(it.key());
    if (was == saved.end() || *was != it.value())
      changed.push_back(key + " " + (was == saved.end() ? std::string("(new)") : was->dump()) + " -> " + it.value().dump());
  }
  if (changed.empty()) return;
  std::printf("note: %zu setting%s differ%s from the config %s was saved with: %s. The restored state continues under "
              "this run's values (docs/cli.md, run)\n",
              changed.size(), changed.size() == 1 ? "" : "s", changed.size() == 1 ? "s" : "", checkpoint.c_str(),
              join(changed, "; ").c_str());
}

void run_or_continue(RestorableJob& job, const std::string& restore) {
  std::string latest = job.restore_latest();
  if (!latest.empty()) {
    std::printf("continuing %s from its latest checkpoint %s\n", job.spec().name.c_str(), latest.c_str());
    note_config_changes(job, (fs::path(job.job_dir()) / latest).string());
  } else if (!restore.empty()) {
    std::printf("restoring %s from %s\n", job.spec().name.c_str(), restore.c_str());
    job.restore_from_path(restore);
  }
  job.run();
}

// --nproc N: this process starts the ranks (each runs `run` without --nproc) and holds the job's lock for them.
int start_local_ranks(const RunArgs& a) {
  if (Distributed::requested_by_env())
    throw UserError("--nproc starts its own ranks; it cannot be combined with WORLD_SIZE=" +
                    std::string(std::getenv("WORLD_SIZE")) + " in the environment (torchrun starts them instead)");
  Config cfg = make_config(a.config_path, a.overrides);  // a mistake is reported once, before any rank starts
  const JobSpec spec = JobSpec::from_config(cfg, a.name);
  JobDirLock lock(job_dir_path(a.out_dir, spec.project, spec.group, spec.name));
  setenv("LT_JOB_LOCK_HELD", "1", 1);  // the ranks' own: this launcher holds the lock for them
  std::vector<std::string> args = {a.program, "run", a.name, a.config_path, a.out_dir};
  if (!a.restore.empty()) args.insert(args.end(), {"--restore", a.restore});
  args.insert(args.end(), a.overrides.begin(), a.overrides.end());
  return run_local_ranks(a.nproc, args, DistributedOptions::from_config(cfg).timeout_s + 10.0);
}

// A re-run continues from the job's `latest`. A job without phase one started from the base its first
// run's --restore gave (lora.base in its checkpoints): a Hugging Face model's config.json gives the job
// its architecture, and a checkpoint that refers to its frozen base (frozen_base) reads the base from
// there. When that base moved or changed, this says so, naming it, before a restore would blame a
// setting the user never touched. Returns the --restore to use: the recorded base when none is given
// (the architecture as the first run took it); adds training/frozen_base_path when --restore gives the
// base's new place.
std::string check_recorded_base(const RunArgs& a, std::vector<std::string>& overrides) {
  using nlohmann::json;
  const char* rank = std::getenv("RANK");  // before the ranks are set up: the first rank's notes alone
  const bool says = rank == nullptr || std::string(rank) == "0";
  const Config cfg = make_config(a.config_path, a.overrides);
  const JobSpec spec = JobSpec::from_config(cfg, a.name);
  const std::string job_dir = job_dir_path(a.out_dir, spec.project, spec.group, spec.name);
  const auto latest = read_latest(job_dir);
  if (!latest) return a.restore;  // a first run: --restore as given
  const std::string checkpoint = (fs::path(job_dir) / *latest).string();
  if (!is_checkpoint(checkpoint)) return a.restore;  // restore_latest says what is wrong with it
  const CheckpointMeta ck = CheckpointMeta::read(checkpoint);
  const json base = ck.lora ? ck.lora->base : json();
  // From its first run's --restore (no phase one): where, and whether a Hugging Face model (its architecture).
  const bool from_restore = base.is_object() && base.value("path", json()).is_string();
  const std::string recorded = from_restore ? base["path"].get<std::string>() : "";
  const bool hf = from_restore && base.value("format", std::string()) == "hf";
  bool base_missing = false;  // the checkpoint refers to its frozen base, which is not where it says
  std::string referred, located;  // where it says, and where it is
  if (ck.frozen_base) {
    const FrozenBaseRef& ref = *ck.frozen_base;
    referred = ref.path;
    try {
      located = locate_frozen_base(ref, checkpoint, "");
    } catch (const UserError&) {
      base_missing = true;
    }
  }
  if (!hf && referred.empty()) return a.restore;  // its checkpoints copy their base: --restore is not read
  const bool given_there = !a.restore.empty() && fs::exists(a.restore);
  auto moved = [&](const std::string& where, const std::string& what) {
    const bool first = from_restore && fs::absolute(where).lexically_normal() == fs::absolute(recorded).lexically_normal();
    throw UserError("job " + a.name + " continues from its checkpoint " + checkpoint + ", " + what + " " + where +
                    (first ? " (the --restore of its first run)" : "") + ", which is no longer there" +
                    (a.restore.empty() || given_there ? std::string() : "; --restore " + a.restore + " does not exist either") +
                    ". If it moved, run again with --restore NEW_PATH, where it is now (its digest is checked); or put it "
                    "back at " + where);
  };
  std::string restore = a.restore;
  if (!given_there) {
    if (base_missing) moved(referred, "which refers to its frozen base, the " + std::string(hf ? "Hugging Face model" : "checkpoint"));
    if (!hf) return a.restore;
    restore = is_hf_model_dir(located) ? located : recorded;  // where its checkpoints last read it
    if (!is_hf_model_dir(restore)) moved(restore, "whose model is the Hugging Face model");
    if (says)
      std::printf("taking job %s's architecture from its base %s (its config.json), as its first run did\n", a.name.c_str(),
                  restore.c_str());
  }
  if (hf && is_hf_model_dir(restore)) {  // its config.json must still describe the model the job trained
    const std::string path = (fs::path(restore) / "config.json").string();
    const json hf_config = read_json_file(path);
    const std::vector<std::string> arch = json_context(path, [&] { return hf_architecture(hf_config, path); });
    Config saved = model_config();
    json_context(checkpoint + "/metadata.json", [&] {
      saved.merge_json({{"architecture", ck.config.value("architecture", json::object())}},
                       checkpoint + "/metadata.json");
    });
    std::vector<std::string> differ;  // block_size, the rows' length, is the job's choice
    for (const auto& [setting, was] : differing_architecture(saved, arch)) differ.push_back(setting + " (the checkpoint's " + was.dump() + ")");
    if (!differ.empty())
      throw UserError("the model at " + restore + " is not the one job " + a.name + " started from (" + recorded +
                      "): its config.json gives " + join(differ, ", ") + ". Give with --restore the directory that " +
                      "holds the model the job trained on (if another model replaced it at " + restore +
                      ", put it back there)");
  }
  if (base_missing && std::none_of(overrides.begin(), overrides.end(),
                                   [](const std::string& o) { return o.rfind("training/frozen_base_path=", 0) == 0; })) {
    overrides.push_back("training/frozen_base_path=" + json(restore).dump());
    if (says)
      std::printf("job %s's frozen base was at %s; reading it from --restore %s (training/frozen_base_path)\n", a.name.c_str(),
                  referred.c_str(), restore.c_str());
  }
  return restore;
}

int run(RunArgs a) {
  check_out_dir(a.out_dir);
  a.restore = check_recorded_base(a, a.overrides);
  a.overrides = with_model_dir_architecture(a.restore, a.overrides, distributed().rank() == 0 ? stdout : nullptr);
  if (a.nproc > 1) return start_local_ranks(a);
  if (Distributed::requested_by_env()) {  // one of several ranks (torchrun's, or --nproc's)
    Config cfg = make_config(a.config_path, a.overrides);
    set_distributed(Distributed::from_env(DistributedOptions::from_config(cfg).timeout_s, Runtime::from_config(cfg).device));
    if (!distributed().is_main() && !std::freopen("/dev/null", "w", stdout))
      throw std::runtime_error("cannot redirect the output of rank " + std::to_string(distributed().rank()));
  }
  auto job = make_job(a.name, a.config_path, a.out_dir, a.overrides);
  std::unique_ptr<JobDirLock> lock;  // one writer per job directory (rank 0 for several ranks)
  if (!JobDirLock::held_by_launcher() && distributed().is_main()) lock = std::make_unique<JobDirLock>(job->job_dir());
  run_or_continue(*job, a.restore);
  return 0;
}

}  // namespace

Command add_run(CLI::App& app, const std::string& program) {
  auto a = std::make_shared<RunArgs>();
  a->program = program;
  auto* sub = app.add_subcommand("run", "run a job; re-running continues from its latest checkpoint");
  sub->add_option("NAME", a->name, "the run's name (its checkpoint directory)")->required();
  sub->add_option("CONFIG", a->config_path, "config file (JSON; `configure` writes one)")->required()->check(CLI::ExistingFile);
  sub->add_option("OUT_DIR", a->out_dir, "output root: checkpoints/ and runs/ go below it (. = this directory)")->required();
  sub->add_option("--restore", a->restore,
                  "start from this checkpoint directory, or from a Hugging Face model directory (config.json + "
                  "safetensors: its architecture is applied over the config file's, and its weights load one tensor "
                  "at a time in their own dtype; a LoRA job keeps its frozen base in bf16 from the start). Ignored "
                  "when the job has a `latest`");
  sub->add_option("--nproc", a->nproc,
                  "data-parallel ranks to start on this machine (c10d/Gloo; see docs/distributed.md). Ranks "
                  "started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) need no --nproc")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  sub->add_option("overrides", a->overrides, "key=value settings over the config file");
  return {sub, [a] { return run(*a); }};
}

}  // namespace lt
