// The memory plan (training/memory_plan.hpp): its state items are the bytes the job then holds, a job
// that does not fit is refused naming the change that makes it fit (and the change does), a job that
// fits is not refused (the 8B QLoRA job on a 24 GB machine), and `lora_trainer plan` prints it.
#include "catch.hpp"

#include <filesystem>

#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/peft/frozen_weight.hpp"
#include "lora_trainer/training/memory_plan.hpp"

using namespace lt;
using lt::test::Contains;

namespace {

const MemoryItem& item(const MemoryPlan& plan, const std::string& phase, const std::string& what) {
  for (const auto& p : plan.phases)
    if (p.name.rfind(phase, 0) == 0)
      for (const auto& i : p.items)
        if (i.what.rfind(what, 0) == 0) return i;
  FAIL("no item \"" << what << "\" in phase \"" << phase << "\":\n" << plan.text());
  throw std::logic_error("unreachable");
}

int64_t numel_of(const NamedTensors& params) {
  int64_t n = 0;
  for (const auto& [name, p] : params) n += p.numel();
  return n;
}

// A Llama of Llama-3-8B's shape (8.03B parameters), as `lora_trainer plan` builds it: nothing allocated.
std::unique_ptr<Trainer> planned_8b(const std::string& data, const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"architecture/family=llama",       "architecture/vocab_size=128256",
                                "architecture/d_model=4096",       "architecture/n_layers=32",
                                "architecture/n_heads=32",         "architecture/n_kv_heads=8",
                                "architecture/d_ff=14336",         "architecture/block_size=128",
                                "architecture/tie_embeddings=false", "architecture/activation=silu",
                                "training/batch_size=1",           "optimization/lora/rank=16",
                                R"(optimization/lora/target_modules=["all-linear"])"};
  o.insert(o.end(), extra.begin(), extra.end());
  Trainer::plan_only = true;
  auto t = test::build_job("lora/train", "p", test::tiny_config(lora_train_schema(), data, o), "/nonexistent-out");
  Trainer::plan_only = false;
  return t;
}

const std::vector<std::string> kNoPhaseOne = {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]",
                                              "training/post_lora_tokens=[256]",
                                              R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])"};

}  // namespace

TEST_CASE("memory plan: its state items are the bytes the job holds, each frozen storage's as its weights say", "[memory]") {
  test::TwoDatasets d;
  for (const std::string storage : {"bf16", "nf4"}) {
    INFO(storage);
    auto t = test::make_lora(d, "m-" + storage, {"optimization/lora/quantize_base=" + storage});
    const MemoryPlan& plan = t->memory_plan();
    const int64_t P = numel_of(base_params(*t->model()));
    CHECK(item(plan, "phase 1", "weights (f32)").host == 4 * P);
    CHECK(item(plan, "phase 1", "gradients (f32)").host == 4 * P);
    CHECK(item(plan, "phase 1", "AdamW moments").host == 8 * P);
    t->transition_to_lora();
    // The adapters, their gradients and moments: what the LoRA phase's optimizer holds.
    const int64_t trained = numel_of(t->trainable());
    CHECK(item(plan, "phase 2", "adapters").host == 4 * trained);
    CHECK(item(plan, "phase 2", "AdamW moments").host == 8 * trained);
    CHECK(item(plan, "phase 2", "AdamW moments").host == t->optimizer().state_bytes());
    // The frozen base: each weight's storage as made (FrozenWeight::bytes), the bf16 ones 2 bytes a value.
    int64_t quantized = 0, bf16 = 0;
    const auto storages = frozen_storages(*t->model());
    for (const auto& [name, p] : base_params(*t->model())) {
      auto s = storages.find(name);
      if (s != storages.end() && s->second->format() != FrozenFormat::Bf16) quantized += s->second->bytes();
      else bf16 += 2 * p.numel();
    }
    CHECK(item(plan, "phase 2", "frozen base: bf16").host == bf16);
    if (storage == "nf4") CHECK(item(plan, "phase 2", "frozen base: 8 linear weights in NF4").host == quantized);
    else CHECK(quantized == 0);
  }
}

