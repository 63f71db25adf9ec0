#include "lora_trainer/peft/frozen_weight.hpp"

#include <c10/util/accumulate.h>

#include <deque>
#include <stdexcept>

#include "lora_trainer/core/checksum.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/kernels/nf4.hpp"
#include "lora_trainer/peft/block_shard.hpp"

namespace lt {

torch::Tensor weight_for(const torch::Tensor& W, const torch::Tensor& x) {
  if (!W.defined() || W.scalar_type() == x.scalar_type()) return W;
  const bool autocast = compat::autocast_enabled(x.device().type());
  return autocast ? W : W.to(x.scalar_type());
}

namespace {

// A LoRA adapter merged into a frozen weight's cast (frozen_lora_linear): W + scale (A B)^T, A (in, r),
// B (r, out).
struct CastAdapter {
  torch::Tensor A, B;
  double scale = 0.0;
};

// The casts of frozen weights go through one reusable buffer per thread, of at most block_bytes: a
// product with a larger weight takes it in blocks of rows. Allocating a fresh cast of every matrix at
// every product churned the heap (it keeps freed memory: runtime.cpp) into fragments that held twice
// the live memory at a 1B model's step.

// Rows [first, first + rows) of W, cast to `dtype` into the thread's buffer. The view is valid until the
// next call on this thread (products on one device stream run in order, so a CUDA kernel reading it is
// done before the next cast overwrites it).
// With an adapter, the rows are those of W + s (A B)^T: its B's columns for these rows, added in the
// buffer the cast writes anyway (a small product, 2 r in a row's element).
torch::Tensor cast_rows(const torch::Tensor& W, int64_t first, int64_t rows, c10::ScalarType dtype,
                        const CastAdapter* adapter = nullptr) {
  thread_local torch::Tensor buffer;
  const torch::Tensor block = W.narrow(0, first, rows);
  const int64_t n = block.numel();
  if (!buffer.defined() || buffer.numel() < n || buffer.device() != W.device() || buffer.scalar_type() != dtype)
    buffer = torch::empty({std::max<int64_t>(n, 1)}, W.options().dtype(dtype).requires_grad(false));
  torch::Tensor view = buffer.narrow(0, 0, n).view(block.sizes());
  view.copy_(block);
  if (adapter) {
    torch::NoGradGuard no_grad;
    view.addmm_(adapter->B.narrow(1, first, rows).t().to(dtype), adapter->A.t().to(dtype), 1.0, adapter->scale);
  }
  return view;
}

// Rows per block: all of W when its cast fits the buffer.
int64_t block_rows(const torch::Tensor& W, c10::ScalarType dtype, int64_t block_bytes) {
  const int64_t row_bytes = std::max<int64_t>(1, W.numel() / std::max<int64_t>(1, W.size(0))) * c10::elementSize(dtype);
  return std::max<int64_t>(1, std::min<int64_t>(W.size(0), block_bytes / row_bytes));
}

// x W^T (+ b), W cast block by block (a weight that fits the buffer: one product, as torch::linear).
// Each block's product goes straight into its columns of the output (BLAS writes a block of columns
// with the output's row stride): concatenating the blocks' outputs afterwards cost another pass over the
// whole output and twice its memory (GPT-2's tied head in an f32 LoRA phase: 1,024 x 50,257 logits, 77
// MB of f32 weight in two blocks, about a tenth of the step). The products are linear's: addmm for a
// matrix x with a bias, otherwise the product and then the bias added.
torch::Tensor cast_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b, int64_t block_bytes,
                          const CastAdapter* adapter = nullptr) {
  const auto dtype = x.scalar_type();
  const torch::Tensor bc = b.defined() ? b.to(dtype) : b;
  const int64_t step = block_rows(W, dtype, block_bytes), out = W.size(0);
  if (step >= out) {
    const torch::Tensor Wc = cast_rows(W, 0, out, dtype, adapter);
    return cpu_linear(x, Wc, bc);
  }
  const torch::Tensor x2 = x.reshape({-1, x.size(-1)});
  // The output in its own shape, no view (a loss may then write its gradient over it: cross_entropy_sum);
  // the blocks write their columns through a matrix view of it.
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  torch::Tensor y = torch::empty(sizes, x.options());
  const torch::Tensor y2 = y.view({x2.size(0), out});
  for (int64_t first = 0; first < out; first += step) {
    const int64_t rows = std::min(step, out - first);
    const torch::Tensor Wb = cast_rows(W, first, rows, dtype, adapter);
    torch::Tensor columns = y2.narrow(1, first, rows);
    if (bc.defined() && x.dim() == 2) {  // addmm's: the bias, then the product added
      columns.copy_(bc.narrow(0, first, rows).expand_as(columns));
      cpu_gemm_out(columns, x2, Wb.t(), /*accumulate=*/true);
    } else {
      cpu_gemm_out(columns, x2, Wb.t());
      if (bc.defined()) columns.add_(bc.narrow(0, first, rows));
    }
  }
  return y;
}

// g W: x's gradient through x W^T, W cast block by block.
torch::Tensor cast_grad_input(const torch::Tensor& g, const torch::Tensor& W, int64_t block_bytes,
                              const CastAdapter* adapter = nullptr) {
  const auto dtype = g.scalar_type();
  const int64_t step = block_rows(W, dtype, block_bytes), out = W.size(0);
  if (step >= out) return cpu_gemm(g, cast_rows(W, 0, out, dtype, adapter));
  // Each block's product added into the first's (one pass over x's gradient less a block).
  const torch::Tensor g2 = g.reshape({-1, out});
  torch::Tensor sum;
  for (int64_t first = 0; first < out; first += step) {
    const int64_t rows = std::min(step, out - first);
    const torch::Tensor Wb = cast_rows(W, first, rows, dtype, adapter);
    if (!sum.defined()) sum = cpu_gemm(g2.narrow(1, first, rows), Wb);
    else cpu_gemm_out(sum, g2.narrow(1, first, rows), Wb, /*accumulate=*/true);
  }
  std::vector<int64_t> sizes = g.sizes().vec();
  sizes.back() = W.size(1);
  return sum.view(sizes);
}

// x W^T (+ b) with W (and b) cast to x's dtype for the product only; the backward casts W again.
// (Two functions: an undefined tensor cannot be an input of a custom autograd function.)
torch::autograd::variable_list frozen_backward(torch::autograd::AutogradContext* ctx, const torch::autograd::variable_list& grad,
                                               size_t inputs) {
  const torch::Tensor W = ctx->get_saved_variables()[0];
  torch::autograd::variable_list out(inputs);
  out[0] = cast_grad_input(grad[0], W, ctx->saved_data["block_bytes"].toInt());
  return out;
}

struct FrozenLinearFn : public torch::autograd::Function<FrozenLinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& W,
                               int64_t block_bytes) {
    ctx->save_for_backward({W});
    ctx->saved_data["block_bytes"] = block_bytes;
    return cast_linear(x, W, torch::Tensor(), block_bytes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    return frozen_backward(ctx, grad, 3);
  }
};

