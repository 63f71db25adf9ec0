// CUDA: the same training on the GPU as on the CPU, and bit-identical resume on the GPU in both phases.
// On a machine without a CUDA device (or with a CPU-only LibTorch) these tests say
// "skipped: no CUDA device" and pass; the rest of the suite then covers the CPU. On a GPU machine the
// whole suite runs on CUDA anyway (runtime/device defaults to auto); these tests pin the device.
#include "catch.hpp"

#include "lora_trainer/kernels/cross_entropy.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/recipes/lora_train.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "fixtures.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

bool have_cuda() {
  if (torch::cuda::is_available()) return true;
  WARN("skipped: no CUDA device");
  return false;
}

using Data = test::TwoDatasets;

// 4 full steps on "gen", then 4 LoRA steps on "gen2" (128 tokens a step).
std::unique_ptr<Trainer> make_cuda_lora(const Data& d, const std::string& name, const std::vector<std::string>& extra) {
  return make_lora_train(
      test::job_spec(name), test::tiny_config(Trainer::lora_schema(), d.dir / "data", test::two_phase_overrides(512), extra),
      d.dir / "out");
}

}  // namespace

TEST_CASE("runtime/device=cuda without a CUDA device is a clear error", "[cuda]") {
  if (torch::cuda::is_available()) {
    WARN("skipped: this machine has a CUDA device");
    return;
  }
  Data d;
  CHECK_THROWS_WITH(make_cuda_lora(d, "nocuda", {"runtime/device=cuda"}),
                    Contains("runtime/device=cuda, but no CUDA device is available"));
}

TEST_CASE("f32 training on CUDA follows the CPU's through both phases", "[cuda]") {
  if (!have_cuda()) return;
  Data d;
  auto cpu = make_cuda_lora(d, "cpu", {"runtime/device=cpu", "runtime/precision=f32"});
  auto gpu = make_cuda_lora(d, "gpu", {"runtime/device=cuda", "runtime/precision=f32"});
  REQUIRE(gpu->runtime().device.is_cuda());
  for (int i = 0; i < 8; ++i) {
    INFO("step " << i);
    auto a = cpu->train_step(), b = gpu->train_step();
    CHECK(b.loss == Approx(a.loss).epsilon(1e-4));
    CHECK(b.grad_norm == Approx(a.grad_norm).epsilon(1e-3));
  }
  CHECK(gpu->in_lora_phase());
  for (const auto& [name, p] : gpu->lora_params().named()) CHECK(p.is_cuda());
}

TEST_CASE("bf16 training on CUDA: the fused loss follows LibTorch's through both phases", "[cuda]") {
  if (!have_cuda()) return;
  if (!cuda_loss_kernels_built()) {
    WARN("skipped: this CUDA build has no kernels of its own");
    return;
  }
  Data d;
  auto ours = make_cuda_lora(d, "fused", {"runtime/device=cuda", "runtime/precision=bf16", "runtime/loss=fused"});
  auto theirs = make_cuda_lora(d, "libtorch", {"runtime/device=cuda", "runtime/precision=bf16", "runtime/loss=libtorch"});
  for (int i = 0; i < 8; ++i) {
    INFO("step " << i);
    auto a = theirs->train_step(), b = ours->train_step();
    CHECK(b.loss == Approx(a.loss).epsilon(1e-3));
    CHECK(b.grad_norm == Approx(a.grad_norm).epsilon(1e-2));
  }
}

TEST_CASE("bf16 training on CUDA resumes bit-identically in both phases", "[cuda]") {
  if (!have_cuda()) return;
  Data d;
  const std::string loss = GENERATE(as<std::string>{}, "libtorch", "fused");
  if (loss == "fused" && !cuda_loss_kernels_built()) return;
  INFO("runtime/loss=" << loss);
  const std::vector<std::string> on_gpu = {"runtime/device=cuda", "runtime/precision=bf16", "architecture/dropout=0.1",
                                           "runtime/loss=" + loss};
  auto straight = make_cuda_lora(d, "straight", on_gpu);
  std::vector<double> losses;
  for (int i = 0; i < 8; ++i) losses.push_back(straight->train_step().loss);
  for (int k : {2, 6}) {  // mid phase 1, mid phase 2
    const std::string name = "split" + std::to_string(k);
    {
      auto first = make_cuda_lora(d, name, on_gpu);
      for (int i = 0; i < k; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
      first->save("ntoks/" + std::to_string(first->tokens()));
    }
    auto resumed = make_cuda_lora(d, name, on_gpu);
    REQUIRE(resumed->restore_latest() == "ntoks/" + std::to_string(k * 128));
    for (int64_t i = resumed->step(); i < 8; ++i) {
      INFO("resumed at " << k << ", step " << i);
      REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
    }
    test::require_same_state(*straight, *resumed);
  }
}
