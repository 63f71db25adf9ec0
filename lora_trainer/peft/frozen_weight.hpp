// How a linear layer's frozen base weight is kept between steps and produced for its matmul: the one
// seam through which another storage plugs in (4-bit NF4 blocks for QLoRA, a shard per rank) without
// the layers, the adapters or the trainer changing. The layer asks for W each time it computes; what
// is kept in between, and where, is the storage's business.
//
// Storages:
//   bf16  the layer's own `weight` parameter cast to bf16 in place, so a checkpoint keeps it as
//         params/<name> like any parameter.
//   nf4   QLoRA's 4-bit NormalFloat blocks (kernels/nf4.hpp, double quantization) of the weight's bf16
//         values (optimization/lora/quantize_base=nf4): quantized once, and the parameter becomes a
//         stand-in of the weight's shape and dtype with no storage of its own (one bf16 zero, expanded:
//         its shape and numel are the weight's for everything that counts or names parameters; writing
//         into it fails). Each product dequantizes W to bf16 for itself alone, in the forward and again
//         in the backward (x's gradient), so no bf16 copy outlives its product; on the device of x (the
//         CUDA kernel there). Its products are bit for bit those of a bf16 base holding dequant(quant(W)).
//         It keeps the CRC of the bf16 values it quantized, for the frozen base's digest.
//   another  registered by name (frozen_storage.hpp's registry): one file that defines its FrozenWeight
//         and registers it (docs/design.md's worked example, tests/peft/test_int8_storage.cpp's int8).
//         optimization/lora/quantize_base=<name> stores the blocks' linear weights in it, a checkpoint
//         keeps its state() as <name>/<weight>.<field>, the export merges into what for_matmul makes.
//   sharded  either of the two kept 1/N a rank (distributed/shard_params=lora, block_shard.hpp): the
//         tensors that keep W (the bf16 W, or NF4's codes and scales) are part of their block's
//         BlockShard, and whole only while the block is gathered; the parameter is a stand-in as for
//         nf4. W's products are those of the storage it shards (bf16's, or nf4's dequantized per
//         product), bit for bit. Used outside its block's forward (DoRA's norms at the transition), it
//         gathers the block for itself: a collective, so every rank must ask alike.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>
#include <string>

#include <torch/torch.h>

#include "lora_trainer/peft/frozen_storage.hpp"

namespace lt {

class FrozenWeight {
 public:
  virtual ~FrozenWeight() = default;
  // W (out, in) for a matmul with x, bf16: as stored (frozen_linear casts it for the product alone), or
  // made from the storage (nf4: a fresh dequantized copy).
  virtual torch::Tensor for_matmul(const torch::Tensor& x) const = 0;
  // x W^T (+ b) with W frozen: no gradient for W or b, x's gradient through W. bf16: frozen_linear of
  // the stored W; nf4: W dequantized for the product and again in the backward, never kept between.
  virtual torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& b) const;
  // Whether linear_with_adapter applies to x: an f32 x outside autocast (W is cast for the product), b
  // frozen. Makes no W (no dequantization, no gather).
  bool merges_lora(const torch::Tensor& x, const torch::Tensor& b) const;
  // linear(x, b) + scale (x A) B with the adapter merged into W's cast: frozen_lora_linear below, W made
  // again for the backward where the storage makes it (nf4), so every storage computes the same numbers
  // for the same bf16 values of W.
  virtual torch::Tensor linear_with_adapter(const torch::Tensor& x, const torch::Tensor& b, const torch::Tensor& A,
                                            const torch::Tensor& B, double scale) const;
  // Bytes the storage holds.
  virtual int64_t bytes() const = 0;
  virtual FrozenFormat format() const = 0;
  // W's shape.
  virtual std::vector<int64_t> shape() const = 0;
  // Stores W (bf16 values of this shape) in place of what is stored: bf16 copies it into the parameter,
  // nf4 quantizes it (a restore reading a base that a checkpoint refers to). W may be a model file's
  // read-only mapped pages, valid only during the call (BaseWeights::peek): a storage copies what it keeps.
  virtual void assign(const torch::Tensor& W) = 0;
  // The tensors that keep W where the parameter does not (a checkpoint saves and loads them in place),
  // by a field name: none for bf16 (the parameter holds it); nf4: its codes and scales (Nf4Tensor's
  // "codes", "absmax_codes", "absmax_scales", "absmax_offset"; a checkpoint names them nf4/<weight>.<field>).
  virtual std::vector<std::pair<std::string, torch::Tensor>> state() const { return {}; }
  // The CRC-32 of the bf16 values of W when they are not in memory (nf4: those it quantized), else none.
  virtual std::optional<uint32_t> values_crc() const { return std::nullopt; }
  // Whether the layer's parameter itself holds W (bf16); else it is a stand-in and W is here.
  virtual bool held_by_parameter() const { return false; }
  // Whether W is kept 1/N a rank (sharded).
  virtual bool sharded() const { return false; }
};

