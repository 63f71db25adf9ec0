// Activation checkpointing (training/activation_checkpointing): the blocks recompute their forward in
// the backward, and nothing a user sees changes but memory and time: gradients, losses, every
// checkpointed tensor and resume are bit-identical to the plain path, in both families and both
// phases, with dropout (the recompute replays the generator) and bf16 autocast; and memory is saved.
#include "catch.hpp"

#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/recipes/lora_train.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/cli/bench.hpp"
#include "fixtures.hpp"
#include "launch.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

const std::vector<std::string> kLlama = {"architecture/family=llama", "architecture/activation=silu",
                                         "architecture/n_heads=4",    "architecture/n_kv_heads=2",
                                         "architecture/d_ff=48",      "architecture/tie_embeddings=false",
                                         "architecture/qkv_bias=true"};

ModelOptions tiny_options(ModelFamily family, bool checkpointing, int64_t T = 16, int64_t layers = 2) {
  ModelOptions o;
  o.family = family;
  o.vocab_size = 64;
  o.block_size = T;
  o.n_layer = layers;
  o.n_head = 4;
  o.d_model = 32;
  o.dropout = 0.1;
  if (family == ModelFamily::Llama) {
    o.n_kv_head = 2;
    o.d_ff = 48;
    o.activation = ModelOptions::Activation::Silu;
    o.tie_embeddings = false;
    o.qkv_bias = true;
  }
  o.activation_checkpointing = checkpointing;
  return o;
}

struct Pass {
  torch::Tensor loss, rng_after;
  NamedTensors grads;
};

// One training forward and backward of a freshly initialised model, from a fixed generator state. The
// trainers call backward inside the autocast scope; PyTorch's recipe calls it after leaving it, and
// then the recompute must put autocast back on itself.
Pass train_pass(const ModelOptions& o, bool bf16, bool backward_in_autocast, const torch::Tensor& idx,
                const torch::Tensor& tgt) {
  CausalLM m = make_model(o);
  m->init_weights(at::detail::createCPUGenerator(3));
  m->train();
  Runtime rt;
  rt.bf16_autocast = bf16;
  torch::manual_seed(11);
  Pass p;
  {
    AutocastGuard autocast(rt);
    p.loss = m->loss_sum(idx, tgt);
    if (backward_in_autocast) p.loss.backward();
  }
  if (!backward_in_autocast) p.loss.backward();
  p.rng_after = rng_state(rt);
  for (auto& [n, t] : named_params(*m)) p.grads.emplace_back(n, t.grad());
  return p;
}

// 5 full steps, then 5 LoRA steps, in micro-batches of 2 rows, dropout on, with modules_to_save that
// live inside the blocks and outside them.
std::unique_ptr<Trainer> make_lora(const test::TwoDatasets& d, const std::string& name, bool checkpointing,
                                       bool llama) {
  Config c = test::tiny_config(Trainer::lora_schema(), d.dir / "data", llama ? kLlama : std::vector<std::string>(),
                               test::two_phase_overrides());
  c.apply_override("architecture/dropout=0.1");
  c.apply_override("training/per_device_batch_size=2");
  c.apply_override(llama ? R"(optimization/lora/modules_to_save=["embed_tokens","input_layernorm"])"
                         : R"(optimization/lora/modules_to_save=["wte","ln_1"])");
  c.apply_override(std::string("training/activation_checkpointing=") + (checkpointing ? "true" : "false"));
  return make_lora_train(test::job_spec(name), std::move(c), d.dir / "out");
}

