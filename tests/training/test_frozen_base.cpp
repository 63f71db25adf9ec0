// Real-size bases (issue 30): a Hugging Face directory as a LoRA job's base, read tensor by tensor into
// bf16 without a float32 copy; LoRA-phase checkpoints that refer to their frozen base by a digest
// instead of copying it; frozen_linear, which keeps no float32 copy of a frozen matrix in the graph.
#include <filesystem>
#include <fstream>
#include <set>

#include "hf_fixtures.hpp"
#include "lora_fixtures.hpp"
#include "rounding.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/frozen_base.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/kernels/cross_entropy.hpp"
#include "launch.hpp"
#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/peft/frozen_weight.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {
namespace {

// The transformers Llama saved in bf16 over three shards (scripts/hf_golden.py).
const std::string kHfBf16 = test::hf_golden("llama") + "/model_bf16_sharded";

// A copy of a model directory's files (flat).
void copy_dir(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (auto& e : fs::directory_iterator(from)) fs::copy_file(e.path(), fs::path(to) / e.path().filename());
}

// A lora/train config without phase one for the model directory `dir`: its architecture from
// config.json (as `run ... --restore DIR` applies it; the tiny tests' block_size), 1280 tokens of
// "gen" in `data`, rank 4, f32; then `extra`.
Config hf_lora_config(const std::string& dir, const std::string& data, const std::vector<std::string>& extra = {}) {
  Config c(Trainer::lora_schema());
  for (const auto& o : test::tiny_overrides(data))
    if (o.rfind("architecture/", 0) != 0 || o.rfind("architecture/block_size", 0) == 0) c.apply_override(o);
  const json hf = read_json_file(dir + "/config.json");
  for (const auto& a : hf_architecture(hf, dir))
    if (a.rfind("architecture/block_size", 0) != 0) c.apply_override(a);
  for (const auto& o : {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[1280]",
                        R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])", "optimization/lora/rank=4",
                        "optimization/lora/alpha=8", "optimization/lora/lr=0.01", "runtime/precision=f32",
                        "logging/checkpoint_interval=4"})
    c.apply_override(o);
  for (const auto& o : extra) c.apply_override(o);
  return c;
}

std::unique_ptr<Trainer> hf_job(const std::string& name, const Config& c, const std::string& out) {
  return std::make_unique<Trainer>(test::job_spec(name), c, out, TrainingPlan::from_lora_config(c));
}

using test::stored_names;

// Flips one bit of the first tensor's data in every shard of a model directory: another base.
void damage_values(const std::string& dir) {
  for (auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    f.seekg(static_cast<std::streamoff>(8 + n + 1));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x01;
    f.seekp(static_cast<std::streamoff>(8 + n + 1));
    f.write(&c, 1);
  }
}

// The Llama directory's tensors under the job's base parameter names, in their order, in float32.
NamedTensors file_values(Trainer& t, const std::string& dir) {
  NamedTensors expected;
  for (const auto& [n, p] : base_params(*t.model())) expected.emplace_back(n, torch::empty(p.sizes()));
  return from_hf(ModelFamily::Llama, read_safetensors_model(dir), expected, dir);
}

}  // namespace

TEST_CASE("a job with phase one starts from a float32 Hugging Face directory: its weights its own, not the file's pages, and trained",
          "[frozen_base][huggingface]") {
  // The load reads the files' mapped pages in place (BaseWeights::peek); a float32 tensor kept as it
  // came is copied, so the optimizer can write it and the files may go once the load is done.
  test::TempDir d;
  test::make_byte_dataset(d / "data", "gen", 1);
  const std::string hf = test::hf_golden("llama") + "/model";  // float32
  const Config c = hf_lora_config(hf, d / "data", {"training/pre_lora_tokens=[640]", R"(training/pre_lora_dataset=[[{"name":"gen","rate":1}]])",
                                                   "training/post_lora_tokens=[640]"});
  auto t = hf_job("two_phase", c, d / "out");
  t->restore_from_path(hf);
  const NamedTensors file = file_values(*t, hf);
  const auto params = base_params(*t->model());
  REQUIRE(params.size() == file.size());
  for (size_t i = 0; i < params.size(); ++i) {
    INFO(params[i].first);
    CHECK(params[i].second.scalar_type() == torch::kFloat32);
    CHECK(torch::equal(params[i].second, file[i].second));
  }
  t->run();
  // Phase one trained every weight in place.
  for (size_t i = 0; i < params.size(); ++i) {
    INFO(params[i].first);
    CHECK_FALSE(torch::equal(params[i].second.to(torch::kFloat32), file[i].second));
  }
}

