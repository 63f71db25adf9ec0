// The layers both model families are built from (gpt2.hpp, llama.hpp). Every layer computes in f32
// whatever its parameters' dtype, so a bf16-frozen base works unchanged; shapes use B = batch rows,
// T = time, C = width, H = heads, D = head size.
#pragma once

#include <torch/torch.h>

#include "lora_trainer/peft/lora.hpp"

namespace lt {

// A linear layer y = x W^T (+ b) that can carry a LoRA adapter (lora.hpp), as torchtune's LoRALinear:
// the adapter's A, B (and DoRA's magnitude) are the layer's parameters lora_A, lora_B, lora_magnitude,
// beside `weight` and `bias`, while it has one. W: (out, in); once frozen, the matmul takes it from its
// FrozenWeight.
class LinearImpl : public torch::nn::Module, public LoraAdaptable {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool with_bias = true);
  torch::Tensor forward(const torch::Tensor& x);  // x: (..., in) -> (..., out)
  // x W^T (+ b) alone, without the adapter.
  torch::Tensor base_forward(const torch::Tensor& x) const;
  // Whether forward adds a plain LoRA adapter (one that is on, and not DoRA): base_forward + add_lora.
  bool plain_lora() const { return lora_on_ && lora_A().defined() && !lora_magnitude().defined(); }
  // Whether forward(x) merges that adapter into its frozen bf16 weight's f32 cast (frozen_lora_linear:
  // an f32 step over a bf16 base, x with rows enough that it pays: layers.cpp), not base_forward + add_lora.
  bool merges_adapter(const torch::Tensor& x) const;
  void set_lora(torch::Tensor A, torch::Tensor B, double scale, torch::Tensor magnitude) override;
  void enable_lora(bool on) override { lora_on_ = on; }
  void freeze_weight(FrozenFormat format) override;
  std::shared_ptr<FrozenWeight> frozen() const override { return frozen_; }
  void set_frozen(std::shared_ptr<FrozenWeight> storage) override { frozen_ = std::move(storage); }
  // W for the matmul with x: the stored one from its FrozenWeight once frozen (bf16: lora_linear's
  // frozen_linear casts it), else the parameter itself.
  torch::Tensor base_weight(const torch::Tensor& x) const;
  // W alone when the layer's output is x W^T (no adapter on, no bias): the stored one once frozen (as
  // its storage makes it for a product), else the parameter; undefined otherwise.
  torch::Tensor plain_weight(const torch::Tensor& x) const;
  torch::Tensor weight, bias;  // bias undefined when built without one

 private:
  friend std::vector<torch::Tensor> linear_shared_input(const torch::Tensor& x, const std::vector<LinearImpl*>& layers);
  // The registered adapter parameters (undefined while the layer has none: named_parameters() skips them).
  const torch::Tensor& lora_A() const { return parameters_["lora_A"]; }
  const torch::Tensor& lora_B() const { return parameters_["lora_B"]; }
  const torch::Tensor& lora_magnitude() const { return parameters_["lora_magnitude"]; }
  double lora_scale_ = 0.0;
  bool lora_on_ = true;
  std::shared_ptr<FrozenWeight> frozen_;  // null while `weight` trains
};
TORCH_MODULE(Linear);

// Each layer's forward(x) for layers that read the same x (Llama's q, k, v projections; gate and up),
// the plain LoRA adapters among them in one product (add_lora_shared_input): the same numbers as the
// layers' own forwards up to rounding. DoRA layers, layers without an adapter and those that merge it
// into their base's cast (merges_adapter: one product each, no rank-r products to share) take their own
// forward.
std::vector<torch::Tensor> linear_shared_input(const torch::Tensor& x, const std::vector<LinearImpl*>& layers);

// The token embedding: torch::nn::Embedding (the same parameter, init and lookup) that can take
// trainable token rows (lora.hpp's TrainableTokens). With rows set, the lookup returns f32 with the
// rows of those ids replaced by their f32 values, and output_weight() the weight with the rows
// replaced, for a head tied to the embedding.
class TokenEmbeddingImpl : public torch::nn::EmbeddingImpl, public TokenRowsAdaptable {
 public:
  TokenEmbeddingImpl(int64_t num_embeddings, int64_t dim);
  torch::Tensor forward(const torch::Tensor& idx);  // idx: (...) int64 -> (..., dim)
  // The (V, dim) weight as a tied head multiplies x with it: weight_for(weight, x), rows replaced.
  torch::Tensor output_weight(const torch::Tensor& x);
  void set_token_rows(torch::Tensor ids, torch::Tensor values) override;
  void enable_token_rows(bool on) override { rows_on_ = on; }

