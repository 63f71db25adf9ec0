// The chunked head + loss computes what the whole head and LibTorch's f32 cross_entropy compute: the
// loss and x's gradient, over blocks of the vocabulary that do not divide it, with W frozen in x's
// dtype or cast from bf16 a block at a time, under CPU autocast's bf16, and with LibTorch's operations
// in place of the row kernels (the CUDA path, run here on the CPU).
#include "catch.hpp"

#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/kernels/head_loss.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

struct Head {
  torch::Tensor x;        // (N, C) f32
  torch::Tensor W;        // (V, C) f32
  torch::Tensor targets;  // (N), some -1
};

Head make_head(int64_t N, int64_t C, int64_t V, double scale, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  Head h;
  h.x = torch::randn({N, C}, gen, torch::kFloat32) * scale;
  h.W = torch::randn({V, C}, gen, torch::kFloat32) / std::sqrt(static_cast<double>(C));
  h.targets = torch::randint(0, V, {N}, gen, torch::kLong);
  for (int64_t i = 0; i < N; i += 5) h.targets[i] = -1;  // padding rows
  return h;
}

// (loss, d loss / d x scaled by g) of LibTorch's f32 cross_entropy over the whole logits x W^T, from
// x and W as given (rounded to bf16 by the caller where the case is bf16).
std::pair<double, torch::Tensor> reference(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& targets,
                                           double g) {
  auto xr = x.to(torch::kFloat64).detach().requires_grad_(true);
  auto logits = torch::mm(xr, W.to(torch::kFloat64).t());
  auto loss = torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
  (loss * g).backward();
  return {loss.item<double>(), xr.grad().to(torch::kFloat32)};
}

struct Chunked {
  double loss;
  torch::Tensor grad;
};

Chunked chunked(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& targets, double g, int64_t columns,
                bool row_kernels, torch::ScalarType products = torch::kFloat32) {
  auto xr = x.detach().requires_grad_(true);
  auto loss = chunked_head_loss_sum(xr, W, targets, products, columns, row_kernels);
  (loss * g).backward();
  REQUIRE(xr.grad().scalar_type() == x.scalar_type());
  return {loss.item<double>(), xr.grad()};
}

// The largest |difference| over the largest |reference|.
double relative(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>() /
         b.to(torch::kFloat64).abs().max().item<double>();
}

}  // namespace

TEST_CASE("chunked head loss: the loss and x's gradient of the whole head's f32 cross_entropy", "[loss][numerics]") {
  const double g = 1.0 / 300.0;  // the trainer scales by 1 / (target tokens of the batch)
  // Blocks that divide V, that do not (a last block of 1 or 17 columns), and one block for the whole.
  for (auto [N, C, V, columns, scale] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, double>{24, 64, 1000, 256, 2.0}, {37, 48, 257, 64, 1.0},
        {9, 32, 1001, 1000, 8.0}, {16, 40, 300, 4096, 3.0}}) {
    INFO("N " << N << " C " << C << " V " << V << " columns " << columns << " scale " << scale);
    Head h = make_head(N, C, V, scale, static_cast<uint64_t>(V + columns));
    for (bool row_kernels : {true, false}) {
      INFO((row_kernels ? "row kernels" : "LibTorch's operations"));
      {
        INFO("f32 W");
        auto [ref_loss, ref_grad] = reference(h.x, h.W, h.targets, g);
        auto c = chunked(h.x, h.W, h.targets, g, columns, row_kernels);
        // f32 sums of a few hundred terms (the rows' exponentials, the products): 1e-7 relative each.
        CHECK(std::abs(c.loss - ref_loss) <= 1e-5 * std::abs(ref_loss));
        CHECK(relative(c.grad, ref_grad) <= 1e-5);
        for (int64_t i = 0; i < N; i += 5) CHECK(c.grad[i].abs().max().item<float>() == 0.0f);
      }
      {
        INFO("a frozen bf16 W, cast a block at a time");
        auto W = h.W.to(torch::kBFloat16);
        auto [ref_loss, ref_grad] = reference(h.x, W, h.targets, g);
        auto c = chunked(h.x, W, h.targets, g, columns, row_kernels);
        CHECK(std::abs(c.loss - ref_loss) <= 1e-5 * std::abs(ref_loss));
        CHECK(relative(c.grad, ref_grad) <= 1e-5);
      }
    }
  }
}

