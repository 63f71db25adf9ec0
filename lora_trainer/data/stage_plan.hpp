// The stage plan: consecutive stages of a training job, each a token budget and a dataset mixture.
//
// A config names the budgets and mixtures (training/plan.hpp reads them); split_stages turns them into
// stages of whole steps, [first_step, end_step) each, for a given number of tokens per step. The
// trainers own their stages; this file only plans them and answers which stage a step belongs to.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/data/data.hpp"

namespace lt {

struct Stage {
  int64_t tokens = 0;
  std::vector<Sampling> samplings;
  int64_t first_step = 0, end_step = 0;  // [first_step, end_step)
};

// Token budgets and dataset mixtures of consecutive stages.
struct StagePlan {
  std::vector<int64_t> tokens;
  std::vector<std::vector<Sampling>> datasets;
  // A UserError naming `tokens_key` and `dataset_key` (the config's keys of the two lists, read by
  // training/plan.cpp's option groups) when there is not one dataset mixture per token budget, ending
  // with `hint`.
  void check_one_mixture_per_budget(const std::string& tokens_key, const std::string& dataset_key,
                                    const std::string& hint = "") const;
  // This plan's stages, then `next`'s.
  StagePlan& append(const StagePlan& next);
};

// The plan's budgets as consecutive stages of whole steps of `tokens_per_step` tokens (a budget's
// remainder is dropped); UserError for a budget of less than one step.
std::vector<Stage> split_stages(const StagePlan& plan, int64_t tokens_per_step);
// The stage that `step` (0-based) belongs to; steps past the end belong to the last stage.
int stage_of(const std::vector<Stage>& stages, int64_t step);
// Every distinct dataset (name and style) of the stages, in order of first use.
std::vector<Sampling> plan_datasets(const std::vector<Stage>& stages);

}  // namespace lt
