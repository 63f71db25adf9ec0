#include "lora_trainer/models/layers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/kernels/batched_matmul.hpp"
#include "lora_trainer/kernels/causal_softmax.hpp"

namespace lt {

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  weight = register_parameter("weight", torch::empty({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({out_features}));
  // The adapter's places, empty until set_lora fills them.
  for (const char* name : {"lora_A", "lora_B", "lora_magnitude"}) register_parameter(name, torch::Tensor(), false);
}

torch::Tensor LinearImpl::base_weight(const torch::Tensor& x) const {
  return frozen_ ? frozen_->for_matmul(x) : weight_for(weight, x);
}

torch::Tensor LinearImpl::plain_weight(const torch::Tensor& x) const {
  if (bias.defined() || (lora_on_ && lora_A().defined())) return {};
  return frozen_ ? frozen_->for_matmul(x) : weight;
}

torch::Tensor LinearImpl::base_forward(const torch::Tensor& x) const {
  return frozen_ ? frozen_->linear(x, bias) : lora_linear(x, base_weight(x), bias, {}, {}, 0.0);
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (!lora_on_ || !lora_A().defined()) return base_forward(x);
  if (merges_adapter(x)) return frozen_->linear_with_adapter(x, bias, lora_A(), lora_B(), lora_scale_);
  if (!lora_magnitude().defined()) return add_lora(x, base_forward(x), lora_A(), lora_B(), lora_scale_);
  // DoRA needs W itself
  return lora_linear(x, base_weight(x), bias, lora_A(), lora_B(), lora_scale_, lora_magnitude());
}

namespace {

// Whether merging a rank-r adapter into the cast (frozen_lora_linear) does less arithmetic than adding it
// beside (add_lora) for `rows` rows of x through an (out, in) weight: the merge forms s (A B)^T twice (the
// forward, x's gradient), 4 r in out operations; beside, the rank-r products over the rows take 2 rows r
// (in + out) more than the merge's A and B gradients. So it merges when rows (in + out) >= 2 in out: a
// micro-batch of 1,024 rows through GPT-2-small-sized layers merges; 256 rows through a 2,048 x 8,192 MLP
// matrix (a 1B Llama at batch 1) would spend about 5x the adapter's products beside it on the merge.
bool merge_pays(int64_t rows, int64_t in, int64_t out) { return rows * (in + out) >= 2 * in * out; }

}  // namespace

bool LinearImpl::merges_adapter(const torch::Tensor& x) const {
  if (!plain_lora() || !frozen_ || !frozen_->merges_lora(x, bias)) return false;
  const std::vector<int64_t> shape = frozen_->shape();  // (out, in)
  return merge_pays(x.numel() / std::max<int64_t>(1, x.size(-1)), shape[1], shape[0]);
}

std::vector<torch::Tensor> linear_shared_input(const torch::Tensor& x, const std::vector<LinearImpl*>& layers) {
  std::vector<torch::Tensor> ys, A(layers.size()), B(layers.size());
  std::vector<double> scales(layers.size(), 0.0);
  for (size_t i = 0; i < layers.size(); ++i) {
    LinearImpl& l = *layers[i];
    if (!l.plain_lora() || l.merges_adapter(x)) {
      ys.push_back(l.forward(x));
      continue;
    }
    ys.push_back(l.base_forward(x));
    A[i] = l.lora_A();
    B[i] = l.lora_B();
    scales[i] = l.lora_scale_;
  }
  return add_lora_shared_input(x, std::move(ys), A, B, scales);
}

void LinearImpl::set_lora(torch::Tensor A, torch::Tensor B, double scale, torch::Tensor magnitude) {
  const bool on = A.defined();
  parameters_["lora_A"] = std::move(A);
  parameters_["lora_B"] = on ? std::move(B) : torch::Tensor();
  parameters_["lora_magnitude"] = on ? std::move(magnitude) : torch::Tensor();
  lora_scale_ = scale;
}

void LinearImpl::freeze_weight(FrozenFormat format) {
  if (frozen_ && frozen_->format() == format) return;
  TORCH_CHECK(!frozen_ || (frozen_->format() == FrozenFormat::Bf16 && !frozen_->sharded()), "freeze_weight: a weight stored as ",
              to_string(frozen_->format()), frozen_->sharded() ? " (sharded)" : "", " cannot be stored as ", to_string(format),
              " (its values are gone)");
  frozen_ = lt::freeze_weight(weight, format);
}

TokenEmbeddingImpl::TokenEmbeddingImpl(int64_t num_embeddings, int64_t dim)
    : torch::nn::EmbeddingImpl(num_embeddings, dim) {
  register_parameter("trainable_tokens_delta", torch::Tensor(), false);  // empty until set_token_rows
}

torch::Tensor TokenEmbeddingImpl::forward(const torch::Tensor& idx) {
  // options.sparse (a tied head, gpt2.cpp) on the CPU only, where it was measured: on CUDA the dense
  // lookup gradient keeps the bits verified there (resume, ranks) and a sparse one would be added into
  // the head's by another kernel, not checked on a GPU. (No max_norm: these options never set it.)
  auto e = torch::embedding(weight, idx, options.padding_idx().value_or(-1), options.scale_grad_by_freq(),
                            options.sparse() && !idx.is_cuda());
  if (!values().defined() || !rows_on_) return e;
  auto slot = slot_.index_select(0, idx.reshape({-1})).view(idx.sizes());
  // A lookup, not index_select: index_select's backward adds the rows of a repeated id with atomics on
  // CUDA, in an order that changes from run to run (no bit-identical resume); the embedding's backward
  // sums them in a fixed order on both devices.
  auto rows = torch::embedding(values(), slot.clamp_min(0));
  return torch::where((slot >= 0).unsqueeze(-1), rows, e.to(torch::kFloat32));
}

torch::Tensor TokenEmbeddingImpl::output_weight(const torch::Tensor& x) {
  if (!values().defined() || !rows_on_) return weight;
  auto W = weight_for(weight, x);
  return W.index_copy(0, ids_, values().to(W.dtype()));
}

void TokenEmbeddingImpl::set_token_rows(torch::Tensor ids, torch::Tensor values) {
  ids_ = std::move(ids);
  parameters_["trainable_tokens_delta"] = ids_.defined() ? std::move(values) : torch::Tensor();
  slot_ = torch::Tensor();
  if (!ids_.defined()) return;
  slot_ = torch::full({weight.size(0)}, -1, ids_.options());
  slot_.index_copy_(0, ids_, torch::arange(ids_.size(0), ids_.options()));
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  auto f = torch::kFloat32;
  return torch::layer_norm(x.to(f), {weight.size(0)}, weight.to(f), bias.to(f), eps_);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  auto xf = x.to(torch::kFloat32);
  return xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight.to(torch::kFloat32);
}

bool fused_attention_available() { return LT_HAS_SDPA; }

SequenceLayout::SequenceLayout(const torch::Tensor& segments, int64_t T, const torch::Device& device) {
  auto t = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(device));
  if (!segments.defined()) {
    positions = t;
    return;
  }
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == T, "segments must be (B, ", T, "), got ", segments.sizes());
  auto seg = segments.to(device, torch::kLong);
  // An example starts where the segment number changes; each position's distance from its start.
  auto starts = torch::cat({torch::ones({seg.size(0), 1}, seg.options().dtype(torch::kBool)),
                            seg.slice(1, 1).ne(seg.slice(1, 0, T - 1))}, 1);
  auto first = std::get<0>(torch::cummax(torch::where(starts, t.expand_as(seg), torch::zeros_like(seg)), 1));
  positions = t - first;
  auto causal = torch::ones({T, T}, seg.options().dtype(torch::kBool)).tril();
  mask = seg.unsqueeze(2).eq(seg.unsqueeze(1)).logical_and(causal).unsqueeze(1);  // (B, 1, T, T)
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double dropout, bool fused, const torch::Tensor& mask) {
#if LT_HAS_SDPA
  if (fused) {
    if (mask.defined()) return at::scaled_dot_product_attention(q, k, v, mask, dropout, /*is_causal=*/false);
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout, /*is_causal=*/true);
  }
