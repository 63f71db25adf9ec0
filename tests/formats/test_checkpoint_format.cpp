// Old checkpoints keep working: tests/data/checkpoints/format1_lora is a LoRA-phase checkpoint written
// by format version 1 (before the adapters became parameters of their layers: its adapters, DoRA
// magnitudes and trainable token rows are stored as lora/<name>, not params/<name>). This build must
// restore every one of its tensors into the job's state, go on training with the losses that the
// build which wrote it recorded for the same steps (expected.json), and save format 2.
//
// The fixture was written by the build before the change, with
//   LT_FORMAT1_WRITE=1 build/lora_trainer_tests "[format1-write]"
// (a job of 4 full-parameter and 8 LoRA steps with DoRA, trainable token rows and an EMA, checkpointed
// at step 6; expected.json holds the losses of steps 7 to 12 of that same run). Never rewrite it with
// a newer build: it stands for the files users already have.
#include "catch.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const fs::path kFixture = fs::path(LT_SOURCE_DIR) / "tests/data/checkpoints/format1_lora";

// The fixture's job: the tiny model, two phases, DoRA, three trainable token rows and an EMA.
std::vector<std::string> fixture_settings(const std::string& data_dir) {
  std::vector<std::string> s = test::tiny_overrides(data_dir);
  for (const char* o : {"runtime/device=cpu", "runtime/precision=f32", "runtime/threads=1", "logging/report_interval=1",
                        "logging/checkpoint_interval=6", "training/pre_lora_tokens=[512]",
                        R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])", "training/post_lora_tokens=[1024]",
                        R"(training/post_lora_dataset=[[{"name":"gen2","rate":1}]])", "optimization/lora/rank=4",
                        "optimization/lora/lr=0.01", "optimization/lora/dora=true",
                        "optimization/lora/trainable_token_indices=[10,32,101]", "optimization/ema/decay=0.9"})
    s.push_back(o);
  return s;
}

// Writes the fixture's config into `dir` (with its datasets) and returns the config's path.
std::string configure_fixture_job(const test::TwoDatasets& d) {
  std::vector<std::string> args = {"configure", "lora/train", d.dir / "job.json"};
  for (const auto& o : fixture_settings(d.dir / "data")) args.push_back(o);
  auto r = test::launch(args);
  INFO(r.out);
  REQUIRE(r.code == 0);
  return d.dir / "job.json";
}

// {step: loss} of the train events after `after`.
json losses_after(const std::string& run_dir, int64_t after) {
  json out = json::object();
  for (const auto& e : test::read_metrics_lines(run_dir))
    if (e.value("event", "") == "train" && e.value("step", int64_t(0)) > after)
      out[std::to_string(e["step"].get<int64_t>())] = e["loss"];
  return out;
}

}  // namespace

