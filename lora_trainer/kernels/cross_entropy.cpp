#include "lora_trainer/kernels/cross_entropy.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "lora_trainer/kernels/parallel.hpp"
#include "lora_trainer/kernels/vector_math.hpp"

#ifdef LT_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "lora_trainer/kernels/cross_entropy_cuda.hpp"
#endif

namespace lt {

namespace {

// The row kernels are plain loops that the compiler vectorises (vector_math.hpp).
using vec::elements;
using vec::exp_nonpositive;
using vec::from_f32;
using vec::to_f32;

// log sum_j e^x[j] of one row, in f32.
template <typename T>
LT_VECTOR_KERNEL float row_logsumexp(const T* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < V; ++j) m = std::max(m, to_f32(x[j]));
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < V; ++j) s += exp_nonpositive(to_f32(x[j]) - m);
  return m + std::log(s);
}

// out[j] = g * (softmax(x)[j] - [j == target]), in the logits' dtype. `out` may be `x` itself.
template <typename T>
LT_VECTOR_KERNEL void row_grad(const T* x, int64_t V, float lse, float g, int64_t target, T* out) {
  const float x_target = to_f32(x[target]);  // read before an in-place pass overwrites it
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) out[j] = from_f32<T>(g * exp_nonpositive(to_f32(x[j]) - lse));
  out[target] = from_f32<T>(g * (exp_nonpositive(x_target - lse) - 1.0f));
}

LT_VECTOR_DISPATCH(row_logsumexp)
LT_VECTOR_DISPATCH(row_grad)

// Whether the logits saved for backward are held by nothing but this loss: not a view, one tensor
// on their storage, and that tensor held only by the saved variable and the handle unpacked from it.
bool held_only_by_the_loss(const torch::Tensor& saved) {
  return !saved.is_view() && saved.storage().use_count() == 1 && saved.use_count() <= 2;
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The array the fused backward (CPU or CUDA) writes the logits' gradient into: the logits' own where
// the caller gave them up (ctx's "overwrite_logits") and nothing else holds them, their version bumped
// so that a second backward through this graph is LibTorch's error; otherwise a new one.
torch::Tensor gradient_array(AutogradContext* ctx, const torch::Tensor& x) {
  if (!ctx->saved_data["overwrite_logits"].toBool() || !held_only_by_the_loss(x)) return torch::empty_like(x);
  x.unsafeGetTensorImpl()->bump_version();
  return x.detach();  // the same array, without the logits' place in the graph
}

template <typename T>
struct FusedCrossEntropySum : public torch::autograd::Function<FusedCrossEntropySum<T>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               bool overwrite_logits) {
    auto x = logits.contiguous();
    auto t = targets.to(torch::kLong).contiguous();
    const int64_t N = x.size(0), V = x.size(1);
    ctx->saved_data["overwrite_logits"] = overwrite_logits;
    auto lse = torch::empty({N}, torch::kFloat32);
    auto row_loss = torch::zeros({N}, torch::kFloat64);
    const T* xp = elements<T>(x);
    const int64_t* tp = t.data_ptr<int64_t>();
    float* lp = lse.data_ptr<float>();
    double* rp = row_loss.data_ptr<double>();
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(tp[i] < V, "cross_entropy_sum: target ", tp[i], " in row ", i, " is outside the vocabulary of ", V);
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (tp[i] < 0) continue;
        lp[i] = row_logsumexp_dispatch(xp + i * V, V);
        rp[i] = static_cast<double>(lp[i]) - static_cast<double>(to_f32(xp[i * V + tp[i]]));
      }
    });
    ctx->save_for_backward({x, t, lse});
    // The rows are summed in order, so the loss does not depend on the thread count.
    double total = 0.0;
    for (int64_t i = 0; i < N; ++i) total += rp[i];
    return torch::tensor(total, torch::kFloat32);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& t = saved[1];
    const auto& lse = saved[2];
    const int64_t N = x.size(0), V = x.size(1);
    const float g = grad_outputs[0].to(torch::kFloat32).item<float>();
    torch::Tensor grad = gradient_array(ctx, x);
    const T* xp = elements<T>(x);
    T* gp = elements<T>(grad);
    const int64_t* tp = t.data_ptr<int64_t>();
    const float* lp = lse.data_ptr<float>();
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (tp[i] < 0) std::memset(gp + i * V, 0, static_cast<size_t>(V) * sizeof(T));
        else row_grad_dispatch(xp + i * V, V, lp[i], g, tp[i], gp + i * V);
      }
    });
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};

