// Golden numerics: every step's loss, gradient norm and learning rate, every validation, transition
// and boundary event of nine tiny jobs (each job kind, and the recipes that change what trains) run
// through the launcher on the CPU in f32 with one thread, against tests/data/golden/numerics.json.
//
// On the machine that recorded the file (its "fingerprint": LibTorch's version, the BLAS and oneDNN
// libraries loaded, the CPU's vendor, family, model and vector extensions) every value must be
// bit-identical: a restructuring that changes the order of a single floating-point operation fails
// here. Elsewhere a different BLAS kernel or a bf16 matmul without AVX-512 BF16 rounds differently,
// so the values must agree to a relative tolerance (tolerance_of). To pin a new machine's values before changing the code:
//   LT_GOLDEN_WRITE=1 build/lora_trainer_tests "[golden]"
// which rewrites the file (and its fingerprint); then run the test after every change. Check a
// rewritten file in only when a change of numerics is intended, and say why in the commit; before
// rewriting, LT_GOLDEN_TOLERANCE=1 checks the change against the other machines' tolerances (as
// another machine would see it).
#include "catch.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "dpo_fixtures.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"

using namespace lt;
using nlohmann::json;

namespace {

const std::string kGoldenFile = std::string(LT_SOURCE_DIR) + "/tests/data/golden/numerics.json";
// The relative tolerance on another machine or LibTorch. Measured between Debian 12 (LibTorch 1.13,
// OpenBLAS 0.3.21) and Debian 13 (2.6, 0.3.29) on one CPU: losses and perplexities within 5e-6,
// DPO rewards within 8e-5, gradient norms within 1e-3 (docs/platforms.md). Norms of gradients and
// rewards (differences of log-probabilities) amplify rounding; losses do not.
double tolerance_of(const std::string& key) {
  for (const char* k : {"grad_norm", "chosen_reward", "rejected_reward", "reward_margin"})
    if (key.find(k) != std::string::npos) return 2e-2;
  return 1e-3;
}

// What decides the exact bits of a CPU f32 run besides our code.
json fingerprint() {
  std::set<std::string> libs;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string base = std::filesystem::path(path).filename().string();
    for (const char* k : {"blas", "mkl", "dnnl", "torch_cpu", "gomp", "iomp"})
      if (base.find(k) != std::string::npos) libs.insert(std::filesystem::weakly_canonical(path).string());
  }
  std::map<std::string, std::string> cpu;
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line) && !line.empty();) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    cpu[key] = value;
  }
  std::string flags;
  std::istringstream fl(cpu["flags"]);
  std::set<std::string> have;
  for (std::string f; fl >> f;) have.insert(f);
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})
    if (have.count(f)) flags += std::string(flags.empty() ? "" : " ") + f;
  // Kernel choices forced through the environment (the suite's avx2 and baseline runs, CMakeLists.txt)
  // change the bits as another CPU would.
  json forced = json::object();
  for (const char* v : {"LT_CPU_KERNELS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OPENBLAS_CORETYPE"})
    if (const char* value = std::getenv(v); value && *value) forced[v] = value;
  json print = {{"libtorch", TORCH_VERSION},
                {"libraries", json(std::vector<std::string>(libs.begin(), libs.end()))},
                {"cpu", cpu["vendor_id"] + " family " + cpu["cpu family"] + " model " + cpu["model"] + " (" +
                            cpu["model name"] + ")"},
                {"cpu_flags", flags}};
  if (!forced.empty()) print["forced_kernels"] = forced;
  return print;
}

struct Golden {
  test::TempDir dir;
  json jobs = json::object();

  Golden() {
    test::make_byte_dataset(dir / "data", "gen", 1);
    test::make_byte_dataset(dir / "data", "gen2", 2);
    test::make_byte_dataset(dir / "data", "gen3", 3);
    write_file_atomic(dir / "prefs.jsonl", test::toy_records(40));
    auto tok = test::launch({"tokenize", "--format", "pairs", "--tokenizer", "byte", "--name", "prefs", "--data-dir",
                             dir / "data", "--val-fraction", "0.25", dir / "prefs.jsonl"});
    INFO(tok.out);
    REQUIRE(tok.code == 0);
  }

