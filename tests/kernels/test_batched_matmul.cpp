// batched_matmul computes what LibTorch's matmul computes, gradients included, on the strided views
// attention hands it, at any thread count; what it does not take is refused, not miscomputed.
#include "catch.hpp"

#include <limits>

#include <ATen/Parallel.h>

#include "lora_trainer/kernels/batched_matmul.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

// Within float rounding of LibTorch's own product (summed in another order where the BLAS blocks it
// differently): 1e-5 of the largest magnitude.
bool close(const torch::Tensor& got, const torch::Tensor& want) {
  return got.sizes() == want.sizes() &&
         (got - want).abs().max().item<double>() <= 1e-5 * std::max(1.0, want.abs().max().item<double>());
}

struct Attention {
  torch::Tensor scores, out, grad_qkv;  // q k^T, softmax(scores) v, d(sum(g * out))/d(c_attn output)
};

// GPT-2's attention shapes on a (B, T, 3C) c_attn output: q, k and v as strided views of it (no copy),
// the scores q k^T, then weights (a plain softmax, or with `causal` the manual path's masked_fill and
// softmax over the visible keys) times v; the gradient back to the c_attn output. With `ours` the
// products are batched_matmul's (with `causal` skipping the blocks above the diagonal: CausalPart),
// else LibTorch's matmul computes them all.
Attention attention(const torch::Tensor& qkv_out, const torch::Tensor& g, int64_t H, bool ours, bool causal = false) {
  const int64_t B = qkv_out.size(0), T = qkv_out.size(1), C = qkv_out.size(2) / 3, D = C / H;
  auto leaf = qkv_out.detach().requires_grad_(true);
  const auto parts = leaf.split(C, -1);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  auto product = [&](const torch::Tensor& a, const torch::Tensor& b, CausalPart part) {
    return ours ? batched_matmul(a, b, causal ? part : CausalPart::None) : torch::matmul(a, b);
  };
  Attention r;
  r.scores = product(q, k.transpose(-2, -1), CausalPart::Scores);
  const auto hidden = torch::ones({T, T}, torch::kBool).triu(1);
  const auto weights = torch::softmax(causal ? r.scores.masked_fill(hidden, -std::numeric_limits<float>::infinity()) : r.scores, -1);
  r.out = product(weights, v, CausalPart::Weights);
  (r.out * g).sum().backward();
  r.grad_qkv = leaf.grad();
  return r;
}

}  // namespace

TEST_CASE("batched_matmul: attention's products and the gradient through them are matmul's, on q, k and v as strided views", "[kernels][numerics]") {
  torch::manual_seed(3);
  for (auto [B, T, C, H] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 64, 96, 3}, {3, 17, 24, 2}, {1, 1, 8, 1}}) {
    INFO("B " << B << " T " << T << " C " << C << " H " << H);
    auto x = torch::randn({B, T, 3 * C});
    auto g = torch::randn({B, H, T, C / H});
    REQUIRE(batched_matmul_supported(x.split(C, -1)[0].view({B, T, H, C / H}).transpose(1, 2),
                                     x.split(C, -1)[1].view({B, T, H, C / H}).transpose(1, 2).transpose(-2, -1)));
    const Attention ours = attention(x, g, H, true), theirs = attention(x, g, H, false);
    CHECK(ours.scores.is_contiguous());
    CHECK(close(ours.scores, theirs.scores));
    CHECK(close(ours.out, theirs.out));
    CHECK(close(ours.grad_qkv, theirs.grad_qkv));
  }
}

TEST_CASE("batched_matmul: 3-D stacks, and a gradient for one operand only", "[kernels][numerics]") {
  torch::manual_seed(4);
  auto a = torch::randn({5, 7, 11}), b = torch::randn({5, 13, 11}).transpose(1, 2);  // b's columns contiguous
  auto g = torch::randn({5, 7, 13});
  auto ours_a = a.clone().requires_grad_(true), theirs_a = a.clone().requires_grad_(true);
  auto ours = batched_matmul(ours_a, b), theirs = torch::matmul(theirs_a, b);
  CHECK(close(ours, theirs));
  (ours * g).sum().backward();
  (theirs * g).sum().backward();
  CHECK(close(ours_a.grad(), theirs_a.grad()));
  CHECK(close(ours_a.grad(), torch::matmul(g, b.transpose(1, 2))));
}

