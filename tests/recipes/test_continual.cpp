// Continual-learning benchmark trainers: stage switches and fades at exact steps, boundary
// checkpoints and the forgetting matrix, exact resume, and the LoRA variant.
#include "catch.hpp"

#include "lora_trainer/recipes/continual.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "fixtures.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

struct Data {
  test::TempDir dir;
  Data() {
    test::make_byte_dataset(dir / "data", "a", 1);
    test::make_byte_dataset(dir / "data", "b", 2);
    test::make_byte_dataset(dir / "data", "c", 3);
  }
};

// The forgetting matrix of a continual job (its ContinualPart's).
const json& forgetting_of(const Trainer& t) {
  const ContinualPart* part = t.part<ContinualPart>();
  REQUIRE(part);
  return part->forgetting();
}

const char* kThreeStages = R"(training/dataset=[[{"name":"a","rate":1}],[{"name":"b","rate":1}],[{"name":"c","rate":1}]])";

// Three stages of 4 steps each (128 tokens a step).
std::unique_ptr<Trainer> make_bench(const Data& d, const std::string& name, std::vector<std::string> extra = {},
                                             const std::string& out = "out") {
  const std::vector<std::string> job = {"training/tokens=[512,512,512]", kThreeStages, "eval/boundary_rows=4"};
  return make_continual(test::job_spec(name), test::tiny_config(continual_schema(), d.dir / "data", job, extra),
                        d.dir / out);
}

}  // namespace

TEST_CASE("fade curves run from 0 to 1", "[benchmark]") {
  for (const std::string& name : fade_curve_names()) {
    INFO(name);
    const FadeCurve c = parse_fade_curve(name);
    CHECK(fade_curve(0.0, c) == Approx(0.0).margin(1e-12));
    CHECK(fade_curve(1.0, c) == Approx(1.0));
    CHECK(fade_curve(0.5, c) == Approx(0.5));
    CHECK(fade_curve(0.25, c) < fade_curve(0.75, c));
  }
  CHECK(fade_curve(0.25, FadeCurve::Linear) == Approx(0.25));
  CHECK(fade_curve(0.25, FadeCurve::Cosine) == Approx(0.5 * (1 - std::cos(M_PI / 4))));
}

TEST_CASE("stage switches and fade weights fall on the exact steps", "[benchmark]") {
  std::vector<Stage> stages(3);
  for (int i = 0; i < 3; ++i) {
    stages[i].first_step = 10 * i;
    stages[i].end_step = 10 * (i + 1);
  }
  // No fade: the stage of each step.
  CHECK(fade_at(stages, 9, 0, FadeCurve::Linear).from == 0);
  CHECK(fade_at(stages, 10, 0, FadeCurve::Linear).from == 1);
  CHECK(fade_at(stages, 29, 0, FadeCurve::Linear).from == 2);
  // A 4-step window before each boundary: steps 6..9 fade 0 -> 1 at k / 5.
  CHECK(fade_at(stages, 5, 4, FadeCurve::Linear).weight == 0.0);
  for (int k = 1; k <= 4; ++k) {
    FadeAt f = fade_at(stages, 5 + k, 4, FadeCurve::Linear);
    CHECK(f.from == 0);
    CHECK(f.to == 1);
    CHECK(f.weight == Approx(k / 5.0));
  }
  CHECK(fade_at(stages, 10, 4, FadeCurve::Linear).weight == 0.0);  // fully stage 1 at its first step
  CHECK(fade_at(stages, 19, 4, FadeCurve::Linear).to == 2);
  CHECK(fade_at(stages, 29, 4, FadeCurve::Linear).weight == 0.0);  // no fade after the last stage
  CHECK(fade_at(stages, 9, 4, FadeCurve::Linear, 0).weight == 0.0);  // nor across a stage marked as a phase end
  // Rows split by largest remainder and sum to the batch.
  for (int b : {1, 3, 16, 33}) {
    auto rows = largest_remainder({1 - 0.4, 0.4}, b);
    CHECK(rows[0] + rows[1] == b);
  }
}

