#include "lora_trainer/recipes/lora_train.hpp"

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/recipes/grpo_part.hpp"

namespace lt {

LoraObjective lora_phase_objective(const StagePlan& plan, size_t pre_lora_stages) {
  auto listed = [](const std::vector<Sampling>& list) {
    std::string out;
    for (const auto& s : list) out += std::string(out.empty() ? "" : ", ") + "\"" + s.name + "\" (" + style_name(s.style) + ")";
    return out;
  };
  std::vector<Sampling> pre, post, not_text;
  for (size_t i = 0; i < plan.datasets.size(); ++i)
    for (const auto& s : plan.datasets[i]) {
      auto& list = i < pre_lora_stages ? pre : post;
      if (std::none_of(list.begin(), list.end(), [&](const Sampling& o) { return o.name == s.name && o.style == s.style; }))
        list.push_back(s);
    }
  for (const auto& s : pre)
    if (s.style == DatasetStyle::CONTRASTIVE || s.style == DatasetStyle::PROMPTS) not_text.push_back(s);
  if (!not_text.empty())
    throw UserError("training/pre_lora_dataset has preference pairs or prompts: " + listed(not_text) + ". Phase 1 trains "
                    "every parameter on next-token prediction, which neither can feed: put them in "
                    "training/post_lora_dataset (the LoRA phase then trains the adapters with DPO on pairs, with GRPO on "
                    "prompts) and text datasets (pmd, padded) before the boundary");
  auto count = [&](DatasetStyle style) {
    return static_cast<size_t>(std::count_if(post.begin(), post.end(), [&](const Sampling& s) { return s.style == style; }));
  };
  const size_t pairs = count(DatasetStyle::CONTRASTIVE), prompts = count(DatasetStyle::PROMPTS);
  if ((pairs != 0 && pairs != post.size()) || (prompts != 0 && prompts != post.size()))
    throw UserError("training/post_lora_dataset mixes datasets of different kinds: " + listed(post) + ". The LoRA phase "
                    "trains with DPO when every post-LoRA dataset is contrastive, with GRPO when every one is prompts, and "
                    "with the next-token loss when none is either: make them all one kind (a second job, --restore'd from "
                    "this one's export, can train the other)");
  return pairs != 0 ? LoraObjective::Dpo : prompts != 0 ? LoraObjective::Grpo : LoraObjective::NextToken;
}

ConfigSchema lora_train_schema() {
  ConfigSchema s = Trainer::lora_schema();
  add_dpo_loss_options(s);
  add_grpo_options(s);
  return s;
}

std::unique_ptr<Trainer> make_lora_train(JobSpec spec, Config cfg, std::string out_dir) {
  const TrainingPlan plan = TrainingPlan::from_lora_config(cfg);
  const LoraObjective objective = lora_phase_objective(plan.stages, plan.full_stages);
  auto t = std::make_unique<Trainer>(std::move(spec), cfg, std::move(out_dir), plan);
  if (objective == LoraObjective::Dpo) {
    check_no_modules_to_save(*t, "a lora/train job whose post-LoRA datasets are preference pairs (DPO)");
    t->add_part(std::make_unique<DpoPart>(*t, DpoOptions::from_config(cfg), /*after_next_token_phase=*/true));
  } else if (objective == LoraObjective::Grpo) {
    check_no_modules_to_save(*t, "a lora/train job whose post-LoRA datasets are prompts (GRPO)");
    t->add_part(std::make_unique<GrpoPart>(*t, GrpoOptions::from_config(cfg), /*after_next_token_phase=*/true));
  }
  return t;
}

}  // namespace lt