#else
  TORCH_CHECK(!fused, "fused attention needs LibTorch 2.0 or newer");
#endif
  const int64_t T = q.size(-2), D = q.size(-1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // f32 on the CPU: the stack of products split across threads, q, k and v read in place, the blocks
  // above the diagonal skipped (kernels/batched_matmul.hpp). A mask (SequenceLayout's) hides at least
  // what the causal mask hides, so the weights are 0 above the diagonal either way.
  const bool square = k.size(-2) == T;
  auto product = [square](const torch::Tensor& a, const torch::Tensor& b, CausalPart part) {
    return batched_matmul_supported(a, b) ? batched_matmul(a, b, square ? part : CausalPart::None) : torch::matmul(a, b);
  };
  auto scores = product(q, k.transpose(-2, -1), CausalPart::Scores);  // (B,H,T,T)
  if (causal_softmax_supported(scores, mask, v.scalar_type())) {  // the CPU: one pass each way (kernels/causal_softmax.hpp)
    auto att = causal_softmax(scores, scale, mask, v.scalar_type());
    if (dropout > 0) att = torch::dropout(att, dropout, true);
    return product(att, v, CausalPart::Weights);
  }
  auto att = scores * scale;
  auto hidden = mask.defined() ? mask.logical_not()
                               : torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  att = att.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  att = torch::softmax(att.to(torch::kFloat32), -1).to(v.scalar_type());  // softmax in f32
  if (dropout > 0) att = torch::dropout(att, dropout, true);
  return torch::matmul(att, v);
}

torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool fused) {
  const int64_t t = q.size(-2), offset = k.size(-2) - t;
  TORCH_CHECK(offset >= 0, "cached_attention: ", t, " queries over ", k.size(-2), " keys");
  if (offset == 0) return causal_attention(q, k, v, 0.0, fused);
  torch::Tensor hidden;  // true where query i may not see key j: j > offset + i (none for one query)
  if (t > 1) {
    auto opts = torch::TensorOptions().dtype(torch::kLong).device(q.device());
    hidden = torch::arange(k.size(-2), opts).unsqueeze(0).gt(torch::arange(offset, offset + t, opts).unsqueeze(1));
  }
#if LT_HAS_SDPA
  if (fused) {  // its mask: true where a query may attend; none for one query (an undefined tensor is refused)
    if (hidden.defined()) return at::scaled_dot_product_attention(q, k, v, hidden.logical_not(), 0.0, /*is_causal=*/false);
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, 0.0, /*is_causal=*/false);
  }
#endif
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  if (hidden.defined()) att = att.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  att = torch::softmax(att.to(torch::kFloat32), -1).to(v.scalar_type());  // softmax in f32, as causal_attention's
  return torch::matmul(att, v);
}

torch::Tensor rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& s, const torch::Device& device) {
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, head_dim, 2, f32) / static_cast<double>(head_dim));
  switch (s.kind) {
    case RopeScaling::Kind::None: return inv_freq;
    case RopeScaling::Kind::Linear: return inv_freq / s.factor;
    case RopeScaling::Kind::Llama3: {
      const double L = static_cast<double>(s.original_context);
      const double low_wavelen = L / s.low_freq_factor, high_wavelen = L / s.high_freq_factor;
      auto wavelen = 2.0 * M_PI / inv_freq;
      auto scaled = torch::where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq);
      auto smooth = (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
      auto medium = wavelen.ge(high_wavelen).logical_and(wavelen.le(low_wavelen));
      return torch::where(medium, smoothed, scaled);
    }
  }
  return inv_freq;
}

