// The CUDA kernels of the fused loss (cross_entropy.hpp), for bf16 logits on the GPU. Built only in a
// CUDA build with a CUDA compiler (LT_WITH_CUDA_KERNELS); this header has no LibTorch and no CUDA
// types, so cross_entropy.cpp, a plain C++ file, calls it with the tensors' pointers and stream.
//
// LibTorch's own route for bf16 logits converts them to an f32 copy, runs log_softmax into another
// f32 array, and in the backward makes an f32 gradient and converts it back: about 30 GB of memory
// traffic a step for 32 x 1024 rows of 50,304 logits. These kernels read the bf16 logits once in
// the forward (one block a row: online max and sum of exponentials in f32) and keep only the row's
// log-sum-exp; the backward reads them once more and writes g * (softmax - onehot) straight into a
// bf16 gradient. Neither waits for the host: the backward reads g on the device.
#pragma once

#include <cstdint>

namespace lt::cuda_kernels {

// For each row i < N of `logits` (N x V bf16, rows `row_stride` elements apart; bit patterns as
// uint16): lse[i] = log sum_j exp(logits[i][j]) and row_loss[i] = lse[i] - logits[i][targets[i]] in
// f32; a row whose target is negative counts 0, one whose target is >= V gets NaN (so the step's
// loss is not finite and is reported, rather than reading outside the row), as does a row holding
// NaN or +inf. `stream` is a cudaStream_t. Returns nullptr, or the CUDA error's text.
const char* cross_entropy_forward(const uint16_t* logits, int64_t N, int64_t V, int64_t row_stride,
                                  const int64_t* targets, float* lse, float* row_loss, void* stream);

// grad[i][j] = g * (exp(logits[i][j] - lse[i]) - [j == targets[i]]) rounded to bf16 (nearest even),
// zero in the rows whose target is negative; `g` points to one f32 on the device (the loss's
// incoming gradient). grad is N x V, contiguous; it may be `logits` itself when row_stride == V (the
// gradient written over the logits). Returns nullptr, or the CUDA error's text.
const char* cross_entropy_backward(const uint16_t* logits, int64_t N, int64_t V, int64_t row_stride,
                                   const int64_t* targets, const float* lse, const float* g, uint16_t* grad,
                                   void* stream);

}  // namespace lt::cuda_kernels
