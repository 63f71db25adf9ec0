// GRPO's loss (recipes/grpo.hpp) against an independent plain-PyTorch recomputation of TRL's formulas
// (scripts/grpo_golden.py, with Debian's python3-torch: tests/data/golden/grpo.json): the advantages under
// each reward scaling (a missing reward among them), and the loss and its gradient with respect to the
// logits for each loss type (grpo, dr_grpo, dapo), without and with the KL penalty, on a batch's first
// iteration (ratio 1) and its second (the policy moved: ratios clipped). Then the property the trainer's
// micro-batches rely on: the micro-batches' losses, each with the step's counts, add up to the step's.
//
// Tolerance: both sides compute in f32 from the same f32 logits (7 ids, 6 positions): a log-softmax,
// an exp, sums of at most 24 terms. Their results differ by a few f32 roundings of values below 10:
// within 1e-5 absolute, losses and gradients alike (the gradients are below 1).
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "lora_trainer/recipes/grpo.hpp"

using namespace lt;
using json = nlohmann::json;

namespace {

json golden() {
  std::ifstream in(std::string(LT_SOURCE_DIR) + "/tests/data/golden/grpo.json");
  REQUIRE(in.good());
  return json::parse(in);
}

torch::Tensor tensor_of(const json& v, torch::ScalarType type) {
  std::vector<double> flat;
  std::vector<int64_t> shape;
  const json* level = &v;
  while (level->is_array()) {
    shape.push_back(static_cast<int64_t>(level->size()));
    level = &(*level)[0];
  }
  std::function<void(const json&)> walk = [&](const json& x) {
    if (x.is_array())
      for (const auto& e : x) walk(e);
    else
      flat.push_back(x.is_null() ? NAN : x.get<double>());
  };
  walk(v);
  return torch::tensor(flat, torch::kFloat64).view(shape).to(type);
}

double max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

}  // namespace

TEST_CASE("grpo: the advantages are TRL's under each reward scaling, a missing reward counted out", "[grpo][numerics]") {
  const json g = golden();
  const auto rewards = tensor_of(g["advantages"]["rewards"], torch::kFloat64);
  const int64_t group = g["advantages"]["group_size"].get<int64_t>();
  for (const auto& [name, scaling] : {std::pair<std::string, RewardScaling>{"group", RewardScaling::Group},
                                      {"batch", RewardScaling::Batch}, {"none", RewardScaling::None}}) {
    INFO("scale_rewards=" << name);
    CHECK(max_abs(group_advantages(rewards, group, scaling), tensor_of(g["advantages"]["expected"][name], torch::kFloat64)) < 1e-12);
  }
  CHECK_THROWS(group_advantages(rewards, 3, RewardScaling::Group));  // 8 rewards are not groups of 3
}

TEST_CASE("grpo: the loss and its gradient are TRL's, for each loss type, beta and iteration", "[grpo][numerics]") {
  const json g = golden();
  GrpoOptions o;
  o.epsilon = g["epsilon"].get<double>();
  o.epsilon_high = g["epsilon_high"].get<double>();
  o.max_completion_length = g["max_completion_length"].get<int64_t>();
  const double temperature = g["temperature"].get<double>();
  const auto targets = tensor_of(g["targets"], torch::kLong);
  const auto mask = tensor_of(g["mask"], torch::kFloat32);
  const auto ref = tensor_of(g["ref_logps"], torch::kFloat32);
  const auto adv = group_advantages(tensor_of(g["step_rewards"], torch::kFloat64), 4, RewardScaling::Group);
  const auto logits1 = tensor_of(g["logits1"], torch::kFloat32);
  const auto old = token_logps(logits1, targets, temperature).detach();
  const GrpoStepSize step{targets.size(0), mask.sum().item<double>()};
  int checked = 0;
  for (const auto& c : g["cases"]) {
    const std::string type = c["loss_type"];
    const int iteration = c["iteration"];
    INFO(type << ", beta " << c["beta"].get<double>() << ", iteration " << iteration);
    o.loss_type = type == "grpo" ? GrpoLossType::Grpo : type == "dr_grpo" ? GrpoLossType::DrGrpo : GrpoLossType::Dapo;
    o.beta = c["beta"].get<double>();
    auto logits = tensor_of(iteration == 1 ? g["logits1"] : g["logits2"], torch::kFloat32).requires_grad_(true);
    GrpoBatch b;
    b.logps = token_logps(logits, targets, temperature);
    if (iteration == 2) b.old_logps = old;
    b.ref_logps = ref;
    b.advantages = adv;
    b.mask = mask;
    const GrpoTerms t = grpo_loss(b, o, step);
    t.loss.backward();
    CHECK(std::abs(t.loss.item<double>() - c["loss"].get<double>()) < 1e-5);
    CHECK(max_abs(logits.grad(), tensor_of(c["grad"], torch::kFloat32)) < 1e-5);
    CHECK(t.tokens == mask.sum().item<double>());
    if (iteration == 1) CHECK(t.clipped_low + t.clipped_high == 0);  // ratio 1: nothing clipped
    ++checked;
  }
  CHECK(checked == 12);
}

TEST_CASE("grpo: micro-batches' losses with the step's counts add up to the step's loss and gradient", "[grpo]") {
  const json g = golden();
  const auto targets = tensor_of(g["targets"], torch::kLong);
  const auto mask = tensor_of(g["mask"], torch::kFloat32);
  const auto adv = group_advantages(tensor_of(g["step_rewards"], torch::kFloat64), 4, RewardScaling::Group);
  const auto old = token_logps(tensor_of(g["logits1"], torch::kFloat32), targets, 0.7).detach();
  const GrpoStepSize step{4, mask.sum().item<double>()};
  for (GrpoLossType type : {GrpoLossType::Grpo, GrpoLossType::DrGrpo, GrpoLossType::Dapo}) {
    GrpoOptions o;
    o.loss_type = type;
    o.beta = 0.04;
    auto run = [&](int64_t from, int64_t to, torch::Tensor& logits) {
      GrpoBatch b;
      b.logps = token_logps(logits.slice(0, from, to), targets.slice(0, from, to), 0.7);
      b.old_logps = old.slice(0, from, to);
      b.ref_logps = old.slice(0, from, to) - 0.1;
      b.advantages = adv.slice(0, from, to);
      b.mask = mask.slice(0, from, to);
      return grpo_loss(b, o, step).loss;
    };
    auto whole = tensor_of(g["logits2"], torch::kFloat32).requires_grad_(true);
    auto parts = tensor_of(g["logits2"], torch::kFloat32).requires_grad_(true);
    const auto loss = run(0, 4, whole);
    loss.backward();
    const auto a = run(0, 1, parts), b = run(1, 4, parts);
    (a + b).backward();
    INFO("loss type " << grpo_loss_type_names()[static_cast<size_t>(type)]);
    CHECK(std::abs((a + b).item<double>() - loss.item<double>()) < 1e-6);
    CHECK(max_abs(whole.grad(), parts.grad()) < 1e-7);
  }
}
