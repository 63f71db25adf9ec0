// Evaluation: the held-out loss of a model on the validation rows of datasets, and the validation
// score of a stage (the token-weighted loss over the datasets it trains on).
//
// The rows are the first `rows` validation samples of each dataset (validation_rows), the same on
// every call, so losses at different steps compare. With several ranks the micro-batches are shared
// out and the sums reduced, so every rank gets the loss a single process computes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lora_trainer/data/data.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/training/dpo_figures.hpp"
#include "lora_trainer/training/tasks.hpp"

namespace lt {

struct DatasetEval {
  std::string name;
  DatasetStyle style = DatasetStyle::PMD;
  double loss = 0.0;  // mean cross-entropy per target token (nats); perplexity = exp(loss)
  int64_t tokens = 0;
  // CONTRASTIVE (dpo.hpp): DPO's figures; `loss` is their mean DPO loss per pair and `tokens` their
  // pairs (the weights of validation_score).
  DpoFigures dpo;
  // PROMPTS (recipes/grpo_part.hpp): the rewards of a greedy completion of each prompt ({"reward",
  // "reward/NAME", "completion_tokens"}); `loss` is minus the mean reward and `tokens` the prompts.
  nlohmann::json figures;
};

struct ValResult {
  double loss = 0.0;  // token-weighted over the datasets of the stage just trained
  std::vector<DatasetEval> per_dataset;
  int64_t tokens = 0;
  std::vector<TaskResult> tasks;  // eval/evaluations' "task:FILE" entries (not in the score)
};

// How the held-out rows are cut: micro-batches of `micro_batch` rows of `block_size` tokens.
struct EvalShape {
  int64_t micro_batch = 1, block_size = 1;
};

// Held-out loss of `model` (in eval mode for the call; its training mode comes back after) on the first
// `rows` validation rows of each of `datasets`, each opened by `open` when its turn comes. Micro-batch k
// is evaluated by rank k % ranks and the sums are reduced over the ranks.
std::vector<DatasetEval> held_out_loss(CausalLM& model, const std::vector<Sampling>& datasets, int64_t rows,
                                       const std::function<const Dataset&(const Sampling&)>& open, EvalShape shape,
                                       const Runtime& rt, Distributed& dist);

// This rank's share of `rows` rows in micro-batches of `micro`: fn(first, n, counted) for micro-batch k
// = first / micro when k % ranks is this rank, in order. With `lockstep` (a model whose blocks gather
// their weights from every rank: each forward is a collective) every rank runs as many micro-batches: one
// without its own in the last round runs the first one again, with counted = false (its result not to
// be counted).
void for_rank_micro_batches(int64_t rows, int64_t micro, const Distributed& dist, bool lockstep,
                            const std::function<void(int64_t first, int64_t n, bool counted)>& fn);

// The validation result of `per_dataset`: its `loss` is token-weighted over those of `scored`'s datasets
// (same name and style) that it holds.
ValResult validation_score(std::vector<DatasetEval> per_dataset, const std::vector<Sampling>& scored);

}  // namespace lt
