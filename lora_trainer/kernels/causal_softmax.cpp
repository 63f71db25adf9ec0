#include "lora_trainer/kernels/causal_softmax.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "lora_trainer/kernels/parallel.hpp"
#include "lora_trainer/kernels/vector_math.hpp"

namespace lt {

namespace {

using vec::elements;
using vec::exp_nonpositive;
using vec::from_f32;
using vec::to_f32;

// The first n keys visible (causal), the rest hidden: weights into out[0, T).
template <typename T, typename O>
LT_VECTOR_KERNEL void row_forward_prefix(const T* x, int64_t n, int64_t len, float scale, O* out) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, to_f32(x[j]) * scale);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += exp_nonpositive(to_f32(x[j]) * scale - m);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = from_f32<O>(exp_nonpositive(to_f32(x[j]) * scale - m) * inv);
  std::memset(out + n, 0, static_cast<size_t>(len - n) * sizeof(O));
}

// Keys visible where vis[j] is true.
template <typename T, typename O>
LT_VECTOR_KERNEL void row_forward_masked(const T* x, const uint8_t* vis, int64_t len, float scale, O* out) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float m = ninf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < len; ++j) m = std::max(m, vis[j] ? to_f32(x[j]) * scale : ninf);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < len; ++j) s += vis[j] ? exp_nonpositive(to_f32(x[j]) * scale - m) : 0.0f;
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) out[j] = from_f32<O>(vis[j] ? exp_nonpositive(to_f32(x[j]) * scale - m) * inv : 0.0f);
}

// dx = scale * p (dp - sum_j p_j dp_j) from the weights p the forward wrote (0 at hidden keys, so
// their gradient is 0 too); the first n keys only, 0 beyond (causal rows).
template <typename T, typename O>
LT_VECTOR_KERNEL void row_backward(const O* p, const O* dp, int64_t n, int64_t len, float scale, T* dx) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < n; ++j) dot += to_f32(p[j]) * to_f32(dp[j]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dx[j] = from_f32<T>(scale * to_f32(p[j]) * (to_f32(dp[j]) - dot));
  std::memset(dx + n, 0, static_cast<size_t>(len - n) * sizeof(T));
}

LT_VECTOR_DISPATCH(row_forward_prefix)
LT_VECTOR_DISPATCH(row_forward_masked)
LT_VECTOR_DISPATCH(row_backward)

// A mask row's visible keys as one run [first, first + count), where they are one (a packed example's
// keys always are): such a row takes the causal rows' kernels on that run, so that a row of one example
// gets exactly the bits of the unmasked causal row (the reductions' order depends on the loop's length).
struct Run {
  int64_t first, count;
  bool one;
};

Run visible_run(const uint8_t* vis, int64_t len) {
  int64_t a = 0;
  while (a < len && !vis[a]) ++a;
  int64_t b = a;
  while (b < len && vis[b]) ++b;
  int64_t c = b;
  while (c < len && !vis[c]) ++c;
  return {a, b - a, c == len};
}

// Calls f with a value of the element type of `t`: float, or uint16_t for bf16.
template <typename F>
void with_element_type(torch::ScalarType t, F&& f) {
  if (t == torch::kFloat32) f(float{});
  else f(uint16_t{});
}

// Rows of (R, T): row r is query r % T of head r / T; its mask row (visible: (B, 1, T, T)) is that of
// batch r / (H T).
struct Layout {
  int64_t rows, len, heads;
  int64_t grain() const { return std::max<int64_t>(1, 16384 / std::max<int64_t>(len, 1)); }
  int64_t query(int64_t r) const { return r % len; }
  int64_t mask_row(int64_t r) const { return (r / (heads * len)) * len + r % len; }
};