 private:
  // The registered parameter trainable_tokens_delta: the rows' values (undefined while none are set).
  const torch::Tensor& values() const { return parameters_["trainable_tokens_delta"]; }
  bool rows_on_ = true;
  torch::Tensor ids_;
  torch::Tensor slot_;  // (V) int64: the row of values_ for each token id, -1 for the frozen ones
};
TORCH_MODULE(TokenEmbedding);

// Layer norm (weight and bias), computed in f32.
class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;

 private:
  double eps_;
};
TORCH_MODULE(LayerNorm);

// RMS norm (Llama's): x / sqrt(mean(x^2) + eps) * weight, computed in f32.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// What a batch's rows are: one sequence each, or several examples packed one after another
// (data/packing.hpp). `segments` (B, T) int64 numbers each position's example within its row, an
// example's positions consecutive; undefined = one sequence per row. Positions restart at 0 at each
// example and a position attends only to the earlier positions of its own example: the causal mask
// made block-diagonal. A model computes it once per forward and hands it to every layer.
struct SequenceLayout {
  SequenceLayout(const torch::Tensor& segments, int64_t T, const torch::Device& device);
  torch::Tensor positions;  // (T) for one sequence a row, (B, T) packed; int64, on the device
  torch::Tensor mask;       // undefined for one sequence a row (the plain causal mask), else (B, 1, T, T)
                            // bool, true where position i may attend to position j
};

// Causal self-attention of q, k, v (B, H, T, D), with dropout p on the attention weights: either
// LibTorch's fused scaled_dot_product_attention (LibTorch 2.0+) or masked softmax computed in f32.
// Both give the same result within rounding (tests/models/test_attention.cpp states the tolerance).
// `mask`: SequenceLayout::mask (undefined: the plain causal mask).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double dropout, bool fused, const torch::Tensor& mask = {});
// Attention of t new queries q (B, H, t, D) at positions offset .. offset + t - 1 over the keys and values
// of positions 0 .. offset + t - 1 (B, H, offset + t, D; a KvCache's, kv_cache.hpp), offset = their length
// minus t: query i sees keys 0 .. offset + i. With offset 0 it is causal_attention; a single new query
// sees every key. No dropout: it serves generation.
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool fused);
// Whether this LibTorch has the fused path.
bool fused_attention_available();

// Rotary position embeddings as Hugging Face's Llama applies them: each head's two halves rotate
// together ("rotate_half", not interleaved pairs), position p by the angles p * inv_freq[i],
// inv_freq[i] = theta^(-2i/D) for i < D/2, computed in f32, then rescaled as transformers'
// modeling_rope_utils does for the static scalings:
//   Linear  inv_freq / factor
//   Llama3  (Llama 3.1, 3.2) by wavelength w = 2 pi / inv_freq, with L = original_context:
//           w < L / high_freq_factor kept; w > L / low_freq_factor divided by factor; in between
//           (1 - s) inv_freq / factor + s inv_freq, s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
struct RopeScaling {
  enum class Kind { None, Linear, Llama3 } kind = Kind::None;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_context = 8192;
};
struct RopeTables {
  torch::Tensor cos, sin;  // (T, D), or (B, 1, T, D) for packed rows, f32: cat(angles, angles).cos() / .sin()
};
// The D/2 inverse frequencies, f32.
torch::Tensor rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling, const torch::Device& device);
// The tables of SequenceLayout::positions ((T) or (B, T)), on their device.
RopeTables rope_tables(const torch::Tensor& positions, int64_t head_dim, double theta, const RopeScaling& scaling);
// x: (B, H, T, D) -> x cos + rotate_half(x) sin, in f32; rotate_half(x) = cat(-x[D/2:], x[:D/2]).
torch::Tensor apply_rope(const torch::Tensor& x, const RopeTables& rope);

// Logits of x (B, T, C) against an output matrix W (V, C). cuBLAS multiplies fast only when each
// row of the (N, V) output starts 16-byte aligned; with GPT-2's V = 50,257 it fell back to old sm75
// kernels, which took a third of a training step on an H100 (docs/performance.md). On CUDA the head
// therefore runs over V rounded up to a multiple of 64, the extra columns held at -inf by a bias so
// that softmax gives them no weight and no gradient; `padded` keeps them (for the loss), else the V
// real columns are returned.
torch::Tensor output_logits(const torch::Tensor& x, const torch::Tensor& W, bool padded);

// The dtype x's products are computed in: autocast's where it is on for x's device, else x's own.
torch::ScalarType product_dtype(const torch::Tensor& x);

}  // namespace lt