TEST_CASE("writes the format-1 fixture (only with LT_FORMAT1_WRITE=1, by the build that reads format 1)",
          "[.][format1-write]") {
  if (!std::getenv("LT_FORMAT1_WRITE")) return;
  test::TwoDatasets d;
  const std::string config = configure_fixture_job(d);
  auto r = test::launch({"run", "fx", config, d.dir / "out"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  const fs::path job = d.dir / "out/checkpoints/general/default/fx";
  const fs::path ck = job / "ntoks/768";
  REQUIRE(is_checkpoint(ck.string()));
  REQUIRE(read_checkpoint_metadata(ck.string())["kind"] == "lora");
  remove_tree(kFixture.string());
  fs::create_directories(kFixture);
  fs::copy_file(ck / "metadata.json", kFixture / "metadata.json");
  fs::copy_file(ck / "state.h5", kFixture / "state.h5");
  const json expected = {{"checkpoint_step", 6},
                         {"losses_after", losses_after(d.dir / "out/runs/general/default/fx", 6)}};
  write_file_atomic((kFixture / "expected.json").string(), expected.dump(2) + "\n");
}

TEST_CASE("a format-1 LoRA checkpoint (adapters stored as lora/*) restores into the adapters' layers, bit for bit",
          "[checkpoint][format]") {
  // The file is what it stands for: format 1, its adapters under lora/.
  const json file = inspect_checkpoint(kFixture.string());
  REQUIRE(file["metadata"]["format_version"] == 1);
  int old_names = 0;
  for (const auto& t : file["tensors"]) old_names += t["name"].get<std::string>().rfind("lora/", 0) == 0;
  REQUIRE(old_names == 2 * 3 * 4 + 1);  // A, B, magnitude of 4 linear layers x 2 blocks; the token rows

  test::TwoDatasets d;
  Config cfg = test::tiny_config(Trainer::lora_schema(), d.dir / "data",
                                 fixture_settings(d.dir / "data"));
  auto t = test::build_job<Trainer>("lora/train", "fx", cfg, d.dir / "out");
  t->restore_from_path(kFixture.string());
  REQUIRE(t->in_lora_phase());
  REQUIRE(t->step() == 6);
  // Every tensor of the file, under its format-2 name, is in the job's state with the same bits.
  std::map<std::string, torch::Tensor> state;
  for (auto& [n, x] : t->state_tensors()) state[n] = x;
  const NamedTensors stored = read_checkpoint_tensors(kFixture.string());
  REQUIRE(stored.size() == state.size());
  for (const auto& [name, x] : stored) {
    INFO(name);
    REQUIRE(state.count(name));
    CHECK(torch::equal(state[name].cpu(), x));
  }
  // The adapters are parameters of their layers: the model's own tensors hold the restored values.
  const auto params = t->model()->named_parameters();
  REQUIRE(params.find("h.1.mlp.c_proj.lora_magnitude"));
  CHECK(torch::equal(*params.find("h.1.mlp.c_proj.lora_magnitude"), state.at("params/h.1.mlp.c_proj.lora_magnitude")));
}

TEST_CASE("a job resumed from a format-1 checkpoint trains on with the losses its build recorded, and saves format 2",
          "[checkpoint][format]") {
  const json expected = read_json_file((kFixture / "expected.json").string(), "");
  test::TwoDatasets d;
  const std::string config = configure_fixture_job(d);
  auto r = test::launch({"run", "fx", config, d.dir / "out", "--restore", kFixture.string()});
  INFO(r.out);
  REQUIRE(r.code == 0);
  const json got = losses_after(d.dir / "out/runs/general/default/fx", 6);
  REQUIRE(got.size() == expected["losses_after"].size());
  for (auto& [step, loss] : expected["losses_after"].items()) {
    INFO("step " << step);
    // Bit-identical on the machine that wrote it; another CPU's BLAS rounds differently (test_golden.cpp).
    CHECK(std::abs(got[step].get<double>() - loss.get<double>()) <= 1e-4 * std::abs(loss.get<double>()));
  }
  const fs::path job = d.dir / "out/checkpoints/general/default/fx";
  auto latest = read_latest(job.string());
  REQUIRE(latest);
  const json saved = inspect_checkpoint((job / *latest).string());
  CHECK(saved["metadata"]["format_version"] == kCheckpointFormatVersion);
  std::vector<std::string> names;
  for (const auto& t : saved["tensors"]) names.push_back(t["name"]);
  CHECK(std::count(names.begin(), names.end(), "params/h.0.attn.c_attn.lora_A") == 1);
  CHECK(std::count(names.begin(), names.end(), "params/wte.trainable_tokens_delta") == 1);
  CHECK(std::none_of(names.begin(), names.end(), [](const std::string& n) { return n.rfind("lora/", 0) == 0; }));
  // An adapter of the old file exports as PEFT does (the readers go by the format-2 names).
  auto e = test::launch({"export", "--format", "peft", kFixture.string(), d.dir / "peft"});
  INFO(e.out);
  CHECK(e.code == 0);
  CHECK(fs::exists(d.dir / "peft/adapter_model.safetensors"));
}
