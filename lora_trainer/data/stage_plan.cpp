#include "lora_trainer/data/stage_plan.hpp"

#include <algorithm>

#include "lora_trainer/core/util.hpp"

namespace lt {

void StagePlan::check_one_mixture_per_budget(const std::string& tokens_key, const std::string& dataset_key,
                                             const std::string& hint) const {
  if (tokens.size() != datasets.size())
    throw UserError(tokens_key + " has " + std::to_string(tokens.size()) + " stages but " + dataset_key + " has " +
                    std::to_string(datasets.size()) + "; give one dataset mixture per token budget" + hint);
}

StagePlan& StagePlan::append(const StagePlan& next) {
  tokens.insert(tokens.end(), next.tokens.begin(), next.tokens.end());
  datasets.insert(datasets.end(), next.datasets.begin(), next.datasets.end());
  return *this;
}

std::vector<Stage> split_stages(const StagePlan& plan, int64_t tokens_per_step) {
  std::vector<Stage> stages;
  int64_t step = 0;
  for (size_t i = 0; i < plan.tokens.size(); ++i) {
    Stage s;
    s.tokens = plan.tokens[i];
    s.samplings = plan.datasets.at(i);
    int64_t steps = s.tokens / tokens_per_step;
    if (steps <= 0)
      throw UserError("stage " + std::to_string(i) + ": a budget of " + std::to_string(s.tokens) +
                      " tokens is less than one step (batch_size x block_size = " + std::to_string(tokens_per_step) +
                      " tokens); raise the token budget or lower training/batch_size");
    s.first_step = step;
    s.end_step = step + steps;
    step = s.end_step;
    stages.push_back(std::move(s));
  }
  return stages;
}

int stage_of(const std::vector<Stage>& stages, int64_t step) {
  for (size_t i = 0; i < stages.size(); ++i)
    if (step < stages[i].end_step) return static_cast<int>(i);
  return static_cast<int>(stages.size()) - 1;
}

static bool same_dataset(const Sampling& a, const Sampling& b) { return a.name == b.name && a.style == b.style; }

std::vector<Sampling> plan_datasets(const std::vector<Stage>& stages) {
  std::vector<Sampling> all;
  for (const auto& st : stages)
    for (const auto& smp : st.samplings)
      if (std::none_of(all.begin(), all.end(), [&](const Sampling& x) { return same_dataset(x, smp); }))
        all.push_back(smp);
  return all;
}

}  // namespace lt
