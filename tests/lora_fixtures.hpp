// The LoRA tests' tiny GPT-2, their two-phase job, and the resume check they share
// (test_lora.cpp, test_dora.cpp).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/recipes/lora_train.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "catch.hpp"
#include "fixtures.hpp"

namespace lt::test {

inline GPT tiny_gpt() {
  ModelOptions o;
  o.vocab_size = 257;
  o.block_size = 16;
  o.n_layer = 2;
  o.n_head = 2;
  o.d_model = 32;
  GPT m(o);
  m->init_weights(at::detail::createCPUGenerator(3));
  return m;
}

// 5 full steps on "gen", then 5 LoRA steps on "gen2" (128 tokens a step).
inline std::unique_ptr<Trainer> make_lora(const TwoDatasets& d, const std::string& name,
                                              std::vector<std::string> extra = {}) {
  return make_lora_train(job_spec(name),
                                       tiny_config(Trainer::lora_schema(), d.dir / "data", two_phase_overrides(), extra),
                                       d.dir / "out");
}

// A plain f32 job on "gen": what an `export` initialises.
inline const std::vector<std::string> kPlainF32 = {"runtime/precision=f32", R"(training/dataset=[{"name":"gen","rate":1}])"};

// Every base tensor of `after` is bf16, frozen (no gradient) and bit-identical to `before`'s (a snapshot).
inline void check_base_frozen_as(const NamedTensors& before, const NamedTensors& after) {
  REQUIRE(after.size() == before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    INFO(before[i].first);
    CHECK(after[i].second.scalar_type() == torch::kBFloat16);
    CHECK_FALSE(after[i].second.requires_grad());
    CHECK(torch::equal(before[i].second, after[i].second));
  }
}

inline NamedTensors snapshot(const NamedTensors& in) {
  NamedTensors out;
  for (const auto& [n, t] : in) out.emplace_back(n, t.detach().clone());
  return out;
}

// Logits on the CPU in f32, whatever device the model is on (CUDA when the suite runs on a GPU).
inline torch::Tensor logits_of(CausalLMImpl& m, const torch::Tensor& idx) {
  torch::NoGradGuard ng;
  m.eval();
  return m.forward(idx.to(m.parameters()[0].device())).to(torch::kFloat32).cpu();
}

// A LoRA job with `opts` saved mid phase 2 (step 7 of 10) resumes bit-identically, losses and state;
// then its final checkpoint restores the finished state. Returns the straight and the resumed jobs.
inline std::pair<std::unique_ptr<Trainer>, std::unique_ptr<Trainer>> check_resume_mid_phase2_and_final(
    TwoDatasets& d, const std::vector<std::string>& opts) {
  auto straight = make_lora(d, "straight", opts);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) losses.push_back(straight->train_step().loss);
  {
    auto first = make_lora(d, "p2", opts);
    for (int i = 0; i < 7; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
    first->save("ntoks/896");
  }
  auto resumed = make_lora(d, "p2", opts);
  resumed->restore_from_path("ntoks/896");
  REQUIRE(resumed->in_lora_phase());
  for (int64_t i = resumed->step(); i < 10; ++i) {
    INFO("step " << i);
    REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
  }
  require_same_state(*straight, *resumed);
  straight->save("final/1280");
  auto fin = make_lora(d, "straight", opts);
  fin->restore_from_path("final/1280");
  require_same_state(*straight, *fin);
  return {std::move(straight), std::move(resumed)};
}

}  // namespace lt::test
