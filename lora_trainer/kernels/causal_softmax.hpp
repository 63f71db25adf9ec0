// Attention's weights on the CPU in one pass: the softmax of scale * scores over each row's visible keys.
//
// The manual attention path (the CPU's, where LibTorch 1.13 has no fused attention) formed its weights
// from the (B, H, T, T) scores q k^T in five passes, each with its own array: scores * scale,
// masked_fill(-inf) above the diagonal, a copy to f32, softmax, a copy back to bf16; and backward went
// through all five again, an f32 copy of the weights kept for it beside the copy in the input's dtype
// that the product with v keeps. This kernel reads the scores once and writes the weights once: per
// row, the maximum and the sum of e^(scale x - max) over the visible keys in f32, the weights
// e^(scale x - max) / sum in the output's dtype, 0 for the hidden keys. Backward reads only those
// weights p (kept by the product with v anyway) and writes scale * p (dp - sum_j p_j dp_j): in a bf16
// run from the bf16 weights, where the five passes used their f32 copy (a difference of one bf16
// rounding of p, within the rounding of the bf16 gradient it writes). Arithmetic is f32 throughout;
// the scaled scores are not rounded to bf16 first, as the five passes' did.
#pragma once

#include <torch/torch.h>

namespace lt {

// Whether causal_softmax takes these: CPU scores (..., T, T) in f32 or bf16, `visible` either
// undefined (causal: key j visible from query i when j <= i) or a bool (B, 1, T, T) for scores
// (B, H, T, T) (SequenceLayout's mask for packed examples: visible where true), and an f32 or bf16 output.
bool causal_softmax_supported(const torch::Tensor& scores, const torch::Tensor& visible, torch::ScalarType out_dtype);

// softmax(scale * scores) over the last dimension, each row over its visible keys only (the hidden
// ones are 0, in the output and in the gradient), computed in f32 and returned in `out_dtype` (f32 or
// bf16). Differentiable with respect to `scores`. A row with no visible key is all zeros. Requires
// causal_softmax_supported(scores, visible).
torch::Tensor causal_softmax(const torch::Tensor& scores, double scale, const torch::Tensor& visible,
                             torch::ScalarType out_dtype);

}  // namespace lt
