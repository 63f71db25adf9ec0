// The loss: cross-entropy over the vocabulary, fused for bf16 logits.
//
// The tied head produces bf16 logits of N rows x V (50,257) columns. LibTorch's loss converts them to
// f32 (a copy twice their size), runs log_softmax (another f32 array), and in backward makes an f32
// gradient and converts it back to bf16: several passes over hundreds of megabytes per step (tens
// of gigabytes on a GPU). The fused loss reads the bf16 logits directly, computes each row's
// log-sum-exp in f32, keeps only the N row values for backward, and writes the gradient
// softmax - onehot straight into a bf16 array. Arithmetic is in f32 throughout, as LibTorch's.
// The same kernels take f32 logits on the CPU (the f32 runs of CPUs without fast bf16), with an f32
// gradient: LibTorch's log_softmax keeps a second f32 array of N x V and passes over both again in
// its backward.
// The CPU's row kernels are in cross_entropy.cpp; the CUDA ones in cross_entropy_cuda.cu, built when
// CMake finds a CUDA compiler (cuda_loss_kernels_built()).
#pragma once

#include <torch/torch.h>

namespace lt {

// Sum over the rows of `logits` (N, V) of -log softmax(logits)[target], with `targets` (N, int64)
// equal to -1 for rows that do not count. Differentiable with respect to `logits`. With `fused`,
// bf16 logits take the fused kernels (on CUDA, where this build has them: else it is an error), and
// so do f32 logits on the CPU; everything else takes LibTorch's log_softmax + nll_loss in f32. A target >= V is an error on the
// CPU; on CUDA, where checking would make the step wait for the GPU, the fused kernel makes that
// row's loss NaN (LibTorch's own kernel stops the process with a device-side assertion).
// With `overwrite_logits`, the fused kernels' backward (CPU and CUDA) writes the gradient into the
// logits' own array when nothing but the loss holds them any more (the models' loss_sum, whose logits
// live only for the loss): one N x V array less at the step's peak (206 MB of f32 logits for 1,024
// tokens of GPT-2's vocabulary; 1.6 GB of bf16 logits for 16 x 1,024 tokens of its padded vocabulary
// on a GPU) and no fresh memory to fault in. Logits that are a view or still held elsewhere are left
// alone, and a retained graph's second backward is LibTorch's "modified by an inplace operation" error.
torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets, bool fused = true,
                                bool overwrite_logits = false);

// Whether this build has the fused loss's CUDA kernels (LT_WITH_CUDA_KERNELS).
bool cuda_loss_kernels_built();

}  // namespace lt
