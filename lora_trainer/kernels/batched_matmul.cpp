#include "lora_trainer/kernels/batched_matmul.hpp"

#include <algorithm>
#include <vector>

#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/kernels/parallel.hpp"

namespace lt {

namespace {

// Whether a BLAS reads each matrix of t's stack in place (cpu_gemm.hpp's gemm_layout).
bool blas_readable(const torch::Tensor& t) {
  return static_cast<bool>(gemm_layout(t.size(-2), t.size(-1), t.stride(-2), t.stride(-1)));
}

// One matrix of a stack: element (r, c) at p[r * rs + c * cs].
struct Matrix {
  const float* p;
  int64_t rs, cs;
  const float* at(int64_t r, int64_t c) const { return p + r * rs + c * cs; }
  // How the BLAS reads its block of rows x cols: the same trans as the whole matrix (a block of a
  // readable matrix is readable).
  GemmLayout layout(int64_t rows, int64_t cols) const { return gemm_layout(rows, cols, rs, cs); }
};

// Matrix i of t's stack (its leading dimensions in row-major order).
Matrix matrix(const torch::Tensor& t, int64_t i) {
  int64_t offset = 0;
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    offset += (i % t.size(d)) * t.stride(d);
    i /= t.size(d);
  }
  return {t.data_ptr<float>() + offset, t.stride(-2), t.stride(-1)};
}

// The rows [r0, r0 + M) by inner range [k0, k0 + K) of x times the inner range by columns [c0, c0 + N)
// of y, into C (row stride ldc).
void block_product(const Matrix& x, const Matrix& y, int64_t r0, int64_t M, int64_t k0, int64_t K, int64_t c0, int64_t N,
                   float* c, int64_t ldc) {
  const GemmLayout lx = x.layout(M, K), ly = y.layout(K, N);
  TORCH_INTERNAL_ASSERT(lx && ly, "batched_matmul: a block that the BLAS cannot read in place");
  cpu_sgemm(lx.trans, ly.trans, M, N, K, x.at(r0, k0), lx.ld, y.at(k0, c0), ly.ld, false, c, ldc);
}

// Which blocks of a product are computed: all of them, or with a square matrix's triangle skipped (a
// b wanted on and below the diagonal only; a 0 above the diagonal; a 0 below it). Rows go in blocks of
// kBlock, and each block's product covers the columns (or the inner range) that its triangle needs.
enum class Blocks { All, LowerResult, LowerLeft, UpperLeft };
constexpr int64_t kBlock = 64;

torch::Tensor products(const torch::Tensor& a, const torch::Tensor& b, Blocks blocks = Blocks::All) {
  std::vector<int64_t> sizes = a.sizes().vec();
  sizes.back() = b.size(-1);
  torch::Tensor out = torch::empty(sizes, a.options());
  const int64_t M = out.size(-2), N = out.size(-1), K = a.size(-1);
  const int64_t n = out.numel() == 0 ? 0 : out.numel() / (M * N);
  const int64_t row_blocks = blocks == Blocks::All ? 1 : (M + kBlock - 1) / kBlock;
  float* const o = out.data_ptr<float>();
  at::parallel_for(0, n * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / row_blocks;
      const Matrix x = matrix(a, i), y = matrix(b, i);
      float* const c = o + i * M * N;
      if (blocks == Blocks::All) {
        block_product(x, y, 0, M, 0, K, 0, N, c, N);
        continue;
      }
      const int64_t r0 = (w % row_blocks) * kBlock, r1 = std::min(M, r0 + kBlock);
      float* const rows = c + r0 * N;
      if (blocks == Blocks::LowerResult) {  // columns [0, r1); 0 beyond
        block_product(x, y, r0, r1 - r0, 0, K, 0, r1, rows, N);
        for (int64_t r = 0; r < r1 - r0; ++r) std::fill(rows + r * N + r1, rows + (r + 1) * N, 0.0f);
      } else if (blocks == Blocks::LowerLeft) {  // x's columns, y's rows [0, r1)
        block_product(x, y, r0, r1 - r0, 0, r1, 0, N, rows, N);
      } else {  // UpperLeft: [r0, K)
        block_product(x, y, r0, r1 - r0, r0, K - r0, 0, N, rows, N);
      }
    }
  });
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct BatchedMatmul : public torch::autograd::Function<BatchedMatmul> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& a, const torch::Tensor& b, int64_t part) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["part"] = part;
    switch (static_cast<CausalPart>(part)) {
      case CausalPart::Scores: return products(a, b, Blocks::LowerResult);
      case CausalPart::Weights: return products(a, b, Blocks::LowerLeft);
      case CausalPart::None: break;
    }
    return products(a, b);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& a = saved[0];
    const torch::Tensor& b = saved[1];
    const auto part = static_cast<CausalPart>(ctx->saved_data["part"].toInt());
    torch::Tensor g = grad_outputs[0];
    if (!blas_readable(g)) g = g.contiguous();
    const torch::Tensor a_t = a.transpose(-2, -1), bt = b.transpose(-2, -1), gt = g.transpose(-2, -1);
    torch::Tensor ga, gb;
    if (part == CausalPart::Scores) {  // g 0 above the diagonal
      if (ctx->needs_input_grad(0)) ga = products(g, bt, Blocks::LowerLeft);
      if (ctx->needs_input_grad(1)) gb = products(gt, a, Blocks::UpperLeft).transpose(-2, -1);  // (g^T a)^T
    } else if (part == CausalPart::Weights) {  // a 0 above the diagonal
      if (ctx->needs_input_grad(0)) ga = products(g, bt, Blocks::LowerResult);
      if (ctx->needs_input_grad(1)) gb = products(a_t, g, Blocks::UpperLeft);
    } else {
      if (ctx->needs_input_grad(0)) ga = products(g, bt);  // dL/da = g b^T
      if (ctx->needs_input_grad(1)) gb = products(a_t, g);  // dL/db = a^T g
    }
    return {ga, gb, torch::Tensor()};
  }
};

}  // namespace

bool batched_matmul_supported(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined() || !a.device().is_cpu() || !b.device().is_cpu()) return false;
  if (a.scalar_type() != torch::kFloat32 || b.scalar_type() != torch::kFloat32) return false;
  if (a.dim() < 3 || a.dim() != b.dim() || a.size(-1) != b.size(-2)) return false;
  for (int64_t d = 0; d + 2 < a.dim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return blas_readable(a) && blas_readable(b);
}

torch::Tensor batched_matmul(const torch::Tensor& a, const torch::Tensor& b, CausalPart part) {
  TORCH_CHECK(batched_matmul_supported(a, b), "batched_matmul: CPU f32 stacks of equal batch sizes, (..., M, K) by (..., K, N), "
              "each matrix BLAS-readable, expected; got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(part != CausalPart::Scores || a.size(-2) == b.size(-1),
              "batched_matmul: causal scores need a square product; got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(part != CausalPart::Weights || a.size(-2) == a.size(-1),
              "batched_matmul: causal weights need square weights; got ", a.sizes());
  return BatchedMatmul::apply(a, b, static_cast<int64_t>(part));
}

}  // namespace lt
