#include "lora_trainer/model.hpp"

#include <cmath>

#include "lora_trainer/config.hpp"
#include "lora_trainer/cross_entropy.hpp"
#include "lora_trainer/torch_compat.hpp"
#include "lora_trainer/util.hpp"

namespace lt {

GPTOptions GPTOptions::from_config(const Config& cfg) {
  GPTOptions o;
  o.vocab_size = cfg.get_int("architecture/vocab_size");
  o.block_size = cfg.get_int("architecture/block_size");
  o.n_layer = cfg.get_int("architecture/n_layers");
  o.n_head = cfg.get_int("architecture/n_heads");
  o.d_model = cfg.get_int("architecture/d_model");
  o.dropout = cfg.get_double("architecture/dropout");
  o.gelu_tanh = cfg.get_string("architecture/activation") == "gelu_tanh";
  const std::string attention = cfg.get_string("runtime/attention");
  if (attention == "fused" && !fused_attention_available())
    throw UserError(std::string("runtime/attention=fused needs LibTorch 2.0 or newer (this build has ") +
                    compat::torch_version() + "); use runtime/attention=auto or manual");
  o.attention = attention == "fused"    ? GPTOptions::Attention::Fused
                : attention == "manual" ? GPTOptions::Attention::Manual
                                        : GPTOptions::Attention::Auto;
  if (o.d_model % o.n_head != 0)
    throw UserError("architecture/d_model (" + std::to_string(o.d_model) +
                    ") must be divisible by architecture/n_heads (" + std::to_string(o.n_head) + ")");
  return o;
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features) {
  weight = register_parameter("weight", torch::empty({out_features, in_features}));
  bias = register_parameter("bias", torch::zeros({out_features}));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  return lora_linear(x, weight, bias, lora_A_, lora_B_, lora_scale_);
}

void LinearImpl::set_lora(torch::Tensor A, torch::Tensor B, double scale) {
  lora_A_ = std::move(A);
  lora_B_ = std::move(B);
  lora_scale_ = scale;
}

LayerNormImpl::LayerNormImpl(int64_t dim) {
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  auto f = torch::kFloat32;
  return torch::layer_norm(x.to(f), {weight.size(0)}, weight.to(f), bias.to(f), 1e-5);
}

bool fused_attention_available() { return LT_HAS_SDPA; }

bool GPTOptions::fused_attention_on(const torch::Device& device) const {
  if (attention == Attention::Auto) return device.is_cuda() && fused_attention_available();
  return attention == Attention::Fused;
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double dropout, bool fused) {
#if LT_HAS_SDPA
  if (fused) return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout, /*is_causal=*/true);
#else
  TORCH_CHECK(!fused, "fused attention needs LibTorch 2.0 or newer");
#endif
  const int64_t T = q.size(-2), D = q.size(-1);
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));  // (B,H,T,T)
  auto causal = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  att = att.masked_fill(causal, -std::numeric_limits<float>::infinity());
  att = torch::softmax(att.to(torch::kFloat32), -1).to(v.scalar_type());  // softmax in f32
  if (dropout > 0) att = torch::dropout(att, dropout, true);
  return torch::matmul(att, v);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTOptions& o)
    : n_head_(o.n_head), dropout_(o.dropout), opts_(o) {
  c_attn = register_module("c_attn", Linear(o.d_model, 3 * o.d_model));
  c_proj = register_module("c_proj", Linear(o.d_model, o.d_model));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = n_head_, D = C / H;
  auto qkv = c_attn(x).view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4});  // (3, B, H, T, D)
  auto y = causal_attention(qkv[0], qkv[1], qkv[2], is_training() ? dropout_ : 0.0,
                            opts_.fused_attention_on(x.device()));  // (B, H, T, D)
  return c_proj(y.transpose(1, 2).reshape({B, T, C}));
}

