// cpu_gemm_out and cpu_linear compute what LibTorch's mm and linear compute (oneDNN's sgemm sums in
// another order: within float rounding), gradients included, for every layout they read in place; what
// oneDNN does not take is LibTorch's own product, and runtime/matmul=libtorch gives linear's bits.
#include "catch.hpp"

#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "rounding.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

bool close_same_type(const torch::Tensor& got, const torch::Tensor& want) {
  return got.sizes() == want.sizes() && got.scalar_type() == want.scalar_type() &&
         (got - want).abs().max().item<double>() <= 1e-5 * std::max(1.0, want.abs().max().item<double>());
}

// The process's choice for the scope, restored after.
struct Backend {
  CpuMatmul before = cpu_matmul(), before_small = cpu_small_matmul();
  Backend() = default;
  explicit Backend(CpuMatmul b) { set_cpu_matmul(b); }
  ~Backend() { set_cpu_matmul(before, before_small); }
};

// (rows, cols) with the given memory order: row-major, or the transpose of a row-major (cols, rows).
torch::Tensor matrix(int64_t rows, int64_t cols, bool transposed) {
  return transposed ? torch::randn({cols, rows}).t() : torch::randn({rows, cols});
}

}  // namespace

TEST_CASE("gemm_layout: rows or columns in memory are read in place, overlapping or strided matrices are not",
          "[kernels][cpu_gemm]") {
  struct Case {
    int64_t rows, cols, rs, cs;
    char trans;
    int64_t ld;
  };
  for (const Case c : {Case{5, 7, 7, 1, 'N', 7},    // row-major
                       Case{5, 7, 10, 1, 'N', 10},  // columns of a wider matrix
                       Case{5, 7, 1, 5, 'T', 5},    // the transpose of a row-major (7, 5)
                       Case{5, 7, 1, 9, 'T', 9},    // ... of rows of a longer one
                       Case{1, 7, 999, 1, 'N', 7},  // one row: its row stride is never read
                       Case{5, 1, 1, 999, 'T', 5},  // one column
                       Case{5, 1, 1, 1, 'N', 1},
                       Case{5, 7, 14, 2, 0, 0},     // every other column
                       Case{5, 7, 0, 1, 0, 0},      // a broadcast row
                       Case{5, 7, 3, 1, 0, 0},      // rows that overlap
                       Case{5, 7, 1, 3, 0, 0}}) {   // columns that overlap
    INFO(c.rows << " x " << c.cols << ", strides " << c.rs << ", " << c.cs);
    const GemmLayout got = gemm_layout(c.rows, c.cols, c.rs, c.cs);
    CHECK(got.trans == c.trans);
    CHECK(static_cast<bool>(got) == (c.trans != 0));
    if (c.trans) CHECK(got.ld == c.ld);
  }
}

TEST_CASE("cpu_gemm_out: a b and a b added into out, for rows or columns in memory, into a block of columns of a wider matrix",
          "[kernels][cpu_gemm][numerics]") {
  if (!onednn_available()) WARN("this build has no oneDNN (libdnnl-dev): the products checked are LibTorch's");
  torch::manual_seed(3);
  struct Shape {
    int64_t M, K, N;
  };
  for (const Shape s : {Shape{7, 13, 5}, Shape{1, 64, 33}, Shape{40, 3000, 1}, Shape{96, 384, 200}}) {
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const bool wide : {false, true})
          for (const bool accumulate : {false, true}) {
            INFO(s.M << "x" << s.K << " by " << s.K << "x" << s.N << (ta ? ", a transposed" : "") << (tb ? ", b transposed" : "")
                     << (wide ? ", into columns of a wider matrix" : "") << (accumulate ? ", added" : ""));
            const auto a = matrix(s.M, s.K, ta), b = matrix(s.K, s.N, tb);
            // A wider matrix's columns [3, 3 + N): its other columns must stay as they were.
            const auto whole = torch::randn({s.M, wide ? s.N + 7 : s.N});
            const auto before = whole.clone();
            torch::Tensor out = wide ? whole.narrow(1, 3, s.N) : whole;
            cpu_gemm_out(out, a, b, accumulate);
            const auto want = accumulate ? before.narrow(1, wide ? 3 : 0, s.N) + at::mm(a, b) : at::mm(a, b);
            CHECK(close_same_type(out, want));
            if (wide) {
              CHECK(torch::equal(whole.narrow(1, 0, 3), before.narrow(1, 0, 3)));
              CHECK(torch::equal(whole.narrow(1, 3 + s.N, 4), before.narrow(1, 3 + s.N, 4)));
            }
          }
  }
}