TEST_CASE("batched_matmul: causal attention skips the blocks above the diagonal and computes what matmul computes", "[kernels][numerics]") {
  torch::manual_seed(6);
  // Each product through oneDNN's sgemm (where this build has it) and through LibTorch's mm.
  const CpuMatmul before = cpu_matmul(), before_small = cpu_small_matmul();
  std::vector<CpuMatmul> backends{CpuMatmul::LibTorch};
  if (onednn_available()) backends.push_back(CpuMatmul::OneDnn);
  // T over one block of 64 rows, not a multiple of it, exactly one, and under one.
  for (const CpuMatmul backend : backends)
  for (auto [B, T, C, H] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{2, 150, 48, 2}, {1, 128, 32, 1}, {2, 64, 24, 3}, {1, 17, 16, 2}}) {
    set_cpu_matmul(CpuMatmul::LibTorch, backend);
    INFO((backend == CpuMatmul::OneDnn ? "oneDNN" : "LibTorch") << " B " << B << " T " << T << " C " << C << " H " << H);
    auto x = torch::randn({B, T, 3 * C});
    auto g = torch::randn({B, H, T, C / H});
    const Attention ours = attention(x, g, H, true, true), theirs = attention(x, g, H, false, true);
    CHECK(close(ours.scores.tril(), theirs.scores.tril()));
    // The blocks wholly above the diagonal are not computed: they hold 0.
    const int64_t first_skipped_column = std::min<int64_t>(T, 64);
    CHECK(ours.scores.slice(-2, 0, 64).slice(-1, first_skipped_column, T).abs().sum().item<double>() == 0.0);
    CHECK(close(ours.out, theirs.out));
    CHECK(close(ours.grad_qkv, theirs.grad_qkv));
  }
  set_cpu_matmul(before, before_small);
}

TEST_CASE("batched_matmul: the same bits with one thread and with two, all blocks or the causal ones", "[kernels][numerics]") {
  torch::manual_seed(7);
  auto x = torch::randn({2, 200, 3 * 32});
  auto g = torch::randn({2, 2, 200, 16});
  for (const bool causal : {false, true}) {
    INFO((causal ? "causal" : "all blocks"));
    auto run = [&](int threads) {
      at::set_num_threads(threads);
      return attention(x, g, 2, true, causal);
    };
    const int before = at::get_num_threads();
    const Attention one = run(1), two = run(2);
    at::set_num_threads(before);
    CHECK(torch::equal(one.out, two.out));
    CHECK(torch::equal(one.grad_qkv, two.grad_qkv));
  }
}

TEST_CASE("batched_matmul: what it does not take is refused, with the shapes", "[kernels]") {
  auto a = torch::randn({2, 3, 4}), b = torch::randn({2, 4, 5});
  CHECK(batched_matmul_supported(a, b));
  CHECK_FALSE(batched_matmul_supported(a.to(torch::kBFloat16), b.to(torch::kBFloat16)));  // bf16: LibTorch's (oneDNN)
  CHECK_FALSE(batched_matmul_supported(a, torch::randn({3, 4, 5})));                       // batch sizes differ
  CHECK_FALSE(batched_matmul_supported(a, torch::randn({2, 5, 5})));                       // inner sizes differ
  CHECK_FALSE(batched_matmul_supported(a[0], b[0]));                                       // a matrix, no stack
  CHECK_FALSE(batched_matmul_supported(torch::randn({2, 3, 8}).slice(2, 0, 8, 2), b));     // no unit stride
  CHECK_THROWS_WITH(batched_matmul(a, torch::randn({3, 4, 5})), Contains("[2, 3, 4] and [3, 4, 5]"));
  // A causal part needs the square matrices it names.
  CHECK_THROWS_WITH(batched_matmul(a, b, CausalPart::Scores), Contains("square"));
  CHECK_THROWS_WITH(batched_matmul(a, b, CausalPart::Weights), Contains("square"));
}
