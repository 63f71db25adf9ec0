// Direct preference optimisation (DPO; Rafailov et al., 2023): the loss of preference pairs, its
// options (optimization/dpo/*) and the summed log-probability of a completion.
//
// A pair is a prompt with a chosen and a rejected completion (a CONTRASTIVE dataset, data.hpp). With
// pi the summed log-probability of a completion's tokens under the model being trained and ref under
// the reference model (the starting point, frozen),
//   logratio = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
//   loss     = -(1 - ls) log sigmoid(beta logratio) - ls log sigmoid(-beta logratio)
// (ls = label_smoothing: conservative DPO, TRL's "sigmoid" loss), and the implicit rewards are
// beta (pi - ref): the reward margin is chosen's minus rejected's, the accuracy the share of pairs
// whose chosen reward is the larger. Until the model moves off the reference the margin is 0 and
// the loss log 2.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/training/dpo_figures.hpp"

namespace lt {

// optimization/dpo/*, each key declared once bound to its field (dpo.cpp: add_dpo_options), read once.
struct DpoOptions {
  double beta{};             // optimization/dpo/beta: the strength of the pull towards the reference (KL weight)
  double label_smoothing{};  // optimization/dpo/label_smoothing: the assumed share of mislabelled pairs
  bool lora = true;          // optimization/dpo/lora: adapters on the frozen base (reference: adapters off),
                             // or every parameter (reference: a frozen bf16 copy); true where the schema has
                             // no such key (lora/train, whose DPO phase is its LoRA phase)
  static DpoOptions from_config(const Config& cfg);
};
// The loss's keys, optimization/dpo/{beta, label_smoothing}: dpo/train's and lora/train's.
void add_dpo_loss_options(ConfigSchema& s);
// add_dpo_loss_options and dpo/train's choice of form, optimization/dpo/lora.
void add_dpo_options(ConfigSchema& s);

// idx, targets: (R, T) int64 -> (R) f32: each row's sum of log p(target) over its targets >= 0.
// Differentiable; the logits go through cross_entropy_sum (runtime/loss) one row at a time.
torch::Tensor sequence_logps(CausalLMImpl& model, const torch::Tensor& idx, const torch::Tensor& targets);

// The terms of P pairs, each (P) f64: `losses` differentiable, the rewards detached.
struct DpoTerms {
  torch::Tensor losses, chosen_rewards, rejected_rewards;
};
// Every argument (P): summed log-probabilities of the chosen and rejected completions.
DpoTerms dpo_loss(const torch::Tensor& policy_chosen, const torch::Tensor& policy_rejected,
                  const torch::Tensor& ref_chosen, const torch::Tensor& ref_rejected, const DpoOptions& o);

// Sums over pairs, for the step line, validation and the sums over ranks.
struct DpoStats {
  double loss = 0, margin = 0, chosen = 0, rejected = 0, correct = 0, pairs = 0;
  void add(const DpoTerms& t);
  void add(const DpoStats& s);
  torch::Tensor to_tensor() const;  // (6) f64, in the order above
  static DpoStats from_tensor(const torch::Tensor& t);
  // The figures: means per pair, and the pairs.
  DpoFigures figures() const;
};

}  // namespace lt