struct FrozenLinearBiasFn : public torch::autograd::Function<FrozenLinearBiasFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& W,
                               const torch::Tensor& b, int64_t block_bytes) {
    ctx->save_for_backward({W});
    ctx->saved_data["block_bytes"] = block_bytes;
    return cast_linear(x, W, b, block_bytes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    return frozen_backward(ctx, grad, 4);
  }
};

// Whether W must be cast to x's dtype for the product (autocast casts both itself).
bool needs_cast(const torch::Tensor& x, c10::ScalarType w_dtype) {
  return w_dtype != x.scalar_type() && !compat::autocast_enabled(x.device().type());
}
bool needs_cast(const torch::Tensor& x, const torch::Tensor& W) { return needs_cast(x, W.scalar_type()); }

// x W^T (+ b) for a frozen W, computed as it is (autograd records it where no cast is needed; a cast
// product records nothing): what frozen_linear computes without its own autograd function.
torch::Tensor frozen_product(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b, int64_t block_bytes) {
  if (!needs_cast(x, W)) return cpu_linear(x, weight_for(W, x), weight_for(b, x));
  return cast_linear(x, W, b, block_bytes);
}

}  // namespace

torch::Tensor frozen_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b, int64_t block_bytes) {
  const bool frozen = !W.requires_grad() && !(b.defined() && b.requires_grad());
  if (!frozen) return cpu_linear(x, weight_for(W, x), weight_for(b, x));
  if (!needs_cast(x, W) || !torch::GradMode::is_enabled() || !x.requires_grad()) return frozen_product(x, W, b, block_bytes);
  return b.defined() ? FrozenLinearBiasFn::apply(x, W, b, block_bytes) : FrozenLinearFn::apply(x, W, block_bytes);
}