TEST_CASE("chunked head loss under CPU autocast: bf16 products, within bf16's rounding of the whole head's", "[loss][numerics]") {
  Head h = make_head(24, 64, 1000, 2.0, 5);
  const double g = 0.01;
  auto W = h.W.to(torch::kBFloat16);
  auto x = h.x.to(torch::kBFloat16).to(torch::kFloat32);  // the values autocast's cast keeps
  auto [ref_loss, ref_grad] = reference(x, W, h.targets, g);
  const double max_logit = torch::mm(x, W.to(torch::kFloat32).t()).abs().max().item<double>();
  for (bool row_kernels : {true, false}) {
    INFO((row_kernels ? "row kernels" : "LibTorch's operations"));
    Chunked c;
    {
      compat::set_autocast_enabled(c10::DeviceType::CPU, true);
      compat::set_autocast_dtype(c10::DeviceType::CPU, torch::kBFloat16);
      c = chunked(x, W, h.targets, g, 256, row_kernels, torch::kBFloat16);
      compat::set_autocast_enabled(c10::DeviceType::CPU, false);
    }
    // Each logit is rounded to bf16 (2^-9 of |logit|): a row's loss moves by at most twice that.
    const int64_t counted = h.targets.ge(0).sum().item<int64_t>();
    CHECK(std::abs(c.loss - ref_loss) <= counted * 2 * max_logit / 512);
    CHECK(std::abs(c.loss - ref_loss) > 0);  // the products were bf16's (f32 products would be within 1e-5)
    // The softmax's terms and each block's product rounded to bf16 (2^-9), four blocks and the target's row.
    CHECK(relative(c.grad, ref_grad) <= 6.0 / 256);
  }
}

TEST_CASE("chunked head loss: without gradients, the same loss and no gradient kept", "[loss][numerics]") {
  Head h = make_head(16, 32, 500, 2.0, 9);
  auto with_grad = chunked(h.x, h.W, h.targets, 1.0, 128, true);
  torch::NoGradGuard ng;
  auto loss = chunked_head_loss_sum(h.x.requires_grad_(true), h.W, h.targets, torch::kFloat32, 128);
  CHECK(loss.item<double>() == with_grad.loss);
  CHECK_FALSE(loss.requires_grad());
}

TEST_CASE("chunked head loss: the loss does not depend on the thread count", "[loss][numerics]") {
  Head h = make_head(64, 64, 5000, 3.0, 7);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto one = chunked(h.x, h.W, h.targets, 0.01, 4096, true);
  at::set_num_threads(2);
  auto two = chunked(h.x, h.W, h.targets, 0.01, 4096, true);
  at::set_num_threads(before);
  CHECK(one.loss == two.loss);
  // x's gradient goes through products (p W_b), whose sums BLAS may split by thread: equal up to rounding.
  CHECK(relative(one.grad, two.grad) <= 1e-6);
}

TEST_CASE("chunked head loss: a target outside the vocabulary is an error, and a head that trains is refused", "[loss]") {
  Head h = make_head(4, 8, 100, 1.0, 3);
  auto targets = h.targets.clone();
  targets[1] = 100;
  CHECK_THROWS_WITH(chunked_head_loss_sum(h.x, h.W, targets, torch::kFloat32), Contains("outside the vocabulary of 100"));
  auto trained = h.W.clone().requires_grad_(true);
  CHECK_FALSE(chunked_head_loss_applies(trained));
  CHECK_THROWS_WITH(chunked_head_loss_sum(h.x, trained, h.targets, torch::kFloat32), Contains("W takes a gradient"));
  torch::NoGradGuard ng;
  CHECK(chunked_head_loss_applies(trained));
}
