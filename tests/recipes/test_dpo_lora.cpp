// lora/train with preference pairs after the boundary: phase 1 next-token training, then DPO on the
// adapters (reference: the base with the adapters off). Phase 2 starts at log 2, learns the toy
// preference, resumes bit-identically in either phase and at the transition, and a mix of styles is
// refused; through the launcher, its metrics and report, on 1 and 2 ranks.
#include "catch.hpp"

#include <cmath>

#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "dpo_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"

using namespace lt;
using lt::test::Contains;
using lt::test::kPrefs;
using test::PrefData;

namespace {

const char* kPrefsStage = R"(training/post_lora_dataset=[[{"name":"prefs","rate":1,"style":"contrastive"}]])";

// lora/train: 4 full-parameter steps on "gen", then `dpo_steps` LoRA steps on the toy pairs (4 a step).
std::unique_ptr<Trainer> make_job(const PrefData& d, const std::string& name, int dpo_steps,
                                      const std::vector<std::string>& extra = {}) {
  const std::vector<std::string> job = {"training/pre_lora_tokens=[512]",
                                        R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
                                        "training/post_lora_tokens=[" + std::to_string(dpo_steps * 128) + "]",
                                        kPrefsStage, "optimization/lora/rank=4"};
  return test::build_job<Trainer>(
      "lora/train", name, test::tiny_config(job_registry().find("lora/train").schema(), d.dir / "data", job, extra),
      d.dir / "out");
}

DpoPart& as_dpo(Trainer& t) {
  auto* d = t.part<DpoPart>();
  REQUIRE(d);  // contrastive post-LoRA datasets make the DPO form
  return *d;
}


}  // namespace

TEST_CASE("lora/train with preference pairs after the boundary: next-token phase 1, DPO phase 2 from log 2 that learns",
          "[dpo][lora]") {
  PrefData d;
  const std::vector<std::string> recipe = {"optimization/lora/lr=0.01", "optimization/lora/schedule=constant",
                                           "optimization/dpo/beta=0.5"};
  auto t = make_job(d, "toy", 40, recipe);
  DpoPart& dpo = as_dpo(*t);
  CHECK(dpo.dpo_options().beta == 0.5);
  // The plan: phase 1 with the next-token loss of any lora/train job, phase 2 with DPO's.
  const std::vector<Phase> plan = t->phases();
  REQUIRE(plan.size() == 2);
  CHECK(plan[0].loss != plan[1].loss);
  // Phase 1 is the next-token training of any lora/train job: the same losses as one whose phase 2 is text.
  auto text = make_job(d, "text", 40, {R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])"});
  CHECK(text->part<DpoPart>() == nullptr);
  CHECK(text->phases()[0].loss == text->phases()[1].loss);
  for (int i = 0; i < 4; ++i) {
    INFO("step " << i + 1);
    REQUIRE(t->train_step().loss == text->train_step().loss);
  }
  REQUIRE(!t->in_lora_phase());
  const DatasetEval v0 = t->evaluate({kPrefs}, 10)[0];  // no adapters yet: the model is its reference
  CHECK(v0.loss == Approx(std::log(2.0)).epsilon(1e-14));
  CHECK(v0.dpo.reward_margin == 0.0);

  StepResult r = t->train_step();  // the transition puts on adapters with B = 0: pi = ref exactly
  REQUIRE(t->in_lora_phase());
  CHECK(r.loss == Approx(std::log(2.0)).epsilon(1e-15));
  CHECK(dpo.last_step().pairs == 4);
  CHECK(dpo.last_step().margin == 0.0);
  CHECK(dpo.last_step().correct == 0.0);
  CHECK(r.grad_norm > 0);

  for (int i = 1; i < 40; ++i) t->train_step();
  const DatasetEval v1 = t->evaluate({kPrefs}, 10)[0];
  INFO("margin " << v0.dpo.reward_margin << " -> " << v1.dpo.reward_margin << ", accuracy " << v0.dpo.accuracy << " -> "
                 << v1.dpo.accuracy << ", loss " << v0.loss << " -> " << v1.loss);
  CHECK(v0.dpo.accuracy == 0.0);
  CHECK(v1.dpo.accuracy >= 0.9);
  CHECK(v1.dpo.reward_margin > v0.dpo.reward_margin + 1.0);
  CHECK(v1.loss < 0.5 * std::log(2.0));
  CHECK(dpo.last_step().correct == dpo.last_step().pairs);
}

