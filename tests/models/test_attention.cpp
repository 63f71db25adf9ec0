// Attention: LibTorch's fused scaled_dot_product_attention (used on LibTorch 2.x) and the masked-softmax
// path (LibTorch 1.13, or runtime/attention=manual) compute the same function, forward and backward.
// Tolerances: f32 inputs agree to 2e-5 absolute (outputs and gradients are O(1)); bf16 inputs (as under
// autocast, on CUDA where the flash/efficient kernels run) to 3e-2 absolute, a few bf16 steps.
#include "catch.hpp"

#include <limits>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/training/trainer.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>();
}

// `packed`: rows of several examples (SequenceLayout's block-diagonal causal mask), else one sequence a row.
void check_paths_agree(torch::Device device, torch::ScalarType dtype, double tol, bool packed = false) {
  INFO("device " << device << ", dtype " << dtype << (packed ? ", packed rows" : ""));
  auto gen = at::detail::createCPUGenerator(11);
  auto make = [&] {
    return torch::randn({2, 3, 37, 16}, gen, torch::kFloat32).to(device).to(dtype).requires_grad_(true);
  };
  auto q = make(), k = make(), v = make();
  auto grad_out = torch::randn({2, 3, 37, 16}, gen, torch::kFloat32).to(device).to(dtype);
  // Row 0: examples of 10, 20 and 7 positions; row 1: 37 and 0 (one example).
  auto segments = torch::cat({torch::cat({torch::zeros({10}), torch::ones({20}), torch::full({7}, 2)}).unsqueeze(0),
                              torch::zeros({1, 37})}).to(torch::kLong);
  const torch::Tensor mask = packed ? SequenceLayout(segments, 37, device).mask : torch::Tensor();
  std::vector<torch::Tensor> outs, grads;
  for (bool fused : {true, false}) {
    for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
    auto y = causal_attention(q, k, v, 0.0, fused, mask);
    y.backward(grad_out);
    outs.push_back(y.detach());
    for (auto* t : {&q, &k, &v}) grads.push_back(t->grad().clone());
  }
  CHECK(max_abs_diff(outs[0], outs[1]) < tol);
  for (size_t i = 0; i < 3; ++i) {
    INFO("gradient of " << "qkv"[i]);
    CHECK(max_abs_diff(grads[i], grads[i + 3]) < tol);
  }
  // Causal: the first position attends only to itself, so its output is v's first row; packed, so
  // does each example's first position (row 0's positions 10 and 30).
  CHECK(max_abs_diff(outs[0].select(2, 0), v.detach().select(2, 0)) < tol);
  if (packed)
    for (int64_t start : {10, 30}) CHECK(max_abs_diff(outs[0][0].select(1, start), v.detach()[0].select(1, start)) < tol);
}

}  // namespace

TEST_CASE("fused and manual attention agree, forward and gradients", "[attention][numerics]") {
  if (!fused_attention_available()) {
    WARN("skipped: LibTorch " << compat::torch_version() << " has no fused attention (2.0+); the manual path is the only one");
    return;
  }
  check_paths_agree(torch::kCPU, torch::kFloat32, 2e-5);
  check_paths_agree(torch::kCPU, torch::kBFloat16, 3e-2);
  if (!torch::cuda::is_available()) {
    WARN("skipped (CUDA part): no CUDA device");
    return;
  }
  check_paths_agree(torch::Device(torch::kCUDA, 0), torch::kFloat32, 2e-5);
  check_paths_agree(torch::Device(torch::kCUDA, 0), torch::kBFloat16, 3e-2);
}

TEST_CASE("fused and manual attention agree on packed rows (a block-diagonal causal mask), forward and gradients", "[attention][numerics]") {
  if (!fused_attention_available()) {
    WARN("skipped: LibTorch " << compat::torch_version() << " has no fused attention (2.0+); the manual path is the only one");
    return;
  }
  check_paths_agree(torch::kCPU, torch::kFloat32, 2e-5, true);
  check_paths_agree(torch::kCPU, torch::kBFloat16, 3e-2, true);
  if (!torch::cuda::is_available()) {
    WARN("skipped (CUDA part): no CUDA device");
    return;
  }
  check_paths_agree(torch::Device(torch::kCUDA, 0), torch::kFloat32, 2e-5, true);
  check_paths_agree(torch::Device(torch::kCUDA, 0), torch::kBFloat16, 3e-2, true);
}

