// `lora_trainer eval CHECKPOINT [--dataset NAME ...] [--rows N] [--json] [key=value ...]`: held-out loss and
// perplexity (DPO's figures for preference pairs) of a checkpoint on its job's datasets or on others.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {
namespace {

struct EvalArgs {
  std::string checkpoint;
  std::vector<std::string> datasets;
  int64_t rows = 0;
  bool json = false;
  std::vector<std::string> overrides;
};

int eval(const EvalArgs& a) {
  Trainer* t = nullptr;
  auto job = load_for_reading(a.checkpoint, a.overrides, &t);
  std::vector<Sampling> datasets;
  if (a.datasets.empty()) datasets = t->plan_datasets();
  for (const auto& n : a.datasets) datasets.push_back(parse_dataset_spec(n));
  auto results = t->evaluate(datasets, a.rows > 0 ? a.rows : t->options().validation_steps);
  nlohmann::json out = {{"checkpoint", a.checkpoint}, {"step", t->step()}, {"kind", state_kind_name(t->state_kind())}};
  for (const auto& e : results)
    out["datasets"][e.name] = e.style == DatasetStyle::CONTRASTIVE  // preference pairs: DPO's figures
                                  ? nlohmann::json{{"dpo_loss", e.loss}, {"reward_margin", e.reward_margin},
                                                   {"accuracy", e.accuracy}, {"pairs", e.tokens}}
                                  : nlohmann::json{{"loss", e.loss}, {"perplexity", std::exp(e.loss)}, {"tokens", e.tokens}};
  if (a.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("%s (step %lld, %s state)\n%-20s %10s %12s %10s\n", a.checkpoint.c_str(), (long long)t->step(),
              state_kind_name(t->state_kind()).c_str(), "dataset", "loss", "perplexity", "tokens");
  for (const auto& e : results) {
    if (e.style == DatasetStyle::CONTRASTIVE)
      std::printf("%-20s %10.4f (DPO loss over %lld pairs; reward margin %.4f, accuracy %.3f)\n", e.name.c_str(), e.loss,
                  (long long)e.tokens, e.reward_margin, e.accuracy);
    else
      std::printf("%-20s %10.4f %12.2f %10lld\n", e.name.c_str(), e.loss, std::exp(e.loss), (long long)e.tokens);
  }
  return 0;
}

}  // namespace

Command add_eval(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  auto* sub = app.add_subcommand("eval", "held-out loss and perplexity of a checkpoint (plain or LoRA) on datasets");
  sub->add_option("CHECKPOINT", a->checkpoint, "checkpoint directory")->required()->check(CLI::ExistingDirectory);
  // One value per --dataset (or a comma-separated list), so that key=value overrides after it stay overrides.
  sub->add_option("--dataset", a->datasets,
                  "dataset name under data/dir, NAME:padded for a PADDED one, NAME:contrastive for preference pairs; repeat it or give a comma-separated "
                  "list (default: every dataset of the job)")
      ->allow_extra_args(false)->delimiter(',')->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  sub->add_option("--rows", a->rows, "validation rows per dataset (default: training/validation_steps)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  sub->add_flag("--json", a->json, "print JSON");
  sub->add_option("overrides", a->overrides, "key=value settings over the saved config (e.g. data/dir=...)");
  return {sub, [a] { return eval(*a); }};
}

}  // namespace lt