namespace {

// Whether a frozen W of `w_dtype` is cast to x's dtype for the product (needs_cast) into an f32 or f64
// buffer that can take the adapter, with b frozen.
bool casts_with_adapter(const torch::Tensor& x, c10::ScalarType w_dtype, const torch::Tensor& b) {
  return !(b.defined() && b.requires_grad()) && needs_cast(x, w_dtype) &&
         (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64);
}

}  // namespace

bool merges_lora_into_cast(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b) {
  return !W.requires_grad() && casts_with_adapter(x, W.scalar_type(), b);
}

namespace {

// Where frozen_lora_linear's W comes from: the tensor W, kept for the backward as frozen_linear keeps
// it; or, W undefined, made by `storage` for the forward and again for the backward (nf4), never kept.
struct LoraCastSource {
  torch::Tensor W, b;
  const FrozenWeight* storage = nullptr;
  torch::Tensor weight(const torch::Tensor& x) const { return W.defined() ? W : storage->for_matmul(x); }
};

// x W^T (+ b) + s (x A) B with W + s (A B)^T made in the cast's buffer, forward and backward: x's
// gradient is g (W + s (A B)^T), A's s x^T (g B^T), B's s (x A)^T g. The source goes through saved_data
// as its address, read during the forward only.
struct FrozenLoraFn : public torch::autograd::Function<FrozenLoraFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& A,
                               const torch::Tensor& B, double scale, int64_t source, int64_t block_bytes) {
    const auto& src = *reinterpret_cast<const LoraCastSource*>(source);
    ctx->save_for_backward({x, A, B});
    if (src.W.defined()) ctx->saved_data["W"] = src.W;
    else ctx->saved_data["storage"] = reinterpret_cast<int64_t>(src.storage);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["block_bytes"] = block_bytes;
    const CastAdapter adapter{A, B, scale};
    return cast_linear(x, src.weight(x), src.b, block_bytes, &adapter);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &A = saved[1], &B = saved[2];
    const double scale = ctx->saved_data["scale"].toDouble();
    const torch::Tensor& g = grad[0];
    torch::autograd::variable_list out(6);
    if (ctx->needs_input_grad(0)) {
      const torch::Tensor W = ctx->saved_data.count("W")
                                  ? ctx->saved_data["W"].toTensor()
                                  : reinterpret_cast<const FrozenWeight*>(ctx->saved_data["storage"].toInt())->for_matmul(g);
      const CastAdapter adapter{A, B, scale};
      out[0] = cast_grad_input(g, W, ctx->saved_data["block_bytes"].toInt(), &adapter);
    }
    const torch::Tensor g2 = g.reshape({-1, g.size(-1)}), x2 = x.reshape({-1, x.size(-1)});
    if (ctx->needs_input_grad(1)) out[1] = torch::mm(x2.t(), torch::mm(g2, B.t()).mul_(scale));
    if (ctx->needs_input_grad(2)) out[2] = torch::mm(torch::mm(x2, A).t(), g2).mul_(scale);
    return out;
  }
};

torch::Tensor lora_cast_linear(const LoraCastSource& src, const torch::Tensor& x, const torch::Tensor& A, const torch::Tensor& B,
                               double scale, int64_t block_bytes) {
  const bool graph = torch::GradMode::is_enabled() && (x.requires_grad() || A.requires_grad() || B.requires_grad());
  if (graph) return FrozenLoraFn::apply(x, A, B, scale, reinterpret_cast<int64_t>(&src), block_bytes);
  const CastAdapter adapter{A, B, scale};
  return cast_linear(x, src.weight(x), src.b, block_bytes, &adapter);
}

}  // namespace

torch::Tensor frozen_lora_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b, const torch::Tensor& A,
                                 const torch::Tensor& B, double scale, int64_t block_bytes) {
  TORCH_CHECK(merges_lora_into_cast(x, W, b), "frozen_lora_linear: W (", W.scalar_type(), ") is not a frozen weight cast to x's ",
              x.scalar_type(), " for its product");
  return lora_cast_linear(LoraCastSource{W, b, nullptr}, x, A, B, scale, block_bytes);
}