TEST_CASE("SequenceLayout: positions restart at each example and attention stays within it", "[attention]") {
  auto segments = torch::tensor({0, 0, 0, 1, 1, 2, 2, 2}, torch::kLong).view({1, 8});
  const SequenceLayout packed(segments, 8, torch::kCPU);
  CHECK(torch::equal(packed.positions, torch::tensor({0, 1, 2, 0, 1, 0, 1, 2}, torch::kLong).view({1, 8})));
  REQUIRE(packed.mask.sizes() == torch::IntArrayRef({1, 1, 8, 8}));
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 8; ++j) {
      INFO(i << " attends to " << j);
      const bool same = segments[0][i].item<int64_t>() == segments[0][j].item<int64_t>();
      CHECK(packed.mask[0][0][i][j].item<bool>() == (same && j <= i));
    }
  const SequenceLayout plain(torch::Tensor(), 8, torch::kCPU);
  CHECK(torch::equal(plain.positions, torch::arange(8, torch::kLong)));
  CHECK_FALSE(plain.mask.defined());
}

TEST_CASE("runtime/attention: auto is fused on CUDA (where LibTorch has it) and manual on the CPU, and fused without it is a clear error", "[attention]") {
  const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA, 0);
  Config c(Trainer::schema());
  auto o = ModelOptions::from_config(c);
  CHECK_FALSE(o.fused_attention_on(cpu));
  CHECK(o.fused_attention_on(gpu) == fused_attention_available());
  c.apply_override("runtime/attention=manual");
  o = ModelOptions::from_config(c);
  CHECK_FALSE(o.fused_attention_on(cpu));
  CHECK_FALSE(o.fused_attention_on(gpu));
  c.apply_override("runtime/attention=fused");
  if (fused_attention_available()) {
    o = ModelOptions::from_config(c);
    CHECK(o.fused_attention_on(cpu));
    CHECK(o.fused_attention_on(gpu));
  } else {
    CHECK_THROWS_WITH(ModelOptions::from_config(c), Contains("runtime/attention=fused needs LibTorch 2.0 or newer"));
  }
}

TEST_CASE("manual attention on the CPU (the causal softmax kernel) computes attention: against LibTorch in f64", "[attention][numerics]") {
  auto gen = at::detail::createCPUGenerator(6);
  for (bool packed : {false, true}) {
    INFO((packed ? "packed rows" : "causal"));
    auto q = torch::randn({2, 3, 37, 16}, gen, torch::kFloat32).requires_grad_(true);
    auto k = torch::randn({2, 3, 37, 16}, gen, torch::kFloat32).requires_grad_(true);
    auto v = torch::randn({2, 3, 37, 16}, gen, torch::kFloat32);
    auto segments = torch::cat({torch::cat({torch::zeros({10}), torch::ones({20}), torch::full({7}, 2)}).unsqueeze(0),
                                torch::zeros({1, 37})}).to(torch::kLong);
    const torch::Tensor mask = packed ? SequenceLayout(segments, 37, torch::kCPU).mask : torch::Tensor();
    auto y = causal_attention(q, k, v, 0.0, /*fused=*/false, mask);
    y.sum().backward();
    auto q64 = q.detach().to(torch::kFloat64).requires_grad_(true), k64 = k.detach().to(torch::kFloat64).requires_grad_(true);
    auto hidden = packed ? mask.logical_not() : torch::ones({37, 37}, torch::kBool).triu(1);
    auto att = (torch::matmul(q64, k64.transpose(-2, -1)) * 0.25).masked_fill(hidden, -std::numeric_limits<double>::infinity());
    auto y64 = torch::matmul(torch::softmax(att, -1), v.to(torch::kFloat64));
    y64.sum().backward();
    CHECK(max_abs_diff(y, y64) < 1e-5);
    CHECK(max_abs_diff(q.grad(), q64.grad()) < 1e-5);
    CHECK(max_abs_diff(k.grad(), k64.grad()) < 1e-5);
  }
}