TEST_CASE("cpu_gemm_out: operands oneDNN cannot read in place (no unit stride, a broadcast, bf16, f64) get LibTorch's product, bit for bit",
          "[kernels][cpu_gemm][numerics]") {
  torch::manual_seed(4);
  const auto big = torch::randn({20, 30});
  const auto every_other = big.slice(0, 0, 20, 2).slice(1, 0, 30, 2);  // (10, 15), strides (60, 2)
  const auto b = torch::randn({15, 6});
  torch::Tensor out = torch::empty({10, 6});
  cpu_gemm_out(out, every_other, b);
  CHECK(torch::equal(out, at::mm(every_other, b)));
  const auto row = torch::randn({1, 15}).expand({10, 15});  // stride 0
  cpu_gemm_out(out, row, b);
  CHECK(torch::equal(out, at::mm(row, b)));
  for (const auto dtype : {torch::kBFloat16, torch::kFloat64}) {
    const auto a = torch::randn({10, 15}).to(dtype), bb = b.to(dtype);
    torch::Tensor o = torch::empty({10, 6}, a.options());
    cpu_gemm_out(o, a, bb);
    CHECK(torch::equal(o, at::mm(a, bb)));
  }
  // cpu_gemm keeps the leading dimensions.
  const auto x = torch::randn({2, 3, 15});
  CHECK(close_same_type(cpu_gemm(x, b), torch::matmul(x, b)));
}

TEST_CASE("cpu_linear: the output and the gradients of x, W and b are torch::linear's", "[kernels][cpu_gemm][numerics]") {
  torch::manual_seed(5);
  for (const bool bias : {false, true})
    for (const bool x_trains : {false, true})
      for (const bool w_trains : {false, true}) {
        INFO((bias ? "with a bias" : "no bias") << (x_trains ? ", x trains" : "") << (w_trains ? ", W trains" : ""));
        const auto x0 = torch::randn({2, 9, 24}), W0 = torch::randn({40, 24}), b0 = torch::randn({40}), g = torch::randn({2, 9, 40});
        auto run = [&](bool ours) {
          auto x = x0.clone().requires_grad_(x_trains), W = W0.clone().requires_grad_(w_trains);
          auto b = bias ? b0.clone().requires_grad_(true) : torch::Tensor();
          auto y = ours ? cpu_linear(x, W, b) : (bias ? torch::linear(x, W, b) : torch::linear(x, W));
          if (y.requires_grad()) (y * g).sum().backward();
          return std::vector<torch::Tensor>{y.detach(), x.grad(), W.grad(), bias ? b.grad() : torch::Tensor()};
        };
        const auto ours = run(true), theirs = run(false);
        CHECK(close_same_type(ours[0], theirs[0]));
        for (size_t i = 1; i < 4; ++i) {
          INFO("gradient " << i << " (x, W, b)");
          REQUIRE(ours[i].defined() == theirs[i].defined());
          if (ours[i].defined()) CHECK(close_same_type(ours[i], theirs[i]));
        }
      }
  // A matrix x gives a matrix that is no view (the fused loss may write its gradient over logits).
  const auto y = cpu_linear(torch::randn({5, 24}), torch::randn({40, 24}));
  CHECK(y.sizes() == torch::IntArrayRef({5, 40}));
  CHECK_FALSE(y.is_view());
}

TEST_CASE("cpu_linear: a weight of many rows has its gradient in blocks of rows, and OpenBLAS keeps no block of all its rows",
          "[kernels][cpu_gemm]") {
  // W's gradient g^T x as one product over a 65,536-row weight packs 4 x min(tokens, 320-512) x 65,536
  // bytes (67-134 MB) into OpenBLAS's buffers, which the library keeps; in blocks of kWeightGradRows,
  // 4 x 320-512 x 8,192 (10-17 MB).
  torch::manual_seed(9);
  const int64_t V = 8 * kWeightGradRows, C = 512, N = 256;  // C > 512 rows: one thread packs whole blocks too
  const auto x0 = torch::randn({N, C}), W0 = torch::randn({V, C}) * 0.02, g = torch::randn({N, V});
  auto W = W0.clone().requires_grad_(true);
  // What the product leaves resident beyond W's gradient: the output and the backward's temporaries are
  // allocations of over 32 MiB, which glibc maps and unmaps (no runtime here keeps freed memory).
  const int64_t before = ProcessMemory::now().anonymous;
  cpu_linear(x0, W).backward(g);
  const int64_t left = ProcessMemory::now().anonymous - before - W.grad().nbytes();
  INFO("left resident beyond W's gradient: " << left / 1e6 << " MB");
  CHECK(left < 4 * 512 * kWeightGradRows + (8 << 20));
  // Each value a sum of N products, in an order the BLAS picks by the product's width: within rounding
  // of the one product's (tests/rounding.hpp).
  const auto g_t = g.t().contiguous(), x_t = x0.t().contiguous();
  CHECK(test::outside_bound(W.grad(), torch::mm(g_t, x0), test::linear_rounding_bound(g_t, x_t)) == "");
}