TEST_CASE("memory plan: a frozen head's chunked loss holds one block of logits and x's gradient, a head that trains the whole logits", "[memory][loss]") {
  test::TempDir dir;
  const int64_t N = 128, V = 128256, C = 4096;  // the 8B job: 1 x 128 tokens, Llama 3's vocabulary
  std::vector<std::string> o = kNoPhaseOne;
  o.insert(o.end(), {"runtime/device=cpu", "runtime/loss=chunked"});
  const MemoryPlan plan = planned_8b(dir / "data", o)->memory_plan();
  INFO(plan.text());
  const MemoryPlanInputs& in = plan.inputs;
  REQUIRE(in.chunked_loss);
  const MemoryItem chunked = item(plan, "phase 2", "logits and loss");
  const int64_t act = in.bf16 ? 2 : 4;
  // A block of 4,096 columns (in f32 1,024: the bf16 head's block cast, 16 MiB); x's gradient in f32;
  // under bf16 the block's product.
  CHECK(chunked.what.find("chunked") != std::string::npos);
  const int64_t columns = in.bf16 ? 4096 : 1024;
  CHECK(chunked.host == N * columns * act + 4 * N * C + (in.bf16 ? 2 * N * C : columns * C * 4));
  CHECK(chunked.host < N * V * act / 2);
  // The logits whole: asked for (runtime/loss=fused), or a head that trains (modules_to_save).
  MemoryPlanInputs fused = in;
  fused.chunked_loss = false;
  CHECK(item(plan_memory(fused), "phase 2", "logits and loss").host == N * V * act);
  MemoryPlanInputs trained = in;
  for (auto& p : trained.params)
    if (p.name == "lm_head.weight") p.trains = true;
  const MemoryItem whole = item(plan_memory(trained), "phase 2", "logits and loss");
  CHECK(whole.what == "logits and loss");
  CHECK(whole.host == N * V * act);
}

TEST_CASE("memory plan: the 8B QLoRA job fits a 24 GB machine, its bf16 and full-parameter forms are refused with what would fit", "[memory]") {
  test::TempDir dir;
  const int64_t gb24 = parse_bytes("24GB");
  auto at = [&](const MemoryPlan& p, int64_t host) {
    MemoryPlanInputs in = p.inputs;
    in.host_memory = host;
    return plan_memory(in);
  };
  std::vector<std::string> qlora = kNoPhaseOne;
  qlora.push_back("optimization/lora/quantize_base=nf4");
  const MemoryPlan q = at(planned_8b(dir / "data", qlora)->memory_plan(), gb24);
  INFO(q.text());
  CHECK(q.fits());
  // 224 linear weights in NF4 (5.2 GB less than bf16's 2 bytes a value), the embedding and head in bf16.
  CHECK(item(q, "phase 2", "frozen base: 224 linear weights in NF4").host > parse_bytes("3.5GB"));
  CHECK(item(q, "phase 2", "frozen base: 224 linear weights in NF4").host < parse_bytes("3.8GB"));
  CHECK(item(q, "phase 2", "frozen base: bf16").host > parse_bytes("2.1GB"));
  // Beside its 5.7 GB of frozen storage, the adapters' state and the buffers (6.7 GB in all), the peak
  // holds one micro-batch's activations, bf16 where the CPU multiplies bf16 fast (1.1 GB), f32 elsewhere
  // (2.2 GB), and the runtime as this process measured it before the model (the test process's own).
  const int64_t activations = item(q, "phase 2", "activations").host;
  CHECK(activations < parse_bytes("2.5GB"));
  CHECK(q.host_peak() - activations - item(q, "phase 2", "runtime").host < parse_bytes("7GB"));

  // On a 16 GB machine, the bf16 base (16 GB) alone does not fit: NF4, or two machines sharding it, would.
  const MemoryPlan b = at(planned_8b(dir / "data", kNoPhaseOne)->memory_plan(), parse_bytes("16GB"));
  INFO(b.text());
  CHECK_FALSE(b.fits());
  CHECK_THAT(b.refusal(), Contains("does not fit") && Contains("frozen base: bf16") &&
                              Contains("optimization/lora/quantize_base=nf4") && Contains("distributed/shard_params=lora"));
  CHECK(at(planned_8b(dir / "data", qlora)->memory_plan(), parse_bytes("16GB")).fits());

  // Training all 8B parameters (f32 weights, gradients, moments: 128 GB) fits no such machine, nor do the changes.
  std::vector<std::string> full = {"training/pre_lora_tokens=[256]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
                                   "training/post_lora_tokens=[256]", R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])"};
  const MemoryPlan f = at(planned_8b(dir / "data", full)->memory_plan(), gb24);
  CHECK_FALSE(f.fits());
  int64_t P = 0;
  for (const auto& p : f.inputs.params) P += p.numel;
  CHECK(P == 8030261248);  // Llama-3-8B's count
  CHECK(item(f, "phase 1", "AdamW moments").host == 8 * P);
  CHECK_THAT(f.refusal(), Contains("needs a machine with more memory"));
}

