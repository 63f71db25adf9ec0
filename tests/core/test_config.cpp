// Config: defaults, file < override precedence, and every error path names the key.
#include "catch.hpp"

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/options.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using lt::test::Contains;

TEST_CASE("defaults come from the schema", "[config]") {
  Config c(Trainer::schema());
  CHECK(c.get_int("training/batch_size") == 16);
  CHECK(c.get_int("training/per_device_batch_size") == -1);
  CHECK(c.get_double("optimization/lr") == Approx(6e-4));
  CHECK(c.get_string("job/kind") == "train");
  CHECK(c.get("training/dataset")[0]["name"] == "english");
  // The nested JSON has every key at its path.
  CHECK(c.to_json()["architecture"]["block_size"] == 256);
}

TEST_CASE("file overrides defaults and key=value overrides the file", "[config]") {
  test::TempDir dir;
  write_file_atomic(dir / "c.json", R"({"training": {"batch_size": 8, "tokens": 1000}, "optimization": {"lr": 0.01}})");
  Config c(Trainer::schema());
  c.merge_file(dir / "c.json");
  c.apply_override("training/batch_size=32");
  c.apply_override(R"(training/dataset=[{"name":"a","rate":0.25},{"name":"b","rate":0.75,"style":"pmd"}])");
  c.apply_override("job/project=demo");  // a bare word is a string
  CHECK(c.get_int("training/batch_size") == 32);
  CHECK(c.get_int("training/tokens") == 1000);
  CHECK(c.get_double("optimization/lr") == Approx(0.01));
  CHECK(c.get("training/dataset").size() == 2);
  CHECK(c.get_string("job/project") == "demo");
  CHECK(c.get_int("architecture/block_size") == 256);  // untouched default
}

TEST_CASE("an integral float is accepted for an integer key", "[config]") {
  Config c(Trainer::schema());
  c.apply_override("training/tokens=1e6");
  CHECK(c.get_int("training/tokens") == 1000000);
}

TEST_CASE("unknown keys are errors that suggest the closest key", "[config]") {
  Config c(Trainer::schema());
  CHECK_THROWS_WITH(c.apply_override("training/batch_sise=4"),
                    Contains("unknown config key \"training/batch_sise\"") && Contains("did you mean \"training/batch_size\""));
  test::TempDir dir;
  write_file_atomic(dir / "c.json", R"({"architecture": {"n_layer": 4}})");
  CHECK_THROWS_WITH(c.merge_file(dir / "c.json"),
                    Contains(dir / "c.json") && Contains("architecture/n_layer") && Contains("architecture/n_layers"));
}

TEST_CASE("wrong types and out-of-range values name the key", "[config]") {
  Config c(Trainer::schema());
  CHECK_THROWS_WITH(c.apply_override("training/batch_size=\"big\""), Contains("training/batch_size") && Contains("integer"));
  CHECK_THROWS_WITH(c.apply_override("training/batch_size=2.5"), Contains("training/batch_size"));
  CHECK_THROWS_WITH(c.apply_override("training/batch_size=0"), Contains("training/batch_size") && Contains("> 0"));
  CHECK_THROWS_WITH(c.apply_override("training/warmup_pct=1.5"), Contains("training/warmup_pct") && Contains("between 0 and 1"));
  CHECK_THROWS_WITH(c.apply_override("training/schedule=linear"), Contains("training/schedule") && Contains("wsd"));
  CHECK_THROWS_WITH(c.apply_override("training/validation=1"), Contains("training/validation") && Contains("true or false"));
  CHECK_THROWS_WITH(c.apply_override("noequals"), Contains("key=value"));
  // The failed sets left the value alone.
  CHECK(c.get_int("training/batch_size") == 16);
}

TEST_CASE("dataset mixtures are checked", "[config]") {
  Config c(Trainer::schema());
  CHECK_THROWS_WITH(c.apply_override(R"(training/dataset=[{"name":"a","rate":0.5}])"),
                    Contains("training/dataset") && Contains("sum to 1"));
  CHECK_THROWS_WITH(c.apply_override(R"(training/dataset=[{"name":"a","rate":1,"style":"csv"}])"),
                    Contains("\"pmd\", \"padded\", \"contrastive\" or \"prompts\""));
  CHECK_THROWS_WITH(c.apply_override(R"(training/dataset=[{"rate":1}])"), Contains("needs a \"name\""));
  CHECK_THROWS_WITH(c.apply_override(R"(training/dataset=[{"name":"a","rate":1,"weight":2}])"),
                    Contains("unknown field \"weight\""));
  CHECK_THROWS_WITH(c.apply_override("training/dataset=[]"), Contains("non-empty"));
}

TEST_CASE("a config file that is not JSON names the file", "[config]") {
  test::TempDir dir;
  write_file_atomic(dir / "bad.json", "{\"training\": {");
  Config c(Trainer::schema());
  CHECK_THROWS_AS(c.merge_file(dir / "bad.json"), UserError);
  CHECK_THROWS_WITH(c.merge_file(dir / "bad.json"), Contains("bad.json") && Contains("not valid JSON"));
  CHECK_THROWS_WITH(c.merge_file(dir / "missing.json"), Contains("missing.json"));
}

