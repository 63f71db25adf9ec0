// f32 matrix products on the CPU through oneDNN's sgemm, where this build has it (LT_HAVE_ONEDNN:
// Debian's libdnnl-dev, the oneDNN that Debian's LibTorch itself links), for the products of a linear
// layer's forward and of its input's gradient.
//
// LibTorch's f32 mm on the CPU is OpenBLAS's sgemm. On the Cascade Lake (AVX-512, no BF16) oneDNN's
// sgemm ran the forward x W^T and the input gradient g W of the bench model's layers up to 1.22x as
// fast (one forward 0.98x), 1.13x and 1.15x for its tied head (1,024 x 384 by 384 x 50,257), and the
// weight gradient g^T x (the inner dimension the tokens) at 0.90-0.93x for the larger weights
// (docs/performance.md, "oneDNN's sgemm"). So the weight gradient stays LibTorch's. The bf16 products (autocast) are LibTorch's, which
// hands them to oneDNN already; CUDA is untouched.
//
// The choices are the process's (runtime/matmul, set by Runtime::from_config): one for the linear layers'
// products, one for attention's many small ones (cpu_sgemm), where oneDNN measured faster on every CPU
// so far (the AVX2-only Zen 1 too, where its large products are slower). Each product is the same
// sgemm call at any thread count (oneDNN splits the output, not the inner dimension: the same bits on
// 1 and 2 threads), so a resumed job computes what the uninterrupted one did.
#pragma once

#include <torch/torch.h>

namespace lt {

enum class CpuMatmul { LibTorch, OneDnn };

// Whether this build has oneDNN's sgemm (LT_HAVE_ONEDNN).
bool onednn_available();
// The process's choices (default: OneDnn for both where available): `linear` for cpu_gemm_out, cpu_gemm
// and cpu_linear, `small` for cpu_sgemm. Choosing OneDnn without oneDNN throws; one argument sets both.
void set_cpu_matmul(CpuMatmul linear, CpuMatmul small);
void set_cpu_matmul(CpuMatmul both);
CpuMatmul cpu_matmul();        // the linear layers'
CpuMatmul cpu_small_matmul();  // cpu_sgemm's

// How a row-major sgemm reads a rows x cols f32 matrix in place, its element (r, c) at
// r * row_stride + c * col_stride: trans 'N' (unit column stride, rows ld apart), 'T' (unit row stride:
// the transpose of a row-major matrix whose rows lie ld apart), or trans 0 where neither (the matrix must
// be copied first). A single row or column takes whichever unit stride it has, with the smallest ld.
// The one rule for cpu_gemm_out's operands and for batched_matmul's matrices and their blocks.
struct GemmLayout {
  char trans = 0;
  int64_t ld = 0;
  explicit operator bool() const { return trans != 0; }
};
GemmLayout gemm_layout(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride);

// out = a b, or out += a b with accumulate; 2-D. Through oneDNN when chosen and when a, b and out are
// f32 CPU matrices that it reads in place (one unit stride each; out's columns unit-stride), else
// LibTorch's mm_out / addmm_. out must not overlap a or b.
void cpu_gemm_out(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate = false);

// C = op(A) op(B) (+ C with accumulate) on row-major f32 matrices given by pointer, op(A) M x K and
// op(B) K x N, C M x N with row stride ldc; trans 'N' reads a matrix as stored (row stride ld), 'T' reads
// the transpose of the stored one. For many small products (attention's), where LibTorch's views and
// dispatch would cost more than the product: oneDNN's sgemm when chosen (cpu_small_matmul), else LibTorch's mm on views of
// the operands (its BLAS call, at::native::cpublas::gemm, is not exported: one dispatch per product).
// Inside a parallel region each call runs on its thread.
void cpu_sgemm(char trans_a, char trans_b, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
               int64_t ldb, bool accumulate, float* c, int64_t ldc);

// a b for a (..., K) and a 2-D b (K, N): a new (..., N) tensor. Not recorded by autograd (for products
// inside an autograd function's forward or backward, or without a graph).
torch::Tensor cpu_gemm(const torch::Tensor& a, const torch::Tensor& b);

// x W^T (+ b), what torch::linear computes, with its gradients: x's g W through cpu_gemm, W's g^T x and
// b's sum as LibTorch computes them; the products oneDNN's or LibTorch's as chosen. torch::linear itself
// where the product is not f32 on the CPU, or under autocast.
torch::Tensor cpu_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b = {});

// cpu_linear makes W's gradient g^T x in blocks of this many rows of W. OpenBLAS's threaded sgemm packs a
// block of up to 320-512 tokens by the product's output columns (W's rows) into per-thread buffers that
// it keeps for the life of the process (core/runtime.hpp, BlasPacking): one product over a 128,256-row
// head left 131-230 MB there, a block of 8,192 rows 8-17 MB. Each value is the same sum over the tokens.
constexpr int64_t kWeightGradRows = 8192;

}  // namespace lt
