#include "lora_trainer/recipes/grpo.hpp"

#include <cmath>

#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/options.hpp"
#include "lora_trainer/recipes/grpo_rewards.hpp"

namespace lt {

const std::vector<std::string>& grpo_loss_type_names() {
  static const std::vector<std::string> names = {"grpo", "dr_grpo", "dapo"};  // in GrpoLossType's order
  return names;
}

const std::vector<std::string>& reward_scaling_names() {
  static const std::vector<std::string> names = {"group", "batch", "none"};  // in RewardScaling's order
  return names;
}

static const OptionGroup<GrpoOptions>& grpo_options() {
  using O = GrpoOptions;
  static const auto g =
      OptionGroup<O>()
          .add("optimization/grpo/loss_type", OptType::String, "dapo",
               "how the per-token losses are normalised over a step's rollouts (TRL's): dapo (by the step's completion "
               "tokens), grpo (each completion by its length, then the mean over completions), dr_grpo (by completions x "
               "max_completion_length)",
               [](O& o, const json& v) {
                 o.loss_type = enum_named<GrpoLossType>(grpo_loss_type_names(), v.get<std::string>(), "optimization/grpo/loss_type");
               },
               check_one_of(grpo_loss_type_names()))
          .add("optimization/grpo/epsilon", OptType::Float, 0.2, "the probability ratio's lower clip, 1 - epsilon",
               &O::epsilon, check_range(0.0, 1.0))
          .add("optimization/grpo/epsilon_high", OptType::Float, 0.2,
               "the ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher sets it above epsilon, e.g. 0.28)",
               &O::epsilon_high, check_range(0.0, 1e6))
          .add("optimization/grpo/beta", OptType::Float, 0.0,
               "the weight of the KL penalty against the reference (the base with the adapters off; k3 estimator); 0 "
               "skips the reference's pass",
               &O::beta, check_range(0.0, 1e6))
          .add("optimization/grpo/scale_rewards", OptType::String, "group",
               "the advantages' scale: group (each group's reward std), batch (the step's), none (the rewards' "
               "differences from their group's mean as they are: Dr. GRPO)",
               [](O& o, const json& v) {
                 o.scale_rewards = enum_named<RewardScaling>(reward_scaling_names(), v.get<std::string>(), "optimization/grpo/scale_rewards");
               },
               check_one_of(reward_scaling_names()))
          .add("optimization/grpo/num_generations", OptType::Int, 8, "completions drawn for each prompt (G, the group)",
               &O::num_generations, check_range(2, 1 << 16))
          .add("optimization/grpo/num_iterations", OptType::Int, 1,
               "optimizer steps on each batch of rollouts (the clipping matters from the second)", &O::num_iterations,
               check_range(1, 1 << 10))
          .add("optimization/grpo/max_completion_length", OptType::Int, 256, "the most new tokens of a completion",
               &O::max_completion_length, check_range(1, 1 << 20))
          .add("optimization/grpo/temperature", OptType::Float, 1.0,
               "the rollouts' sampling temperature (the log-probabilities take logits / temperature too)", &O::temperature,
               check_range(1e-3, 1e3))
          .add("optimization/grpo/top_k", OptType::Int, 0, "the rollouts' top-k (0: all ids)", &O::top_k,
               check_range(0, int64_t(1) << 31))
          .add("optimization/grpo/top_p", OptType::Float, 1.0, "the rollouts' nucleus (1: all ids)", &O::top_p,
               check_range(1e-6, 1.0))
          .add("optimization/grpo/stop", OptType::StringList, json::array(),
               "stop strings: a completion ends with the token that completes the first of them (the rewards read "
               "the text before it); besides the stop ids (end of text, the chat format's end of turn)",
               &O::stop, [](const json& v) -> std::string {
                 for (const auto& s : v)
                   if (s.get<std::string>().empty()) return "has an empty string, which would stop every completion at once";
                 return "";
               })
          .add("optimization/grpo/rewards", OptType::Objects, json::array({{{"kind", "exact_match"}}}),
               "what scores a completion: a list of rewards {\"kind\", \"weight\" (1), \"name\"} summed by weight; kinds: "
               "exact_match (\"pattern\": a regular expression whose first group is the final answer; 1 when it equals the "
               "record's \"answer\", normalised), regex (\"pattern\": 1 when it matches), length (-tokens / "
               "max_completion_length), command (\"command\": [program, args...], \"timeout\" seconds: a program that "
               "reads {\"prompt\", \"completion\", ...record} a JSON line and prints {\"reward\": x} a line)",
               &O::rewards, [](const json& v) -> std::string {
                 try {
                   RewardSet check(v, 1, "entry");
                 } catch (const UserError& e) {
                   return e.what();
                 }
                 return "";
               });
  return g;
}

void add_grpo_options(ConfigSchema& s) { grpo_options().declare(s); }

GrpoOptions GrpoOptions::from_config(const Config& cfg) { return grpo_options().read(cfg); }

torch::Tensor group_advantages(const torch::Tensor& rewards, int64_t group_size, RewardScaling scaling) {
  TORCH_CHECK(rewards.dim() == 1 && group_size > 0 && rewards.size(0) % group_size == 0, "group_advantages: ",
              rewards.size(0), " rewards are not groups of ", group_size);
  const auto r = rewards.to(torch::kFloat64);
  const auto groups = r.view({-1, group_size});
  const auto valid = groups.isnan().logical_not();
  const auto count = valid.sum(1, /*keepdim=*/true).to(torch::kFloat64);
  const auto mean = groups.nan_to_num(0.0).sum(1, true) / count;  // NaN for a group without rewards
  // Bessel-corrected std over the valid rewards: NaN with fewer than two.
  auto nan_std = [](const torch::Tensor& x, const torch::Tensor& ok, const torch::Tensor& n, const torch::Tensor& m) {
    return ((x - m).nan_to_num(0.0).pow(2) * ok).sum(-1, true).div(n - 1).sqrt().where(n > 1, torch::full_like(n, NAN));
  };
  auto adv = groups - mean;
  if (scaling == RewardScaling::Group) {
    adv = adv / (nan_std(groups, valid, count, mean) + 1e-4);
  } else if (scaling == RewardScaling::Batch) {
    const auto all = r.view({1, -1});
    const auto ok = all.isnan().logical_not();
    const auto n = ok.sum(1, true).to(torch::kFloat64);
    adv = adv / (nan_std(all, ok, n, all.nan_to_num(0.0).sum(1, true) / n) + 1e-4);
  }
  return adv.nan_to_num(0.0, 0.0, 0.0).reshape({-1});
}

torch::Tensor token_logps(const torch::Tensor& logits, const torch::Tensor& targets, double temperature) {
  TORCH_CHECK(logits.dim() == 3 && targets.sizes() == logits.sizes().slice(0, 2), "token_logps: logits ", logits.sizes(),
              " and targets ", targets.sizes());
  const auto z = logits.to(torch::kFloat32) / temperature;
  const auto keep = targets.ge(0);
  const auto ids = targets.clamp_min(0).unsqueeze(-1);
  const auto picked = z.gather(-1, ids).squeeze(-1) - z.logsumexp(-1);
  return picked.masked_fill(keep.logical_not(), 0.0);
}

GrpoTerms grpo_loss(const GrpoBatch& b, const GrpoOptions& o, const GrpoStepSize& step) {
  TORCH_CHECK(step.rows > 0, "grpo_loss: a step without rows");
  const auto& logp = b.logps;
  const auto old = b.old_logps.defined() ? b.old_logps : logp.detach();
  const auto mask = b.mask.to(logp.scalar_type());
  const auto A = b.advantages.to(logp.scalar_type()).unsqueeze(1);  // (B, 1)
  const auto ratio = (logp - old).exp();
  const auto clipped = ratio.clamp(1.0 - o.epsilon, 1.0 + o.epsilon_high);
  auto per_token = -torch::min(ratio * A, clipped * A);
  GrpoTerms t;
  if (o.beta != 0.0) {
    TORCH_CHECK(b.ref_logps.defined(), "grpo_loss: beta > 0 needs the reference's log-probabilities");
    const auto d = b.ref_logps - logp;
    const auto kl = d.exp() - d - 1.0;
    per_token = per_token + o.beta * kl;
    t.kl = (kl.detach() * mask).sum().item<double>();
  }
  const auto masked = per_token * mask;
  switch (o.loss_type) {
    case GrpoLossType::Grpo:
      t.loss = (masked.sum(1) / mask.sum(1).clamp_min(1.0)).sum() / static_cast<double>(step.rows);
      break;
    case GrpoLossType::DrGrpo:
      t.loss = masked.sum() / (static_cast<double>(step.rows) * static_cast<double>(o.max_completion_length));
      break;
    case GrpoLossType::Dapo:
      t.loss = masked.sum() / std::max(1.0, step.tokens);
      break;
  }
  const auto r = ratio.detach();
  const auto m = mask.detach().to(torch::kBool);
  const auto low = r.lt(1.0 - o.epsilon).logical_and(A.lt(0)).logical_and(m);
  const auto high = r.gt(1.0 + o.epsilon_high).logical_and(A.gt(0)).logical_and(m);
  t.tokens = mask.detach().sum().item<double>();
  t.clipped_low = low.sum().item<double>();
  t.clipped_high = high.sum().item<double>();
  return t;
}

}  // namespace lt
