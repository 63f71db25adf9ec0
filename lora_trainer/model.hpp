// The GPT: token + position embeddings, pre-norm blocks (causal self-attention, GELU MLP), a final
// layer norm and an output head tied to the token embedding.
//
// Shapes: B = batch rows, T = time (<= block_size), C = d_model, V = vocab_size, H = n_head.
//
// Parameter names (`named_parameters()`), stable and used to pick LoRA targets and in checkpoints:
//   wte.weight (V, C)   wpe.weight (block_size, C)
//   h.<i>.ln_1.{weight,bias} (C)
//   h.<i>.attn.c_attn.{weight (3C, C), bias (3C)}   h.<i>.attn.c_proj.{weight (C, C), bias (C)}
//   h.<i>.ln_2.{weight,bias} (C)
//   h.<i>.mlp.c_fc.{weight (4C, C), bias (4C)}      h.<i>.mlp.c_proj.{weight (C, 4C), bias (C)}
//   ln_f.{weight,bias} (C)
// The residual stream is f32 whatever the parameters' dtype, so a bf16-frozen base works unchanged.
#pragma once

#include <torch/torch.h>

#include "lora_trainer/lora.hpp"

namespace lt {

class Config;

struct GPTOptions {
  int64_t vocab_size = 50257;
  int64_t block_size = 256;
  int64_t n_layer = 6;
  int64_t n_head = 6;
  int64_t d_model = 384;
  double dropout = 0.0;
  bool gelu_tanh = false;  // architecture/activation: the MLP's GELU, exact (erf) or the tanh approximation
  // runtime/attention. auto: fused on CUDA (where LibTorch has it), masked softmax on the CPU, where
  // LibTorch 2.6's fused kernel measured 1.6-1.8x slower for the whole step (docs/performance.md).
  enum class Attention { Auto, Fused, Manual } attention = Attention::Auto;
  bool fused_attention_on(const torch::Device& device) const;
  static GPTOptions from_config(const Config& cfg);
};

// Causal self-attention of q, k, v (B, H, T, D), with dropout p on the attention weights: either
// LibTorch's fused scaled_dot_product_attention (LibTorch 2.0+) or masked softmax computed in f32.
// Both give the same result within rounding (tests/test_model.cpp states the tolerance).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double dropout, bool fused);
// Whether this LibTorch has the fused path.
bool fused_attention_available();

// A linear layer y = x W^T + b that can carry a LoRA adapter (lora.hpp).
class LinearImpl : public torch::nn::Module, public LoraAdaptable {
 public:
  LinearImpl(int64_t in_features, int64_t out_features);
  torch::Tensor forward(const torch::Tensor& x);  // x: (..., in) -> (..., out)
  void set_lora(torch::Tensor A, torch::Tensor B, double scale) override;
  torch::Tensor weight, bias;

 private:
  torch::Tensor lora_A_, lora_B_;
  double lora_scale_ = 0.0;
};
TORCH_MODULE(Linear);

// Layer norm computed in f32 whatever the input's and parameters' dtypes.
class LayerNormImpl : public torch::nn::Module {
 public:
  explicit LayerNormImpl(int64_t dim);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
};
TORCH_MODULE(LayerNorm);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTOptions& o);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)
  Linear c_attn{nullptr}, c_proj{nullptr};

 private:
  int64_t n_head_;
  double dropout_;
  GPTOptions opts_;  // the attention choice
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  Linear c_fc{nullptr}, c_proj{nullptr};

 private:
  bool gelu_tanh_;
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
  double dropout;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTOptions& o);
  // idx: (B, T) int64 token ids -> logits (B, T, V)
  torch::Tensor forward(const torch::Tensor& idx);
  // Sum of the cross-entropy over positions whose target is >= 0 (count them with count_targets).
  // idx, targets: (B, T) int64; targets < 0 are ignored (padding). Reads nothing back from the
  // device, so a CUDA step is not held up waiting for it.
  torch::Tensor loss_sum(const torch::Tensor& idx, const torch::Tensor& targets);
  // GPT-2 initialisation (normal 0.02; residual projections 0.02 / sqrt(2 n_layer)), from `gen`.
  void init_weights(torch::Generator gen);
  const GPTOptions& options() const { return opts_; }

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  LayerNorm ln_f{nullptr};

 private:
  torch::Tensor hidden(const torch::Tensor& idx);  // (B, T) -> (B, T, C) after ln_f, f32
  torch::Tensor head(const torch::Tensor& x, bool padded);  // (B, T, C) -> logits (model.cpp)
  GPTOptions opts_;
};
TORCH_MODULE(GPT);

// The number of targets >= 0 (positions that count in the loss). Count on the host copy of a batch.
int64_t count_targets(const torch::Tensor& targets);

// named_parameters() as an ordered vector: the single source of parameter identity.
NamedTensors named_params(torch::nn::Module& m);

}  // namespace lt