bool FrozenWeight::merges_lora(const torch::Tensor& x, const torch::Tensor& b) const {
  // Every storage's W is bf16 (as stored, or made), so this is merges_lora_into_cast without making it.
  return casts_with_adapter(x, torch::kBFloat16, b);
}

torch::Tensor FrozenWeight::linear_with_adapter(const torch::Tensor& x, const torch::Tensor& b, const torch::Tensor& A,
                                                const torch::Tensor& B, double scale) const {
  return frozen_lora_linear(x, for_matmul(x), b, A, B, scale);
}

torch::Tensor FrozenWeight::linear(const torch::Tensor& x, const torch::Tensor& b) const {
  return frozen_linear(x, for_matmul(x), b);
}

namespace {

// The parameter itself, in bf16, as stored: frozen_linear casts it for the product.
class Bf16Weight : public FrozenWeight {
 public:
  explicit Bf16Weight(torch::Tensor weight) : weight_(std::move(weight)) {}
  torch::Tensor for_matmul(const torch::Tensor&) const override { return weight_; }
  int64_t bytes() const override { return weight_.numel() * weight_.element_size(); }
  FrozenFormat format() const override { return FrozenFormat::Bf16; }
  std::vector<int64_t> shape() const override { return weight_.sizes().vec(); }
  void assign(const torch::Tensor& W) override {
    torch::NoGradGuard no_grad;
    weight_.copy_(W);
  }
  bool held_by_parameter() const override { return true; }

 private:
  torch::Tensor weight_;
};

// x W^T (+ b) for a W made by `storage` in each pass: the forward computes frozen_product, what
// frozen_linear computes for a stored bf16 W (the same kernels, so the same numbers), and the backward
// makes W again for x's gradient. The storage is the layer's and outlives the step's graph; it goes
// through saved_data as its address.

torch::autograd::variable_list made_weight_backward(torch::autograd::AutogradContext* ctx, const torch::autograd::variable_list& grad,
                                                    size_t inputs) {
  const auto* storage = reinterpret_cast<const FrozenWeight*>(ctx->saved_data["storage"].toInt());
  const torch::Tensor& g = grad[0];
  const torch::Tensor W = storage->for_matmul(g);
  torch::autograd::variable_list out(inputs);
  const auto x_dtype = ctx->saved_data["x_dtype"].toScalarType();
  // Under autocast the forward multiplied bf16 copies and autograd would return x's gradient in x's dtype.
  out[0] = (W.scalar_type() == g.scalar_type() ? cpu_gemm(g, W) : cast_grad_input(g, W, kFrozenCastBlockBytes)).to(x_dtype);
  return out;
}

struct MadeWeightFn : public torch::autograd::Function<MadeWeightFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t storage) {
    ctx->saved_data["storage"] = storage;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return frozen_product(x, reinterpret_cast<const FrozenWeight*>(storage)->for_matmul(x), torch::Tensor(), kFrozenCastBlockBytes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    return made_weight_backward(ctx, grad, 2);
  }
};

struct MadeWeightBiasFn : public torch::autograd::Function<MadeWeightBiasFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& b,
                               int64_t storage) {
    ctx->saved_data["storage"] = storage;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return frozen_product(x, reinterpret_cast<const FrozenWeight*>(storage)->for_matmul(x), b, kFrozenCastBlockBytes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    return made_weight_backward(ctx, grad, 3);
  }
};

}  // namespace

// x W^T (+ b) for a storage that makes W for each product (nf4): W made in the forward and again in
// the backward.
torch::Tensor made_weight_linear(const FrozenWeight& storage, const torch::Tensor& x_in, const torch::Tensor& b) {
  // Under autocast, x cast as autocast's linear casts it (its cache included), outside the function:
  // the graph then sums x's gradients where a bf16 base's graph sums them, in the same dtype.
  const auto device = x_in.device().type();
  const torch::Tensor x = compat::autocast_enabled(device) && x_in.is_floating_point()
                              ? at::autocast::cached_cast(compat::autocast_dtype(device), x_in, device)
                              : x_in;
  const auto self = reinterpret_cast<int64_t>(&storage);
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return frozen_product(x, storage.for_matmul(x), b, kFrozenCastBlockBytes);
  return b.defined() ? MadeWeightBiasFn::apply(x, b, self) : MadeWeightFn::apply(x, self);
}