  // Writes `kind`'s config with the tiny settings and `extra`, runs it as job `name` and keeps its
  // metrics (without the speeds, which vary from run to run).
  void run(const std::string& name, const std::string& kind, const std::vector<std::string>& extra,
           const std::vector<std::string>& run_args = {}) {
    std::vector<std::string> args = {"configure", kind, dir / (name + ".json")};
    for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
    for (const auto& o : {"runtime/device=cpu", "runtime/precision=f32", "runtime/threads=1", "training/batch_size=8",
                          "training/per_device_batch_size=4", "logging/report_interval=1",
                          "logging/validation_interval=3", "training/validation_steps=4"})
      args.push_back(o);
    args.insert(args.end(), extra.begin(), extra.end());
    auto configure = test::launch(args);
    INFO(configure.out);
    REQUIRE(configure.code == 0);
    std::vector<std::string> cmd = {"run", name, dir / (name + ".json"), dir / "out"};
    cmd.insert(cmd.end(), run_args.begin(), run_args.end());
    auto r = test::launch(cmd);
    INFO(r.out);
    REQUIRE(r.code == 0);
    json events = json::array();
    for (auto e : test::read_metrics_lines(dir / ("out/runs/general/default/" + name))) {
      if (e.value("event", "") == "memory") continue;  // the machine's measured memory, not numerics
      e.erase("tok_per_s");
      events.push_back(e);
    }
    REQUIRE(events.size() > 0);
    jobs[name] = events;
  }

  std::string final_checkpoint(const std::string& name) {
    const std::string job = dir / ("out/checkpoints/general/default/" + name);
    auto latest = read_latest(job);
    REQUIRE(latest);
    return job + "/" + *latest;
  }

  void run_all() {
    // Every parameter, with dropout and an EMA: 8 steps, 2 micro-batches each.
    run("train", "train",
        {"training/tokens=2048", R"(training/dataset=[{"name":"gen","rate":1}])", "architecture/dropout=0.1",
         "optimization/ema/decay=0.9"});
    const std::vector<std::string> two_phase = {
        "training/pre_lora_tokens=[1024]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
        "training/post_lora_tokens=[1024]", R"(training/post_lora_dataset=[[{"name":"gen2","rate":1}]])",
        "optimization/lora/rank=4", "optimization/lora/lr=0.01"};
    run("lora", "lora/train", two_phase);
    // The recipes that change the trainable set and its rates: DoRA, rsLoRA, LoRA+, modules_to_save,
    // per-parameter groups and an EMA of the adapters.
    auto recipes = two_phase;
    for (const char* o : {"optimization/lora/dora=true", "optimization/lora/rslora=true", "optimization/lora/lr_ratio=16",
                          R"(optimization/lora/modules_to_save=["wte"])", "optimization/lora/modules_to_save_lr_ratio=0.5",
                          R"(optimization/param_groups=[{"match":"ln_","lr_ratio":0.1,"weight_decay":false}])",
                          "optimization/ema/decay=0.9"})
      recipes.push_back(o);
    run("lora_recipes", "lora/train", recipes);
    // A Llama-family model (RoPE, grouped-query attention, SwiGLU) with trainable token rows.
    auto llama = two_phase;
    for (const char* o : {"architecture/family=\"llama\"", "architecture/n_kv_heads=1", "architecture/tie_embeddings=false",
                          "optimization/lora/trainable_token_indices=[10,32,101]"})
      llama.push_back(o);
    run("lora_llama", "lora/train", llama);
    // DPO from the train job's base, with adapters and with every parameter.
    const std::string base = final_checkpoint("train");
    const std::vector<std::string> dpo = {"training/tokens=1536",
                                          R"(training/dataset=[{"name":"prefs","rate":1,"style":"contrastive"}])",
                                          "architecture/dropout=0.1", "optimization/lora/rank=4",
                                          "optimization/lora/lr=0.01"};
    run("dpo_lora", "dpo/train", dpo, {"--restore", base});
    auto dpo_full = dpo;
    dpo_full.push_back("optimization/dpo/lora=false");
    run("dpo_full", "dpo/train", dpo_full, {"--restore", base});
    // A LoRA phase on preference pairs after phase one.
    run("lora_dpo", "lora/train",
        {"training/pre_lora_tokens=[768]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
         "training/post_lora_tokens=[768]",
         R"(training/post_lora_dataset=[[{"name":"prefs","rate":1,"style":"contrastive"}]])", "optimization/lora/rank=4"});
    // Continual learning: stages with fades and an optimizer reset, and its LoRA variant.
    run("continual", "continual/train/benchmark",
        {"training/tokens=[768,768,512]",
         R"(training/dataset=[[{"name":"gen","rate":1}],[{"name":"gen2","rate":1}],[{"name":"gen3","rate":1}]])",
         "training/fade/overlap=256", "training/reset_optimizer=true", "eval/boundary_rows=4"});
    run("continual_lora", "continual/train/benchmark_lora",
        {"training/pre_lora_tokens=[512,512]",
         R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}],[{"name":"gen2","rate":1}]])",
         "training/post_lora_tokens=[512,512]",
         R"(training/post_lora_dataset=[[{"name":"gen3","rate":1}],[{"name":"gen","rate":1}]])",
         "optimization/lora/rank=4", "optimization/lora/lr=0.01", "training/fade/overlap=256", "eval/boundary_rows=4"});
  }
};

