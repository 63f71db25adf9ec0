// The fused bf16 cross-entropy computes what LibTorch's f32 cross_entropy computes on the same logits.
#include "catch.hpp"

#include <ATen/Parallel.h>

#include "lora_trainer/cross_entropy.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

struct Case {
  torch::Tensor logits;   // bf16 (N, V)
  torch::Tensor targets;  // (N), some -1
};

Case make_case(int64_t N, int64_t V, double scale, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  Case c;
  c.logits = (torch::randn({N, V}, gen, torch::kFloat32) * scale).to(torch::kBFloat16);
  c.targets = torch::randint(0, V, {N}, gen, torch::kLong);
  for (int64_t i = 0; i < N; i += 5) c.targets[i] = -1;  // padding rows
  return c;
}

// (loss, d loss / d logits) from LibTorch in f32.
std::pair<double, torch::Tensor> reference(const Case& c, double grad_scale) {
  auto x = c.logits.to(torch::kFloat32).detach().requires_grad_(true);
  auto loss = torch::nn::functional::cross_entropy(
      x, c.targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
  (loss * grad_scale).backward();
  return {loss.item<double>(), x.grad()};
}

std::pair<double, torch::Tensor> fused(const Case& c, double grad_scale) {
  auto x = c.logits.detach().requires_grad_(true);
  auto loss = cross_entropy_sum(x, c.targets);
  (loss * grad_scale).backward();
  REQUIRE(x.grad().scalar_type() == torch::kBFloat16);
  return {loss.item<double>(), x.grad()};
}

}  // namespace

TEST_CASE("fused cross-entropy: loss and gradient match LibTorch's f32 cross_entropy", "[loss]") {
  // The GPT-2 vocabulary, the byte vocabulary, and sizes that are not a multiple of any vector width.
  for (auto [N, V, scale] : {std::tuple<int64_t, int64_t, double>{24, 50257, 2.0}, {37, 257, 1.0}, {9, 1001, 8.0}}) {
    INFO("N " << N << " V " << V << " scale " << scale);
    Case c = make_case(N, V, scale, static_cast<uint64_t>(V));
    const double g = 1.0 / 300.0;  // the trainer scales by 1 / (target tokens of the batch)
    auto [ref_loss, ref_grad] = reference(c, g);
    auto [loss, grad] = fused(c, g);
    CHECK(std::abs(loss - ref_loss) <= 1e-5 * std::abs(ref_loss));
    // The gradient is the f32 one rounded to bf16: within 2 bf16 steps (2^-7 relative) of it.
    auto diff = (grad.to(torch::kFloat32) - ref_grad).abs();
    auto bound = ref_grad.abs() * (1.0 / 128) + 1e-9;
    CHECK(diff.le(bound).all().item<bool>());
    // Padding rows get no gradient.
    for (int64_t i = 0; i < N; i += 5) CHECK(grad[i].abs().max().item<float>() == 0.0f);
  }
}

TEST_CASE("fused cross-entropy: the loss does not depend on the thread count", "[loss]") {
  Case c = make_case(64, 50257, 3.0, 7);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto [one, grad_one] = fused(c, 0.01);
  at::set_num_threads(2);
  auto [two, grad_two] = fused(c, 0.01);
  at::set_num_threads(before);
  CHECK(one == two);
  CHECK(torch::equal(grad_one, grad_two));
}

TEST_CASE("fused cross-entropy: a target outside the vocabulary is an error, not a wrong loss", "[loss]") {
  Case c = make_case(4, 100, 1.0, 3);
  c.targets[1] = 100;
  CHECK_THROWS_WITH(cross_entropy_sum(c.logits, c.targets), Contains("outside the vocabulary of 100"));
}
