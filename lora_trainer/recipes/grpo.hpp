// Group relative policy optimisation (GRPO; Shao et al., 2024, "DeepSeekMath"), computed as TRL's
// GRPOTrainer computes it: its options (optimization/grpo/*), the advantages of a group's rewards, the
// per-token log-probabilities of completions and the clipped policy-gradient loss with its three
// normalisations.
//
// A step's rollouts are groups of G completions of one prompt each (G = num_generations). With r the
// rewards (NaN where a reward gave none: counted as 0 in a sum of rewards, left out of means),
//   advantage  A = r - mean(group), divided by std(group) + 1e-4 (scale_rewards=group), by the std of
//              the whole step's rewards + 1e-4 (batch), or not divided (none); std with Bessel's
//              correction; NaN becomes 0.
// For each completion token t of row i, with logp the policy's log-probability of the token under
// logits / temperature, old the same at the time the rollouts were generated (the policy that drew
// them: logp itself, detached, when each batch of rollouts trains one step) and ref the reference's
// (the base with its adapters off),
//   ratio      = exp(logp - old),  clipped = clamp(ratio, 1 - epsilon, 1 + epsilon_high)
//   loss_it    = -min(ratio A_i, clipped A_i) + beta (exp(ref - logp) - (ref - logp) - 1)
// (the last term is the k3 estimate of KL(policy || ref)), summed over the completion's tokens (through
// its stop id) and normalised over the step's rollouts:
//   grpo       mean over the rows of (their sum / their token count)
//   dr_grpo    sum / (rows x max_completion_length)
//   dapo       sum / the step's completion tokens          (TRL's default)
// A step's rows may be split into micro-batches: each micro-batch's loss is its share of the step's
// (grpo_loss with the step's counts), so their gradients add up to the step's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "lora_trainer/core/config.hpp"

namespace lt {

enum class GrpoLossType { Grpo, DrGrpo, Dapo };
const std::vector<std::string>& grpo_loss_type_names();  // "grpo", "dr_grpo", "dapo": in GrpoLossType's order
enum class RewardScaling { Group, Batch, None };
const std::vector<std::string>& reward_scaling_names();  // "group", "batch", "none": in RewardScaling's order

// optimization/grpo/*, each key declared once bound to its field (grpo.cpp: add_grpo_options).
struct GrpoOptions {
  GrpoLossType loss_type = GrpoLossType::Dapo;
  double epsilon = 0.2;       // the ratio's lower clip: 1 - epsilon
  double epsilon_high = 0.2;  // its upper clip: 1 + epsilon_high
  double beta = 0.0;          // the KL penalty's weight (0: no reference pass)
  RewardScaling scale_rewards = RewardScaling::Group;
  int64_t num_generations = 8;         // G: completions a prompt
  int64_t num_iterations = 1;          // optimizer steps on each batch of rollouts
  int64_t max_completion_length = 256;
  double temperature = 1.0;            // sampling, and the log-probabilities' logits / temperature
  int64_t top_k = 0;
  double top_p = 1.0;
  std::vector<std::string> stop;  // a completion ends with the first of these strings (its token kept)
  nlohmann::json rewards = nlohmann::json::array({{{"kind", "exact_match"}}});  // grpo_rewards.hpp's RewardSet specs
  static GrpoOptions from_config(const Config& cfg);
};
void add_grpo_options(ConfigSchema& s);

// rewards (N) f64, N a multiple of group_size, consecutive rows a group; NaN = no reward. -> (N) f64.
torch::Tensor group_advantages(const torch::Tensor& rewards, int64_t group_size, RewardScaling scaling);

// logits (B, T, V), targets (B, T) int64 -> (B, T) f32: log softmax(logits / temperature)[target],
// differentiable; 0 where the target is < 0 (not a completion token).
torch::Tensor token_logps(const torch::Tensor& logits, const torch::Tensor& targets, double temperature);

// A micro-batch of rollouts for the loss: B rows of T positions.
struct GrpoBatch {
  torch::Tensor logps;       // (B, T) f32, the policy's, differentiable
  torch::Tensor old_logps;   // (B, T) the policy's when the rollouts were drawn; undefined: logps detached
  torch::Tensor ref_logps;   // (B, T) the reference's; needed when beta > 0
  torch::Tensor advantages;  // (B)
  torch::Tensor mask;        // (B, T) f32: 1 on the completions' tokens
};
// The step the micro-batch belongs to: its rows and its completion tokens (the normalisers).
struct GrpoStepSize {
  int64_t rows = 0;
  double tokens = 0;
};

// The micro-batch's share of the step's loss, and its sums for the figures.
struct GrpoTerms {
  torch::Tensor loss;  // scalar, differentiable
  // Over the micro-batch's completion tokens (detached, f64): how many; those whose ratio was clipped
  // below (ratio < 1 - epsilon where A < 0) and above (ratio > 1 + epsilon_high where A > 0); the k3
  // KL estimates (with beta > 0).
  double tokens = 0, clipped_low = 0, clipped_high = 0, kl = 0;
};
GrpoTerms grpo_loss(const GrpoBatch& batch, const GrpoOptions& o, const GrpoStepSize& step);

}  // namespace lt
