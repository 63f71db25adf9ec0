#include "lora_trainer/kernels/head_loss.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lora_trainer/kernels/parallel.hpp"
#include "lora_trainer/kernels/vector_math.hpp"

namespace lt {

namespace {

using vec::elements;
using vec::exp_nonpositive;
using vec::from_f32;
using vec::to_f32;

// One row of a block of n logits: the running maximum *m and sum *s of e^(logit - max) taken over the
// block (the sum so far rescaled by *alpha = e^(old max - new max)), the target's logit where it is in
// the block (`target` >= 0), and with `write_p` the block's e^(logit - new max) written over the logits.
template <typename T>
LT_VECTOR_KERNEL void row_block(T* l, int64_t n, int64_t target, bool write_p, float* m, float* s, float* target_logit,
                                float* alpha) {
  float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
  for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, to_f32(l[j]));
  if (target >= 0) *target_logit = to_f32(l[target]);
  const float new_max = std::max(*m, block_max);
  const float a = exp_nonpositive(*m - new_max);  // the first block: e^-87 times a sum of 0
  float sum = 0.0f;
  if (write_p) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float e = exp_nonpositive(to_f32(l[j]) - new_max);
      sum += e;
      l[j] = from_f32<T>(e);
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += exp_nonpositive(to_f32(l[j]) - new_max);
  }
  *s = *s * a + sum;
  *m = new_max;
  *alpha = a;
}

LT_VECTOR_DISPATCH(row_block)

template <typename T>
void cpu_block(const torch::Tensor& l, int64_t first, const torch::Tensor& t, bool write_p, torch::Tensor& m,
               torch::Tensor& s, torch::Tensor& target_logit, torch::Tensor& alpha) {
  const int64_t N = l.size(0), n = l.size(1);
  T* lp = elements<T>(l);
  const int64_t* tp = t.data_ptr<int64_t>();
  float *mp = m.data_ptr<float>(), *sp = s.data_ptr<float>(), *tlp = target_logit.data_ptr<float>(),
        *ap = alpha.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t target = tp[i] >= first && tp[i] < first + n ? tp[i] - first : -1;
      row_block_dispatch(lp + i * n, n, target, write_p, mp + i, sp + i, tlp + i, ap + i);
    }
  });
}

// The same block with LibTorch's operations (CUDA; the CPU in tests).
void generic_block(const torch::Tensor& l, int64_t first, const torch::Tensor& t, bool write_p, torch::Tensor& m,
                   torch::Tensor& s, torch::Tensor& target_logit, torch::Tensor& alpha) {
  const int64_t n = l.size(1);
  auto lf = l.to(torch::kFloat32);
  auto new_max = torch::maximum(m, std::get<0>(lf.max(1)));
  alpha = (m - new_max).exp();
  auto p = (lf - new_max.unsqueeze(1)).exp();
  s = s * alpha + p.sum(1);
  auto in_block = t.ge(first).logical_and(t.lt(first + n));
  auto column = (t - first).clamp(0, n - 1).unsqueeze(1);
  target_logit = torch::where(in_block, lf.gather(1, column).squeeze(1), target_logit);
  m = new_max;
  if (write_p) l.copy_(p);
}

struct Result {
  torch::Tensor loss;    // () f32
  torch::Tensor grad_x;  // (N, C) f32, undefined without need_grad
};

