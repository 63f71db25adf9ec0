// The loss: cross-entropy over the vocabulary, fused for bf16 logits on the CPU (and on CUDA, without
// an f32 copy of the logits).
//
// The tied head produces bf16 logits of N rows x V (50,257) columns. The unfused loss converts them to
// f32 (a copy twice their size), runs log_softmax (another f32 array), and in backward makes an f32
// gradient and converts it back to bf16: several passes over hundreds of megabytes per step.
// cross_entropy_sum reads the bf16 logits directly, computes each row's log-sum-exp in f32 (two
// passes over the row, which stays in cache), keeps only the N row values for backward, and writes the
// gradient softmax - onehot straight into a bf16 array. Arithmetic is in f32 throughout, as before.
#pragma once

#include <torch/torch.h>

namespace lt {

// Sum over the rows of `logits` (N, V) of -log softmax(logits)[target], with `targets` (N, int64)
// equal to -1 for rows that do not count. Differentiable with respect to `logits`. bf16 logits on
// the CPU take the fused path; on CUDA, log_softmax upcasts to f32 inside its kernel; other dtypes
// use LibTorch's cross_entropy in f32.
torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace lt
