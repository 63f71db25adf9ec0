#include "lora_trainer/kernels/cpu_gemm.hpp"

#include <algorithm>
#include <atomic>

#include <c10/core/impl/LocalDispatchKeySet.h>

#if LT_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

namespace lt {

namespace {

std::atomic<CpuMatmul> g_backend{onednn_available() ? CpuMatmul::OneDnn : CpuMatmul::LibTorch};        // linear layers'
std::atomic<CpuMatmul> g_small_backend{onednn_available() ? CpuMatmul::OneDnn : CpuMatmul::LibTorch};  // cpu_sgemm's

bool is_f32_cpu(const torch::Tensor& t) { return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat32; }

GemmLayout layout(const torch::Tensor& t) { return gemm_layout(t.size(0), t.size(1), t.stride(0), t.stride(1)); }

// C = a b (+ C), LibTorch's product.
void libtorch_gemm_out(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  if (accumulate) out.addmm_(a, b);
  else at::mm_out(out, a, b);
}

// C = a b (+ C), through oneDNN; false where it does not take these operands.
bool onednn_gemm(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
#if LT_HAVE_ONEDNN
  if (g_backend.load(std::memory_order_relaxed) != CpuMatmul::OneDnn) return false;
  if (!is_f32_cpu(out) || !is_f32_cpu(a) || !is_f32_cpu(b) || out.dim() != 2 || a.dim() != 2 || b.dim() != 2) return false;
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (M == 0 || N == 0 || K == 0 || b.size(0) != K || out.size(0) != M || out.size(1) != N) return false;
  const GemmLayout la = layout(a), lb = layout(b), lc = layout(out);
  if (!la || !lb || lc.trans != 'N') return false;
  const dnnl_status_t status = dnnl_sgemm(la.trans, lb.trans, M, N, K, 1.0f, a.data_ptr<float>(), la.ld, b.data_ptr<float>(), lb.ld,
                                          accumulate ? 1.0f : 0.0f, out.data_ptr<float>(), lc.ld);
  TORCH_CHECK(status == dnnl_success, "oneDNN's sgemm failed (status ", static_cast<int>(status), ") on ", a.sizes(), " by ",
              b.sizes());
  return true;
#else
  (void)out, (void)a, (void)b, (void)accumulate;
  return false;
#endif
}

// Autocast is on where its key is not excluded (what at::autocast::is_cpu_enabled reads, in 1.13 and 2.x).
bool autocast_on() { return !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutocastCPU); }

// Whether cpu_linear computes x W^T (+ b) itself (its products through cpu_gemm_out, oneDNN's or LibTorch's
// sgemm as chosen): every f32 product on the CPU, so that the step's memory (the logits written over by the
// loss, the gradients' layouts) does not depend on which library multiplies.
bool takes_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
  return is_f32_cpu(x) && is_f32_cpu(W) && W.dim() == 2 &&
         x.dim() >= 1 && x.size(-1) == W.size(1) && (!b.defined() || (is_f32_cpu(b) && b.dim() == 1 && b.size(0) == W.size(0))) &&
         !autocast_on();
}

// (..., in) as (rows, in): a view where the strides allow, else a copy.
torch::Tensor rows_of(const torch::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// The (rows, n) product back in `like`'s leading shape: itself for a matrix, so that it is no view (a
// loss may write its gradient over a head's logits: cross_entropy_sum).
torch::Tensor leading_shape(const torch::Tensor& out, const torch::Tensor& like) {
  if (like.dim() == 2) return out;
  std::vector<int64_t> sizes = like.sizes().vec();
  sizes.back() = out.size(1);
  return out.view(sizes);
}

torch::Tensor linear_forward(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
  const torch::Tensor x2 = rows_of(x);
  // A buffer of its own, the bias copied into each row: b.expand(...).contiguous() of one row would be
  // b itself, and the product would accumulate into the parameter.
  torch::Tensor y = torch::empty({x2.size(0), W.size(0)}, x.options());
  if (b.defined()) y.copy_(b.expand({x2.size(0), W.size(0)}));
  cpu_gemm_out(y, x2, W.t(), /*accumulate=*/b.defined());
  return leading_shape(y, x);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// W's gradient g^T x (LibTorch's mm) in blocks of kWeightGradRows rows of W, each block's rows the same
// sums over the tokens as one product's.
torch::Tensor weight_grad(const torch::Tensor& g2, const torch::Tensor& x2) {
  const int64_t rows = g2.size(1);
  if (rows <= kWeightGradRows) return torch::mm(g2.t(), x2);
  torch::Tensor dW = torch::empty({rows, x2.size(1)}, x2.options());
  for (int64_t b = 0; b < rows; b += kWeightGradRows) {
    const int64_t n = std::min(kWeightGradRows, rows - b);
    torch::Tensor block = dW.narrow(0, b, n);  // whole rows: contiguous
    torch::mm_out(block, g2.narrow(1, b, n).t(), x2);
  }
  return dW;
}

// Gradients: x's g W (cpu_gemm), W's g^T x (weight_grad) and b's column sums (LibTorch's, as linear's backward).
variable_list linear_backward(AutogradContext* ctx, const variable_list& grad, size_t inputs) {
  const auto saved = ctx->get_saved_variables();
  const torch::Tensor &x = saved[0], &W = saved[1];
  const torch::Tensor g2 = rows_of(grad[0]);
  variable_list out(inputs);
  if (ctx->needs_input_grad(0)) out[0] = cpu_gemm(grad[0], W);
  if (ctx->needs_input_grad(1)) out[1] = weight_grad(g2, rows_of(x));
  if (inputs == 3 && ctx->needs_input_grad(2)) out[2] = g2.sum(0);
  return out;
}

// (Two functions: an undefined tensor cannot be an input of a custom autograd function.)
struct LinearFn : public torch::autograd::Function<LinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& W) {
    ctx->save_for_backward({x, W});
    return linear_forward(x, W, {});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) { return linear_backward(ctx, grad, 2); }
};