// The trainable tensors' gradients after a step, copied.
NamedTensors grads_of(const Trainer& t) {
  NamedTensors out;
  for (const auto& [n, p] : t.trainable()) out.emplace_back(n, p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

}  // namespace

TEST_CASE("activation checkpointing: gradients equal the plain path's bit for bit, both families, dropout, f32 and bf16",
          "[activation_checkpointing][numerics]") {
  auto gen = at::detail::createCPUGenerator(5);
  auto ids = torch::randint(0, 64, {3, 17}, gen, torch::TensorOptions().dtype(torch::kLong));
  auto idx = ids.slice(1, 0, 16), tgt = ids.slice(1, 1).clone();
  tgt[0][3] = -1;  // a padded target
  for (ModelFamily family : {ModelFamily::Gpt2, ModelFamily::Llama}) {
    for (auto [bf16, inside] : {std::pair{false, true}, std::pair{true, true}, std::pair{true, false}}) {
      INFO(to_string(family) << (bf16 ? " bf16 autocast" : " f32") << (inside ? "" : ", backward after autocast"));
      Pass plain = train_pass(tiny_options(family, false), bf16, inside, idx, tgt);
      Pass ckpt = train_pass(tiny_options(family, true), bf16, inside, idx, tgt);
      CHECK(torch::equal(plain.loss, ckpt.loss));
      REQUIRE(plain.grads.size() == ckpt.grads.size());
      for (size_t i = 0; i < plain.grads.size(); ++i) {
        INFO(plain.grads[i].first);
        REQUIRE(ckpt.grads[i].second.defined());
        CHECK(torch::equal(plain.grads[i].second, ckpt.grads[i].second));
      }
      // The recompute draws nothing from the sequence training goes on with.
      CHECK(torch::equal(plain.rng_after, ckpt.rng_after));
    }
  }
}

TEST_CASE("activation checkpointing: evaluation (no gradients) computes what the plain model computes",
          "[activation_checkpointing][numerics]") {
  auto idx = torch::randint(0, 64, {2, 16}, at::detail::createCPUGenerator(2), torch::TensorOptions().dtype(torch::kLong));
  for (ModelFamily family : {ModelFamily::Gpt2, ModelFamily::Llama}) {
    CausalLM a = make_model(tiny_options(family, false)), b = make_model(tiny_options(family, true));
    a->init_weights(at::detail::createCPUGenerator(3));
    b->init_weights(at::detail::createCPUGenerator(3));
    a->eval();
    b->eval();
    torch::NoGradGuard ng;
    CHECK(torch::equal(a->forward(idx), b->forward(idx)));
  }
}

TEST_CASE("activation checkpointing: a training step holds less memory", "[activation_checkpointing]") {
  // 4 blocks of T = 128: without checkpointing each keeps its attention weights (B, H, T, T) and its
  // MLP activations; with it, only its input (B, T, C).
  auto idx = torch::randint(0, 64, {2, 128}, at::detail::createCPUGenerator(2), torch::TensorOptions().dtype(torch::kLong));
  for (ModelFamily family : {ModelFamily::Gpt2, ModelFamily::Llama}) {
    INFO(to_string(family));
    int64_t peak[2];
    for (bool on : {false, true}) {
      CausalLM m = make_model(tiny_options(family, on, 128, 4));
      m->init_weights(at::detail::createCPUGenerator(3));
      m->train();
      CpuAllocatorPeak tracker;
      m->loss_sum(idx, idx).backward();
      peak[on] = tracker.peak_bytes();
    }
    UNSCOPED_INFO(to_string(family) << ": plain " << peak[0] << " bytes, checkpointed " << peak[1] << " bytes");
    CHECK(peak[0] > 0);
    CHECK(peak[1] < peak[0] * 0.6);
  }
}

TEST_CASE("activation checkpointing: a LoRA job takes the plain job's steps bit for bit in both phases (gpt2, llama)",
          "[activation_checkpointing][lora]") {
  test::TwoDatasets d;
  for (bool llama : {false, true}) {
    INFO((llama ? "llama" : "gpt2"));
    // One after the other: dropout draws from the process's generator, which the constructor seeds.
    auto plain = make_lora(d, llama ? "plain_llama" : "plain", false, llama);
    REQUIRE(plain->total_steps() == 10);
    std::vector<StepResult> steps;
    std::vector<NamedTensors> grads;
    for (int i = 0; i < 10; ++i) {
      steps.push_back(plain->train_step());
      grads.push_back(grads_of(*plain));
    }
    auto ckpt = make_lora(d, llama ? "ckpt_llama" : "ckpt", true, llama);
    for (size_t i = 0; i < 10; ++i) {
      INFO("step " << i);
      StepResult r = ckpt->train_step();
      CHECK(r.loss == steps[i].loss);
      CHECK(r.grad_norm == steps[i].grad_norm);
      // Every trainable tensor's gradient: in phase 2 the adapters' and the modules_to_save's, inside
      // the blocks (ln_1, input_layernorm) and outside them (the embedding).
      NamedTensors g = grads_of(*ckpt);
      REQUIRE(g.size() == grads[i].size());
      for (size_t j = 0; j < g.size(); ++j) {
        INFO(g[j].first);
        REQUIRE(g[j].first == grads[i][j].first);
        REQUIRE(g[j].second.defined());
        CHECK(torch::equal(g[j].second, grads[i][j].second));
      }
    }
    REQUIRE(ckpt->in_lora_phase());
    test::require_same_state(*plain, *ckpt);
  }
}

TEST_CASE("activation checkpointing: resume mid-run is bit-identical, and the switch may change at a resume",
          "[activation_checkpointing][resume]") {
  test::TwoDatasets d;
  auto straight = make_lora(d, "straight", true, false);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) losses.push_back(straight->train_step().loss);
  // name, steps before the save, checkpointing before and after it
  for (auto [name, k, before, after] : std::vector<std::tuple<std::string, int, bool, bool>>{
           {"on_p1", 3, true, true}, {"on_p2", 7, true, true}, {"off_then_on", 7, false, true}, {"on_then_off", 3, true, false}}) {
    INFO(name);
    {
      auto first = make_lora(d, name, before, false);
      for (int i = 0; i < k; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
      first->save("ntoks/" + std::to_string(first->tokens()));
    }
    auto resumed = make_lora(d, name, after, false);
    resumed->restore_from_path("ntoks/" + std::to_string(k * 128));
    for (int64_t i = resumed->step(); i < 10; ++i) {
      INFO("step " << i);
      REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
    }
    test::require_same_state(*straight, *resumed);
  }
}

TEST_CASE("activation checkpointing: a value that is not a boolean is refused, naming the key (exit 2)",
          "[activation_checkpointing]") {
  test::TempDir dir;
  test::Result r = test::launch({"configure", "lora/train", dir / "x.json", "training/activation_checkpointing=sometimes"});
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Contains("training/activation_checkpointing"));
  r = test::launch({"configure", "lora/train", dir / "y.json", "training/activation_checkpointing=true"});
  REQUIRE(r.code == 0);
  CHECK(nlohmann::json::parse(read_file(dir / "y.json"))["training"]["activation_checkpointing"] == true);
}