TEST_CASE("cpu_linear of a single row leaves its bias as it was", "[kernels][cpu_gemm]") {
  // One row is what generation's every new token is (a KV cache's step, or a one-token prompt): the
  // output buffer, the bias broadcast over the rows, was the bias itself for one row, and the product
  // accumulated into the parameter.
  torch::manual_seed(6);
  const auto W = torch::randn({40, 24}), b0 = torch::randn({40});
  for (const auto& shape : {std::vector<int64_t>{1, 24}, std::vector<int64_t>{1, 1, 24}, std::vector<int64_t>{24}})
    for (const bool grad : {false, true}) {
      INFO("x " << torch::IntArrayRef(shape) << (grad ? ", b trains" : ", no gradients"));
      auto b = b0.clone().requires_grad_(grad);
      const auto x = torch::randn(shape);
      torch::Tensor y;
      {
        torch::AutoGradMode mode(grad);
        y = cpu_linear(x, W, b);
      }
      CHECK(torch::equal(b.detach(), b0));
      CHECK(close_same_type(y.detach(), torch::linear(x, W, b0)));
    }
}

TEST_CASE("cpu_linear: its own node with oneDNN's or LibTorch's products (LibTorch's: linear's bits), LibTorch's linear under bf16 autocast",
          "[kernels][cpu_gemm][numerics]") {
  torch::manual_seed(6);
  const auto x = torch::randn({64, 96}).requires_grad_(true), W = torch::randn({80, 96}).requires_grad_(true), b = torch::randn({80});
  if (onednn_available()) {
    const Backend chosen(CpuMatmul::OneDnn);
    CHECK_THAT(cpu_linear(x, W, b).grad_fn()->name(), Contains("LinearBiasFn"));
    CHECK_THAT(cpu_linear(x, W).grad_fn()->name(), Contains("LinearFn"));
    // A model's linear layer (trained, f32) takes it.
    Linear layer(96, 80, true);
    CHECK_THAT(layer->forward(x).grad_fn()->name(), Contains("LinearBiasFn"));
  } else {
    CHECK_THROWS_WITH(set_cpu_matmul(CpuMatmul::OneDnn), Contains("libdnnl-dev"));
  }
  {
    // The same node, its products LibTorch's: linear's bits, gradients included.
    const Backend libtorch(CpuMatmul::LibTorch);
    const auto y = cpu_linear(x, W, b);
    CHECK(torch::equal(y, torch::linear(x, W, b)));
    CHECK_THAT(y.grad_fn()->name(), Contains("LinearBiasFn"));
    const auto g = torch::randn_like(y);
    const auto ours = torch::autograd::grad({y}, {x, W}, {g});
    const auto theirs = torch::autograd::grad({torch::linear(x, W, b)}, {x, W}, {g});
    CHECK(torch::equal(ours[0], theirs[0]));
    CHECK(torch::equal(ours[1], theirs[1]));
  }
  {
    Runtime rt;
    rt.bf16_autocast = true;
    const AutocastGuard autocast(rt);
    const auto y = cpu_linear(x, W, b);
    const auto want = torch::linear(x, W, b);
    CHECK(y.scalar_type() == torch::kBFloat16);
    CHECK(torch::equal(y, want));
  }
}

TEST_CASE("runtime/matmul: auto takes oneDNN for attention's small products wherever the build has it, for the linear layers "
          "only with AVX-512, and libtorch or onednn takes one library for both",
          "[kernels][cpu_gemm][config]") {
  const Backend restored;
  Config cfg(Trainer::schema());
  cfg.apply_override("runtime/device=cpu");
  cfg.apply_override("runtime/threads=" + std::to_string(at::get_num_threads()));  // the process's, unchanged
  cfg.apply_override("runtime/precision=f32");  // describe() names the f32 products' library (a bf16 CPU's auto is bf16)
  constexpr CpuMatmul kOneDnn = CpuMatmul::OneDnn, kLibTorch = CpuMatmul::LibTorch;
  const Runtime automatic = Runtime::from_config(cfg);
  CHECK(cpu_small_matmul() == (onednn_available() ? kOneDnn : kLibTorch));
  CHECK(cpu_matmul() == (onednn_available() && __builtin_cpu_supports("avx512f") ? kOneDnn : kLibTorch));
  if (cpu_matmul() != cpu_small_matmul()) CHECK_THAT(automatic.describe(), Contains("LibTorch products (attention's oneDNN)"));
  cfg.apply_override("runtime/matmul=libtorch");
  CHECK_THAT(Runtime::from_config(cfg).describe(), Contains("LibTorch products") && !Contains("attention"));
  CHECK(cpu_matmul() == kLibTorch);
  CHECK(cpu_small_matmul() == kLibTorch);
  cfg.apply_override("runtime/matmul=onednn");
  if (onednn_available()) {
    CHECK_THAT(Runtime::from_config(cfg).describe(), Contains("oneDNN products") && !Contains("attention"));
    CHECK(cpu_matmul() == kOneDnn);
    CHECK(cpu_small_matmul() == kOneDnn);
  } else {
    CHECK_THROWS_WITH(Runtime::from_config(cfg), Contains("libdnnl-dev"));
  }
}
