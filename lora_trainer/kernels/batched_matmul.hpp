// Products of stacks of matrices on the CPU with the stack split across threads: attention's q k^T and
// weights x v on the manual attention path (models/layers.cpp).
//
// LibTorch's bmm (and matmul, which reshapes attention's strided q, k and v into copies for it) hands
// each of the B x H small products (256 x 64 by 64 x 256 for the bench model) to the BLAS one after
// another, and the BLAS splits each across the threads: at these sizes the threads spend much of the
// product waiting for each other. Here each thread takes whole products (the BLAS runs single-threaded
// inside the parallel region) and reads the operands through their strides, so the views of c_attn's
// output are not copied first. Each product is the same BLAS call, so the bits are the same at any
// thread count.
#pragma once

#include <torch/torch.h>

namespace lt {

// Whether batched_matmul takes these: CPU f32 tensors of the same rank >= 3, equal leading (batch)
// sizes, a (..., M, K) and b (..., K, N), each matrix with one unit stride (what a BLAS reads without
// a copy: contiguous rows or contiguous columns).
bool batched_matmul_supported(const torch::Tensor& a, const torch::Tensor& b);

// a b over the last two dimensions, the result contiguous (..., M, N); differentiable with respect to
// both (each gradient contiguous, from the same products). Requires batched_matmul_supported(a, b).
torch::Tensor batched_matmul(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace lt