MLPImpl::MLPImpl(const GPTOptions& o) : gelu_tanh_(o.gelu_tanh) {
  c_fc = register_module("c_fc", Linear(o.d_model, 4 * o.d_model));
  c_proj = register_module("c_proj", Linear(4 * o.d_model, o.d_model));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // The exact (erf) GELU by default: LibTorch 1.13 vectorises it for bf16 and not the tanh approximation,
  // which measured 7x slower (docs/performance.md). GPT-2's own weights (imported from Hugging Face)
  // were trained with the tanh approximation (architecture/activation=gelu_tanh).
  return c_proj(torch::gelu(c_fc(x), gelu_tanh_ ? "tanh" : "none"));
}

BlockImpl::BlockImpl(const GPTOptions& o) : dropout(o.dropout) {
  ln_1 = register_module("ln_1", LayerNorm(o.d_model));
  attn = register_module("attn", CausalSelfAttention(o));
  ln_2 = register_module("ln_2", LayerNorm(o.d_model));
  mlp = register_module("mlp", MLP(o));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  auto a = attn(ln_1(x)).to(torch::kFloat32);
  if (dropout > 0 && is_training()) a = torch::dropout(a, dropout, true);
  auto y = x + a;
  auto m = mlp(ln_2(y)).to(torch::kFloat32);
  if (dropout > 0 && is_training()) m = torch::dropout(m, dropout, true);
  return y + m;
}

GPTImpl::GPTImpl(const GPTOptions& o) : opts_(o) {
  wte = register_module("wte", torch::nn::Embedding(o.vocab_size, o.d_model));
  wpe = register_module("wpe", torch::nn::Embedding(o.block_size, o.d_model));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layer; ++i) h->push_back(Block(o));
  ln_f = register_module("ln_f", LayerNorm(o.d_model));
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

torch::Tensor GPTImpl::hidden(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  TORCH_CHECK(T <= opts_.block_size, "sequence length ", T, " exceeds architecture/block_size ",
              opts_.block_size);
  auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
  auto x = (wte(idx).to(torch::kFloat32) + wpe(pos).to(torch::kFloat32));  // (B, T, C)
  if (opts_.dropout > 0 && is_training()) x = torch::dropout(x, opts_.dropout, true);
  for (auto& block : *h) x = block->as<Block>()->forward(x);
  return ln_f(x);
}

// The tied head. cuBLAS multiplies fast only when each row of the (N, V) output starts 16-byte
// aligned; with GPT-2's V = 50,257 it fell back to old sm75 kernels, which took a third of a training
// step on an H100 (docs/performance.md). On CUDA the head therefore runs over V rounded up to a
// multiple of 64, the extra columns held at -inf by a bias so that softmax gives them no weight and
// no gradient; `padded` keeps them (for the loss), else the V real columns are returned.
torch::Tensor GPTImpl::head(const torch::Tensor& x, bool padded) {
  const auto& W = wte->weight;
  const int64_t V = W.size(0);
  if (!x.is_cuda() || V % 64 == 0) return torch::linear(x, weight_for(W, x));
  const int64_t Vp = (V + 63) / 64 * 64;
  auto Wp = torch::cat({W, torch::zeros({Vp - V, W.size(1)}, W.options().requires_grad(false))});
  auto bias = torch::zeros({Vp}, x.options().dtype(torch::kFloat32));
  bias.slice(0, V).fill_(-std::numeric_limits<float>::infinity());
  auto logits = torch::linear(x, weight_for(Wp, x), weight_for(bias, x));  // (B, T, Vp)
  return padded ? logits : logits.slice(-1, 0, V);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  return head(hidden(idx), /*padded=*/false);  // (B, T, V)
}

torch::Tensor GPTImpl::loss_sum(const torch::Tensor& idx, const torch::Tensor& targets) {
  auto logits = head(hidden(idx), /*padded=*/true);  // (B, T, V or padded V), bf16 under autocast
  return cross_entropy_sum(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

int64_t count_targets(const torch::Tensor& targets) { return targets.ge(0).sum().item<int64_t>(); }

NamedTensors named_params(torch::nn::Module& m) {
  NamedTensors out;
  for (auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

}  // namespace lt