Layout layout_of(const torch::Tensor& scores) {
  const int64_t T = scores.size(-1);
  const int64_t heads = scores.dim() >= 3 ? scores.size(-3) : 1;
  return {scores.numel() / std::max<int64_t>(T, 1), T, heads};
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct CausalSoftmaxFn : public torch::autograd::Function<CausalSoftmaxFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& scores_in, double scale_in,
                               const torch::Tensor& visible_in, int64_t out_dtype) {
    const auto scores = scores_in.contiguous();
    const auto visible = visible_in.contiguous();  // empty: causal
    const auto L = layout_of(scores);
    const float scale = static_cast<float>(scale_in);
    auto out = torch::empty(scores.sizes(), scores.options().dtype(static_cast<torch::ScalarType>(out_dtype)));
    const uint8_t* vis = visible.numel() ? reinterpret_cast<const uint8_t*>(visible.data_ptr<bool>()) : nullptr;
    with_element_type(scores.scalar_type(), [&](auto t_tag) {
      using T = decltype(t_tag);
      with_element_type(out.scalar_type(), [&](auto o_tag) {
        using O = decltype(o_tag);
        const T* x = elements<T>(scores);
        O* o = elements<O>(out);
        at::parallel_for(0, L.rows, L.grain(), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t off = r * L.len;
            if (!vis) {
              row_forward_prefix_dispatch(x + off, L.query(r) + 1, L.len, scale, o + off);
              continue;
            }
            const uint8_t* vr = vis + L.mask_row(r) * L.len;
            const Run run = visible_run(vr, L.len);
            if (run.one) {
              std::memset(o + off, 0, static_cast<size_t>(run.first) * sizeof(O));
              row_forward_prefix_dispatch(x + off + run.first, run.count, L.len - run.first, scale, o + off + run.first);
            } else {
              row_forward_masked_dispatch(x + off, vr, L.len, scale, o + off);
            }
          }
        });
      });
    });
    // Backward needs only the weights, which the product with v keeps anyway (and the mask, one per
    // example, not per head): no copy of the scores.
    ctx->save_for_backward({out, visible});
    ctx->saved_data["scale"] = scale_in;
    ctx->saved_data["dtype"] = static_cast<int64_t>(scores.scalar_type());
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& p = saved[0];
    const auto& visible = saved[1];
    const uint8_t* vis = visible.numel() ? reinterpret_cast<const uint8_t*>(visible.data_ptr<bool>()) : nullptr;
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    const auto dp = grad_outputs[0].to(p.scalar_type()).contiguous();
    const auto L = layout_of(p);
    auto dx = torch::empty(p.sizes(), p.options().dtype(dtype));
    with_element_type(dtype, [&](auto t_tag) {
      using T = decltype(t_tag);
      with_element_type(p.scalar_type(), [&](auto o_tag) {
        using O = decltype(o_tag);
        const O* pp = elements<O>(p);
        const O* g = elements<O>(dp);
        T* d = elements<T>(dx);
        at::parallel_for(0, L.rows, L.grain(), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t off = r * L.len;
            // The same runs as the forward's (the hidden keys' weights are 0, so a row of several runs
            // takes the whole row).
            const Run run = vis ? visible_run(vis + L.mask_row(r) * L.len, L.len) : Run{0, L.query(r) + 1, true};
            const int64_t a = run.one ? run.first : 0, n = run.one ? run.count : L.len;
            std::memset(d + off, 0, static_cast<size_t>(a) * sizeof(T));
            row_backward_dispatch(pp + off + a, g + off + a, n, L.len - a, scale, d + off + a);
          }
        });
      });
    });
    return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

bool f32_or_bf16(torch::ScalarType t) { return t == torch::kFloat32 || t == torch::kBFloat16; }

}  // namespace

bool causal_softmax_supported(const torch::Tensor& scores, const torch::Tensor& visible, torch::ScalarType out_dtype) {
  if (!f32_or_bf16(out_dtype) || !scores.defined() || !scores.device().is_cpu() || scores.dim() < 2 ||
      !f32_or_bf16(scores.scalar_type()) || scores.size(-1) != scores.size(-2))
    return false;
  if (!visible.defined()) return true;
  return scores.dim() == 4 && visible.dim() == 4 && visible.scalar_type() == torch::kBool && visible.device().is_cpu() &&
         visible.size(0) == scores.size(0) && visible.size(1) == 1 && visible.size(2) == scores.size(2) &&
         visible.size(3) == scores.size(3);
}

torch::Tensor causal_softmax(const torch::Tensor& scores, double scale, const torch::Tensor& visible,
                             torch::ScalarType out_dtype) {
  TORCH_CHECK(f32_or_bf16(out_dtype), "causal_softmax: the output's dtype must be f32 or bf16, got ", out_dtype);
  TORCH_CHECK(causal_softmax_supported(scores, visible, out_dtype),
              "causal_softmax: CPU scores (..., T, T) in f32 or bf16, and no mask or a bool (B, 1, T, T) one, expected; got ",
              scores.sizes(), " ", scores.scalar_type(), visible.defined() ? " with a mask" : "");
  // No mask travels as an empty one (an undefined tensor cannot be an input of a custom function).
  const auto mask = visible.defined() ? visible : torch::empty({0}, scores.options().dtype(torch::kBool));
  return CausalSoftmaxFn::apply(scores, scale, mask, static_cast<int64_t>(out_dtype));
}

}  // namespace lt