// frozen_lora_linear for such a storage: W made for the forward and again for the backward, never kept.
torch::Tensor made_weight_lora_linear(const FrozenWeight& storage, const torch::Tensor& x, const torch::Tensor& b,
                                      const torch::Tensor& A, const torch::Tensor& B, double scale) {
  TORCH_CHECK(storage.merges_lora(x, b), "frozen_lora_linear: a ", to_string(storage.format()), " weight is not cast to x's ",
              x.scalar_type(), " for its product");
  return lora_cast_linear(LoraCastSource{torch::Tensor(), b, &storage}, x, A, B, scale, kFrozenCastBlockBytes);
}

torch::Tensor frozen_values(const FrozenWeight& storage) {
  return storage.for_matmul(torch::empty({0}, torch::kBFloat16)).cpu();
}

namespace {

// QLoRA's storage: NF4 blocks with double quantization (kernels/nf4.hpp), on the weight's device
// (moved to x's if a product runs elsewhere).
class Nf4Weight : public FrozenWeight {
 public:
  explicit Nf4Weight(const torch::Tensor& weight) {
    if (!is_frozen_stand_in(weight)) {
      assign(weight);
      return;
    }
    q_ = Nf4Tensor::zeros(weight.sizes().vec(), weight.device());  // a template's, until a restore fills it
  }
  torch::Tensor for_matmul(const torch::Tensor& x) const override {
    if (q_.device() != x.device()) q_ = q_.to(x.device());
    return dequantize_nf4(q_, torch::kBFloat16);
  }
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& b) const override { return made_weight_linear(*this, x, b); }
  torch::Tensor linear_with_adapter(const torch::Tensor& x, const torch::Tensor& b, const torch::Tensor& A, const torch::Tensor& B,
                                    double scale) const override {
    return made_weight_lora_linear(*this, x, b, A, B, scale);
  }
  int64_t bytes() const override { return q_.bytes(); }
  FrozenFormat format() const override { return FrozenFormat::Nf4; }
  std::vector<int64_t> shape() const override { return q_.shape; }
  void assign(const torch::Tensor& W) override {
    TORCH_CHECK(q_.shape.empty() || W.sizes().vec() == q_.shape, "Nf4Weight::assign: a weight of another shape");
    const torch::Tensor bf16 = W.detach().to(torch::kBFloat16);
    crc_ = bf16_crc32(bf16);
    q_.fill_from(quantize_nf4(bf16, /*double_quant=*/true).to(W.device()));  // a restore's template: in place
  }
  std::vector<std::pair<std::string, torch::Tensor>> state() const override {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (auto [field, t] : q_.fields()) out.emplace_back(field, *t);
    return out;
  }
  // None for a template's storage until a restore assigns its values (a checkpoint's codes loaded in
  // place leave it so: such a job copies its base into its checkpoints, it refers to none).
  std::optional<uint32_t> values_crc() const override { return crc_; }

 private:
  mutable Nf4Tensor q_;
  std::optional<uint32_t> crc_;
};

// A bf16 or nf4 storage kept 1/N a rank in its block's BlockShard (the header's "sharded").
class ShardedWeight : public FrozenWeight {
 public:
  ShardedWeight(const std::shared_ptr<FrozenWeight>& from, const torch::Tensor& weight, std::shared_ptr<BlockShard> block)
      : block_(std::move(block)), format_(from->format()), shape_(from->shape()), crc_(from->values_crc()) {
    if (format_ == FrozenFormat::Bf16) {
      first_ = block_->add(torch::kBFloat16, shape_);
      count_ = 1;
      // W's values, unless the parameter is a template's stand-in.
      if (!is_frozen_stand_in(weight)) {
        pending_.push_back(weight.detach());
        crc_ = bf16_crc32(weight.detach());
      }
      return;
    }
    Nf4Tensor layout = Nf4Tensor::zeros(shape_, torch::kCPU);
    for (auto [field, t] : layout.fields()) {
      const int64_t i = block_->add(t->scalar_type(), t->sizes().vec());
      if (first_ < 0) first_ = i;
      ++count_;
    }
    if (from->values_crc())  // a storage that holds values (not a template's zeros)
      for (auto& [field, t] : from->state()) pending_.push_back(t);
  }
  void finish() {
    for (size_t k = 0; k < pending_.size(); ++k) block_->write(first_ + static_cast<int64_t>(k), pending_[k]);
    pending_.clear();
  }

