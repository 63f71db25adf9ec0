// The gpt2 family: token + position embeddings, pre-norm blocks (causal self-attention, GELU MLP), a
// final layer norm and an output head tied to the token embedding.
//
// Shapes: B = batch rows, T = time (<= block_size), C = d_model, V = vocab_size, H = n_head, F = d_ff.
//
// Parameter names (`named_parameters()`), stable and used to pick LoRA targets and in checkpoints:
//   wte.weight (V, C)   wpe.weight (block_size, C)
//   h.<i>.ln_1.{weight,bias} (C)
//   h.<i>.attn.c_attn.{weight (3C, C), bias (3C)}   h.<i>.attn.c_proj.{weight (C, C), bias (C)}
//   h.<i>.ln_2.{weight,bias} (C)
//   h.<i>.mlp.c_fc.{weight (F, C), bias (F)}        h.<i>.mlp.c_proj.{weight (C, F), bias (C)}
//   ln_f.{weight,bias} (C)
// The residual stream is f32 whatever the parameters' dtype, so a bf16-frozen base works unchanged.
#pragma once

#include <torch/torch.h>

#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const ModelOptions& o);
  // (B, T, C) -> (B, T, C); mask: SequenceLayout::mask (layers.hpp). With a cache (generation: no mask),
  // the T positions follow the cache's and attend to them too (kv_cache.hpp).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask = {}, KvCache* cache = nullptr);
  Linear c_attn{nullptr}, c_proj{nullptr};

 private:
  ModelOptions opts_;
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const ModelOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  Linear c_fc{nullptr}, c_proj{nullptr};

 private:
  bool gelu_tanh_;
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask = {}, KvCache* cache = nullptr);
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
  double dropout;
};
TORCH_MODULE(Block);

class GPTImpl : public CausalLMImpl {
 public:
  explicit GPTImpl(const ModelOptions& o);
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& segments = {}) override;
  torch::Tensor loss_sum(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments = {}) override;
  torch::Tensor forward_cached(const torch::Tensor& idx, KvCache& cache) override;
  // GPT-2 initialisation (normal 0.02; residual projections 0.02 / sqrt(2 n_layer)), from `gen`.
  void init_weights(torch::Generator gen) override;
  bool is_lookup(const std::string& name) const override { return name == "wpe.weight"; }
  int64_t block_of(const std::string& name) const override { return block_number(name, "h."); }

  TokenEmbedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  LayerNorm ln_f{nullptr};

 private:
  // (B, T) -> (B, T, C) after ln_f, f32; with a cache, the positions after its own (no segments).
  torch::Tensor hidden(const torch::Tensor& idx, const torch::Tensor& segments, KvCache* cache = nullptr);
};
TORCH_MODULE(GPT);

}  // namespace lt