TEST_CASE("memory plan: `plan` names the change that makes a job fit, and with it the plan fits, and run refuses before it allocates", "[memory][launcher]") {
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1);
  std::vector<std::string> args = {"configure", "lora/train", dir / "job.json"};
  for (const auto& o : test::tiny_overrides(dir / "data")) args.push_back(o);
  for (std::string o : {"architecture/block_size=256", "training/batch_size=32", "architecture/d_model=128", "architecture/n_layers=4",
                        "training/pre_lora_tokens=[8192]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
                        "training/post_lora_tokens=[8192]", R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])"})
    args.push_back(o);
  REQUIRE(test::launch(args).code == 0);
  // The plan on this machine, then on one with memory between its peak with checkpointing and without.
  test::Result json = test::launch({"plan", dir / "job.json", "--json"});
  INFO(json.out);
  REQUIRE(json.code == 0);
  const auto plan = nlohmann::json::parse(json.out);
  CHECK(plan["fits"] == true);
  test::Result with_ckpt = test::launch({"plan", dir / "job.json", "--json", "training/activation_checkpointing=true"});
  REQUIRE(with_ckpt.code == 0);
  const int64_t high = plan["host_peak"].get<int64_t>(), low = nlohmann::json::parse(with_ckpt.out)["host_peak"].get<int64_t>();
  REQUIRE(low < high);
  const std::string between = std::to_string((low + high) / 2);
  test::Result refused = test::launch({"plan", dir / "job.json", "--host-memory", between});
  INFO(refused.out);
  CHECK(refused.code == 5);
  CHECK_THAT(refused.out, Contains("does not fit") && Contains("activations") && Contains("training/activation_checkpointing=true"));
  CHECK(test::launch({"plan", dir / "job.json", "--host-memory", between, "training/activation_checkpointing=true"}).code == 0);
  // Bad sizes are the user's mistake.
  CHECK(test::launch({"plan", dir / "job.json", "--host-memory", "lots"}).code == 2);

  // A job whose plan exceeds this machine (each tensor allocatable; 16 bytes a parameter in phase 1) is
  // refused by `run` with the plan's reasons, before anything is allocated or written.
  const int64_t layers = std::max<int64_t>(2, machine_memory() / 8 / (12 * 1024 * 1024) + 1);  // d_model 1024: 12 M a layer
  test::Result big = test::launch({"run", "big", dir / "job.json", dir / "out", "architecture/d_model=1024", "architecture/n_heads=8",
                                   "architecture/n_layers=" + std::to_string(layers)});
  INFO(big.out);
  CHECK(big.code == 2);
  CHECK_THAT(big.out, Contains("this job does not fit in memory") && Contains("AdamW moments"));
  CHECK_FALSE(std::filesystem::exists(dir / "out/checkpoints"));
}