TEST_CASE("every config shipped in configs/ builds its job", "[config]") {
  test::TempDir out;
  int n = 0;
  // As `lora_trainer plan CONFIG` builds it: every key read and checked, its memory planned, nothing
  // allocated. Whether it fits is this machine's question (bench_gpt2_124m.json is a GPU's job: its
  // 16 x 1024-token micro-batches need 30 GB of f32 activations on a CPU without fast bf16).
  struct PlanOnly {
    PlanOnly() { Trainer::plan_only = true; }
    ~PlanOnly() { Trainer::plan_only = false; }
  } plan_only;
  walk_tree(std::string(LT_SOURCE_DIR) + "/configs", [&](const std::string& path, bool is_dir) {
    if (is_dir || std::filesystem::path(path).extension() != ".json") return true;
    INFO(path);
    CHECK_NOTHROW(make_job("check", path, out.str(), {}));
    ++n;
    return true;
  });
  CHECK(n >= 3);
}

namespace {
struct ToyOptions {
  int64_t steps = -7;
  double lr = 0;
  std::string mode = "unset";
  bool kept = true;  // its key is not in the schema below: stays as initialised
};
}  // namespace

TEST_CASE("OptionGroup: each key declared once with its default, read into the field it is bound to", "[config]") {
  const auto group = OptionGroup<ToyOptions>()
                         .add("toy/steps", OptType::Int, 3, "steps", &ToyOptions::steps, check_positive())
                         .add("toy/lr", OptType::Float, 0.5, "lr", &ToyOptions::lr)
                         .add("toy/mode", OptType::String, "fast", "mode",
                              [](ToyOptions& o, const json& v) { o.mode = "mode:" + v.get<std::string>(); },
                              check_one_of({"fast", "slow"}))
                         .add("toy/kept", OptType::Bool, false, "kept", &ToyOptions::kept);
  ConfigSchema s;
  group.declare(s);
  s.remove("toy/kept");  // a kind without this key
  REQUIRE(s.find("toy/steps"));
  CHECK(s.find("toy/steps")->default_value == 3);
  CHECK(s.find("toy/mode")->doc == "mode");
  Config cfg(s);
  ToyOptions at_defaults = group.read(cfg);
  CHECK(at_defaults.steps == 3);
  CHECK(at_defaults.lr == 0.5);
  CHECK(at_defaults.mode == "mode:fast");
  CHECK(at_defaults.kept);
  cfg.apply_override("toy/steps=12");
  cfg.apply_override("toy/mode=slow");
  const ToyOptions set = group.read(cfg);
  CHECK(set.steps == 12);
  CHECK(set.mode == "mode:slow");
  // The declared check still guards the key.
  CHECK_THROWS_WITH(cfg.apply_override("toy/steps=0"), Contains("toy/steps"));
}

TEST_CASE("runtime/* and job/* are read into their typed fields: each name to its own enum value", "[config]") {
  Config cfg(Trainer::schema());
  RuntimeOptions d = RuntimeOptions::from_config(cfg);
  CHECK(d.device == RuntimeOptions::Device::Auto);
  CHECK(d.precision == RuntimeOptions::Precision::Auto);
  CHECK(d.attention == RuntimeOptions::Attention::Auto);
  CHECK(d.loss == RuntimeOptions::Loss::Auto);
  CHECK(d.matmul == RuntimeOptions::Matmul::Auto);
  CHECK(d.threads == 0);
  for (const char* o : {"runtime/device=cpu", "runtime/precision=f32", "runtime/attention=manual", "runtime/loss=libtorch",
                        "runtime/matmul=libtorch", "runtime/threads=3", "job/project=p1", "job/group=g1"})
    cfg.apply_override(o);
  RuntimeOptions r = RuntimeOptions::from_config(cfg);
  CHECK(r.device == RuntimeOptions::Device::Cpu);
  CHECK(r.precision == RuntimeOptions::Precision::F32);
  CHECK(r.attention == RuntimeOptions::Attention::Manual);
  CHECK(r.loss == RuntimeOptions::Loss::LibTorch);
  CHECK(r.matmul == RuntimeOptions::Matmul::LibTorch);
  CHECK(r.threads == 3);
  cfg.apply_override("runtime/precision=bf16");
  cfg.apply_override("runtime/loss=fused");
  cfg.apply_override("runtime/matmul=onednn");
  CHECK(RuntimeOptions::from_config(cfg).matmul == RuntimeOptions::Matmul::OneDnn);
  CHECK(RuntimeOptions::from_config(cfg).precision == RuntimeOptions::Precision::Bf16);
  CHECK(RuntimeOptions::from_config(cfg).loss == RuntimeOptions::Loss::Fused);
  // The model takes the runtime's two keys it computes with.
  const ModelOptions m = ModelOptions::from_config(cfg);
  CHECK(m.attention == RuntimeOptions::Attention::Manual);
  CHECK(m.loss == RuntimeOptions::Loss::Fused);
  // A job reads job/* into its spec; the name stays the command line's.
  JobSpec spec;
  spec.name = "named";
  test::TempDir dir;
  for (const auto& o : test::tiny_overrides(dir / "data")) cfg.apply_override(o);
  Trainer t(spec, cfg, dir / "out");
  CHECK(t.spec().name == "named");
  CHECK(t.spec().project == "p1");
  CHECK(t.spec().group == "g1");
  CHECK(t.spec().kind == "train");
}