struct LinearBiasFn : public torch::autograd::Function<LinearBiasFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
    ctx->save_for_backward({x, W});
    return linear_forward(x, W, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) { return linear_backward(ctx, grad, 3); }
};

}  // namespace

GemmLayout gemm_layout(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if (col_stride == 1 && (rows == 1 || row_stride >= std::max<int64_t>(1, cols)))
    return {'N', rows == 1 ? std::max<int64_t>(1, cols) : row_stride};
  if (row_stride == 1 && (cols == 1 || col_stride >= std::max<int64_t>(1, rows)))
    return {'T', cols == 1 ? std::max<int64_t>(1, rows) : col_stride};
  return {};
}

bool onednn_available() { return LT_HAVE_ONEDNN != 0; }

void set_cpu_matmul(CpuMatmul linear, CpuMatmul small) {
  TORCH_CHECK((linear != CpuMatmul::OneDnn && small != CpuMatmul::OneDnn) || onednn_available(),
              "this build has no oneDNN (install Debian's libdnnl-dev and build again)");
  g_backend.store(linear);
  g_small_backend.store(small);
}

void set_cpu_matmul(CpuMatmul both) { set_cpu_matmul(both, both); }

CpuMatmul cpu_matmul() { return g_backend.load(); }

CpuMatmul cpu_small_matmul() { return g_small_backend.load(); }

void cpu_gemm_out(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  if (!onednn_gemm(out, a, b, accumulate)) libtorch_gemm_out(out, a, b, accumulate);
}

void cpu_sgemm(char trans_a, char trans_b, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
               int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  if (M == 0 || N == 0) return;
#if LT_HAVE_ONEDNN
  if (g_small_backend.load(std::memory_order_relaxed) == CpuMatmul::OneDnn && K > 0) {
    const dnnl_status_t status = dnnl_sgemm(trans_a, trans_b, M, N, K, 1.0f, a, lda, b, ldb, accumulate ? 1.0f : 0.0f, c, ldc);
    TORCH_CHECK(status == dnnl_success, "oneDNN's sgemm failed (status ", static_cast<int>(status), ") on ", M, " x ", K,
                " by ", K, " x ", N);
    return;
  }
#endif
  // LibTorch's mm on views of the operands (its BLAS call, at::native::cpublas::gemm, is not exported).
  const at::NoGradGuard no_grad;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto view = [&](const float* p, char trans, int64_t rows, int64_t cols, int64_t ld) {
    const std::vector<int64_t> strides = trans == 'T' ? std::vector<int64_t>{1, ld} : std::vector<int64_t>{ld, 1};
    return torch::from_blob(const_cast<float*>(p), {rows, cols}, strides, f32);
  };
  torch::Tensor out = view(c, 'N', M, N, ldc);
  libtorch_gemm_out(out, view(a, trans_a, M, K, lda), view(b, trans_b, K, N, ldb), accumulate);
}

torch::Tensor cpu_gemm(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor a2 = rows_of(a);
  torch::Tensor out = torch::empty({a2.size(0), b.size(1)}, a.options());
  cpu_gemm_out(out, a2, b);
  return leading_shape(out, a);
}

torch::Tensor cpu_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
  if (!takes_linear(x, W, b)) return b.defined() ? torch::linear(x, W, b) : torch::linear(x, W);
  const bool graph = torch::GradMode::is_enabled() && (x.requires_grad() || W.requires_grad() || (b.defined() && b.requires_grad()));
  if (!graph) return linear_forward(x, W, b);
  return b.defined() ? LinearBiasFn::apply(x, W, b) : LinearFn::apply(x, W);
}

}  // namespace lt
