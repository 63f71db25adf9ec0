// An NF4-frozen linear layer (FrozenFormat::Nf4, peft/frozen_weight.hpp): its products and LoRA gradients
// are bit for bit those of a bf16-frozen layer whose weight is dequant(quant(W)), with and without bf16
// autocast, and what it keeps is the 4-bit codes and their scales, not the weight.
#include "catch.hpp"

#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/kernels/nf4.hpp"
#include "lora_trainer/models/layers.hpp"

using namespace lt;

namespace {

struct Pass {
  torch::Tensor y, x_grad, A_grad, B_grad;
};

Pass run(Linear& layer, const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& x_in, bool bf16) {
  auto a = A.clone().requires_grad_(true), b = B.clone().requires_grad_(true);
  layer->set_lora(a, b, 2.0, {});
  auto x = x_in.clone().requires_grad_(true);
  Runtime rt;
  rt.bf16_autocast = bf16;
  Pass p;
  {
    AutocastGuard autocast(rt);  // the trainers' step: forward and backward inside it
    p.y = layer(x);
    (p.y.to(torch::kFloat32) * torch::linspace(-1, 1, p.y.size(-1))).sum().backward();
  }
  p.x_grad = x.grad();
  p.A_grad = a.grad();
  p.B_grad = b.grad();
  return p;
}

}  // namespace

TEST_CASE("an NF4-frozen layer computes bit for bit what a bf16 layer holding dequant(quant(W)) computes, forward and LoRA gradients", "[nf4][lora][numerics]") {
  auto gen = at::detail::createCPUGenerator(21);
  const int64_t in = 192, out = 100;  // 19,200 values: 300 blocks of 64, two absmax scales of 256
  const auto W = torch::randn({out, in}, gen, torch::kFloat32) * 0.05;
  const auto bias = torch::randn({out}, gen, torch::kFloat32) * 0.1;
  const auto A = torch::randn({in, 8}, gen, torch::kFloat32) * 0.1, B = torch::randn({8, out}, gen, torch::kFloat32) * 0.1;
  const auto x = torch::randn({3, 5, in}, gen, torch::kFloat32);

  Linear nf4(in, out), ref(in, out);
  {
    torch::NoGradGuard ng;
    nf4->weight.copy_(W);
    nf4->bias.copy_(bias);
    ref->weight.copy_(dequantize_nf4(quantize_nf4(W.to(torch::kBFloat16), true), torch::kFloat32));
    ref->bias.copy_(bias);
  }
  nf4->weight.set_data(nf4->weight.detach().to(torch::kBFloat16));  // a bf16 base, as a loaded one is
  nf4->freeze_weight(FrozenFormat::Nf4);
  ref->freeze_weight(FrozenFormat::Bf16);
  nf4->bias.requires_grad_(false);
  ref->bias.requires_grad_(false);
  // The weight itself is gone (a stand-in of its shape over one bf16 zero, which no write can change);
  // the codes and scales stay.
  CHECK(nf4->weight.sizes() == W.sizes());
  CHECK(nf4->weight.storage().nbytes() == 2);
  CHECK_THROWS(nf4->weight.detach().copy_(W));
  CHECK(nf4->frozen()->bytes() < W.numel() * 0.53);
  CHECK(torch::equal(nf4->base_weight(x), ref->weight));

  for (bool bf16 : {false, true}) {
    INFO((bf16 ? "bf16 autocast" : "f32"));
    const Pass a = run(nf4, A, B, x, bf16), b = run(ref, A, B, x, bf16);
    CHECK(a.y.scalar_type() == b.y.scalar_type());
    CHECK(torch::equal(a.y, b.y));
    CHECK(torch::equal(a.x_grad, b.x_grad));
    CHECK(torch::equal(a.A_grad, b.A_grad));
    CHECK(torch::equal(a.B_grad, b.B_grad));
  }
  // Without a graph (eval, sample): the same product.
  torch::NoGradGuard ng;
  nf4->enable_lora(false);
  ref->enable_lora(false);
  CHECK(torch::equal(nf4(x), ref(x)));
}
