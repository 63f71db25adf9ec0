// Attention: LibTorch's fused scaled_dot_product_attention (used on LibTorch 2.x) and the masked-softmax
// path (LibTorch 1.13, or runtime/attention=manual) compute the same function, forward and backward.
// Tolerances: f32 inputs agree to 2e-5 absolute (outputs and gradients are O(1)); bf16 inputs (as under
// autocast, on CUDA where the flash/efficient kernels run) to 3e-2 absolute, a few bf16 steps.
#include "catch.hpp"

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

void check_paths_agree(torch::Device device, torch::ScalarType dtype, double tol) {
  INFO("device " << device << ", dtype " << dtype);
  auto gen = at::detail::createCPUGenerator(11);
  auto make = [&] {
    return torch::randn({2, 3, 37, 16}, gen, torch::kFloat32).to(device).to(dtype).requires_grad_(true);
  };
  auto q = make(), k = make(), v = make();
  auto grad_out = torch::randn({2, 3, 37, 16}, gen, torch::kFloat32).to(device).to(dtype);
  std::vector<torch::Tensor> outs, grads;
  for (bool fused : {true, false}) {
    for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
    auto y = causal_attention(q, k, v, 0.0, fused);
    y.backward(grad_out);
    outs.push_back(y.detach());
    for (auto* t : {&q, &k, &v}) grads.push_back(t->grad().clone());
  }
  CHECK(max_abs_diff(outs[0], outs[1]) < tol);
  for (size_t i = 0; i < 3; ++i) {
    INFO("gradient of " << "qkv"[i]);
    CHECK(max_abs_diff(grads[i], grads[i + 3]) < tol);
  }
  // Causal: the first position attends only to itself, so its output is v's first row.
  CHECK(max_abs_diff(outs[0].select(2, 0), v.detach().select(2, 0)) < tol);
}

}  // namespace

TEST_CASE("fused and manual attention agree, forward and gradients", "[attention]") {
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