TEST_CASE("a fading batch takes its rows from both stages", "[benchmark]") {
  Data d;
  // Overlap of 2 steps (256 tokens): steps 2 and 3 mix stage 0 and 1 at weights 1/3 and 2/3.
  auto t2 = make_bench(d, "fade4", {"training/fade/overlap=256"});
  REQUIRE(t2->data().stages()[0].end_step == 4);
  t2->train_step();
  t2->train_step();
  // Steps 2 and 3 are the window. The batch itself is checked through the sampler cursors in the
  // checkpoint metadata: stage 1's sampler has drawn round(4 x 1/3) + round(4 x 2/3) rows by step 4.
  t2->train_step();
  t2->train_step();
  t2->save("ntoks/512");
  auto meta = read_checkpoint_metadata(t2->job_dir() + "/ntoks/512");
  CHECK(meta["data"]["cursors"]["0"] == 4 + 4 + 3 + 1);
  CHECK(meta["data"]["cursors"]["1"] == 1 + 3);
}

TEST_CASE("boundaries save checkpoints and the forgetting matrix, and a resumed run equals the straight one", "[benchmark]") {
  Data d;
  const std::vector<std::string> opts = {"training/fade/overlap=256", "training/reset_optimizer=true",
                                         "logging/checkpoint_interval=7"};
  auto straight = make_bench(d, "straight", opts);
  straight->run();
  std::string job = straight->job_dir();
  for (std::string s : {"boundary_0_1", "boundary_1_2", "boundary_2_end"}) CHECK(is_checkpoint(job + "/" + s));
  CHECK(read_checkpoint_metadata(job + "/boundary_0_1")["step"] == 4);
  const auto& m = forgetting_of(*straight);
  REQUIRE(m.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(m[i]["after_stage"] == i);
    CHECK(m[i]["loss"].size() == 3);  // every stage's data
  }
  CHECK_THAT(read_file(straight->run_dir() + "/forgetting.txt"), Contains("stage 2 (step 12)"));
  CHECK_THAT(read_file(straight->run_dir() + "/forgetting.svg"), Contains("after stage 1"));

  // The periodic checkpoint at step 7 lies inside the second fade window; the same job resumed from
  // it (in another output root) ends exactly where the straight run ended.
  auto resumed = make_bench(d, "straight", opts, "out2");
  resumed->restore_from_path(job + "/ntoks/896");
  CHECK(resumed->step() == 7);
  REQUIRE(forgetting_of(*resumed).size() == 1);
  resumed->run();
  test::require_same_state(*straight, *resumed);
  REQUIRE(forgetting_of(*resumed).size() == 3);
  CHECK(forgetting_of(*resumed) == m);
  // A boundary checkpoint restores (with the optimizer already reset for the next stage), and the
  // rest of the run equals the uninterrupted one; a new name keeps the matrix too.
  auto from_boundary = make_bench(d, "branch", opts, "out3");
  from_boundary->restore_from_path(job + "/boundary_1_2");
  CHECK(from_boundary->step() == 8);
  CHECK(forgetting_of(*from_boundary).size() == 2);
  from_boundary->run();
  test::require_same_state(*straight, *from_boundary);
  CHECK(forgetting_of(*from_boundary) == m);
}

// A benchmark_lora job of two pre-LoRA and two LoRA stages (12 steps) on the tiny model.
std::unique_ptr<Trainer> make_benchmark_lora(const Data& d, const std::string& name,
                                                              const std::vector<std::string>& extra = {}) {
  const std::vector<std::string> job = {
      "training/pre_lora_tokens=[384,384]",
      R"(training/pre_lora_dataset=[[{"name":"a","rate":1}],[{"name":"b","rate":1}]])",
      "training/post_lora_tokens=[384,384]",
      R"(training/post_lora_dataset=[[{"name":"c","rate":1}],[{"name":"a","rate":1}]])",
      "optimization/lora/rank=4",
      "training/fade/overlap=128",
      "eval/boundary_rows=4"};
  return make_continual_lora(test::job_spec(name), test::tiny_config(continual_lora_schema(), d.dir / "data", job, extra),
                             d.dir / "out");
}

