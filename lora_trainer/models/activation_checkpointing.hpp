// Activation checkpointing (`training/activation_checkpointing`, ModelOptions::activation_checkpointing):
// a transformer block runs its forward without keeping the activations its backward would need, and
// its backward runs the forward again, with gradients on, to get them. Per block, only the input
// (B, T, C) stays alive between forward and backward instead of every intermediate (the attention
// weights (B, H, T, T), the MLP's (B, T, F), ...); the cost is one more forward of the blocks.
//
// LibTorch's C++ API has no torch.utils.checkpoint. checkpointed() is its equivalent: an autograd
// node whose inputs are the block's input and every tensor inside the block that requires a gradient
// (its parameters and its linear layers' LoRA adapters), so that
//   - the block's output requires grad whenever anything in the block does (a frozen base with
//     adapters, whose first block's input needs no gradient, still trains the adapters);
//   - the gradients of those tensors leave the node like any other, and the engine accumulates them
//     into .grad as it would without checkpointing (micro-batches add up the same way).
// The recompute replays what the forward saw: the default generators' state (CPU, and CUDA for a CUDA
// input), so dropout draws the same masks, and the autocast state (enabled, dtype), which a backward
// called after leaving the autocast scope would not have. The autocast weight-cast cache is off in both
// runs: a cast cached by the gradient-free forward has no history, and a recompute that reused it would
// give the weights no gradient (tested); off in the forward, such casts never enter the cache, nor do
// bf16 copies of the weights stay in it for the step.
// The results are bit-identical to the plain path (tests/models/test_activation_checkpointing.cpp).
//
// A block whose frozen weights are sharded across ranks (peft/block_shard.hpp) is gathered around each
// of its forwards, and always checkpointed when it needs a backward: its gathered weights are dropped
// after the forward, so the backward gathers them again and recomputes. The forward prefetches the
// next block's weights, the backward the previous block's.
#pragma once

#include <functional>

#include <torch/torch.h>

#include "lora_trainer/peft/block_shard.hpp"

namespace lt {

using BlockForward = std::function<torch::Tensor(const torch::Tensor&)>;

// forward(x) for the module `block` that it computes, x: (B, T, C) -> (B, T, C). With `enabled`, and
// grad mode on, its activations are recomputed in the backward; otherwise forward(x) as it is.
// `forward` is called again in the backward: what it captures must still be alive then (capture by
// value). Only `block`'s parameters and adapters receive gradients through a checkpointed forward.
// `shard`: the block's sharded frozen weights, or null.
torch::Tensor checkpointed(bool enabled, torch::nn::Module& block, const BlockForward& forward, const torch::Tensor& x,
                           BlockShard* shard = nullptr);

// The tensors inside `block` that require a gradient: its parameters (the adapters of its layers
// among them), in module order.
std::vector<torch::Tensor> grad_tensors(torch::nn::Module& block);

}  // namespace lt