#ifdef LT_WITH_CUDA_KERNELS
const uint16_t* bf16_bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_launch(const char* error, const char* what) {
  TORCH_CHECK(error == nullptr, "cross_entropy_sum: the CUDA ", what, " kernel failed: ", error);
}

// The same function on CUDA (cross_entropy_cuda.cu). Nothing is read back to the host: the row
// losses are summed on the device, and the backward reads its incoming gradient there.
struct CudaCrossEntropySum : public torch::autograd::Function<CudaCrossEntropySum> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               bool overwrite_logits) {
    auto x = logits.contiguous();
    ctx->saved_data["overwrite_logits"] = overwrite_logits;
    auto t = targets.to(x.device(), torch::kLong).contiguous();
    const int64_t N = x.size(0), V = x.size(1);
    const c10::cuda::CUDAGuard device(x.device());
    auto f32 = x.options().dtype(torch::kFloat32);
    auto lse = torch::empty({N}, f32), row_loss = torch::empty({N}, f32);
    check_launch(cuda_kernels::cross_entropy_forward(bf16_bits(x), N, V, V, t.data_ptr<int64_t>(), lse.data_ptr<float>(),
                                                     row_loss.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream()),
                 "forward");
    ctx->save_for_backward({x, t, lse});
    return row_loss.sum(torch::kFloat64).to(torch::kFloat32);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& t = saved[1];
    const auto& lse = saved[2];
    const c10::cuda::CUDAGuard device(x.device());
    auto g = grad_outputs[0].to(x.device(), torch::kFloat32).contiguous();
    auto grad = gradient_array(ctx, x);  // the kernel reads each element before it writes it
    check_launch(cuda_kernels::cross_entropy_backward(
                     bf16_bits(x), x.size(0), x.size(1), x.size(1), t.data_ptr<int64_t>(), lse.data_ptr<float>(),
                     g.data_ptr<float>(), reinterpret_cast<uint16_t*>(grad.data_ptr<at::BFloat16>()),
                     c10::cuda::getCurrentCUDAStream().stream()),
                 "backward");
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

bool cuda_loss_kernels_built() {
#ifdef LT_WITH_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets, bool fused,
                                bool overwrite_logits) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "cross_entropy_sum: logits (N, V) and targets (N) expected");
  if (fused && logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32)
    return FusedCrossEntropySum<float>::apply(logits, targets, overwrite_logits);
  if (fused && logits.scalar_type() == torch::kBFloat16) {
    if (logits.device().is_cpu()) return FusedCrossEntropySum<uint16_t>::apply(logits, targets, overwrite_logits);
#ifdef LT_WITH_CUDA_KERNELS
    if (logits.is_cuda()) return CudaCrossEntropySum::apply(logits, targets, overwrite_logits);
#endif
    TORCH_CHECK(!logits.is_cuda(), "cross_entropy_sum: this build has no CUDA kernels for the fused loss "
                "(runtime/loss=fused needs a build configured with a CUDA compiler)");
  }
  // LibTorch's (bf16 logits without the fused kernels, f64, or runtime/loss=libtorch): log_softmax
  // over an f32 copy of the logits (what autocast and F.cross_entropy do),
  // then nll_loss; its backward makes the f32 gradient and converts it to the logits' dtype.
  return at::nll_loss(at::log_softmax(logits, 1, torch::kFloat32), targets, /*weight=*/{}, at::Reduction::Sum,
                      /*ignore_index=*/-1);
}

}  // namespace lt