TEST_CASE("benchmark LoRA: pre-LoRA stages, the switch, LoRA stages, a bit-identical base and restores in each phase", "[benchmark]") {
  Data d;
  auto make = [&](const std::string& name) { return make_benchmark_lora(d, name); };
  auto straight = make("bl");
  std::vector<double> losses;
  NamedTensors base_at_switch;
  while (!straight->done()) {
    losses.push_back(straight->train_step().loss);
    if (straight->step() == 7) {  // the first LoRA step has been taken: the base is frozen
      for (auto& [n, t] : base_params(*straight->model())) base_at_switch.emplace_back(n, t.clone());
    }
  }
  REQUIRE(straight->total_steps() == 12);
  for (size_t i = 0; i < base_at_switch.size(); ++i) {
    INFO(base_at_switch[i].first);
    CHECK(torch::equal(base_at_switch[i].second, base_params(*straight->model())[i].second));
  }
  // A run through the launcher's path keeps the matrix: one row per stage end.
  auto full = make("bl_run");
  full->run();
  REQUIRE(forgetting_of(*full).size() == 4);
  std::string job = full->job_dir();
  CHECK(is_checkpoint(job + "/boundary_0_1"));
  CHECK(is_checkpoint(job + "/lora_boundary_1_2"));
  CHECK(is_checkpoint(job + "/boundary_2_3"));
  CHECK(is_checkpoint(job + "/boundary_3_end"));
  CHECK(read_checkpoint_metadata(job + "/lora_boundary_1_2")["kind"] == "plain");
  CHECK(read_checkpoint_metadata(job + "/boundary_2_3")["kind"] == "lora");
  // Restore at the switch (plain) and inside the LoRA stages: the rest equals the uninterrupted run.
  for (std::string suffix : {"lora_boundary_1_2", "boundary_2_3"}) {
    INFO(suffix);
    auto r = make("bl_run");
    r->restore_from_path(suffix);
    int64_t from = r->step();
    for (int64_t i = from; i < 12; ++i) CHECK(r->train_step().loss == losses[static_cast<size_t>(i)]);
    CHECK(r->in_lora_phase());
  }
}

TEST_CASE("benchmark LoRA with reset_optimizer: the reset keeps the modules_to_save and their lr ratio", "[benchmark]") {
  Data d;
  const std::vector<std::string> job = {"training/pre_lora_tokens=[384]",
                                        R"(training/pre_lora_dataset=[[{"name":"a","rate":1}]])",
                                        "training/post_lora_tokens=[384,384]",
                                        R"(training/post_lora_dataset=[[{"name":"b","rate":1}],[{"name":"c","rate":1}]])",
                                        "optimization/lora/rank=4",
                                        "training/reset_optimizer=true",
                                        "eval/boundary_rows=4",
                                        R"(optimization/lora/modules_to_save=["ln_f"])",
                                        "optimization/lora/modules_to_save_lr_ratio=0.25"};
  auto job_ptr = make_continual_lora(test::job_spec("reset"), test::tiny_config(continual_lora_schema(), d.dir / "data", job),
                                     d.dir / "out");
  Trainer& t = *job_ptr;
  t.run();
  REQUIRE(t.in_lora_phase());
  const auto names = t.optimizer().param_names();
  const auto& scale = t.optimizer().lr_scale();
  REQUIRE(names.size() == scale.size());
  REQUIRE(names.back() == "ln_f.bias");
  CHECK(scale.back() == 0.25);
  CHECK(scale.front() == 1.0);
}

TEST_CASE("benchmark jobs are registered and their lists are checked", "[benchmark]") {
  Data d;
  CHECK_THROWS_WITH(make_bench(d, "bad", {"training/tokens=[512,512]"}),
                    Contains("training/tokens has 2 stages but training/dataset has 3"));
}

TEST_CASE("benchmark LoRA with a llama-family model: stage ends, the switch and a restore inside the LoRA stages", "[benchmark][llama]") {
  Data d;
  const std::vector<std::string> llama = {"architecture/family=llama", "architecture/activation=silu",
                                          "architecture/n_kv_heads=1", "architecture/tie_embeddings=false"};
  auto straight = make_benchmark_lora(d, "ll", llama);
  std::vector<double> losses;
  while (!straight->done()) losses.push_back(straight->train_step().loss);
  REQUIRE(losses.size() == 12);
  CHECK(straight->in_lora_phase());
  auto full = make_benchmark_lora(d, "ll_run", llama);
  full->run();
  REQUIRE(forgetting_of(*full).size() == 4);
  auto r = make_benchmark_lora(d, "ll_run", llama);
  r->restore_from_path("boundary_2_3");
  CHECK(r->in_lora_phase());
  for (int64_t i = r->step(); i < 12; ++i) CHECK(r->train_step().loss == losses[static_cast<size_t>(i)]);
}
