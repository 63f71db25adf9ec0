// The fused cross-entropy computes what LibTorch's f32 cross_entropy computes on the same logits: bf16
// logits on the CPU and (where there is a CUDA device and the build has the kernels) on CUDA, and f32
// logits on the CPU (the f32 runs of CPUs without fast bf16).
#include "catch.hpp"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "lora_trainer/kernels/cross_entropy.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

struct Case {
  torch::Tensor logits;   // bf16 (N, V)
  torch::Tensor targets;  // (N), some -1
};

Case make_case(int64_t N, int64_t V, double scale, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  Case c;
  c.logits = (torch::randn({N, V}, gen, torch::kFloat32) * scale).to(torch::kBFloat16);
  c.targets = torch::randint(0, V, {N}, gen, torch::kLong);
  for (int64_t i = 0; i < N; i += 5) c.targets[i] = -1;  // padding rows
  return c;
}

// (loss, d loss / d logits) from LibTorch in f32.
std::pair<double, torch::Tensor> reference(const Case& c, double grad_scale) {
  auto x = c.logits.to(torch::kFloat32).detach().requires_grad_(true);
  auto loss = torch::nn::functional::cross_entropy(
      x, c.targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
  (loss * grad_scale).backward();
  return {loss.item<double>(), x.grad()};
}

// (loss, d loss / d logits) of cross_entropy_sum with the logits and targets on `device`; the
// gradient comes back to the CPU.
std::pair<double, torch::Tensor> fused(const Case& c, double grad_scale, torch::Device device = torch::kCPU) {
  auto x = c.logits.to(device).detach().requires_grad_(true);
  auto loss = cross_entropy_sum(x, c.targets.to(device), /*fused=*/true);
  (loss * grad_scale).backward();
  REQUIRE(x.grad().scalar_type() == torch::kBFloat16);
  REQUIRE(x.grad().device().type() == device.type());
  return {loss.item<double>(), x.grad().cpu()};
}

// Within 2 bf16 steps (2^-7 relative) of the f32 gradient it rounds.
bool within_bf16(const torch::Tensor& grad, const torch::Tensor& ref_grad) {
  auto diff = (grad.to(torch::kFloat32) - ref_grad).abs();
  return diff.le(ref_grad.abs() * (1.0 / 128) + 1e-9).all().item<bool>();
}

bool have_cuda_kernels() {
  if (!torch::cuda::is_available()) {
    WARN("skipped: no CUDA device");
    return false;
  }
  if (!cuda_loss_kernels_built()) {
    WARN("skipped: this CUDA build has no kernels of its own (no CUDA compiler when it was configured)");
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("fused cross-entropy: loss and gradient match LibTorch's f32 cross_entropy", "[loss][numerics]") {
  // The GPT-2 vocabulary, the byte vocabulary, and sizes that are not a multiple of any vector width.
  for (auto [N, V, scale] : {std::tuple<int64_t, int64_t, double>{24, 50257, 2.0}, {37, 257, 1.0}, {9, 1001, 8.0}}) {
    INFO("N " << N << " V " << V << " scale " << scale);
    Case c = make_case(N, V, scale, static_cast<uint64_t>(V));
    const double g = 1.0 / 300.0;  // the trainer scales by 1 / (target tokens of the batch)
    auto [ref_loss, ref_grad] = reference(c, g);
    auto [loss, grad] = fused(c, g);
    CHECK(std::abs(loss - ref_loss) <= 1e-5 * std::abs(ref_loss));
    CHECK(within_bf16(grad, ref_grad));  // the f32 gradient rounded to bf16
    // Padding rows get no gradient.
    for (int64_t i = 0; i < N; i += 5) CHECK(grad[i].abs().max().item<float>() == 0.0f);
  }
}

TEST_CASE("fused cross-entropy of f32 logits: loss and f32 gradient match LibTorch's", "[loss][numerics]") {
  for (auto [N, V, scale] : {std::tuple<int64_t, int64_t, double>{24, 50257, 2.0}, {37, 257, 1.0}, {9, 1001, 8.0}}) {
    INFO("N " << N << " V " << V << " scale " << scale);
    Case c = make_case(N, V, scale, static_cast<uint64_t>(V) + 1);
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(N));
    c.logits = c.logits.to(torch::kFloat32) + torch::rand({N, V}, gen) * 0.01;  // values bf16 cannot hold
    const double g = 1.0 / 300.0;
    auto [ref_loss, ref_grad] = reference(c, g);
    auto x = c.logits.detach().requires_grad_(true);
    auto loss = cross_entropy_sum(x, c.targets, /*fused=*/true);
    (loss * g).backward();
    REQUIRE(x.grad().scalar_type() == torch::kFloat32);
    CHECK(std::abs(loss.item<double>() - ref_loss) <= 1e-6 * std::abs(ref_loss));
    // e^(x - lse) with lse in f32: its rounding (1e-7 of |lse|, up to ~30 here) is the softmax's relative
    // error, as in LibTorch's own f32 log_softmax; a wrong term is off by the whole gradient scale.
    const double worst = (x.grad() - ref_grad).abs().max().item<double>();
    CHECK(worst <= 1e-5 * ref_grad.abs().max().item<double>());
    for (int64_t i = 0; i < N; i += 5) CHECK(x.grad()[i].abs().max().item<float>() == 0.0f);
  }
}

TEST_CASE("fused cross-entropy: the loss does not depend on the thread count", "[loss][numerics]") {
  Case c = make_case(64, 50257, 3.0, 7);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  auto [one, grad_one] = fused(c, 0.01);
  at::set_num_threads(2);
  auto [two, grad_two] = fused(c, 0.01);
  at::set_num_threads(before);
  CHECK(one == two);
  CHECK(torch::equal(grad_one, grad_two));
}

TEST_CASE("fused cross-entropy: a target outside the vocabulary is an error, not a wrong loss", "[loss]") {
  Case c = make_case(4, 100, 1.0, 3);
  c.targets[1] = 100;
  CHECK_THROWS_WITH(cross_entropy_sum(c.logits, c.targets), Contains("outside the vocabulary of 100"));
}

namespace {

// The gradient of cross_entropy_sum(z, targets, fused, overwrite_logits=true) with respect to a leaf
// whose copy z the logits are, and where that gradient was written. With `keep`, the caller still holds z.
struct Overwritten {
  torch::Tensor grad;           // d loss / d leaf, scaled by g
  const void* logits = nullptr;  // z's array
  const void* written = nullptr;  // the array the loss's gradient arrived in
  torch::Tensor kept;           // z after backward, where kept
};

Overwritten overwritten(const torch::Tensor& logits, const torch::Tensor& targets, double g, bool keep) {
  auto leaf = logits.detach().requires_grad_(true);
  auto z = leaf.mul(1.0);  // not a leaf, not a view: what a model's head hands the loss
  Overwritten o;
  o.logits = z.data_ptr();
  z.register_hook([&o](const torch::Tensor& grad) { o.written = grad.data_ptr(); });
  auto loss = cross_entropy_sum(z, targets, /*fused=*/true, /*overwrite_logits=*/true);
  if (keep) o.kept = z;
  z = torch::Tensor();
  (loss * g).backward();
  o.grad = leaf.grad();
  return o;
}

}  // namespace

TEST_CASE("fused cross-entropy with overwrite_logits: the gradient takes the logits' array when only the loss holds them, and is the same gradient", "[loss][numerics]") {
  const double g = 1.0 / 300.0;
  // Small vocabularies put a visible probability on the target, whose entry the in-place pass must read
  // before it overwrites the row.
  for (auto [N, V, scale] : {std::tuple<int64_t, int64_t, double>{24, 50257, 2.0}, {37, 257, 1.0}, {9, 1001, 8.0}}) {
    INFO("N " << N << " V " << V << " scale " << scale);
    Case c = make_case(N, V, scale, static_cast<uint64_t>(V) + 2);
    auto [ref_loss, ref_grad] = reference(c, g);
    SECTION("bf16 logits") {
      auto o = overwritten(c.logits, c.targets, g, /*keep=*/false);
      CHECK(o.written == o.logits);
      CHECK(within_bf16(o.grad, ref_grad));
      CHECK(torch::equal(o.grad, fused(c, g).second));  // the bits of the gradient into a new array
    }
    SECTION("f32 logits") {
      auto f32 = c.logits.to(torch::kFloat32);
      auto o = overwritten(f32, c.targets, g, /*keep=*/false);
      CHECK(o.written == o.logits);
      CHECK((o.grad - ref_grad).abs().max().item<double>() <= 1e-5 * ref_grad.abs().max().item<double>());
    }
  }
}

TEST_CASE("fused cross-entropy with overwrite_logits: logits the caller still holds, or a view, are left as they were", "[loss][numerics]") {
  Case c = make_case(16, 257, 2.0, 11);
  auto f32 = c.logits.to(torch::kFloat32);
  SECTION("held") {
    auto o = overwritten(f32, c.targets, 0.5, /*keep=*/true);
    CHECK(o.written != o.logits);
    CHECK(torch::equal(o.kept, f32));
  }
  SECTION("a view of a larger array") {
    auto leaf = f32.reshape({4, 4, 257}).detach().requires_grad_(true);
    auto z = leaf.mul(1.0);
    const void* array = z.data_ptr();
    const void* written = nullptr;
    auto rows = z.reshape({16, 257});
    rows.register_hook([&written](const torch::Tensor& grad) { written = grad.data_ptr(); });
    auto loss = cross_entropy_sum(rows, c.targets, /*fused=*/true, /*overwrite_logits=*/true);
    rows = torch::Tensor();
    loss.backward();
    CHECK(written != array);
    CHECK(torch::equal(z, f32.reshape({4, 4, 257})));
  }
  SECTION("a retained graph's second backward is an error, not a wrong gradient") {
    auto leaf = f32.detach().requires_grad_(true);
    auto z = leaf.mul(1.0);
    auto loss = cross_entropy_sum(z, c.targets, /*fused=*/true, /*overwrite_logits=*/true);
    z = torch::Tensor();
    loss.backward({}, /*retain_graph=*/true);
    CHECK_THROWS_WITH(loss.backward(), Contains("modified by an inplace operation"));
  }
}

TEST_CASE("fused cross-entropy on CUDA: loss and gradient match LibTorch's f32 cross_entropy and the CPU kernel", "[loss][cuda]") {
  if (!have_cuda_kernels()) return;
  const torch::Device gpu(torch::kCUDA);
  // 50,304 (the padded GPT-2 head) and 1,024 take the 16-byte vector path; 257 and 1,001 the one
  // value at a time.
  for (auto [N, V, scale] : {std::tuple<int64_t, int64_t, double>{24, 50304, 2.0}, {37, 257, 1.0}, {9, 1001, 8.0}, {700, 1024, 4.0}}) {
    INFO("N " << N << " V " << V << " scale " << scale);
    Case c = make_case(N, V, scale, static_cast<uint64_t>(V) + 1);
    const double g = 1.0 / 300.0;
    auto [ref_loss, ref_grad] = reference(c, g);
    auto [loss, grad] = fused(c, g, gpu);
    auto [cpu_loss, cpu_grad] = fused(c, g);
    CHECK(std::abs(loss - ref_loss) <= 1e-5 * std::abs(ref_loss));
    CHECK(std::abs(loss - cpu_loss) <= 1e-5 * std::abs(cpu_loss));
    CHECK(within_bf16(grad, ref_grad));
    CHECK(within_bf16(grad, cpu_grad.to(torch::kFloat32)));
    for (int64_t i = 0; i < N; i += 5) CHECK(grad[i].abs().max().item<float>() == 0.0f);
  }
}

TEST_CASE("fused cross-entropy on CUDA with overwrite_logits: the gradient takes the logits' array when only the loss holds them, and is the same gradient", "[loss][cuda]") {
  if (!have_cuda_kernels()) return;
  const torch::Device gpu(torch::kCUDA);
  const double g = 1.0 / 300.0;
  for (auto [N, V, scale] : {std::tuple<int64_t, int64_t, double>{24, 50304, 2.0}, {37, 257, 1.0}}) {
    INFO("N " << N << " V " << V << " scale " << scale);
    Case c = make_case(N, V, scale, static_cast<uint64_t>(V) + 3);
    auto o = overwritten(c.logits.to(gpu), c.targets.to(gpu), g, /*keep=*/false);
    CHECK(o.written == o.logits);
    CHECK(torch::equal(o.grad.cpu(), fused(c, g, gpu).second));  // the bits of the gradient into a new array
    auto held = overwritten(c.logits.to(gpu), c.targets.to(gpu), g, /*keep=*/true);
    CHECK(held.written != held.logits);
    CHECK(torch::equal(held.kept.cpu(), c.logits));
  }
}

TEST_CASE("fused cross-entropy on CUDA: rows that do not start 16-byte aligned take the scalar path and agree", "[loss][cuda]") {
  if (!have_cuda_kernels()) return;
  Case c = make_case(12, 1024, 3.0, 11);
  auto [ref_loss, ref_grad] = reference(c, 0.5);
  // The same values one element into a buffer: contiguous, but the rows start 2 bytes off.
  auto buffer = torch::zeros({12 * 1024 + 1}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA));
  auto x = buffer.slice(0, 1).view({12, 1024});
  x.copy_(c.logits.to(torch::kCUDA));
  REQUIRE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0);
  auto xs = x.detach().requires_grad_(true);
  auto loss = cross_entropy_sum(xs, c.targets.to(torch::kCUDA), /*fused=*/true);
  (loss * 0.5).backward();
  CHECK(std::abs(loss.item<double>() - ref_loss) <= 1e-5 * std::abs(ref_loss));
  CHECK(within_bf16(xs.grad().cpu(), ref_grad));
}

