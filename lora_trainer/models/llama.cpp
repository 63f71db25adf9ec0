#include "lora_trainer/models/llama.hpp"

#include "lora_trainer/models/activation_checkpointing.hpp"
#include "lora_trainer/kernels/cross_entropy.hpp"
#include "lora_trainer/kernels/head_loss.hpp"

namespace lt {

LlamaAttentionImpl::LlamaAttentionImpl(const ModelOptions& o) : opts_(o) {
  const int64_t D = o.head_dim();
  q_proj = register_module("q_proj", Linear(o.d_model, o.n_head * D, o.qkv_bias));
  k_proj = register_module("k_proj", Linear(o.d_model, o.kv_heads() * D, o.qkv_bias));
  v_proj = register_module("v_proj", Linear(o.d_model, o.kv_heads() * D, o.qkv_bias));
  o_proj = register_module("o_proj", Linear(o.n_head * D, o.d_model, /*with_bias=*/false));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& mask,
                                          KvCache* cache) {
  const int64_t B = x.size(0), T = x.size(1), H = opts_.n_head, KV = opts_.kv_heads(), D = opts_.head_dim();
  // The three adapters' A matrices read x in one product.
  const auto qkv = linear_shared_input(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  auto v = qkv[2].view({B, T, KV, D}).transpose(1, 2);  // (B, KV, T, D)
  auto q = apply_rope(qkv[0].view({B, T, H, D}).transpose(1, 2), rope).to(v.scalar_type());
  auto k = apply_rope(qkv[1].view({B, T, KV, D}).transpose(1, 2), rope).to(v.scalar_type());
  if (cache) std::tie(k, v) = cache->append(k, v);  // the cache keeps the KV heads, not their copies
  if (KV != H) {  // each key/value head serves H / KV consecutive query heads
    k = k.repeat_interleave(H / KV, /*dim=*/1);
    v = v.repeat_interleave(H / KV, /*dim=*/1);
  }
  const bool fused = opts_.fused_attention_on(x.device());
  auto y = cache ? cached_attention(q, k, v, fused) : causal_attention(q, k, v, is_training() ? opts_.dropout : 0.0, fused, mask);
  return o_proj(y.transpose(1, 2).reshape({B, T, H * D}));
}

LlamaMLPImpl::LlamaMLPImpl(const ModelOptions& o) : act_(o.activation) {
  gate_proj = register_module("gate_proj", Linear(o.d_model, o.ff(), /*with_bias=*/false));
  up_proj = register_module("up_proj", Linear(o.d_model, o.ff(), /*with_bias=*/false));
  down_proj = register_module("down_proj", Linear(o.ff(), o.d_model, /*with_bias=*/false));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  const auto gate_up = linear_shared_input(x, {gate_proj.get(), up_proj.get()});  // one product for both A's
  auto g = gate_up[0];
  g = act_ == ModelOptions::Activation::Silu ? torch::silu(g)
                                              : torch::gelu(g, act_ == ModelOptions::Activation::GeluTanh ? "tanh" : "none");
  return down_proj(g * gate_up[1]);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const ModelOptions& o) : dropout_(o.dropout) {
  input_layernorm = register_module("input_layernorm", RMSNorm(o.d_model, o.norm_eps));
  self_attn = register_module("self_attn", LlamaAttention(o));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(o.d_model, o.norm_eps));
  mlp = register_module("mlp", LlamaMLP(o));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& mask,
                                             KvCache* cache) {
  // x + a reads the bf16 sublayer outputs as they are (as in gpt2.cpp's BlockImpl::forward).
  auto a = self_attn(input_layernorm(x), rope, mask, cache);
  if (dropout_ > 0 && is_training()) a = torch::dropout(a.to(torch::kFloat32), dropout_, true);
  auto h = x + a;
  auto m = mlp(post_attention_layernorm(h));
  if (dropout_ > 0 && is_training()) m = torch::dropout(m.to(torch::kFloat32), dropout_, true);
  return h + m;
}

LlamaBodyImpl::LlamaBodyImpl(const ModelOptions& o) {
  embed_tokens = register_module("embed_tokens", TokenEmbedding(o.vocab_size, o.d_model));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) layers->push_back(LlamaDecoderLayer(o));
  norm = register_module("norm", RMSNorm(o.d_model, o.norm_eps));
}

