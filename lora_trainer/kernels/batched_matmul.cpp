#include "lora_trainer/kernels/batched_matmul.hpp"

#include <vector>

#include "lora_trainer/kernels/parallel.hpp"

namespace lt {

namespace {

// A BLAS reads a matrix without copying it when one of its strides is 1 and the other spans a row or
// column.
bool blas_readable(const torch::Tensor& t) {
  const int64_t r = t.size(-2), c = t.size(-1), sr = t.stride(-2), sc = t.stride(-1);
  return (sc == 1 && sr >= std::max<int64_t>(1, c)) || (sr == 1 && sc >= std::max<int64_t>(1, r));
}

// Matrix i of t's stack (its leading dimensions in row-major order), a view.
torch::Tensor matrix(const torch::Tensor& t, int64_t i) {
  const int64_t lead = t.dim() - 2;
  std::vector<int64_t> index(static_cast<size_t>(lead));
  for (int64_t d = lead - 1; d >= 0; --d) {
    index[static_cast<size_t>(d)] = i % t.size(d);
    i /= t.size(d);
  }
  torch::Tensor m = t;
  for (int64_t d = 0; d < lead; ++d) m = m.select(0, index[static_cast<size_t>(d)]);
  return m;
}

torch::Tensor products(const torch::Tensor& a, const torch::Tensor& b) {
  std::vector<int64_t> sizes = a.sizes().vec();
  sizes.back() = b.size(-1);
  torch::Tensor out = torch::empty(sizes, a.options());
  const int64_t n = out.numel() == 0 ? 0 : out.numel() / (out.size(-2) * out.size(-1));
  const torch::Tensor stack = out.view({n, out.size(-2), out.size(-1)});
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    // Grad mode is the thread's own: the pool's threads do not have the caller's (off inside an autograd
    // function), and an out= product refuses operands that require grad where it is on.
    const at::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) {
      torch::Tensor o = stack.select(0, i);
      at::mm_out(o, matrix(a, i), matrix(b, i));
    }
  });
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct BatchedMatmul : public torch::autograd::Function<BatchedMatmul> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& a, const torch::Tensor& b) {
    ctx->save_for_backward({a, b});
    return products(a, b);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& a = saved[0];
    const torch::Tensor& b = saved[1];
    torch::Tensor g = grad_outputs[0];
    if (!blas_readable(g)) g = g.contiguous();
    torch::Tensor ga, gb;
    if (ctx->needs_input_grad(0)) ga = products(g, b.transpose(-2, -1));  // dL/da = g b^T
    if (ctx->needs_input_grad(1)) gb = products(a.transpose(-2, -1), g);  // dL/db = a^T g
    return {ga, gb};
  }
};

}  // namespace

bool batched_matmul_supported(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined() || !a.device().is_cpu() || !b.device().is_cpu()) return false;
  if (a.scalar_type() != torch::kFloat32 || b.scalar_type() != torch::kFloat32) return false;
  if (a.dim() < 3 || a.dim() != b.dim() || a.size(-1) != b.size(-2)) return false;
  for (int64_t d = 0; d + 2 < a.dim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return blas_readable(a) && blas_readable(b);
}

torch::Tensor batched_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(batched_matmul_supported(a, b), "batched_matmul: CPU f32 stacks of equal batch sizes, (..., M, K) by (..., K, N), "
              "each matrix BLAS-readable, expected; got ", a.sizes(), " and ", b.sizes());
  return BatchedMatmul::apply(a, b);
}

}  // namespace lt