TEST_CASE("a LoRA job starts from a Hugging Face directory: its tensors in bf16 as loaded, no random draw, no phase-one optimizer",
          "[frozen_base][huggingface]") {
  test::TempDir d;
  test::make_byte_dataset(d / "data", "gen", 1);
  const Config c = hf_lora_config(kHfBf16, d / "data", {"optimization/lora/modules_to_save=[\"model.norm\"]"});
  auto t = hf_job("adapt", c, d / "out");
  // A job that starts with adapters has no optimizer over every parameter (its moments would be twice
  // the base in float32).
  CHECK(t->trainable().empty());
  t->restore_from_path(kHfBf16);
  // Every tensor is the file's, in bf16 from the start, except the one that trains (f32).
  const NamedTensors file = file_values(*t, kHfBf16);
  const auto params = base_params(*t->model());
  REQUIRE(params.size() == file.size());
  for (size_t i = 0; i < params.size(); ++i) {
    INFO(params[i].first);
    CHECK(params[i].second.scalar_type() == (params[i].first == "model.norm.weight" ? torch::kFloat32 : torch::kBFloat16));
    CHECK(torch::equal(params[i].second.cpu().to(torch::kFloat32), file[i].second));
  }
  CHECK(t->base_model()["hf_dir"] == fs::absolute(kHfBf16).lexically_normal().string());
  t->run();
  // Its checkpoints refer to the directory: the adapters and model.norm, not the frozen tensors.
  const std::string fin = d / "out/checkpoints/general/default/adapt/final/1280";
  const json meta = read_checkpoint_metadata(fin);
  REQUIRE(meta.contains("frozen_base"));
  CHECK(meta["frozen_base"]["format"] == "hf");
  CHECK(meta["frozen_base"]["path"] == fs::absolute(kHfBf16).lexically_normal().string());
  CHECK(meta["frozen_base"]["tensors"].size() == params.size() - 1);
  const auto names = stored_names(fin);
  CHECK(names.count("params/model.norm.weight") == 1);
  CHECK(names.count("params/model.layers.0.self_attn.q_proj.weight") == 0);
  CHECK(names.count("params/model.layers.0.self_attn.q_proj.lora_A") == 1);
  // eval and sample rebuild the trained model from it: the same logits as the trainer's own.
  auto ids = torch::randint(0, 300, {2, 16}, torch::kLong);
  test::Loaded l = test::load(fin);
  CHECK(torch::equal(l.logits(ids), test::logits_of(*t->model(), ids)));
}

TEST_CASE("a LoRA checkpoint that refers to its base: a moved base is found by training/frozen_base_path, a changed one is refused, "
          "save_frozen_base keeps copies", "[frozen_base][huggingface]") {
  test::TempDir d;
  test::make_byte_dataset(d / "data", "gen", 1);
  const std::string base = d / "base";
  copy_dir(kHfBf16, base);
  auto t = hf_job("adapt", hf_lora_config(base, d / "data"), d / "out");
  t->restore_from_path(base);
  t->run();
  const std::string fin = d / "out/checkpoints/general/default/adapt/final/1280";
  auto ids = torch::randint(0, 300, {2, 16}, torch::kLong);
  const torch::Tensor trained = test::logits_of(*t->model(), ids);

  // The same bf16 values in another form (the float32 model they were saved from) match the digest.
  const std::string moved = d / "moved";
  fs::rename(base, moved);
  CHECK_THROWS_WITH(test::load(fin), test::Contains("no longer exists") && test::Contains("training/frozen_base_path"));
  {
    test::Loaded l = test::load(fin, {"training/frozen_base_path=" + moved});
    CHECK(torch::equal(l.logits(ids), trained));
    test::Loaded f32 = test::load(fin, {"training/frozen_base_path=" + test::hf_golden("llama") + "/model"});
    CHECK(torch::equal(f32.logits(ids), trained));
  }
  // A resumed job carries the reference on to where it found the base.
  {
    auto resumed = hf_job("adapt", hf_lora_config(moved, d / "data", {"training/frozen_base_path=" + moved}), d / "out");
    resumed->restore_from_path("ntoks/512");
    resumed->save("again");
    CHECK(read_checkpoint_metadata(d / "out/checkpoints/general/default/adapt/again")["frozen_base"]["path"] ==
          fs::absolute(moved).lexically_normal().string());
  }
  // Another base (one value changed) is refused by every reader, naming the digest.
  damage_values(moved);
  CHECK_THROWS_WITH(test::load(fin, {"training/frozen_base_path=" + moved}),
                    test::Contains("is not the one") && test::Contains("digest"));
  CHECK_THROWS_WITH(export_merged(fin, d / "exported", false, false, moved), test::Contains("digest"));
  CHECK_FALSE(fs::exists(d / "exported"));

  // logging/save_frozen_base=true: every checkpoint holds the base, and needs nothing else.
  copy_dir(kHfBf16, base);
  auto copies = hf_job("copies", hf_lora_config(base, d / "data", {"logging/save_frozen_base=true"}), d / "out");
  copies->restore_from_path(base);
  copies->run();
  const std::string own = d / "out/checkpoints/general/default/copies/final/1280";
  CHECK_FALSE(read_checkpoint_metadata(own).contains("frozen_base"));
  CHECK(stored_names(own).count("params/model.layers.0.self_attn.q_proj.weight") == 1);
  remove_tree(base);
  test::Loaded l = test::load(own);
  // Both forms trained the same adapters on the same base.
  CHECK(torch::equal(l.logits(ids), trained));
}