// Compares `got` with `want`: bit-identical when `exact`, numbers within tolerance_of(their path)
// otherwise. Returns the first difference ("" when none).
std::string difference(const json& want, const json& got, bool exact, const std::string& at) {
  if (want.is_number() && got.is_number()) {
    const double w = want.get<double>(), g = got.get<double>();
    const bool same = exact ? w == g : std::abs(w - g) <= tolerance_of(at) * std::max(std::abs(w), std::abs(g)) + 1e-5;
    if (same) return "";
    std::ostringstream s;
    s.precision(17);
    s << at << ": golden " << w << ", now " << g;
    return s.str();
  }
  if (want.type() != got.type()) return at + ": golden " + want.dump() + ", now " + got.dump();
  if (want.is_object()) {
    for (const auto& [k, v] : want.items()) {
      if (!got.contains(k)) return at + "/" + k + ": missing now";
      auto d = difference(v, got[k], exact, at + "/" + k);
      if (!d.empty()) return d;
    }
    for (const auto& [k, v] : got.items())
      if (!want.contains(k)) return at + "/" + k + ": new (" + v.dump() + ")";
    return "";
  }
  if (want.is_array()) {
    if (want.size() != got.size())
      return at + ": " + std::to_string(want.size()) + " entries golden, " + std::to_string(got.size()) + " now";
    for (size_t i = 0; i < want.size(); ++i) {
      auto d = difference(want[i], got[i], exact, at + "[" + std::to_string(i) + "]");
      if (!d.empty()) return d;
    }
    return "";
  }
  return want == got ? "" : at + ": golden " + want.dump() + ", now " + got.dump();
}

}  // namespace

TEST_CASE("golden numerics: each job kind's losses, gradient norms and validations equal the recorded ones", "[golden][numerics]") {
  Golden g;
  g.run_all();
  const json here = fingerprint();
  if (std::getenv("LT_GOLDEN_WRITE")) {
    std::filesystem::create_directories(std::filesystem::path(kGoldenFile).parent_path());
    write_file_atomic(kGoldenFile, json({{"fingerprint", here}, {"jobs", g.jobs}}).dump(1) + "\n");
    WARN("LT_GOLDEN_WRITE: wrote " << kGoldenFile);
    return;
  }
  const json golden = read_json_file(kGoldenFile);
  const bool exact = golden["fingerprint"] == here && !std::getenv("LT_GOLDEN_TOLERANCE");
  INFO("recorded on " << golden["fingerprint"].dump() << "\nthis machine " << here.dump());
  INFO((exact ? "the same machine and libraries: bit-identical required"
              : "another machine or library: within the relative tolerances of tolerance_of()"));
  for (const auto& [name, events] : golden["jobs"].items()) {
    INFO("job " << name);
    REQUIRE(g.jobs.contains(name));
    CHECK(difference(events, g.jobs[name], exact, name) == "");
  }
  CHECK(g.jobs.size() == golden["jobs"].size());
}