RopeTables rope_tables(const torch::Tensor& positions, int64_t head_dim, double theta, const RopeScaling& scaling) {
  auto inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device());
  auto angles = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq;  // (..., T, D/2)
  auto emb = torch::cat({angles, angles}, -1);                          // (..., T, D)
  if (emb.dim() == 3) emb = emb.unsqueeze(1);                           // packed rows: (B, 1, T, D), over the heads
  return {emb.cos(), emb.sin()};
}

torch::Tensor apply_rope(const torch::Tensor& x, const RopeTables& rope) {
  auto xf = x.to(torch::kFloat32);
  const int64_t half = xf.size(-1) / 2;
  auto rotated = torch::cat({-xf.slice(-1, half), xf.slice(-1, 0, half)}, -1);
  return xf * rope.cos + rotated * rope.sin;
}

namespace {

// The rows of W per product of the trained head's weight gradient (TrainedHeadFn).
constexpr int64_t kHeadGradRows = 8192;

// x W^T for a head W that trains, in bf16 on the CPU. Autograd's own backward forms W's gradient
// g^T x as one (V, N) x (N, C) product, which oneDNN runs at about 260 GFLOP/s on a Zen 4 for GPT-2's
// V against about 330 in blocks of 8192 rows of W (docs/performance.md); this backward takes those
// blocks, each row's sum over the N rows of x the same product. x's gradient is g W as before.
struct TrainedHeadFn : public torch::autograd::Function<TrainedHeadFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& W) {
    ctx->save_for_backward({x, W});
    return torch::matmul(x, W.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& W = saved[1];
    const int64_t V = W.size(0), C = W.size(1);
    const torch::Tensor g = grad[0].to(W.scalar_type());
    const auto g2 = g.reshape({-1, V}), x2 = x.reshape({-1, C});
    auto dW = torch::empty_like(W);
    for (int64_t b = 0; b < V; b += kHeadGradRows) {
      const int64_t n = std::min(kHeadGradRows, V - b);
      auto rows = dW.narrow(0, b, n);  // contiguous: whole rows
      torch::mm_out(rows, g2.narrow(1, b, n).t(), x2);
    }
    return {torch::matmul(g, W), dW};
  }
};

}  // namespace

torch::ScalarType product_dtype(const torch::Tensor& x) {
  const auto type = x.device().type();
  return compat::autocast_enabled(type) ? compat::autocast_dtype(type) : x.scalar_type();
}

torch::Tensor output_logits(const torch::Tensor& x, const torch::Tensor& W, bool padded) {
  const int64_t V = W.size(0);
  if (!x.is_cuda() && V > kHeadGradRows && W.requires_grad() && torch::GradMode::is_enabled() &&
      compat::autocast_enabled(c10::DeviceType::CPU)) {
    // Cast as autocast's linear casts them (its cache included): the graph's casts are autocast's.
    const auto bf16 = compat::autocast_dtype(c10::DeviceType::CPU);
    if (bf16 == torch::kBFloat16)
      return TrainedHeadFn::apply(at::autocast::cached_cast(bf16, x, c10::DeviceType::CPU),
                                  at::autocast::cached_cast(bf16, W, c10::DeviceType::CPU));
  }
  if (!x.is_cuda() || V % 64 == 0) return frozen_linear(x, W);  // a frozen (tied) head: no f32 copy kept
  const int64_t Vp = (V + 63) / 64 * 64;
  auto Wp = torch::cat({W, torch::zeros({Vp - V, W.size(1)}, W.options().requires_grad(false))});
  auto bias = torch::zeros({Vp}, x.options().dtype(torch::kFloat32));
  bias.slice(0, V).fill_(-std::numeric_limits<float>::infinity());
  auto logits = torch::linear(x, weight_for(Wp, x), weight_for(bias, x));  // (B, T, Vp)
  return padded ? logits : logits.slice(-1, 0, V);
}

}  // namespace lt