TEST_CASE("export --format hf of a bf16 base writes bf16 merged in f32 and rounded once, and shards past --max-shard-size "
          "with transformers' index", "[frozen_base][huggingface]") {
  test::TempDir d;
  test::make_byte_dataset(d / "data", "gen", 1);
  const std::string base = d / "base";
  copy_dir(kHfBf16, base);
  auto t = hf_job("adapt", hf_lora_config(base, d / "data"), d / "out");
  t->restore_from_path(base);
  t->run();
  const std::string fin = d / "out/checkpoints/general/default/adapt/final/1280";
  MergedWeights f32 = merged_weights(fin, false, "", torch::kFloat32);
  REQUIRE(f32.merged > 0);
  CHECK(base_dtype(export_tensors(CheckpointMeta::read(fin), false)) == torch::kBFloat16);
  std::map<std::string, torch::Tensor> want;  // HF names: the f32 merge, rounded once
  uint64_t largest = 0, total = 0;
  for (auto& [n, x] : to_hf(ModelFamily::Llama, f32.params)) {
    want[n] = x.to(torch::kBFloat16);
    largest = std::max<uint64_t>(largest, 2 * x.numel());
    total += 2 * x.numel();
  }
  auto check_bf16 = [&](const std::string& dir) {
    SafetensorsModel model(dir);
    REQUIRE(model.entries().size() == want.size());
    for (const auto& e : model.entries()) {
      INFO(dir << ": " << e.name);
      const torch::Tensor x = model.tensor(e.name);
      CHECK(x.scalar_type() == torch::kBFloat16);
      CHECK(torch::equal(x, want.at(e.name)));
    }
  };
  // The default (source): the base's bf16, one file.
  test::Result r = test::launch({"export", "--format", "hf", fin, d / "hf"});
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, test::Contains("model.safetensors with") && test::Contains("bfloat16"));
  check_bf16(d / "hf");
  CHECK(read_json_file(d / "hf/config.json")["dtype"] == "bfloat16");
  // Past --max-shard-size: transformers' shards and index, replacing the single file.
  r = test::launch({"export", "--format", "hf", "--max-shard-size", std::to_string(largest), fin, d / "hf"});
  REQUIRE(r.code == 0);
  CHECK_FALSE(fs::exists(d / "hf/model.safetensors"));
  const json index = read_json_file(d / "hf/model.safetensors.index.json");
  CHECK(index["metadata"]["total_size"] == total);
  std::set<std::string> shards;
  for (auto& [n, f] : index["weight_map"].items()) shards.insert(f.get<std::string>());
  REQUIRE(shards.size() > 2);
  CHECK(*shards.begin() == "model-00001-of-" + std::string(5 - std::to_string(shards.size()).size(), '0') +
                               std::to_string(shards.size()) + ".safetensors");
  for (const auto& s : shards) {
    uint64_t bytes = 0;
    const auto in_file = read_safetensors(d / ("hf/" + s));
    for (const auto& [n, x] : in_file) bytes += 2 * x.numel();
    CHECK((bytes <= largest || in_file.size() == 1));
  }
  check_bf16(d / "hf");
  // One file again: the earlier export's shards and index go, nothing else does.
  write_file_atomic(d / "hf/README.md", "mine\n");
  REQUIRE(test::launch({"export", "--format", "hf", "--dtype", "float32", fin, d / "hf"}).code == 0);
  CHECK(fs::exists(d / "hf/README.md"));
  CHECK_FALSE(fs::exists(d / "hf/model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(d / ("hf/" + *shards.begin())));
  CHECK(read_json_file(d / "hf/config.json")["dtype"] == "float32");
  for (auto& [n, x] : to_hf(ModelFamily::Llama, f32.params)) CHECK(torch::equal(SafetensorsModel(d / "hf").tensor(n), x));
  // Mistakes: exit 2, nothing written.
  for (const auto& bad : std::vector<std::vector<std::string>>{{"--max-shard-size", "5 GB"}, {"--max-shard-size", "0"},
                                                               {"--format", "peft", "--dtype", "bfloat16"}}) {
    std::vector<std::string> args = {"export", fin, d / "bad"};
    if (bad[0] != "--format") args.insert(args.begin() + 1, {"--format", "hf"});
    args.insert(args.end(), bad.begin(), bad.end());
    test::Result b = test::launch(args);
    INFO(b.out);
    CHECK(b.code == 2);
    CHECK_FALSE(fs::exists(d / "bad"));
  }
}

TEST_CASE("a two-phase job's LoRA checkpoints refer to its pre_lora_checkpoint, found again when the job directory moves",
          "[frozen_base][lora]") {
  test::TwoDatasets d;
  // Resuming mid phase 2 reads the base from the boundary checkpoint, bit-identically.
  auto [straight, resumed] = test::check_resume_mid_phase2_and_final(d, {});
  const std::string job = d.dir / "out/checkpoints/general/default/straight";
  const json meta = read_checkpoint_metadata(job + "/final/1280");
  REQUIRE(meta.contains("frozen_base"));
  CHECK(meta["frozen_base"]["format"] == "checkpoint");
  CHECK(meta["frozen_base"]["relative"] == "pre_lora_checkpoint");
  CHECK(stored_names(job + "/final/1280").count("params/h.0.attn.c_attn.weight") == 0);
  auto ids = torch::randint(0, 257, {2, 16}, torch::kLong);
  const torch::Tensor before = test::logits_of(*straight->model(), ids);
  const std::string moved = d.dir / "elsewhere";
  fs::rename(job, moved);
  test::Loaded l = test::load(moved + "/final/1280");
  CHECK(torch::equal(l.logits(ids), before));
  CHECK(export_tensors(CheckpointMeta::read(moved + "/final/1280"), false).size() >
        read_checkpoint_tensors(moved + "/final/1280").size());
}

TEST_CASE("frozen_linear: the product and x's gradient of a bf16 weight, without a float32 copy in the graph", "[frozen_base][lora][numerics]") {
  torch::manual_seed(5);
  const auto W = torch::randn({48, 16}).to(torch::kBFloat16), b = torch::randn({48}).to(torch::kBFloat16);
  const auto x0 = torch::randn({3, 5, 16});
  const auto Wf = W.to(torch::kFloat32), bf = b.to(torch::kFloat32);
  // The reference: the cast made by hand (what a layer did before), autograd keeping it; the product an
  // f32 layer computes (kernels/cpu_gemm.hpp: oneDNN's where the build has it).
  auto xr = x0.clone().requires_grad_(true);
  auto yr = cpu_linear(xr, Wf, bf);
  auto g = torch::randn(yr.sizes());
  yr.backward(g);
  for (const int64_t block : {kFrozenCastBlockBytes, int64_t(16 * 4 * 10)}) {  // one product; blocks of 10 rows
    INFO("block " << block);
    auto x = x0.clone().requires_grad_(true);
    auto y = frozen_linear(x, W, b, block);
    REQUIRE(y.grad_fn());
    CHECK(y.grad_fn()->name().find("FrozenLinear") != std::string::npos);  // not linear's node, which keeps its cast W
    if (block == kFrozenCastBlockBytes) CHECK(torch::equal(y, yr));
    // Blocks sum each output's terms as the whole product does, but a kernel may order them by the
    // matrix's shape; x's gradient sums the blocks' parts of every column (tests/rounding.hpp).
    CHECK(test::outside_bound(y, yr, test::linear_rounding_bound(x0, Wf, bf)) == "");
    y.backward(g);
    CHECK(test::outside_bound(x.grad(), xr.grad(), test::linear_rounding_bound(g, Wf.t())) == "");
    if (block == kFrozenCastBlockBytes) CHECK(torch::equal(x.grad(), xr.grad()));
  }
  // No graph needed (x does not train): the same product.
  CHECK(torch::equal(frozen_linear(x0, W, b), yr.detach()));
  CHECK(test::outside_bound(frozen_linear(x0, W, b, 64), yr, test::linear_rounding_bound(x0, Wf, bf)) == "");
  // In blocks, each block's columns of the output hold its product (with and without the bias, for a
  // matrix x and a batch of them), as one product of the whole cast weight gives them.
  for (const auto& x : {x0, x0.reshape({15, 16})})
    for (const int64_t block : {int64_t(16 * 4 * 10), int64_t(16 * 4 * 7)}) {  // blocks of 10 rows (7: a shorter last one)
      INFO("x " << x.sizes() << ", block " << block);
      CHECK(test::outside_bound(frozen_linear(x, W, b, block), torch::linear(x, Wf, bf),
                                test::linear_rounding_bound(x, Wf, bf)) == "");
      CHECK(test::outside_bound(frozen_linear(x, W, torch::Tensor(), block), torch::linear(x, Wf),
                                test::linear_rounding_bound(x, Wf)) == "");
    }
}

TEST_CASE("frozen_lora_linear: an adapter merged into the f32 cast of a bf16 weight gives add_lora's output and gradients",
          "[frozen_base][lora][numerics]") {
  torch::manual_seed(7);
  const int64_t in = 16, out = 48, r = 4;
  const double scale = 2.5;
  const auto W = torch::randn({out, in}).to(torch::kBFloat16), b = torch::randn({out}).to(torch::kBFloat16);
  const auto A0 = torch::randn({in, r}) * 0.3, B0 = torch::randn({r, out}) * 0.3, x0 = torch::randn({3, 5, in});
  const auto g = torch::randn({3, 5, out});
  // Grads of x, A, B through f, or undefined where a leaf does not train.
  auto run = [&](auto f, bool x_trains) {
    auto x = x0.clone().requires_grad_(x_trains);
    auto A = A0.clone().requires_grad_(true), B = B0.clone().requires_grad_(true);
    auto y = f(x, A, B);
    y.backward(g);
    return std::vector<torch::Tensor>{y.detach(), x.grad(), A.grad(), B.grad()};
  };
  for (const bool bias : {true, false})
    for (const bool x_trains : {true, false})
      for (const int64_t block : {kFrozenCastBlockBytes, int64_t(in * 4 * 10), int64_t(in * 4 * 7)}) {  // one product; blocks of 10, 7 rows
        INFO("bias " << bias << ", x trains " << x_trains << ", block " << block);
        const auto bb = bias ? b : torch::Tensor();
        auto unmerged = run([&](auto x, auto A, auto B) { return add_lora(x, frozen_linear(x, W, bb, block), A, B, scale); }, x_trains);
        std::string node;
        auto merged = run([&](auto x, auto A, auto B) {
          auto y = frozen_lora_linear(x, W, bb, A, B, scale, block);
          node = y.grad_fn() ? y.grad_fn()->name() : "";
          return y;
        }, x_trains);
        CHECK(node.find("FrozenLora") != std::string::npos);  // one node: no rank-r products of its own in the graph
        for (size_t i = 0; i < unmerged.size(); ++i) {
          INFO("output " << i << " (y, x's, A's, B's gradient)");
          REQUIRE(merged[i].defined() == unmerged[i].defined());
          if (merged[i].defined()) CHECK(torch::allclose(merged[i], unmerged[i], 1e-5, 1e-5));
        }
        CHECK(x_trains == merged[1].defined());
        // Without a graph (evaluation): the same product.
        torch::NoGradGuard no_grad;
        CHECK(torch::allclose(frozen_lora_linear(x0, W, bb, A0, B0, scale, block), unmerged[0], 1e-5, 1e-5));
      }
  // Only a frozen W that is cast for x's product merges: not an f32 W, not a bf16 x, not a trained W.
  CHECK(merges_lora_into_cast(x0, W, b));
  CHECK_FALSE(merges_lora_into_cast(x0, W.to(torch::kFloat32), b));
  CHECK_FALSE(merges_lora_into_cast(x0.to(torch::kBFloat16), W.to(torch::kFloat32)));
  CHECK_FALSE(merges_lora_into_cast(x0, W.clone().requires_grad_(true)));
  CHECK_THROWS_WITH(frozen_lora_linear(x0, W.to(torch::kFloat32), b, A0, B0, scale), test::Contains("frozen_lora_linear"));
}

TEST_CASE("a layer with a bf16 base and an adapter merges it in an f32 step with the rows for it to pay, not under bf16 autocast", "[frozen_base][lora][numerics]") {
  torch::manual_seed(8);
  Linear layer(16, 24, true);
  {
    torch::NoGradGuard no_grad;
    layer->weight.normal_(0.0, 0.3);  // a layer's weight starts uninitialized (the model's init fills it)
    layer->bias.normal_(0.0, 0.3);
  }
  layer->freeze_weight(FrozenFormat::Bf16);
  layer->set_lora(torch::randn({16, 4}).requires_grad_(true), (torch::randn({4, 24}) * 0.1).requires_grad_(true), 2.0, {});
  // 20 rows: the merge pays from 2 in out / (in + out) = 19.2 rows of x (layers.cpp's merge_pays).
  const auto x = torch::randn({4, 5, 16}).requires_grad_(true);
  CHECK_FALSE(layer->merges_adapter(x));  // its bias trains (a module kept trainable): the bias needs its gradient
  // The bias frozen as transition_to_lora freezes it.
  layer->bias.set_data(layer->bias.detach().to(torch::kBFloat16));
  layer->bias.requires_grad_(false);
  CHECK(layer->merges_adapter(x));
  // 19 rows: forming s (A B)^T twice would cost more than the adapter's rank-r products beside the layer.
  const auto few = torch::randn({19, 16}).requires_grad_(true);
  CHECK_FALSE(layer->merges_adapter(few));
  CHECK_FALSE(layer->forward(few).grad_fn()->name().find("FrozenLora") != std::string::npos);
  CHECK(torch::allclose(layer->forward(few), add_lora(few, layer->base_forward(few), layer->named_parameters()["lora_A"],
                                                      layer->named_parameters()["lora_B"], 2.0), 1e-5, 1e-5));
  const auto y = layer->forward(x);
  REQUIRE(y.grad_fn());
  CHECK(y.grad_fn()->name().find("FrozenLora") != std::string::npos);
  CHECK(torch::allclose(y, add_lora(x, layer->base_forward(x), layer->named_parameters()["lora_A"], layer->named_parameters()["lora_B"], 2.0),
                        1e-5, 1e-5));
  {
    Runtime rt;
    rt.bf16_autocast = true;
    AutocastGuard autocast(rt);
    CHECK_FALSE(layer->merges_adapter(x));  // a bf16 merge would round the adapter's small values away
  }
  {
    AdaptersOff off(*layer);
    CHECK_FALSE(layer->merges_adapter(x));
    CHECK(torch::equal(layer->forward(x), layer->base_forward(x)));
  }
}

TEST_CASE("a frozen head's logits take the loss's gradient in place: frozen_linear of a matrix gives no view", "[frozen_base][lora][loss][numerics]") {
  torch::manual_seed(6);
  const auto W = torch::randn({300, 16}).to(torch::kBFloat16);  // a tied head of 300 tokens
  const auto t = torch::randint(0, 300, {12}, torch::kLong);
  for (const int64_t block : {kFrozenCastBlockBytes, int64_t(16 * 4 * 64)}) {  // one product; blocks of 64 rows
    INFO("block " << block);
    auto x = torch::randn({12, 16}).requires_grad_(true);
    auto logits = frozen_linear(x, W, torch::Tensor(), block);
    CHECK_FALSE(logits.is_view());
    const void* array = logits.data_ptr();
    const void* written = nullptr;
    logits.register_hook([&written](const torch::Tensor& g) { written = g.data_ptr(); });
    auto loss = cross_entropy_sum(logits, t, /*fused=*/true, /*overwrite_logits=*/true);
    logits = torch::Tensor();
    loss.backward();
    CHECK(written == array);
    CHECK(x.grad().defined());
  }
}

}  // namespace lt
