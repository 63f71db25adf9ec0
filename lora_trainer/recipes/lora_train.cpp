#include "lora_trainer/recipes/lora_train.hpp"

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"

namespace lt {

bool lora_phase_is_dpo(const StagePlan& plan, size_t pre_lora_stages) {
  auto listed = [](const std::vector<Sampling>& list) {
    std::string out;
    for (const auto& s : list) out += std::string(out.empty() ? "" : ", ") + "\"" + s.name + "\" (" + style_name(s.style) + ")";
    return out;
  };
  std::vector<Sampling> pre, post, pairs;
  for (size_t i = 0; i < plan.datasets.size(); ++i)
    for (const auto& s : plan.datasets[i]) {
      auto& list = i < pre_lora_stages ? pre : post;
      if (std::none_of(list.begin(), list.end(), [&](const Sampling& o) { return o.name == s.name && o.style == s.style; }))
        list.push_back(s);
    }
  for (const auto& s : pre)
    if (s.style == DatasetStyle::CONTRASTIVE) pairs.push_back(s);
  if (!pairs.empty())
    throw UserError("training/pre_lora_dataset has preference pairs: " + listed(pairs) + ". Phase 1 trains every "
                    "parameter on next-token prediction, which pairs cannot feed: put them in training/post_lora_dataset "
                    "(the LoRA phase then trains the adapters with DPO) and text datasets (pmd, padded) before the "
                    "boundary");
  const size_t n_pairs = static_cast<size_t>(std::count_if(
      post.begin(), post.end(), [](const Sampling& s) { return s.style == DatasetStyle::CONTRASTIVE; }));
  if (n_pairs != 0 && n_pairs != post.size())
    throw UserError("training/post_lora_dataset mixes preference pairs with single rows: " + listed(post) +
                    ". The LoRA phase trains with DPO when every post-LoRA dataset is contrastive and with the "
                    "next-token loss when none is: make them all one or the other (a second job, --restore'd from "
                    "this one's export, can train the other kind)");
  return n_pairs != 0;
}

ConfigSchema lora_train_schema() {
  ConfigSchema s = Trainer::lora_schema();
  add_dpo_loss_options(s);
  return s;
}

std::unique_ptr<Trainer> make_lora_train(JobSpec spec, Config cfg, std::string out_dir) {
  const TrainingPlan plan = TrainingPlan::from_lora_config(cfg);
  const bool dpo = lora_phase_is_dpo(plan.stages, plan.full_stages);
  auto t = std::make_unique<Trainer>(std::move(spec), cfg, std::move(out_dir), plan);
  if (!dpo) return t;
  check_no_modules_to_save(*t, "a lora/train job whose post-LoRA datasets are preference pairs (DPO)");
  t->add_part(std::make_unique<DpoPart>(*t, DpoOptions::from_config(cfg), /*after_next_token_phase=*/true));
  return t;
}

}  // namespace lt