LlamaImpl::LlamaImpl(const ModelOptions& o) : CausalLMImpl(o) {
  model = register_module("model", LlamaBody(o));
  if (!o.tie_embeddings) lm_head = register_module("lm_head", Linear(o.d_model, o.vocab_size, /*with_bias=*/false));
  // Tied: the lookup's gradient as rows, added into the head's dense one (GPTImpl's wte, gpt2.cpp).
  // Untied, the embedding's gradient reaches its weight alone and must be dense.
  model->embed_tokens->options.sparse(o.tie_embeddings);
}

void LlamaImpl::init_weights(torch::Generator gen) {
  torch::NoGradGuard ng;
  for (auto& p : named_parameters()) {
    const std::string& name = p.key();
    auto& t = p.value();
    if (name.find("norm.") != std::string::npos) {
      t.fill_(1.0);
    } else if (t.dim() == 1) {
      t.zero_();
    } else {
      t.normal_(0.0, 0.02, gen);
    }
  }
}

bool LlamaImpl::is_lookup(const std::string& name) const {
  return !opts_.tie_embeddings && name == "model.embed_tokens.weight";
}

torch::Tensor LlamaImpl::hidden(const torch::Tensor& idx, const torch::Tensor& segments, KvCache* cache) {
  const int64_t T = idx.size(1), start = cache ? cache->length() : 0;
  TORCH_CHECK(start + T <= opts_.block_size, "sequence length ", start + T, " exceeds architecture/block_size ", opts_.block_size);
  const SequenceLayout layout(segments, T, idx.device());
  const RopeTables rope = rope_tables(start ? layout.positions + start : layout.positions, opts_.head_dim(), opts_.rope_theta, opts_.rope_scaling);
  auto x = model->embed_tokens(idx).to(torch::kFloat32);  // (B, T, C)
  if (opts_.dropout > 0 && is_training()) x = torch::dropout(x, opts_.dropout, true);
  for (size_t i = 0; i < model->layers->size(); ++i) {
    const auto layer = model->layers->ptr(i);
    auto forward = [layer, rope, mask = layout.mask, cache](const torch::Tensor& in) {
      return layer->as<LlamaDecoderLayer>()->forward(in, rope, mask, cache);
    };
    x = checkpointed(opts_.activation_checkpointing && !cache, *layer, forward, x, block_shard(i));
  }
  if (cache) cache->advance(T);
  return model->norm(x);
}

// A tied head takes output_logits' CUDA padding; an untied one is a Linear (it can carry an adapter).
torch::Tensor LlamaImpl::logits(const torch::Tensor& x, bool padded) {
  return lm_head ? lm_head(x) : output_logits(x, model->embed_tokens->output_weight(x), padded);
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx, const torch::Tensor& segments) {
  return logits(hidden(idx, segments), /*padded=*/false);
}

torch::Tensor LlamaImpl::forward_cached(const torch::Tensor& idx, KvCache& cache) {
  return logits(hidden(idx, {}, &cache).select(1, -1), /*padded=*/false);  // (B, V): the last new position
}

torch::Tensor LlamaImpl::loss_sum(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments) {
  // (B * T, C) in, so the logits are no view and the loss may write its gradient over them (gpt2.cpp).
  auto x = hidden(idx, segments).flatten(0, 1);
  if (opts_.chunked_loss_on(idx.device())) {  // a frozen head without an adapter: no logits whole
    auto W = lm_head ? lm_head->plain_weight(x) : model->embed_tokens->output_weight(x);
    if (W.defined() && chunked_head_loss_applies(W)) return chunked_head_loss_sum(x, W, targets.reshape({-1}), product_dtype(x));
  }
  auto z = logits(x, /*padded=*/true);
  return cross_entropy_sum(z, targets.reshape({-1}), opts_.fused_loss_on(idx.device()), /*overwrite_logits=*/true);
}

}  // namespace lt