TEST_CASE("fused cross-entropy on CUDA: -inf columns (the padded head) change nothing and get no gradient", "[loss][cuda]") {
  if (!have_cuda_kernels()) return;
  Case c = make_case(16, 1000, 2.0, 5);
  Case padded = c;
  padded.logits = torch::cat({c.logits, torch::full({16, 24}, -INFINITY, c.logits.options())}, 1);  // 1,024 columns
  auto [loss, grad] = fused(c, 1.0, torch::kCUDA);
  auto [ploss, pgrad] = fused(padded, 1.0, torch::kCUDA);
  // The two sum their rows in another order (1,024 columns go 8 at a time, 1,000 one at a time).
  CHECK(std::abs(ploss - loss) <= 1e-6 * std::abs(loss));
  CHECK(within_bf16(pgrad.slice(1, 0, 1000), grad.to(torch::kFloat32)));
  CHECK(pgrad.slice(1, 1000).abs().max().item<float>() == 0.0f);
}

TEST_CASE("fused cross-entropy on CUDA: NaN logits or a target outside the vocabulary make the loss NaN", "[loss][cuda]") {
  if (!have_cuda_kernels()) return;
  for (int bad : {0, 1, 2}) {
    INFO((bad == 0 ? "NaN logit" : bad == 1 ? "+inf logit" : "target == V"));
    Case c = make_case(6, 512, 1.0, 9);
    c.targets[2] = 7;
    if (bad == 0) c.logits[2][100] = NAN;
    if (bad == 1) c.logits[2][100] = INFINITY;
    if (bad == 2) c.targets[2] = 512;
    auto x = c.logits.to(torch::kCUDA);
    CHECK(std::isnan(cross_entropy_sum(x, c.targets.to(torch::kCUDA), /*fused=*/true).item<double>()));
  }
}
