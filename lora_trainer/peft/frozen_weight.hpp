// How a linear layer's frozen base weight is kept between steps and produced for its matmul: the one
// seam through which another storage plugs in (4-bit NF4 blocks for QLoRA, a shard per rank) without
// the layers, the adapters or the trainer changing. The layer asks for W each time it computes; what
// is kept in between, and where, is the storage's business.
//
// Today there is one storage, bf16: the layer's own `weight` parameter cast to bf16 in place, so a
// checkpoint keeps it as params/<name> like any parameter.
#pragma once

#include <memory>
#include <string>

#include <torch/torch.h>

namespace lt {

// The storages a frozen base can take (optimization/lora's base storage; bf16 only so far).
enum class FrozenFormat { Bf16 };

class FrozenWeight {
 public:
  virtual ~FrozenWeight() = default;
  // W (out, in) as it enters a matmul with x: in x's dtype, or as stored when autocast casts both.
  virtual torch::Tensor for_matmul(const torch::Tensor& x) const = 0;
};

// Freezes `weight` (a layer's registered parameter) in `format`: no gradient, and for bf16 the tensor
// itself cast to bf16 in place (its name and identity stay: the checkpoint and the optimizer's
// bookkeeping see the same parameter).
std::shared_ptr<FrozenWeight> freeze_weight(torch::Tensor weight, FrozenFormat format);

// W as it should enter a matmul with x: unchanged under autocast (which casts both), else cast to x's
// dtype, so a bf16-frozen weight works in an f32 forward too.
torch::Tensor weight_for(const torch::Tensor& W, const torch::Tensor& x);

}  // namespace lt
