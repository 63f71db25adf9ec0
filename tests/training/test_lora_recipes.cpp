// The LoRA job's recipes beside plain adapters: init_from (adapters from an earlier run), the EMA of the
// trained weights, param_groups, and their checks before training starts.
#include "catch.hpp"

#include <csignal>

#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/training/report.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

using Data = test::TwoDatasets;
using test::logits_of;
using test::make_lora;
using test::snapshot;
using test::tiny_gpt;


TEST_CASE("init_from starts the adapters from an earlier run's, read from our checkpoint or its PEFT export", "[lora]") {
  Data d;
  auto src = make_lora(d, "src");
  src->run();
  const std::string final_ck = src->job_dir() + "/final/1280";
  REQUIRE(is_checkpoint(final_ck));
  export_peft(final_ck, d.dir / "peft");
  auto started_from = [&](const std::string& name, const std::string& from) {
    auto t = make_lora(d, name, {"optimization/lora/init_from=\"" + from + "\""});
    for (int i = 0; i < 5; ++i) t->train_step();
    t->transition_to_lora();
    const auto& a = t->lora_params();
    const auto& b = src->lora_params();
    REQUIRE(a.names == b.names);
    for (size_t i = 0; i < a.names.size(); ++i) {
      INFO(a.names[i]);
      CHECK(torch::equal(a.A[i], b.A[i]));
      CHECK(torch::equal(a.B[i], b.B[i]));
    }
    CHECK(torch::count_nonzero(a.B[0]).item<int64_t>() > 0);  // trained adapters, not fresh ones
    return t;
  };
  SECTION("our checkpoint") {
    auto t = started_from("from_ck", final_ck);
    t->train_step();  // and they train on from there
    CHECK_FALSE(torch::equal(t->lora_params().B[0], src->lora_params().B[0]));
  }
  SECTION("a PEFT adapter directory") { started_from("from_peft", d.dir / "peft"); }
  SECTION("a source that does not fit is refused, naming the key to change") {
    auto refused = [&](const std::vector<std::string>& extra, const std::string& text) {
      INFO(text);
      std::vector<std::string> o = {"optimization/lora/init_from=\"" + final_ck + "\""};
      o.insert(o.end(), extra.begin(), extra.end());  // later overrides win
      auto t = make_lora(d, "bad", o);
      for (int i = 0; i < 5; ++i) t->train_step();
      CHECK_THROWS_WITH(t->transition_to_lora(), Contains(text));
    };
    refused({"optimization/lora/rank=2"}, "Set optimization/lora/rank=4");
    refused({"optimization/lora/alpha=32"}, "they would compute another function");
    refused({R"(optimization/lora/target_modules=["attn.c_attn"])"}, "which this job does not");
    refused({"optimization/lora/init_from=\"" + src->job_dir() + "/pre_lora_checkpoint\""}, "is a plain checkpoint");
  }
}

namespace {
// The ema/<name> tensors of a trainer's state, by name (without "ema/").
std::map<std::string, torch::Tensor> ema_of(Trainer& t) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, v] : t.state_tensors())
    if (n.rfind("ema/", 0) == 0) out[n.substr(4)] = v.clone();
  return out;
}
}  // namespace

TEST_CASE("EMA: the average equals the hand-computed one in both phases, restarts over the adapters, and resumes bit-identically", "[lora][ema]") {
  Data d;
  const std::vector<std::string> ema = {"optimization/ema/decay=0.75", "runtime/precision=f32"};
  auto t = make_lora(d, "ema", ema);
  // by hand: avg_0 = p_0, avg_k = 0.75 avg_{k-1} + 0.25 p_k, over the trainable parameters of each phase
  std::map<std::string, torch::Tensor> hand;
  for (auto& [n, p] : t->trainable()) hand[n] = p.detach().clone();
  for (int i = 1; i <= 5; ++i) {
    t->train_step();
    for (auto& [n, p] : t->trainable()) hand[n] = 0.75 * hand[n] + 0.25 * p.detach();
  }
  auto avg = ema_of(*t);
  REQUIRE(avg.size() == hand.size());
  REQUIRE(avg.count("wte.weight") == 1);
  for (auto& [n, h] : hand) {
    INFO(n);
    CHECK(torch::allclose(avg.at(n), h, 1e-6, 1e-7));
  }
  CHECK_FALSE(torch::equal(avg.at("wte.weight"), t->trainable()[0].second));  // an average, not the weights
  t->transition_to_lora();
  hand.clear();
  for (auto& [n, p] : t->trainable()) hand[n] = p.detach().clone();
  for (int i = 6; i <= 8; ++i) {
    t->train_step();
    for (auto& [n, p] : t->trainable()) hand[n] = 0.75 * hand[n] + 0.25 * p.detach();
  }
  avg = ema_of(*t);
  REQUIRE(avg.size() == t->lora_params().names.size() * 2);  // only the adapters now
  for (auto& [n, h] : hand) {
    INFO(n);
    CHECK(torch::allclose(avg.at(n), h, 1e-6, 1e-7));
  }

  // Resume mid phase 2: the average comes back with everything else.
  auto straight = make_lora(d, "ema_straight", ema);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) losses.push_back(straight->train_step().loss);
  {
    auto first = make_lora(d, "ema_split", ema);
    for (int i = 0; i < 8; ++i) first->train_step();
    first->save("ntoks/1024");
  }
  auto resumed = make_lora(d, "ema_split", ema);
  resumed->restore_from_path("ntoks/1024");
  for (int64_t i = resumed->step(); i < 10; ++i) REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
  test::require_same_state(*straight, *resumed);
  CHECK(ema_of(*resumed).size() == 2 * resumed->lora_params().names.size());
}