// x W^T (+ b) and x W^T (+ b) + scale (x A) B for a storage that makes W for each product (nf4, a
// quantized storage's linear and linear_with_adapter): W made by storage.for_matmul in the forward and
// again in the backward for x's gradient, never kept between; the numbers of frozen_linear and
// frozen_lora_linear on a stored bf16 W of the same values. `storage` outlives the step's graph.
torch::Tensor made_weight_linear(const FrozenWeight& storage, const torch::Tensor& x, const torch::Tensor& b);
torch::Tensor made_weight_lora_linear(const FrozenWeight& storage, const torch::Tensor& x, const torch::Tensor& b,
                                      const torch::Tensor& A, const torch::Tensor& B, double scale);

// W's bf16 values as `storage` makes them for a product, on the CPU (an export's merge).
torch::Tensor frozen_values(const FrozenWeight& storage);

class BlockShard;
// Whether a storage of `format` can be sharded (bf16 and nf4; sharded_storage's layout knows theirs).
bool shardable(FrozenFormat format);
// `storage` (of the layer parameter `weight`) as a sharded storage of the same format, its tensors
// added to `block`'s layout; the parameter becomes a stand-in. Call finish_sharding on each such
// storage once `block` is sealed: it stores what this rank keeps of W's values (zeros when the storage
// was a restore's template holding none).
std::shared_ptr<FrozenWeight> shard_weight(const std::shared_ptr<FrozenWeight>& storage, torch::Tensor weight,
                                           const std::shared_ptr<BlockShard>& block);
void finish_sharding(FrozenWeight& sharded);

// y = x W^T (+ b) where W and b may be a frozen weight and bias in another dtype than x (a bf16 base
// in an f32 forward): they are cast for the product, and autograd keeps W as stored, not the cast
// copy, which the backward makes again for x's gradient. Without it the graph of a forward held a
// float32 copy of every frozen matrix until the backward: twice the bf16 base, for a 1B model 4 GB.
// W and b get no gradient (they are frozen). When W trains, is already in x's dtype, or autocast casts
// both, this is torch::linear(x, weight_for(W, x), weight_for(b, x)), the same numbers either way.
// The cast goes through a buffer of the thread, reused by every product: a W whose cast is larger than
// `block_bytes` (64 MiB) is taken in blocks of rows (the output and x's gradient are the same up to
// the order of the gradient's sums; tests pass smaller blocks).
inline constexpr int64_t kFrozenCastBlockBytes = int64_t(64) << 20;
torch::Tensor frozen_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b = {},
                            int64_t block_bytes = kFrozenCastBlockBytes);

// Whether frozen_linear casts W for its product with x (W and b frozen, W stored in another dtype than x,
// no autocast: an f32 step over a bf16 base, on a CPU without fast bf16 products); frozen_lora_linear
// takes exactly these.
bool merges_lora_into_cast(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b = {});
// x W^T (+ b) + scale (x A) B, PEFT's plain LoRA (A (in, r), B (r, out)), for a W that frozen_linear
// casts: the adapter is added to W's cast, W + scale (A B)^T, in the buffer the cast writes anyway (2 r
// operations an element of W), so the forward is one product, and so is x's gradient. The unmerged
// form (add_lora) adds a product of rank r over the whole (rows, out) output and another over x's
// gradient: two passes over arrays as large as the layer's activations, for arithmetic a rank-16 product
// barely has. A's and B's gradients are add_lora's, s x^T (g B^T) and s (x A)^T g. The numbers equal
// add_lora(x, frozen_linear(x, W, b), A, B, scale)'s up to float rounding; f32 only, where W's cast
// keeps the adapter's small values exactly (a bf16 merge would round them away).
torch::Tensor frozen_lora_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b, const torch::Tensor& A,
                                 const torch::Tensor& B, double scale, int64_t block_bytes = kFrozenCastBlockBytes);

// Freezes `weight` (a layer's registered parameter) in `format`: no gradient, and for bf16 the tensor
// itself cast to bf16 in place (its name and identity stay: the checkpoint and the optimizer's
// bookkeeping see the same parameter); for nf4 (any other storage: the registry's make) its bf16 values
// quantized, and the tensor made the stand-in above in place.
std::shared_ptr<FrozenWeight> freeze_weight(torch::Tensor weight, FrozenFormat format);

// A frozen weight's stand-in (nf4): one bf16 zero expanded to `shape`, on `device`; and whether `t` is
// one. A template for a restore may be built on stand-ins: freezing one as nf4 allocates the storage
// without quantizing anything, for the restore to fill (FrozenWeight::assign, or the checkpoint's codes).
torch::Tensor frozen_stand_in(at::IntArrayRef shape, const torch::Device& device);
bool is_frozen_stand_in(const torch::Tensor& t);

// W as it should enter a matmul with x: unchanged under autocast (which casts both), else cast to x's
// dtype, so a bf16-frozen weight works in an f32 forward too.
torch::Tensor weight_for(const torch::Tensor& W, const torch::Tensor& x);

}  // namespace lt
