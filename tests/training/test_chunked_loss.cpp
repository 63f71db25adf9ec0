// runtime/loss=chunked in a two-phase job: the LoRA phase's frozen head takes the chunked head + loss
// (kernels/head_loss.hpp) and trains the adapters as the whole logits' fused loss does; a head with an
// adapter, or one in modules_to_save, keeps the whole logits and trains.
#include "catch.hpp"

#include <cmath>

#include "lora_trainer/recipes/lora_train.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"

using namespace lt;

namespace {

// A tiny Llama on byte tokens; the head untied unless `tied`.
std::vector<std::string> tiny_llama(bool tied) {
  return {"architecture/family=llama", "architecture/activation=silu", "architecture/n_heads=4", "architecture/n_kv_heads=2",
          "architecture/d_ff=48", std::string("architecture/tie_embeddings=") + (tied ? "true" : "false"),
          "runtime/precision=f32"};
}

struct Run {
  std::vector<double> losses;  // 5 full steps, then 5 LoRA steps
  std::unique_ptr<Trainer> job;
};

Run run(const test::TempDir& dir, const std::string& name, const std::vector<std::string>& arch,
        const std::vector<std::string>& extra) {
  Run r;
  r.job = make_lora_train(test::job_spec(name),
                          test::tiny_config(Trainer::lora_schema(), dir / "data", arch, test::two_phase_overrides(), extra),
                          dir / "out");
  for (int i = 0; i < 10; ++i) r.losses.push_back(r.job->train_step().loss);
  return r;
}

}  // namespace

TEST_CASE("runtime/loss=chunked: the LoRA phase's frozen head trains the adapters as the whole logits do", "[lora][loss][numerics]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  for (bool tied : {false, true}) {
    INFO((tied ? "tied head" : "untied head"));
    const auto arch = tiny_llama(tied);
    Run whole = run(dir, "whole", arch, {"runtime/loss=fused"});
    Run chunked = run(dir, "chunked", arch, {"runtime/loss=chunked"});
    REQUIRE(chunked.job->in_lora_phase());
    for (size_t i = 0; i < 5; ++i) CHECK(chunked.losses[i] == whole.losses[i]);  // phase 1: the head trains, never chunked
    // f32: the chunked loss sums each row's exponentials over blocks (1e-7 relative each), and the five steps'
    // updates carry that on; a wrong gradient is off in the first LoRA step's loss after it.
    for (size_t i = 5; i < 10; ++i) {
      INFO("step " << i + 1);
      CHECK(std::abs(chunked.losses[i] - whole.losses[i]) <= 1e-5 * whole.losses[i]);
    }
    // It did take the chunked loss: x's gradient is rounded otherwise (p W, not (softmax - onehot) W), so the
    // adapters differ in their last bits (the reported losses, f32 means, need not).
    const auto a = chunked.job->model()->named_parameters()["model.layers.0.self_attn.q_proj.lora_B"];
    const auto b = whole.job->model()->named_parameters()["model.layers.0.self_attn.q_proj.lora_B"];
    CHECK_FALSE(torch::equal(a, b));
    CHECK((a - b).abs().max().item<double>() <= 1e-4 * b.abs().max().item<double>());
  }
}

TEST_CASE("runtime/loss=chunked: a head with an adapter or in modules_to_save keeps the whole logits and trains", "[lora][loss]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  test::make_byte_dataset(dir / "data", "gen2", 2);
  const auto arch = tiny_llama(false);
  for (const std::string setting : {R"(optimization/lora/target_modules=["q_proj","lm_head"])",
                                    R"(optimization/lora/modules_to_save=["lm_head"])"}) {
    INFO(setting);
    Run whole = run(dir, "whole", arch, {"runtime/loss=fused", setting});
    Run chunked = run(dir, "chunked", arch, {"runtime/loss=chunked", setting});
    for (size_t i = 0; i < 10; ++i) CHECK(chunked.losses[i] == whole.losses[i]);  // the same kernels, bit for bit
    // The head's trained tensor moved from where the transition left it.
    const auto params = chunked.job->model()->named_parameters();
    const bool adapter = setting.find("target_modules") != std::string::npos;
    const auto& trained = params[adapter ? "lm_head.lora_B" : "lm_head.weight"];
    REQUIRE(trained.requires_grad());
    if (adapter) CHECK(trained.abs().max().item<float>() > 0.0f);  // lora_B starts at zero
  }
}
