// The optimizer (AdamW over an explicit, ordered, named parameter list), global-norm clipping and the
// learning-rate schedules.
//
// The state is keyed by parameter name, never by position or tensor address, so a checkpoint stores
// `optim/exp_avg/<name>` and `optim/exp_avg_sq/<name>` and loading checks that the names match.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

// Decoupled-weight-decay Adam. Weight decay applies to parameters of 2 or more dimensions (matrices
// and embeddings), not to biases and layer-norm gains, as in GPT-2/nanoGPT practice.
// `lr_scale` (empty: 1 for all) multiplies the learning rate of each parameter, as a PyTorch param
// group's own lr would: the LoRA phase trains its saved base modules at a fraction of the adapters' lr.
class AdamW {
 public:
  AdamW(NamedTensors params, AdamWOptions opts, std::vector<double> lr_scale = {});
  void step(double lr);  // uses each parameter's .grad(); a parameter without a gradient is skipped
  void zero_grad();
  int64_t steps_taken() const { return t_; }
  double weight_decay() const { return o_.weight_decay; }
  const std::vector<double>& lr_scale() const { return lr_scale_; }
  // Whether parameter i decays (default: 2 or more dimensions); a param_groups rule may say otherwise.
  void set_decay(size_t i, bool on) { decay_.at(i) = on; }
  bool decays(size_t i) const { return decay_.at(i); }
  const NamedTensors& params() const { return params_; }
  std::vector<std::string> param_names() const;
  // optim/exp_avg/<name>, optim/exp_avg_sq/<name> and optim/step, in parameter order.
  NamedTensors state() const;
  // state() hands out the moment tensors themselves (a checkpoint load copies into them) and the step
  // count as a fresh scalar, which the loader hands back here.
  void set_steps_taken(int64_t t) { t_ = t; }
  // Bytes of moments this process holds.
  int64_t state_bytes() const;

  // ZeRO-1 over `world` ranks: the parameters are split among the ranks (whole tensors, largest
  // first, each to the rank holding the fewest elements so far; the same split on every rank), and
  // this rank keeps and updates only the moments of its own share. step() then updates only the
  // owned parameters; the caller copies the others from their owners. state() gives zeros for the
  // moments held elsewhere (so a sum over the ranks assembles the whole state).
  void shard(int rank, int world);
  bool sharded() const { return world_ > 1; }
  bool owns(size_t i) const { return owner_.empty() || owner_[i] == rank_; }

 private:
  void fused_step(double lr);  // CUDA with LibTorch 2.x
  NamedTensors params_;
  AdamWOptions o_;
  // The moments of the parameters this rank keeps, made (zeros) when first needed: a sharded optimizer
  // never holds the others' (make_moments).
  void make_moments() const;
  mutable std::vector<torch::Tensor> m_, v_;
  std::vector<bool> decay_;
  std::vector<double> lr_scale_;
  std::vector<int> owner_;  // empty: not sharded
  int rank_ = 0, world_ = 1;
  int64_t t_ = 0;
};

// Scales all gradients so that their global L2 norm is at most max_norm; returns the norm before.
double clip_grad_norm(const NamedTensors& params, double max_norm);
// The same when some of the gradients (piece[i]) are each rank's own piece of a sharded parameter:
// `sum_pieces` turns this rank's sum of their squares into every rank's (a sum over the ranks); the
// others are whole on every rank and counted once.
double clip_grad_norm(const NamedTensors& params, double max_norm, const std::vector<bool>& piece,
                      const std::function<double(double)>& sum_pieces);

// The shape of a learning-rate schedule; its name in configs is "constant", "wsd" or "cosine".
enum class ScheduleKind { Constant, Wsd, Cosine };
ScheduleKind parse_schedule_kind(const std::string& name);  // std::invalid_argument naming the known ones
std::string schedule_kind_name(ScheduleKind kind);
const std::vector<std::string>& schedule_kind_names();  // in ScheduleKind's order: every name, for a config check

// optimization/param_groups: rules by parameter name, the first whose `match` is a substring of the
// name applying. `lr_ratio` multiplies the parameter's learning rate (on top of the LoRA phase's own
// ratios), `weight_decay` switches its decoupled weight decay on or off (unset: matrices decay).
struct ParamRule {
  std::string match;
  double lr_ratio = 1.0;
  int weight_decay = -1;  // -1 unset, 0 off, 1 on
};
std::vector<ParamRule> parse_param_rules(const nlohmann::json& v);
// The index of the first rule matching `name`, or -1.
int match_param_rule(const std::vector<ParamRule>& rules, const std::string& name);
// A UserError naming optimization/param_groups when a rule matches no parameter of `params` (a
// model's base parameters) nor an adapter a LoRA phase could put on one of its matrices.
void check_param_rules(const std::vector<ParamRule>& rules, const NamedTensors& params);
// The rule each of `params` takes (-1: none), its lr_ratio multiplied into `lr_scale`.
std::vector<int> apply_param_rules(const std::vector<ParamRule>& rules, const NamedTensors& params,
                                   std::vector<double>& lr_scale);
// "param group R (match ..., lr xF, ...): names" a line per rule, over the `params` rule_of assigns.
std::string describe_param_groups(const std::vector<ParamRule>& rules, const std::vector<int>& rule_of,
                                  const NamedTensors& params);

// lr(step) for step in [0, total_steps).
//   constant: warmup then flat.
//   wsd:      linear warmup over warmup_pct, flat, then linear decay to min_lr over the last decay_pct.
//   cosine:   linear warmup, then cosine from lr to min_lr.
struct Schedule {
  ScheduleKind kind = ScheduleKind::Wsd;
  double lr = 3e-4, min_lr = 0.0;
  int64_t total_steps = 1, warmup_steps = 0, decay_steps = 0;
  double at(int64_t step) const;
  static Schedule make(ScheduleKind kind, double lr, double min_lr_ratio, int64_t total_steps,
                       double warmup_pct, double decay_pct);
};

}  // namespace lt