TEST_CASE("lora/train with DPO after the boundary: resume mid phase 1, at the transition and mid phase 2 is bit-identical",
          "[dpo][lora]") {
  PrefData d;
  auto straight = make_job(d, "straight", 6);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) losses.push_back(straight->train_step().loss);
  // 2: mid phase 1 (a plain state); 4: pre_lora_checkpoint, written as step 5 starts; 7: mid DPO (a LoRA state).
  const int at = GENERATE(2, 4, 7);
  INFO("resumed after step " << at);
  const std::string name = "split" + std::to_string(at);
  std::string checkpoint;
  {
    auto first = make_job(d, name, 6);
    for (int i = 0; i < at; ++i) REQUIRE(first->train_step().loss == losses[static_cast<size_t>(i)]);
    if (at == 4) {
      first->train_step();  // the transition saves the boundary's plain state first
      checkpoint = "pre_lora_checkpoint";
    } else {
      checkpoint = "ntoks/" + std::to_string(at * 128);
      first->save(checkpoint);
    }
  }
  auto resumed = make_job(d, name, 6);
  resumed->restore_from_path(checkpoint);
  REQUIRE(resumed->step() == at);
  CHECK(resumed->in_lora_phase() == (at > 4));
  for (int64_t i = at; i < 10; ++i) {
    INFO("step " << i + 1);
    REQUIRE(resumed->train_step().loss == losses[static_cast<size_t>(i)]);
  }
  test::require_same_state(*straight, *resumed);
  const DpoStats& a = as_dpo(*straight).last_step();
  const DpoStats& b = as_dpo(*resumed).last_step();
  CHECK(a.margin == b.margin);
  CHECK(a.correct == b.correct);
}

TEST_CASE("lora/train refuses preference pairs mixed with text after the boundary, or before it (exit status 2)",
          "[dpo][lora]") {
  PrefData d;
  test::make_byte_dataset(d.dir / "data", "gen2", 2);
  auto configure = [&](const std::string& kind, const std::string& path, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"configure", kind, path};
    for (const auto& o : test::tiny_overrides(d.dir / "data")) args.push_back(o);
    args.insert(args.end(), extra.begin(), extra.end());
    REQUIRE(test::launch(args).code == 0);
  };
  configure("lora/train", d.dir / "mixed.json",
            {R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])", "training/post_lora_tokens=[256,256]",
             R"(training/post_lora_dataset=[[{"name":"prefs","rate":1,"style":"contrastive"}],[{"name":"gen2","rate":1}]])"});
  auto mixed = test::launch({"run", "mixed", d.dir / "mixed.json", d.dir / "out"});
  INFO(mixed.out);
  CHECK(mixed.code == 2);
  CHECK_THAT(mixed.out, Contains("training/post_lora_dataset mixes datasets of different kinds") &&
                            Contains("\"prefs\" (contrastive), \"gen2\" (pmd)"));
  configure("lora/train", d.dir / "early.json",
            {R"(training/pre_lora_dataset=[[{"name":"prefs","rate":1,"style":"contrastive"}]])",
             R"(training/post_lora_dataset=[[{"name":"gen2","rate":1}]])"});
  auto early = test::launch({"run", "early", d.dir / "early.json", d.dir / "out"});
  INFO(early.out);
  CHECK(early.code == 2);
  CHECK_THAT(early.out, Contains("training/pre_lora_dataset has preference pairs or prompts: \"prefs\" (contrastive)") &&
                            Contains("Phase 1 trains every parameter on next-token prediction"));
  CHECK_THROWS_WITH(make_job(d, "mts", 2, {R"(optimization/lora/modules_to_save=["wte"])"}),
                    Contains("modules_to_save must be [] in a lora/train job whose post-LoRA datasets are preference pairs"));
  // The continual LoRA benchmark measures forgetting by perplexity: no DPO phase, no optimization/dpo keys.
  CHECK(job_registry().find("lora/train").schema().find("optimization/dpo/label_smoothing"));
  CHECK_FALSE(job_registry().find("continual/train/benchmark_lora").schema().find("optimization/dpo/beta"));
  configure("continual/train/benchmark_lora", d.dir / "bench.json", {kPrefsStage, R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])"});
  auto bench = test::launch({"run", "bench", d.dir / "bench.json", d.dir / "out"});
  CHECK(bench.code == 2);
  CHECK_THAT(bench.out, Contains("\"prefs\" is contrastive") && Contains("the LoRA phase of a `lora/train` job"));
}