  torch::Tensor for_matmul(const torch::Tensor& x) const override {
    BlockGathered gathered(block_.get(), BlockGathered::Direction::None);
    if (format_ == FrozenFormat::Bf16) {
      torch::Tensor W = block_->tensor(first_);
      return W.device() == x.device() ? W : W.to(x.device());
    }
    Nf4Tensor q;  // views of the gathered bytes, in fields() order (as the constructor laid them out)
    q.shape = shape_;
    q.numel = c10::multiply_integers(shape_);
    int64_t i = first_;
    for (auto [field, t] : q.fields()) *t = block_->tensor(i++);
    if (q.device() != x.device()) q = q.to(x.device());
    return dequantize_nf4(q, torch::kBFloat16);
  }
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& b) const override {
    // bf16: W is a view of the gathered bytes, which it keeps alive for the product and its backward.
    return format_ == FrozenFormat::Nf4 ? made_weight_linear(*this, x, b) : frozen_linear(x, for_matmul(x), b);
  }
  torch::Tensor linear_with_adapter(const torch::Tensor& x, const torch::Tensor& b, const torch::Tensor& A, const torch::Tensor& B,
                                    double scale) const override {
    return format_ == FrozenFormat::Nf4 ? made_weight_lora_linear(*this, x, b, A, B, scale)
                                        : frozen_lora_linear(x, for_matmul(x), b, A, B, scale);
  }
  int64_t bytes() const override {
    // This rank's share of the block, in proportion to W's part of it.
    int64_t own = 0;
    for (int64_t i = first_; i < first_ + count_; ++i) own += block_->tensor_bytes(i);
    return own * block_->shard_bytes() / std::max<int64_t>(1, block_->full_bytes());
  }
  FrozenFormat format() const override { return format_; }
  std::vector<int64_t> shape() const override { return shape_; }
  void assign(const torch::Tensor& W) override {
    TORCH_CHECK(W.sizes().vec() == shape_, "ShardedWeight::assign: a weight of another shape");
    const torch::Tensor bf16 = W.detach().to(torch::kBFloat16);
    crc_ = bf16_crc32(bf16);
    if (format_ == FrozenFormat::Bf16) {
      block_->write(first_, bf16);
      return;
    }
    Nf4Tensor q = quantize_nf4(bf16, /*double_quant=*/true);
    int64_t i = first_;
    for (auto [field, t] : q.fields()) block_->write(i++, *t);
  }
  std::optional<uint32_t> values_crc() const override { return crc_; }
  bool sharded() const override { return true; }

 private:
  std::shared_ptr<BlockShard> block_;
  FrozenFormat format_;
  std::vector<int64_t> shape_;
  std::optional<uint32_t> crc_;
  int64_t first_ = -1;                 // the index of its first tensor in the block
  int64_t count_ = 0;                  // and how many it has there (bf16: W; nf4: Nf4Tensor::fields())
  std::vector<torch::Tensor> pending_;  // the values to store once the block is sealed
};

}  // namespace

bool shardable(FrozenFormat format) { return format == FrozenFormat::Bf16 || format == FrozenFormat::Nf4; }

std::shared_ptr<FrozenWeight> shard_weight(const std::shared_ptr<FrozenWeight>& storage, torch::Tensor weight,
                                           const std::shared_ptr<BlockShard>& block) {
  TORCH_CHECK(!storage->sharded(), "shard_weight: already sharded");
  if (!shardable(storage->format()))
    throw UserError(std::string("distributed/shard_params keeps the frozen base 1/N a rank in bf16 or nf4; a base stored as ") +
                    to_string(storage->format()) + " (optimization/lora/quantize_base=" + to_string(storage->format()) +
                    ") cannot be sharded. Set distributed/shard_params=none, or another quantize_base");
  auto sharded = std::make_shared<ShardedWeight>(storage, weight, block);
  weight.set_data(frozen_stand_in(weight.sizes(), weight.device()));
  return sharded;
}

void finish_sharding(FrozenWeight& sharded) { dynamic_cast<ShardedWeight&>(sharded).finish(); }

torch::Tensor frozen_stand_in(at::IntArrayRef shape, const torch::Device& device) {
  return torch::zeros({1}, torch::TensorOptions().dtype(torch::kBFloat16).device(device)).expand(shape);
}

bool is_frozen_stand_in(const torch::Tensor& t) {
  if (t.numel() <= 1) return false;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.stride(d) != 0) return false;
  return true;
}