// The products in dtype `ct`.
Result head_loss(const torch::Tensor& x_in, const torch::Tensor& W, const torch::Tensor& targets, torch::ScalarType ct,
                 int64_t block_columns, bool row_kernels, bool need_grad) {
  const auto device = x_in.device();
  const bool cpu = device.is_cpu() && row_kernels && (ct == torch::kFloat32 || ct == torch::kBFloat16);
  auto x = x_in.detach().to(ct).contiguous();
  auto t = targets.to(device, torch::kLong).contiguous();
  const int64_t N = x.size(0), C = x.size(1), V = W.size(0);
  const int64_t columns = head_loss_columns(V, C, W.scalar_type() != ct, block_columns);
  if (device.is_cpu()) {
    const int64_t* tp = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(tp[i] < V, "chunked_head_loss_sum: target ", tp[i], " in row ", i, " is outside the vocabulary of ", V);
  }
  auto f32 = x.options().dtype(torch::kFloat32);
  auto m = torch::full({N}, -std::numeric_limits<float>::infinity(), f32);
  auto s = torch::zeros({N}, f32), target_logit = torch::zeros({N}, f32), alpha = torch::empty({N}, f32);
  torch::Tensor acc = need_grad ? torch::zeros({N, C}, f32) : torch::Tensor();
  auto logits = torch::empty({N * columns}, x.options());                                     // a block's
  auto cast = W.scalar_type() == ct ? torch::Tensor() : torch::empty({columns * C}, x.options());  // W's block cast
  torch::Tensor product;  // p W_b in bf16, added into acc
  for (int64_t first = 0; first < V; first += columns) {
    const int64_t n = std::min(columns, V - first);
    auto Wb = W.narrow(0, first, n);
    if (cast.defined()) Wb = cast.narrow(0, 0, n * C).view({n, C}).copy_(Wb);
    else Wb = Wb.contiguous();
    auto l = logits.narrow(0, 0, N * n).view({N, n});
    torch::mm_out(l, x, Wb.t());
    if (cpu && ct == torch::kFloat32) cpu_block<float>(l, first, t, need_grad, m, s, target_logit, alpha);
    else if (cpu) cpu_block<uint16_t>(l, first, t, need_grad, m, s, target_logit, alpha);
    else generic_block(l, first, t, need_grad, m, s, target_logit, alpha);
    if (!need_grad) continue;
    acc.mul_(alpha.unsqueeze(1));
    if (ct == torch::kFloat32) {
      acc.addmm_(l, Wb);
    } else {
      if (!product.defined()) product = torch::empty({N, C}, x.options());
      torch::mm_out(product, l, Wb);
      acc.add_(product);
    }
  }
  auto counted = t.ge(0);
  Result r;
  if (device.is_cpu()) {  // in row order, in f64: the same sum whatever the thread count
    const int64_t* tp = t.data_ptr<int64_t>();
    const float *mp = m.data_ptr<float>(), *sp = s.data_ptr<float>(), *tlp = target_logit.data_ptr<float>();
    double total = 0.0;
    for (int64_t i = 0; i < N; ++i)
      if (tp[i] >= 0) total += static_cast<double>(mp[i] + std::log(sp[i])) - static_cast<double>(tlp[i]);
    r.loss = torch::tensor(total, torch::kFloat32);
  } else {
    auto rows = (m + s.log()).to(torch::kFloat64) - target_logit.to(torch::kFloat64);
    auto loss = torch::where(counted, rows, torch::zeros_like(rows)).sum();
    r.loss = torch::where(t.ge(V).any(), torch::full_like(loss, std::nan("")), loss).to(torch::kFloat32);
  }
  if (need_grad) {
    acc.div_(s.unsqueeze(1));
    acc.sub_(W.index_select(0, t.clamp(0, V - 1)).to(torch::kFloat32));
    acc.mul_(counted.unsqueeze(1).to(torch::kFloat32));
    r.grad_x = acc;
  }
  return r;
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct ChunkedHeadLossSum : public torch::autograd::Function<ChunkedHeadLossSum> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& W,
                               const torch::Tensor& targets, int64_t ct, int64_t block_columns, bool row_kernels) {
    Result r = head_loss(x, W, targets, static_cast<torch::ScalarType>(ct), block_columns, row_kernels, /*need_grad=*/true);
    ctx->saved_data["grad_x"] = r.grad_x;
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return r.loss;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto grad = ctx->saved_data["grad_x"].toTensor();
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto g = grad_outputs[0].to(grad.device(), torch::kFloat32);
    return {(grad * g).to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

int64_t head_loss_columns(int64_t V, int64_t C, bool cast, int64_t block_columns) {
  int64_t columns = std::max<int64_t>(1, std::min(block_columns, V));
  if (cast) columns = std::min(columns, std::max<int64_t>(64, kHeadLossCastBytes / (4 * std::max<int64_t>(1, C)) / 64 * 64));
  return columns;
}

bool chunked_head_loss_applies(const torch::Tensor& W) { return !(torch::GradMode::is_enabled() && W.requires_grad()); }

torch::Tensor chunked_head_loss_sum(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& targets,
                                    torch::ScalarType products, int64_t block_columns, bool row_kernels) {
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1) && targets.dim() == 1 && targets.size(0) == x.size(0),
              "chunked_head_loss_sum: x (N, C), W (V, C) and targets (N) expected");
  TORCH_CHECK(chunked_head_loss_applies(W), "chunked_head_loss_sum: W takes a gradient (the head trains)");
  const auto ct = products;
  if (torch::GradMode::is_enabled() && x.requires_grad())
    return ChunkedHeadLossSum::apply(x, W, targets, static_cast<int64_t>(ct), block_columns, row_kernels);
  return head_loss(x, W, targets, ct, block_columns, row_kernels, /*need_grad=*/false).loss;
}

}  // namespace lt
