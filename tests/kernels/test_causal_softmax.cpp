// The CPU attention weights' kernel (kernels/causal_softmax.hpp) against the five-pass LibTorch
// composite it replaces, computed in f64 from the same scores: the weights within f32 rounding (f32
// output) or one bf16 step (bf16 output), the gradient likewise; hidden keys exactly 0 in both; the
// same bits for any thread count.
#include "catch.hpp"

#include <ATen/Parallel.h>

#include "lora_trainer/kernels/causal_softmax.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

// (weights, d scores) from the kernel, for scores of `dtype`, output of `out`, upstream gradient g.
std::pair<torch::Tensor, torch::Tensor> run_kernel(const torch::Tensor& scores, double scale, const torch::Tensor& visible,
                                                   torch::ScalarType out, const torch::Tensor& g) {
  auto x = scores.detach().clone().requires_grad_(true);
  auto p = causal_softmax(x, scale, visible, out);
  p.backward(g.to(out));
  return {p.detach(), x.grad()};
}

// The same in f64 through LibTorch: masked_fill(-inf) of the hidden keys, softmax, autograd.
std::pair<torch::Tensor, torch::Tensor> run_reference(const torch::Tensor& scores, double scale, const torch::Tensor& visible,
                                                      const torch::Tensor& g) {
  const int64_t T = scores.size(-1);
  auto x = scores.detach().to(torch::kFloat64).requires_grad_(true);
  auto hidden = visible.defined() ? visible.logical_not() : torch::ones({T, T}, torch::kBool).triu(1);
  auto p = torch::softmax((x * scale).masked_fill(hidden, -std::numeric_limits<double>::infinity()), -1);
  p.backward(g.to(torch::kFloat64));
  return {p.detach(), x.grad()};
}

double max_abs(const torch::Tensor& a) { return a.abs().max().item<double>(); }
double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return max_abs(a.to(torch::kFloat64) - b.to(torch::kFloat64)); }

// Packed rows, as SequenceLayout masks them (B, 1, T, T): row 0 holds examples of 10, 20 and 7
// positions, row 1 one of 37; a key is visible from a query of the same example at or before it.
torch::Tensor packed_mask() {
  auto seg = torch::cat({torch::cat({torch::zeros({10}), torch::ones({20}), torch::full({7}, 2)}).unsqueeze(0),
                         torch::zeros({1, 37})}).to(torch::kLong);
  auto causal = torch::ones({37, 37}, torch::kBool).tril();
  return seg.unsqueeze(2).eq(seg.unsqueeze(1)).logical_and(causal).unsqueeze(1);
}

}  // namespace

TEST_CASE("causal softmax kernel: the weights and the gradient of the masked f32 softmax, hidden keys exactly 0", "[attention][numerics]") {
  auto gen = at::detail::createCPUGenerator(5);
  const double scale = 0.25;
  // Causal; packed examples (each row's visible keys one run); and scattered keys (several runs a row,
  // the general kernel; each row sees itself).
  auto scattered = (torch::rand({2, 1, 37, 37}, gen) < 0.5).logical_or(torch::eye(37, torch::kBool));
  for (int mask_kind : {0, 1, 2}) {
    const bool packed = mask_kind > 0;
    const torch::Tensor visible = mask_kind == 0 ? torch::Tensor() : mask_kind == 1 ? packed_mask() : scattered;
    const auto hidden = packed ? visible.logical_not().expand({2, 3, 37, 37}) : torch::ones({37, 37}, torch::kBool).triu(1).expand({2, 3, 37, 37});
    for (auto [in, out] : {std::pair{torch::kFloat32, torch::kFloat32}, std::pair{torch::kBFloat16, torch::kBFloat16},
                           std::pair{torch::kBFloat16, torch::kFloat32}}) {
      INFO((mask_kind == 0 ? "causal, " : mask_kind == 1 ? "packed rows, " : "scattered keys, ") << "scores " << in << ", weights " << out);
      auto scores = (torch::randn({2, 3, 37, 37}, gen, torch::kFloat32) * 6).to(in);
      auto g = torch::randn({2, 3, 37, 37}, gen, torch::kFloat32);
      auto [p, dx] = run_kernel(scores, scale, visible, out, g);
      auto [rp, rdx] = run_reference(scores, scale, visible, g.to(out));
      CHECK(p.scalar_type() == out);
      CHECK(dx.scalar_type() == in);
      // f32: rounding of e^x (~1e-7 relative) and of the sums; bf16: one step of 2^-8 of the value.
      const bool f32 = in == torch::kFloat32 && out == torch::kFloat32;
      CHECK(max_diff(p, rp) < (out == torch::kFloat32 ? 1e-6 : 4e-3));
      CHECK(max_diff(dx, rdx) < (f32 ? 1e-6 : 1e-2 * max_abs(rdx)));
      // Each row sums to 1 over its visible keys; hidden keys are exactly 0, forward and backward.
      CHECK(max_diff(p.to(torch::kFloat64).sum(-1), torch::ones({2, 3, 37}, torch::kFloat64)) < (out == torch::kFloat32 ? 1e-6 : 3e-2));
      CHECK(p.to(torch::kFloat32).masked_select(hidden).abs().max().item<float>() == 0.0f);
      CHECK(dx.to(torch::kFloat32).masked_select(hidden).abs().max().item<float>() == 0.0f);
    }
  }
}

