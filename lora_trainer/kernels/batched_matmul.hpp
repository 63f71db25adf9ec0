// Products of stacks of matrices on the CPU with the stack split across threads: attention's q k^T and
// weights x v on the manual attention path (models/layers.cpp).
//
// LibTorch's bmm (and matmul, which reshapes attention's strided q, k and v into copies for it) hands
// each of the B x H small products (256 x 64 by 64 x 256 for the bench model) to the BLAS one after
// another, and the BLAS splits each across the threads: at these sizes the threads spend much of the
// product waiting for each other. Here each thread takes whole products (the BLAS runs single-threaded
// inside the parallel region) and reads the operands through their strides, so the views of c_attn's
// output are not copied first. Each product is one sgemm call on pointers into the operands
// (kernels/cpu_gemm.hpp's cpu_sgemm: oneDNN's where chosen): a LibTorch view and dispatch per product
// would cost about as much as the blocks below save. Each product is the same call at any thread
// count, so the bits are the same.
//
// With a causal mask (a query sees only the keys at or before it) attention's products have square
// matrices that are wanted, or nonzero, only on and below the diagonal. Told so (CausalPart), the
// products skip the blocks of 64 rows by 64 columns wholly above the diagonal: 3/8 of each product at
// T 256, 7/16 at T 1,024, forward and backward. On the Cascade Lake, one layer's attention of the bench
// model (4 x 6 heads, T 256, head 64) forward and backward went from 17.6 to 13.8 ms (docs/performance.md).
#pragma once

#include <torch/torch.h>

namespace lt {

// Whether batched_matmul takes these: CPU f32 tensors of the same rank >= 3, equal leading (batch)
// sizes, a (..., M, K) and b (..., K, N), each matrix with one unit stride (what a BLAS reads without
// a copy: contiguous rows or contiguous columns).
bool batched_matmul_supported(const torch::Tensor& a, const torch::Tensor& b);

// What a causal mask leaves of a square product, for the products to skip.
enum class CausalPart {
  None,
  // Scores q k^T (M == N), read only on and below the diagonal (the causal softmax, or a mask that
  // hides the rest): the blocks above it are not computed and hold 0. Its gradient takes the caller's
  // gradient to be 0 above the diagonal, as the softmax's is.
  Scores,
  // Weights times v, the weights (M == K) 0 above the diagonal (a causal softmax's output): the
  // product skips them. The weights' gradient is computed on and below the diagonal only (the blocks
  // above hold 0), which is all the softmax's gradient reads.
  Weights,
};

// a b over the last two dimensions, the result contiguous (..., M, N); differentiable with respect to
// both (from the same products). Requires batched_matmul_supported(a, b), and for a CausalPart other
// than None square matrices where that part says.
torch::Tensor batched_matmul(const torch::Tensor& a, const torch::Tensor& b, CausalPart part = CausalPart::None);

}  // namespace lt
