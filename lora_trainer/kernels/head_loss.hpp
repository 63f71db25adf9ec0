// The output head and the loss together, over blocks of the vocabulary: the logits are never whole.
//
// The head of a 128k-vocabulary model makes N x 128,256 logits: 1 GB in f32 for 2,048 tokens, beside
// a LoRA phase's few hundred megabytes of activations, and a validation's freed logits the heap may
// never reuse. When the head's weight W takes no gradient (a frozen head in the LoRA phase, and every
// pass without gradients: validation), the loss and x's gradient need no more than each row's
// log-sum-exp and sum_j softmax_j W_j. Both are accumulated over blocks of W's rows, as flash attention
// accumulates its softmax over blocks of keys (here W is the keys and the values): per block, the block's
// logits x W_b^T, the rows' running maximum and sum of exponentials (the sums so far rescaled when the
// maximum grows), the target's logit where it falls in the block, and acc = acc * rescale + p W_b with
// p = e^(logits - max). After the last block, loss_i = max_i + log sum_i - logit_i[target] and
// x's gradient is acc_i / sum_i - W[target_i]: computed in the forward and kept (N x C, f32) for the
// backward, which scales it by the loss's incoming gradient. The head's products are the same in number
// as the whole head's forward and its backward for x; the memory is one block of logits (N x 4,096),
// W's block cast where it is cast, and the N x C gradient.
//
// Arithmetic: the block's logits in the products' dtype (autocast's bf16, else x's dtype; W cast a
// block at a time), everything per row in f32, the loss summed in f64 in row order (not dependent on the
// thread count). The blocks are 4,096 columns (fewer where W is cast: 16 MiB of cast at most, 1,024
// columns for d_model 4,096) whatever N is: a row's sums are taken in the same blocks in a micro-batch
// of any size. On the CPU a row kernel does a block's row in one pass (vector_math.hpp); elsewhere
// LibTorch's operations do the same arithmetic (tests run both on the CPU).
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace lt {

inline constexpr int64_t kHeadLossBlockColumns = 4096;
inline constexpr int64_t kHeadLossCastBytes = int64_t(16) << 20;

// The columns of a block: `block_columns` (at most V), and where W is cast for the products (`cast`: a
// bf16 head in an f32 step) no more than kHeadLossCastBytes of cast (a multiple of 64 columns, at least 64).
int64_t head_loss_columns(int64_t V, int64_t C, bool cast, int64_t block_columns = kHeadLossBlockColumns);

// Whether chunked_head_loss_sum can take a head of weight W here: W takes no gradient (it is frozen,
// or gradients are off).
bool chunked_head_loss_applies(const torch::Tensor& W);

// Sum over the rows of x (N, C) of -log softmax(x W^T)[target], `targets` (N, int64) -1 for rows that
// do not count, the products x W_b^T and p W_b in dtype `products` (autocast's where it is on: the
// models' product_dtype; the caller's choice, as kernels see no autocast state); differentiable with respect to x (not W: see chunked_head_loss_applies). A target >= V
// is an error on the CPU, and makes the loss NaN elsewhere (no read back to the host). `block_columns`:
// W's rows a block (tests pass fewer); `row_kernels` = false takes LibTorch's operations on the CPU too
// (tests).
torch::Tensor chunked_head_loss_sum(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& targets,
                                    torch::ScalarType products, int64_t block_columns = kHeadLossBlockColumns, bool row_kernels = true);

}  // namespace lt
