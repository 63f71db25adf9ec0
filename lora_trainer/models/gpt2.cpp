#include "lora_trainer/models/gpt2.hpp"

#include <cmath>

#include "lora_trainer/models/activation_checkpointing.hpp"
#include "lora_trainer/kernels/cross_entropy.hpp"
#include "lora_trainer/kernels/head_loss.hpp"

namespace lt {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const ModelOptions& o) : opts_(o) {
  c_attn = register_module("c_attn", Linear(o.d_model, 3 * o.d_model));
  c_proj = register_module("c_proj", Linear(o.d_model, o.d_model));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& mask, KvCache* cache) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = opts_.n_head, D = C / H;
  // q, k and v as views of c_attn's output, split along its last dimension: the backward joins their
  // gradients with one concatenation, where selecting from a (3, B, H, T, D) view filled a zero array
  // of the whole output for each of the three and summed them.
  const auto qkv = c_attn(x).split(C, /*dim=*/-1);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };  // (B, H, T, D)
  if (cache) {
    const auto [k, v] = cache->append(heads(qkv[1]), heads(qkv[2]));
    return c_proj(cached_attention(heads(qkv[0]), k, v, opts_.fused_attention_on(x.device())).transpose(1, 2).reshape({B, T, C}));
  }
  auto y = causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), is_training() ? opts_.dropout : 0.0,
                            opts_.fused_attention_on(x.device()), mask);  // (B, H, T, D)
  return c_proj(y.transpose(1, 2).reshape({B, T, C}));
}

MLPImpl::MLPImpl(const ModelOptions& o) : gelu_tanh_(o.activation == ModelOptions::Activation::GeluTanh) {
  c_fc = register_module("c_fc", Linear(o.d_model, o.ff()));
  c_proj = register_module("c_proj", Linear(o.ff(), o.d_model));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // The exact (erf) GELU by default: LibTorch 1.13 vectorises it for bf16 and not the tanh approximation,
  // which measured 7x slower (docs/performance.md). GPT-2's own weights (imported from Hugging Face)
  // were trained with the tanh approximation (architecture/activation=gelu_tanh).
  return c_proj(torch::gelu(c_fc(x), gelu_tanh_ ? "tanh" : "none"));
}

BlockImpl::BlockImpl(const ModelOptions& o) : dropout(o.dropout) {
  ln_1 = register_module("ln_1", LayerNorm(o.d_model, o.norm_eps));
  attn = register_module("attn", CausalSelfAttention(o));
  ln_2 = register_module("ln_2", LayerNorm(o.d_model, o.norm_eps));
  mlp = register_module("mlp", MLP(o));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& mask, KvCache* cache) {
  // The residual stream x is f32; the sublayers' outputs are bf16 under autocast, and x + a reads
  // them as they are (the same sum as converting them first, without the extra pass over memory).
  auto a = attn(ln_1(x), mask, cache);
  if (dropout > 0 && is_training()) a = torch::dropout(a.to(torch::kFloat32), dropout, true);
  auto y = x + a;
  auto m = mlp(ln_2(y));
  if (dropout > 0 && is_training()) m = torch::dropout(m.to(torch::kFloat32), dropout, true);
  return y + m;
}

GPTImpl::GPTImpl(const ModelOptions& o) : CausalLMImpl(o) {
  wte = register_module("wte", TokenEmbedding(o.vocab_size, o.d_model));
  // The tied head's weight is the embedding's, so its gradient is the head's dense (V, C) one plus the
  // looked-up rows'. With a sparse lookup gradient (the rows alone) autograd adds those rows into the
  // head's in place; a dense one was a zeroed (V, C) array, its rows added, then added whole to the
  // head's (about 2.5% of a bench_block256 phase-1 step). The sum the weight receives is dense. On the
  // CPU only (TokenEmbeddingImpl::forward).
  wte->options.sparse(true);
  wpe = register_module("wpe", torch::nn::Embedding(o.block_size, o.d_model));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) h->push_back(Block(o));
  ln_f = register_module("ln_f", LayerNorm(o.d_model, o.norm_eps));
}

void GPTImpl::init_weights(torch::Generator gen) {
  torch::NoGradGuard ng;
  const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(opts_.n_layer));
  for (auto& p : named_parameters()) {
    const std::string& name = p.key();
    auto& t = p.value();
    if (name.find("ln_") != std::string::npos) {
      t.fill_(name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? 1.0 : 0.0);
    } else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      t.zero_();
    } else if (name.find("c_proj.weight") != std::string::npos) {
      t.normal_(0.0, resid_std, gen);
    } else {
      t.normal_(0.0, 0.02, gen);
    }
  }
}

torch::Tensor GPTImpl::hidden(const torch::Tensor& idx, const torch::Tensor& segments, KvCache* cache) {
  const int64_t T = idx.size(1), start = cache ? cache->length() : 0;
  TORCH_CHECK(start + T <= opts_.block_size, "sequence length ", start + T, " exceeds architecture/block_size ",
              opts_.block_size);
  const SequenceLayout layout(segments, T, idx.device());
  auto x = (wte(idx).to(torch::kFloat32) + wpe(start ? layout.positions + start : layout.positions).to(torch::kFloat32));  // (B, T, C)
  if (opts_.dropout > 0 && is_training()) x = torch::dropout(x, opts_.dropout, true);
  for (size_t i = 0; i < h->size(); ++i) {
    const auto block = h->ptr(i);
    auto forward = [block, mask = layout.mask, cache](const torch::Tensor& in) {
      return block->as<Block>()->forward(in, mask, cache);
    };
    x = checkpointed(opts_.activation_checkpointing && !cache, *block, forward, x, block_shard(i));
  }
  if (cache) cache->advance(T);
  return ln_f(x);
}

torch::Tensor GPTImpl::forward_cached(const torch::Tensor& idx, KvCache& cache) {
  auto x = hidden(idx, {}, &cache).select(1, -1);  // (B, C): the last new position
  return output_logits(x, wte->output_weight(x), /*padded=*/false);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, const torch::Tensor& segments) {
  auto x = hidden(idx, segments);
  return output_logits(x, wte->output_weight(x), /*padded=*/false);  // (B, T, V)
}

torch::Tensor GPTImpl::loss_sum(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments) {
  // (B * T, C): the head then makes (B * T, V or padded V) logits (bf16 under autocast) that are no view,
  // so the loss may write its gradient over them.
  auto x = hidden(idx, segments).flatten(0, 1);
  auto W = wte->output_weight(x);
  if (opts_.chunked_loss_on(idx.device()) && chunked_head_loss_applies(W))  // a frozen head: no logits whole
    return chunked_head_loss_sum(x, W, targets.reshape({-1}), product_dtype(x));
  auto logits = output_logits(x, W, /*padded=*/true);
  return cross_entropy_sum(logits, targets.reshape({-1}), opts_.fused_loss_on(idx.device()), /*overwrite_logits=*/true);
}

}  // namespace lt