TEST_CASE("memory plan: within 15% of the peak a run measures: full-parameter and LoRA, checkpointed or not, bf16, NF4 and sharded on 2 ranks", "[memory][launcher]") {
  // A Llama of 6.0M parameters, 2 steps of 8 x 256 byte tokens: the weights, activations and runtime
  // all count (scripts/memory_bench.py runs the same jobs and prints the table; rank 0's with 2 ranks).
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1, 8, 6000);
  const std::vector<std::string> arch = {
      "architecture/family=llama", "architecture/vocab_size=257",      "architecture/d_model=256",  "architecture/n_layers=8",
      "architecture/n_heads=8",    "architecture/n_kv_heads=4",        "architecture/d_ff=704",     "architecture/block_size=256",
      "architecture/activation=silu", "architecture/tie_embeddings=false", "training/batch_size=8", "training/validation=false",
      "data/dir=\"" + (dir / "data") + "\"", "logging/report_interval=1000", "logging/checkpoint_interval=1000"};
  auto configure = [&](const std::string& kind, const std::string& file, std::vector<std::string> extra) {
    std::vector<std::string> args = {"configure", kind, dir / file};
    args.insert(args.end(), arch.begin(), arch.end());
    args.insert(args.end(), extra.begin(), extra.end());
    REQUIRE(test::launch(args).code == 0);
  };
  configure("train", "full.json", {"training/tokens=4096", R"(training/dataset=[{"name":"gen","rate":1}])"});
  configure("lora/train", "lora.json",
            {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[4096]",
             R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])", "optimization/lora/rank=8"});
  const std::string base = dir / "out/checkpoints/general/default/full/final/4096";
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"full", {"run", "full", dir / "full.json", dir / "out"}},
      {"full_ckpt", {"run", "full_ckpt", dir / "full.json", dir / "out", "training/activation_checkpointing=true"}},
      {"lora", {"run", "lora", dir / "lora.json", dir / "out", "--restore", base}},
      {"lora_ckpt", {"run", "lora_ckpt", dir / "lora.json", dir / "out", "--restore", base, "training/activation_checkpointing=true"}},
      {"qlora", {"run", "qlora", dir / "lora.json", dir / "out", "--restore", base, "optimization/lora/quantize_base=nf4"}},
      {"sharded", {"run", "sharded", dir / "lora.json", dir / "out", "--restore", base, "--nproc", "2",
                   "distributed/shard_params=lora"}}};
  for (const auto& [name, args] : runs) {
    INFO(name);
    test::Result r = test::launch(args);
    INFO(r.out);
    REQUIRE(r.code == 0);
    nlohmann::json memory;
    for (const auto& e : test::read_metrics_lines(dir / ("out/runs/general/default/" + name)))
      if (e.value("event", "") == "memory") memory = e;
    REQUIRE(memory.is_object());
    const double measured = memory["peak_allocated"].get<double>(), planned = memory["plan_host"].get<double>();
    INFO("measured " << measured / 1e6 << " MB, planned " << planned / 1e6 << " MB");
    CHECK(planned > 0.85 * measured);
    CHECK(planned < 1.15 * measured);
  }
}

TEST_CASE("memory plan: OpenBLAS's packing of the widest f32 weight gradient, a block of 8,192 rows of a 128k head, and none in bf16", "[memory][launcher]") {
  // Phase 1 of a tiny Llama with Llama 3's tied vocabulary (128,256 x 64), 2 x 128 tokens, OpenBLAS on 2
  // threads: the head's gradient g^T x, made in blocks of kWeightGradRows rows, packs 4 x 256 x 8,192
  // bytes (8 MB) that the library keeps (as one product: 4 x 256 x 128,256, 131 MB: test_cpu_gemm.cpp
  // checks what it leaves). bf16 products are not OpenBLAS's.
  test::TempDir dir;
  test::make_byte_dataset(dir / "data", "gen", 1, 2, 500);
  REQUIRE(test::launch({"configure", "train", dir / "train.json", "architecture/family=llama", "architecture/vocab_size=128256",
                        "architecture/d_model=64", "architecture/n_layers=2", "architecture/n_heads=4",
                        "architecture/n_kv_heads=2", "architecture/d_ff=172", "architecture/block_size=128",
                        "architecture/activation=silu", "architecture/tie_embeddings=true", "training/batch_size=2",
                        "training/tokens=768", "training/validation=false", R"(training/dataset=[{"name":"gen","rate":1}])",
                        "runtime/threads=2", "data/dir=\"" + (dir / "data") + "\""})
              .code == 0);
  const std::string two = "OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2";  // ctest's one thread packs no such block
  const std::string item = "BLAS packing, kept (widest f32 weight gradient)";
  test::Result f32 = test::launch({"plan", dir / "train.json", "runtime/precision=f32"}, two);
  INFO(f32.out);
  REQUIRE(f32.code == 0);
  const int64_t depth = std::min<int64_t>(256, blas_packing(2).depth);
  CHECK_THAT(f32.out, Contains(item) && Contains(format_bytes(4 * depth * kWeightGradRows)));
  test::Result bf16 = test::launch({"plan", dir / "train.json", "runtime/precision=bf16"}, two);
  INFO(bf16.out);
  REQUIRE(bf16.code == 0);
  CHECK_THAT(bf16.out, !Contains(item));
}
