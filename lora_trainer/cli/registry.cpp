#include "lora_trainer/cli/registry.hpp"

#include "lora_trainer/recipes/continual.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/recipes/grpo_part.hpp"
#include "lora_trainer/recipes/lora_train.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

const JobRegistry& job_registry() {
  static const JobRegistry registry = [] {
    JobRegistry r;
    r.add({"train", "full-parameter GPT training on a dataset mixture (the base trainer)", &Trainer::schema,
           [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestorableJob> {
             return std::make_unique<Trainer>(std::move(spec), std::move(cfg), std::move(out));
           }});
    r.add({"lora/train",
           "two phases: full-parameter training, then LoRA adapters on a frozen bf16 base (with DPO when the post-LoRA "
           "datasets are preference pairs, GRPO when they are prompts)",
           &lora_train_schema, [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestorableJob> {
             return make_lora_train(std::move(spec), std::move(cfg), std::move(out));
           }});
    r.add({"continual/train/benchmark",
           "continual-learning benchmark: stages A, B, C, ... with optional fades; forgetting matrix at each boundary",
           &continual_schema, [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestorableJob> {
             return make_continual(std::move(spec), std::move(cfg), std::move(out));
           }});
    r.add({"continual/train/benchmark_lora",
           "the benchmark's stages as the pre-LoRA phase, then LoRA stages; forgetting matrix at every boundary",
           &continual_lora_schema, [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestorableJob> {
             return make_continual_lora(std::move(spec), std::move(cfg), std::move(out));
           }});
    r.add({"dpo/train",
           "DPO on preference pairs from a pretrained base: LoRA adapters (reference: adapters off) or every parameter "
           "(reference: a frozen bf16 copy), by optimization/dpo/lora",
           &dpo_train_schema, [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestorableJob> {
             return make_dpo_train(std::move(spec), std::move(cfg), std::move(out));
           }});
    r.add({"grpo/train",
           "GRPO on prompts from a pretrained base: LoRA adapters trained on the rewards of their own completions "
           "(reference: adapters off)",
           &grpo_train_schema, [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestorableJob> {
             return make_grpo_train(std::move(spec), std::move(cfg), std::move(out));
           }});
    return r;
  }();
  return registry;
}

static json parse_config_file(const std::string& path) {
  json j = read_json_file(path, "fix the file, or write a fresh one with `lora_trainer configure JOB OUT`");
  if (!j.is_object()) throw UserError(path + ": a config must be a JSON object");
  return j;
}

static std::string kind_of(const json& nested, const std::string& source) {
  if (nested.contains("job") && nested["job"].is_object() && nested["job"].contains("kind")) {
    if (!nested["job"]["kind"].is_string()) throw UserError(source + ": job/kind must be a string");
    return nested["job"]["kind"].get<std::string>();
  }
  throw UserError(source + ": no job/kind; write a config with `lora_trainer configure JOB " + source + "`");
}

Config make_config(const std::string& config_path, const std::vector<std::string>& overrides) {
  json nested = parse_config_file(config_path);
  // A job/kind override picks the class too; its value is parsed like any override's.
  std::string kind;
  for (const auto& o : overrides) {
    if (o.rfind("job/kind=", 0) != 0) continue;
    const std::string text = o.substr(9);
    json v = json::accept(text) ? parse_json(text, "override job/kind") : json(text);
    kind = v.is_string() ? v.get<std::string>() : text;
  }
  if (kind.empty()) kind = kind_of(nested, config_path);
  Config cfg(job_registry().find(kind).schema());
  cfg.merge_json(nested, config_path);
  for (const auto& o : overrides) cfg.apply_override(o);
  return cfg;
}

std::unique_ptr<RestorableJob> make_job(const std::string& name, const std::string& config_path,
                                         const std::string& out_dir, const std::vector<std::string>& overrides) {
  Config cfg = make_config(config_path, overrides);
  const JobClass& cls = job_registry().find(cfg.get_string("job/kind"));
  JobSpec spec;
  spec.name = name;
  return cls.make(spec, std::move(cfg), out_dir);
}

std::unique_ptr<RestorableJob> from_checkpoint_path(const std::string& checkpoint, const std::string& name,
                                                     const std::string& out_dir,
                                                     const std::vector<std::string>& overrides) {
  const CheckpointMeta ck = CheckpointMeta::read(checkpoint);
  if (!ck.has_config || !ck.job)
    throw UserError(checkpoint + ": metadata has no saved config/job; it cannot be restored as a job");
  std::string kind = kind_of(ck.config, checkpoint + "/metadata.json");
  const JobClass& cls = job_registry().find(kind);
  Config cfg(cls.schema());
  cfg.merge_json(ck.config, checkpoint + "/metadata.json");
  for (const auto& o : overrides) cfg.apply_override(o);
  if (cfg.get_string("job/kind") != kind)
    throw UserError("job/kind cannot change on restore: " + checkpoint + " is a " + kind +
                    " state. To start a job of another kind from its weights, use `run NAME CONFIG OUT_DIR --restore`");
  JobSpec spec = JobSpec::from_json(ck.job->to_json());
  if (!name.empty()) spec.name = name;
  auto job = cls.make(spec, std::move(cfg), out_dir);
  job->restore_from_checkpoint(ck);
  return job;
}

}  // namespace lt