TEST_CASE("lora/train with DPO through the launcher: DPO figures in metrics and report, 2 ranks take the steps of 1",
          "[dpo][lora][distributed]") {
  PrefData d;
  std::vector<std::string> args = {"configure", "lora/train", d.dir / "job.json"};
  for (const auto& o : test::tiny_overrides(d.dir / "data")) args.push_back(o);
  for (const auto& o : {"training/batch_size=8", "training/per_device_batch_size=2", "runtime/precision=f32",
                        "runtime/threads=1", "logging/report_interval=1", "logging/validation_interval=3",
                        "training/validation_steps=8", "distributed/timeout_s=20", "training/pre_lora_tokens=[1024]",
                        R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])", "training/post_lora_tokens=[1536]",
                        kPrefsStage, "optimization/lora/rank=4", "optimization/lora/lr=0.01",
                        "optimization/lora/schedule=constant", "optimization/dpo/beta=0.5"})
    args.push_back(o);
  REQUIRE(test::launch(args).code == 0);
  auto one = test::launch({"run", "job", d.dir / "job.json", d.dir / "one"});
  INFO(one.out);
  REQUIRE(one.code == 0);
  CHECK_THAT(one.out, Contains("transition to LoRA at step 4") && Contains("prefs dpo loss") &&
                          Contains("validation DPO") && Contains("prefs, before LoRA (step 4)") &&
                          Contains("prefs, after LoRA (step 10)") &&
                          Contains("DPO steps (step lines 5 -> 10): loss 0.6931 -> ") &&
                          Contains("  before LoRA (step 4)"));
  auto two = test::launch({"run", "job", d.dir / "job.json", d.dir / "two", "--nproc", "2"});
  INFO(two.out);
  REQUIRE(two.code == 0);

  std::vector<nlohmann::json> train1, train2, val1, val2;
  auto split = [&](const std::string& out, std::vector<nlohmann::json>& train, std::vector<nlohmann::json>& val) {
    for (const auto& e : test::read_metrics_lines(d.dir / (out + "/runs/general/default/job"))) {
      if (e["event"] == "train") train.push_back(e);
      if (e["event"] == "val") val.push_back(e);
    }
  };
  split("one", train1, val1);
  split("two", train2, val2);
  REQUIRE(train1.size() == 10);
  REQUIRE(train2.size() == 10);
  // The two runs' parameters differ in their last bits from the first step (2 ranks sum the gradients in
  // another order), and Adam's steps at lr 0.01 grow that. A reward margin is beta times a difference of
  // four sums of up to block_size (32) log-probabilities of up to ln 257 each: 1e-5 of that scale (3.6e-3)
  // holds what the CPUs' kernels give (2.4e-4 with AVX-512's oneDNN products), where a rank that
  // computed the margin otherwise would be off by tenths.
  const double margin_tolerance = 1e-5 * 0.5 * 4 * 32 * std::log(257.0);
  for (size_t i = 0; i < 10; ++i) {
    INFO("step " << i + 1 << ": " << train1[i].dump() << "\n" << train2[i].dump());
    CHECK(train1[i].contains("reward_margin") == (i >= 4));  // phase 1's lines have no DPO figures
    CHECK(std::abs(train1[i]["loss"].get<double>() - train2[i]["loss"].get<double>()) <= 1e-4 * (1 + train1[i]["loss"].get<double>()));
    if (i >= 4)
      for (const char* k : {"reward_margin", "accuracy"})
        CHECK(std::abs(train1[i][k].get<double>() - train2[i][k].get<double>()) <= (k[0] == 'r' ? margin_tolerance : 0.0));
  }
  CHECK(train1[4]["loss"].get<double>() == Approx(std::log(2.0)).epsilon(1e-12));  // adapters at B = 0
  CHECK(train1[4]["reward_margin"].get<double>() == 0.0);
  // Validations at steps 3, 4 (phase 1), 6, 9 and 10, of every dataset (eval/evaluations "perplexity"):
  // the text's perplexity, the pairs' DPO figures, at log 2 before the adapters.
  REQUIRE(val1.size() == 5);
  REQUIRE(val2.size() == 5);
  for (size_t i = 0; i < 5; ++i) {
    INFO(val1[i].dump() << "\n" << val2[i].dump());
    CHECK(val1[i]["perplexity"].contains("gen"));
    CHECK_FALSE(val1[i]["perplexity"].contains("prefs"));
    if (i < 2) CHECK(val1[i]["per_dataset"]["prefs"].get<double>() == Approx(std::log(2.0)).epsilon(1e-12));
    CHECK(std::abs(val1[i]["reward_margin"]["prefs"].get<double>() - val2[i]["reward_margin"]["prefs"].get<double>()) <= margin_tolerance);
    CHECK(val1[i]["accuracy"]["prefs"] == val2[i]["accuracy"]["prefs"]);
  }
  CHECK(val1.back()["reward_margin"]["prefs"].get<double>() > 0);
}