TEST_CASE("causal softmax kernel: the same bits for 1 and 2 threads, and a row of one example has the causal row's bits", "[attention][numerics]") {
  auto gen = at::detail::createCPUGenerator(6);
  auto scores = (torch::randn({2, 4, 200, 200}, gen, torch::kFloat32) * 4).to(torch::kBFloat16);
  auto g = torch::randn({2, 4, 200, 200}, gen, torch::kFloat32);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto one = run_kernel(scores, 0.125, {}, torch::kBFloat16, g);
  at::set_num_threads(2);
  auto two = run_kernel(scores, 0.125, {}, torch::kBFloat16, g);
  at::set_num_threads(before);
  CHECK(torch::equal(one.first, two.first));
  CHECK(torch::equal(one.second, two.second));
  // A mask that hides nothing a causal row sees (one example a row) changes no bit, forward or backward.
  auto causal_mask = torch::ones({200, 200}, torch::kBool).tril().expand({2, 1, 200, 200}).contiguous();
  auto masked = run_kernel(scores, 0.125, causal_mask, torch::kBFloat16, g);
  CHECK(torch::equal(masked.first, two.first));
  CHECK(torch::equal(masked.second, two.second));

}

TEST_CASE("causal softmax kernel: what it does not take is said, not miscomputed", "[attention]") {
  auto s = torch::randn({2, 3, 5, 5});
  CHECK(causal_softmax_supported(s, {}, torch::kFloat32));
  CHECK_FALSE(causal_softmax_supported(torch::randn({2, 3, 5, 6}), {}, torch::kFloat32));          // not square
  CHECK_FALSE(causal_softmax_supported(s.to(torch::kFloat16), {}, torch::kFloat32));              // f16
  CHECK_FALSE(causal_softmax_supported(s, torch::ones({2, 3, 5, 5}, torch::kBool), torch::kFloat32));  // a mask per head
  CHECK_FALSE(causal_softmax_supported(s, torch::ones({2, 1, 5, 5}), torch::kFloat32));           // not bool
  CHECK(causal_softmax_supported(s, torch::ones({2, 1, 5, 5}, torch::kBool), torch::kFloat32));
  CHECK(causal_softmax_supported(s, {}, torch::kBFloat16));
  CHECK_FALSE(causal_softmax_supported(s, {}, torch::kFloat16));                 // f16 weights
  CHECK_THROWS_WITH(causal_softmax(torch::randn({2, 3, 5, 6}), 1.0, {}, torch::kFloat32),
                    Contains("(..., T, T) in f32 or bf16"));
  CHECK_THROWS_WITH(causal_softmax(s, 1.0, {}, torch::kFloat16), Contains("f32 or bf16, got"));
}
