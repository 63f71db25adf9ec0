// The built-in jobs, by kind. The one place that knows every job class.
#include "lora_trainer/job.hpp"
#include "lora_trainer/lora_trainer.hpp"
#include "lora_trainer/trainer.hpp"

namespace lt {

const JobRegistry& job_registry() {
  static const JobRegistry registry = [] {
    JobRegistry r;
    r.add({"train", "full-parameter GPT training on a dataset mixture (the base trainer)", &BaseTrainer::schema,
           [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestoreableJob> {
             return std::make_unique<BaseTrainer>(std::move(spec), std::move(cfg), std::move(out));
           }});
    r.add({"lora/train", "two phases: full-parameter training, then LoRA adapters on a frozen bf16 base",
           &LoRATrainer::schema, [](JobSpec spec, Config cfg, std::string out) -> std::unique_ptr<RestoreableJob> {
             return std::make_unique<LoRATrainer>(std::move(spec), std::move(cfg), std::move(out));
           }});
    return r;
  }();
  return registry;
}

}  // namespace lt