std::shared_ptr<FrozenWeight> freeze_weight(torch::Tensor weight, FrozenFormat format) {
  std::shared_ptr<FrozenWeight> storage = frozen_storage(format).make(weight);
  TORCH_CHECK(storage && storage->format() == format, "freeze_weight: the ", to_string(format), " storage's make gave another storage");
  if (!storage->held_by_parameter()) weight.set_data(frozen_stand_in(weight.sizes(), weight.device()));
  weight.requires_grad_(false);
  return storage;
}

// The registry (frozen_storage.hpp): bf16 and nf4 first, in FrozenFormat's order, then what is registered.
struct FrozenStorageRegistry {
  std::deque<FrozenStorage> storages;  // a deque: entries stay where they are as others are added

  static FrozenStorageRegistry& get() {
    static FrozenStorageRegistry registry;
    return registry;
  }
  FrozenStorageRegistry() {
    storages.push_back({"bf16", "bf16", [](torch::Tensor weight) -> std::shared_ptr<FrozenWeight> {
                          weight.set_data(weight.detach().to(torch::kBFloat16));  // as Module::to casts a parameter
                          return std::make_shared<Bf16Weight>(std::move(weight));
                        },
                        [](const std::vector<int64_t>& shape) { return 2 * c10::multiply_integers(shape); }});
    storages.push_back({"nf4", "NF4",
                        [](torch::Tensor weight) -> std::shared_ptr<FrozenWeight> { return std::make_shared<Nf4Weight>(weight); },
                        [](const std::vector<int64_t>& shape) { return nf4_bytes(shape); }});
  }
  static FrozenFormat format(size_t i) { return FrozenFormat(static_cast<int>(i)); }
};

const FrozenFormat FrozenFormat::Bf16{0};
const FrozenFormat FrozenFormat::Nf4{1};

FrozenFormat register_frozen_storage(FrozenStorage storage) {
  auto& r = FrozenStorageRegistry::get();
  const std::string& name = storage.name;
  bool plain = !name.empty();
  for (char c : name) plain = plain && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_');
  if (!plain) throw std::invalid_argument("register_frozen_storage: \"" + name + "\" is not a name of lower-case letters, digits and '_'");
  for (const char* taken : {"none", "params", "ema", "optim", "rng"})
    if (name == taken) throw std::invalid_argument("register_frozen_storage: \"" + name + "\" is a name a checkpoint or a config uses otherwise");
  for (const auto& s : r.storages)
    if (s.name == name) throw std::invalid_argument("register_frozen_storage: a storage named \"" + name + "\" is registered already");
  if (!storage.make) throw std::invalid_argument("register_frozen_storage: \"" + name + "\" has no make");
  r.storages.push_back(std::move(storage));
  return FrozenStorageRegistry::format(r.storages.size() - 1);
}

int64_t FrozenStorage::bytes_of(const std::vector<int64_t>& shape) const {
  if (stored_bytes) return stored_bytes(shape);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return 2 * n;
}

const FrozenStorage& frozen_storage(FrozenFormat format) {
  const auto& s = FrozenStorageRegistry::get().storages;
  TORCH_CHECK(format.id() >= 0 && static_cast<size_t>(format.id()) < s.size(), "frozen_storage: no storage ", format.id());
  return s[static_cast<size_t>(format.id())];
}

const char* to_string(FrozenFormat format) { return frozen_storage(format).name.c_str(); }

std::vector<std::string> frozen_format_names() {
  std::vector<std::string> out;
  for (const auto& s : FrozenStorageRegistry::get().storages) out.push_back(s.name);
  return out;
}

std::vector<FrozenFormat> quantizing_frozen_formats() {
  std::vector<FrozenFormat> out;
  const auto& s = FrozenStorageRegistry::get().storages;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i].quantizes()) out.push_back(FrozenStorageRegistry::format(i));
  return out;
}

FrozenFormat parse_frozen_format(const std::string& name) {
  if (name == "none") return FrozenFormat::Bf16;  // the older name
  const auto& s = FrozenStorageRegistry::get().storages;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i].name == name) return FrozenStorageRegistry::format(i);
  throw std::invalid_argument("\"" + name + "\" is no frozen storage; the storages are " + join(frozen_format_names()) +
                              " (\"none\" is bf16's older name)");
}

}  // namespace lt