TEST_CASE("EMA weights: eval/use_ema evaluates the average and puts the weights back, export --ema writes it", "[lora][ema]") {
  Data d;
  auto t = make_lora(d, "ema", {"optimization/ema/decay=0.5", "runtime/precision=f32"});
  t->run();
  const std::string ck = t->job_dir() + "/final/1280";
  // export --ema merges the averaged adapters; without --ema the trained ones.
  const auto meta = read_checkpoint_metadata(ck);
  CHECK(meta["ema"]["decay"] == 0.5);
  auto plain = merged_weights(ck), averaged = merged_weights(ck, /*use_ema=*/true);
  std::map<std::string, torch::Tensor> tensors;
  for (auto& [n, v] : test::checkpoint_tensors(ck)) tensors[n] = v;
  const std::string w = "h.0.attn.c_attn.weight";
  auto find = [&](const MergedWeights& m) {
    for (auto& [n, v] : m.params)
      if (n == w) return v;
    return torch::Tensor();
  };
  auto expected = merge_lora_params(tensors.at("params/" + w).to(torch::kFloat32), tensors.at("ema/h.0.attn.c_attn.lora_A"),
                                    tensors.at("ema/h.0.attn.c_attn.lora_B"), meta["lora"]["alpha"].get<double>(), 4);
  CHECK(torch::equal(find(averaged), expected));
  CHECK_FALSE(torch::equal(find(averaged), find(plain)));
  // eval with and without the average: different losses, and the weights are the trained ones after.
  test::TempDir out;
  auto with = from_checkpoint_path(ck, "", out / "a", {"eval/use_ema=true"});
  auto without = from_checkpoint_path(ck, "", out / "b", {});
  auto* tw = dynamic_cast<Trainer*>(with.get());
  auto* tn = dynamic_cast<Trainer*>(without.get());
  const auto rows = parse_samplings(nlohmann::json::parse(R"([{"name":"gen2","rate":1}])"));
  const double lw = tw->evaluate(rows, 4)[0].loss, ln = tn->evaluate(rows, 4)[0].loss;
  CHECK(lw != ln);
  for (size_t i = 0; i < tw->lora_params().A.size(); ++i) CHECK(torch::equal(tw->lora_params().A[i], tn->lora_params().A[i]));
  // A checkpoint without an average: export --ema says so.
  auto none = make_lora(d, "none", {"runtime/precision=f32"});
  none->run();
  CHECK_THROWS_WITH(merged_weights(none->job_dir() + "/final/1280", true), Contains("holds no moving average"));
}

TEST_CASE("param_groups: a rule's lr ratio applies in phase 1 and to the adapters, and a rule that matches nothing is refused", "[lora][optim]") {
  Data d;
  auto t = make_lora(d, "groups", {R"(optimization/param_groups=[{"match":"h.0.","lr_ratio":1e-9},{"match":"lora_A","lr_ratio":1e-9,"weight_decay":false}])",
                                   "runtime/precision=f32"});
  auto before = snapshot(named_params(*t->model()));
  for (int i = 0; i < 3; ++i) t->train_step();
  auto after = named_params(*t->model());
  for (size_t i = 0; i < before.size(); ++i) {
    INFO(before[i].first);
    const double moved = (after[i].second - before[i].second).abs().max().item<double>();
    if (before[i].first.rfind("h.0.", 0) == 0) CHECK(moved < 1e-8);
    else if (before[i].first.find("ln_") == std::string::npos && before[i].first.find("bias") == std::string::npos)
      CHECK(moved > 1e-5);
  }
  for (int i = 0; i < 2; ++i) t->train_step();
  t->transition_to_lora();
  auto A = snapshot(t->lora_params().named());
  for (int i = 0; i < 3; ++i) t->train_step();
  auto now = t->lora_params().named();
  for (size_t i = 0; i < A.size(); ++i) {
    INFO(A[i].first);
    const double moved = (now[i].second - A[i].second).abs().max().item<double>();
    // h.0.'s adapters fall under the first rule too (the first match applies); the other B train.
    if (A[i].first.find("lora_A") != std::string::npos || A[i].first.rfind("h.0.", 0) == 0) CHECK(moved < 1e-8);
    else CHECK(moved > 1e-5);
  }
  CHECK_THROWS_WITH(make_lora(d, "bad", {R"(optimization/param_groups=[{"match":"q_proj"}])"}),
                    Contains("optimization/param_groups: \"q_proj\" matches no parameter of this model"));
  CHECK_THROWS_WITH(make_lora(d, "bad", {R"(optimization/param_groups=[{"match":"wte","lr":0.1}])"}),
                    Contains("unknown field \"lr\" (known: match, lr_ratio, weight_decay)"));
}

TEST_CASE("init_from and eval/use_ema are checked before training starts, not at the transition", "[lora][ema]") {
  Data d;
  auto t = make_lora(d, "early", {"optimization/lora/init_from=\"" + (d.dir / "nowhere") + "\""});
  CHECK_THROWS_WITH(t->run(), Contains("optimization/lora/init_from: " + (d.dir / "nowhere") + " is not a directory"));
  CHECK(t->step() == 0);  // refused before the first step
  CHECK_THROWS_WITH(make_lora(d, "ema", {"eval/use_ema=true"}), Contains("eval/use_ema is true but optimization/ema/decay is 0"));
}

// ---- trainable_token_indices (PEFT's trainable tokens): chosen rows of the token embedding train ----
