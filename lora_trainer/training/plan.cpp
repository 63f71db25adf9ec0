#include "lora_trainer/training/plan.hpp"

#include "lora_trainer/core/util.hpp"

namespace lt {

TrainingPlan TrainingPlan::full(StagePlan stages) {
  const size_t n = stages.tokens.size();
  return {std::move(stages), n};
}

TrainingPlan TrainingPlan::from_train_config(const Config& cfg) {
  return full({{cfg.get_int("training/tokens")}, {parse_samplings(cfg.get("training/dataset"))}});
}

TrainingPlan TrainingPlan::from_lora_config(const Config& cfg) {
  StagePlan pre = StagePlan::from_config(cfg, "training/pre_lora_tokens", "training/pre_lora_dataset",
                                         " (both [] to skip phase one)");
  StagePlan post = StagePlan::from_config(cfg, "training/post_lora_tokens", "training/post_lora_dataset");
  if (post.tokens.empty())
    throw UserError("training/post_lora_tokens is empty: a LoRA job needs at least one post-LoRA stage "
                    "(for full-parameter training alone use the `train` job)");
  const size_t n_pre = pre.tokens.size();
  return {pre.append(post), n_pre};
}

}  // namespace lt
