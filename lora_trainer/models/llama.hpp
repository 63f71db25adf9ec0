// The llama family (Hugging Face's LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM): token
// embedding, pre-norm decoder layers (RMSNorm; attention with rotary positions and grouped-query
// key/value heads; a gated MLP), a final RMSNorm and an output head, tied to the embedding or not.
//
// Shapes: C = d_model, H = n_head, KV = n_kv_head (divides H), D = C / H, F = d_ff, V = vocab_size.
// Parameter names are Hugging Face's, so PEFT's target_modules (q_proj, v_proj, ...) work unchanged:
//   model.embed_tokens.weight (V, C)
//   model.layers.<i>.input_layernorm.weight (C)
//   model.layers.<i>.self_attn.q_proj.{weight (H D, C), bias (H D) with qkv_bias}
//   model.layers.<i>.self_attn.k_proj.{weight (KV D, C), bias (KV D) with qkv_bias}
//   model.layers.<i>.self_attn.v_proj.{weight (KV D, C), bias (KV D) with qkv_bias}
//   model.layers.<i>.self_attn.o_proj.weight (C, H D)
//   model.layers.<i>.post_attention_layernorm.weight (C)
//   model.layers.<i>.mlp.{gate_proj,up_proj}.weight (F, C)   model.layers.<i>.mlp.down_proj.weight (C, F)
//   model.norm.weight (C)
//   lm_head.weight (V, C)   only when tie_embeddings is false
// Layer i computes h = x + o_proj(attn(rope(q), rope(k), v)) on input_layernorm(x), then
// h + down_proj(act(gate_proj(n)) * up_proj(n)) with n = post_attention_layernorm(h); key/value head j
// serves query heads j*H/KV .. (j+1)*H/KV - 1. The residual stream is f32.
#pragma once

#include <torch/torch.h>

#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const ModelOptions& o);
  // (B, T, C) -> (B, T, C); mask: SequenceLayout::mask (layers.hpp). With a cache (generation: no mask),
  // the T positions follow the cache's and attend to them too (kv_cache.hpp).
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& mask = {},
                        KvCache* cache = nullptr);
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  ModelOptions opts_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const ModelOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  ModelOptions::Activation act_;
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const ModelOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& mask = {},
                        KvCache* cache = nullptr);
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(LlamaDecoderLayer);

// HF's `model.` (LlamaModel): everything but the head.
class LlamaBodyImpl : public torch::nn::Module {
 public:
  explicit LlamaBodyImpl(const ModelOptions& o);
  TokenEmbedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

class LlamaImpl : public CausalLMImpl {
 public:
  explicit LlamaImpl(const ModelOptions& o);
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& segments = {}) override;
  torch::Tensor loss_sum(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments = {}) override;
  torch::Tensor forward_cached(const torch::Tensor& idx, KvCache& cache) override;
  // HF's initialisation: normal(0, 0.02) for every matrix, zero biases, unit norms.
  void init_weights(torch::Generator gen) override;
  bool is_lookup(const std::string& name) const override;
  int64_t block_of(const std::string& name) const override { return block_number(name, "model.layers."); }

  LlamaBody model{nullptr};
  Linear lm_head{nullptr};  // null when tied to model.embed_tokens

 private:
  // (B, T) -> (B, T, C) after the final norm, f32; with a cache, the positions after its own (no segments).
  torch::Tensor hidden(const torch::Tensor& idx, const torch::Tensor& segments, KvCache* cache = nullptr);
  torch::Tensor logits(const torch::Tensor& x, bool padded);
};
TORCH_MODULE(Llama);

}  // namespace lt
