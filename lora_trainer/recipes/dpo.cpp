#include "lora_trainer/recipes/dpo.hpp"

#include <algorithm>

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/kernels/cross_entropy.hpp"

namespace lt {

// The loss's keys (dpo/train, and lora/train for a DPO LoRA phase), and dpo/train's choice of form.
static const OptionGroup<DpoOptions>& dpo_loss_options() {
  static const auto g =
      OptionGroup<DpoOptions>()
          .add("optimization/dpo/beta", OptType::Float, 0.1,
               "DPO's beta: the implicit reward is beta (log pi - log ref); larger keeps the model closer to the reference",
               &DpoOptions::beta, check_positive())
          .add("optimization/dpo/label_smoothing", OptType::Float, 0.0,
               "conservative DPO: the assumed share of pairs whose labels are flipped (0 = plain DPO; at most 0.5)",
               &DpoOptions::label_smoothing, check_range(0.0, 0.5));
  return g;
}

static const OptionGroup<DpoOptions>& dpo_form_option() {
  static const auto g = OptionGroup<DpoOptions>().add(
      "optimization/dpo/lora", OptType::Bool, true,
      "true: train LoRA adapters (optimization/lora/*) on the frozen bf16 base, the reference being the base with the "
      "adapters off; false: train every parameter (optimization/lr, training/schedule) against a frozen bf16 copy "
      "of the starting weights",
      &DpoOptions::lora);
  return g;
}

void add_dpo_loss_options(ConfigSchema& s) { dpo_loss_options().declare(s); }

void add_dpo_options(ConfigSchema& s) {
  add_dpo_loss_options(s);
  dpo_form_option().declare(s);
}

DpoOptions DpoOptions::from_config(const Config& cfg) {
  DpoOptions o = dpo_loss_options().read(cfg);
  o.lora = dpo_form_option().read(cfg).lora;  // true where the kind has no such key (lora/train)
  return o;
}

torch::Tensor sequence_logps(CausalLMImpl& model, const torch::Tensor& idx, const torch::Tensor& targets) {
  auto logits = model.forward(idx);  // (R, T, V)
  auto rows = logits.unbind(0);      // one backward node stacks the rows' gradients
  auto row_targets = targets.unbind(0);
  std::vector<torch::Tensor> out;
  const bool fused = model.options().fused_loss_on(idx.device());
  for (size_t r = 0; r < rows.size(); ++r) out.push_back(-cross_entropy_sum(rows[r], row_targets[r], fused));
  return torch::stack(out);
}

DpoTerms dpo_loss(const torch::Tensor& policy_chosen, const torch::Tensor& policy_rejected,
                  const torch::Tensor& ref_chosen, const torch::Tensor& ref_rejected, const DpoOptions& o) {
  auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
  auto chosen = f64(policy_chosen) - f64(ref_chosen);        // (P) log pi/ref of the chosen completion
  auto rejected = f64(policy_rejected) - f64(ref_rejected);  // (P) and of the rejected one
  auto z = o.beta * (chosen - rejected);
  DpoTerms t;
  t.losses = -(1.0 - o.label_smoothing) * torch::log_sigmoid(z) - o.label_smoothing * torch::log_sigmoid(-z);
  t.chosen_rewards = o.beta * chosen.detach();
  t.rejected_rewards = o.beta * rejected.detach();
  return t;
}

void DpoStats::add(const DpoTerms& t) {
  auto c = t.chosen_rewards.cpu(), r = t.rejected_rewards.cpu();
  loss += t.losses.detach().sum().item<double>();
  margin += (c - r).sum().item<double>();
  chosen += c.sum().item<double>();
  rejected += r.sum().item<double>();
  correct += c.gt(r).sum().item<double>();
  pairs += static_cast<double>(c.size(0));
}

void DpoStats::add(const DpoStats& s) {
  loss += s.loss;
  margin += s.margin;
  chosen += s.chosen;
  rejected += s.rejected;
  correct += s.correct;
  pairs += s.pairs;
}

torch::Tensor DpoStats::to_tensor() const {
  return torch::tensor({loss, margin, chosen, rejected, correct, pairs}, torch::kFloat64);
}

DpoStats DpoStats::from_tensor(const torch::Tensor& t) {
  auto c = t.cpu().contiguous();
  const double* p = c.data_ptr<double>();
  DpoStats s;
  s.loss = p[0];
  s.margin = p[1];
  s.chosen = p[2];
  s.rejected = p[3];
  s.correct = p[4];
  s.pairs = p[5];
  return s;
}

DpoFigures DpoStats::figures() const {
  const double n = std::max(1.0, pairs);
  DpoFigures f;
  f.loss = loss / n;
  f.reward_margin = margin / n;
  f.accuracy = correct / n;
  f.chosen_reward = chosen / n;
  f.rejected_reward = rejected / n;
  f.pairs = static_cast<int64_t>(pairs);
  return f;
}

}  // namespace lt
