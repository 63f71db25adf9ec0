// The optimizer's arithmetic on the CPU, fused: one pass over each parameter's values.
//
// LibTorch's AdamW (and ours before this kernel) updates a parameter with a chain of tensor ops:
// decay, two moment updates, a square root, a division, each reading and writing whole arrays, and a
// temporary for the denominator: about twenty passes over four arrays a parameter, and the gradient
// norm squares every gradient into another temporary first. On a CPU these passes are memory-bound
// and cost as much as a tenth of a small model's step. Here the update reads p, g, m and v once and
// writes p, m and v once, in f32, vectorised by the compiler (AVX-512, AVX2 or the baseline, picked
// once per process: vector_math.hpp); training/optim.cpp cuts the parameters into chunks that the
// threads share.
#pragma once

#include <cstdint>

namespace lt {

// The scalars of one AdamW step, as f32 (the arithmetic is f32, as LibTorch's is for f32 tensors).
struct AdamWScalars {
  float decay = 1.0f;        // p *= decay first: 1 - lr * weight_decay, or 1 without decay
  float beta1 = 0.9f, beta2 = 0.999f;
  float one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;  // computed in double, then rounded
  float inv_sqrt_bc2 = 1.0f;  // 1 / sqrt(1 - beta2^t)
  float eps = 1e-8f;
  float step_size = 0.0f;    // lr / (1 - beta1^t)
};

// For i < n: p = decay p; m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
// p -= step_size m / (sqrt(v) inv_sqrt_bc2 + eps). The arrays do not overlap.
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);

// sum x[i]^2 for i < n, in double, the same for the same values whatever the caller's threads (the
// caller fixes the chunks and sums them in order).
double sum_of_squares(const float* x, int64_t n);

}  // namespace lt
