// QLoRA (issue 32): optimization/lora/quantize_base=nf4 stores the frozen linear weights of the blocks
// as NF4 (kernels/nf4.hpp, peft/frozen_weight.hpp). A job with it trains the same adapters as a bf16
// LoRA job whose base holds dequant(quant(W)), bit for bit; it resumes bit-identically from a
// checkpoint that refers to its base or copies it (as NF4); eval, export and the PEFT export read it.
#include <filesystem>
#include <set>

#include "hf_fixtures.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/kernels/nf4.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {
namespace {

const std::vector<std::string> kNf4 = {"optimization/lora/quantize_base=nf4"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

using test::stored_names;

// The tiny GPT's linear weights of the blocks: what quantize_base=nf4 quantizes.
const std::vector<std::string> kBlockLinear = {"h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.weight",
                                               "h.0.mlp.c_proj.weight",  "h.1.attn.c_attn.weight", "h.1.attn.c_proj.weight",
                                               "h.1.mlp.c_fc.weight",    "h.1.mlp.c_proj.weight"};

torch::Tensor nf4_round_trip(const torch::Tensor& W) {
  return dequantize_nf4(quantize_nf4(W.detach().cpu().to(torch::kBFloat16)), torch::kBFloat16);
}

}  // namespace

TEST_CASE("QLoRA: the adapters train as on a bf16 base holding dequant(quant(W)), bit for bit, and only the blocks' "
          "linear weights are NF4", "[qlora][lora]") {
  test::TwoDatasets d;
  auto q = test::make_lora(d, "q", kNf4);
  auto ref = test::make_lora(d, "ref");
  for (int i = 0; i < 5; ++i) REQUIRE(q->train_step().loss == ref->train_step().loss);  // phase one: nothing differs
  q->transition_to_lora();
  ref->transition_to_lora();
  {
    // The reference's bf16 base replaced by what the NF4 base dequantizes to.
    torch::NoGradGuard ng;
    for (auto& [name, p] : base_params(*ref->model()))
      if (std::find(kBlockLinear.begin(), kBlockLinear.end(), name) != kBlockLinear.end()) p.copy_(nf4_round_trip(p));
  }
  const auto storages = frozen_storages(*q->model());
  std::set<std::string> quantized;
  for (const auto& [name, s] : storages) quantized.insert(name);
  CHECK(quantized == std::set<std::string>(kBlockLinear.begin(), kBlockLinear.end()));
  for (const auto& [name, p] : base_params(*q->model())) {
    INFO(name);
    if (quantized.count(name)) {
      // A stand-in of the weight's shape with no storage of its own; the codes hold it, ~0.52 bytes a value.
      CHECK(p.stride(0) == 0);
      CHECK(p.sizes().vec() == storages.at(name)->shape());
      CHECK(storages.at(name)->bytes() < p.numel() * 0.53);
    } else {
      CHECK(p.scalar_type() == torch::kBFloat16);  // wte, wpe, the norms: bf16 as before
    }
  }
  for (int i = 5; i < 10; ++i) {
    INFO("step " << i);
    const double a = q->train_step().loss, b = ref->train_step().loss;
    REQUIRE(a == b);
  }
  for (const auto& [name, t] : q->lora_params().named()) {
    INFO(name);
    const auto& other = ref->lora_params().named();
    auto it = std::find_if(other.begin(), other.end(), [&](const auto& np) { return np.first == name; });
    REQUIRE(it != other.end());
    CHECK(torch::equal(t, it->second));
  }
}

TEST_CASE("QLoRA resumes bit-identically: checkpoints that refer to the pre_lora_checkpoint (quantized again on restore) "
          "or copy the base as NF4 (logging/save_frozen_base), with activation checkpointing and DoRA, with modules_to_save",
          "[qlora][lora]") {
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {},
           {"logging/save_frozen_base=true"},
           {"training/activation_checkpointing=true", "optimization/lora/dora=true"},
           {"optimization/lora/target_modules=[\"c_attn\", \"c_proj\"]", "optimization/lora/modules_to_save=[\"mlp.c_fc\"]"}}) {
    INFO(json(extra).dump());
    test::TwoDatasets d;
    auto [straight, resumed] = test::check_resume_mid_phase2_and_final(d, with(kNf4, extra));
    const std::string fin = d.dir / "out/checkpoints/general/default/straight/final/1280";
    const json meta = read_checkpoint_metadata(fin);
    CHECK(meta["lora"]["quantize_base"] == "nf4");
    // A block linear weight that trains in full (modules_to_save) stays f32: not quantized.
    const bool saved = extra.size() == 2 && extra[1].find("modules_to_save") != std::string::npos;
    CHECK(meta["lora"]["quantized"].size() == kBlockLinear.size() - (saved ? 2 : 0));
    CHECK(meta["lora"]["quantized"].contains("h.0.mlp.c_fc.weight") == !saved);
    CHECK(meta["lora"]["quantized"]["h.0.attn.c_attn.weight"] == json::array({96, 32}));
    const auto names = stored_names(fin);
    CHECK(names.count("params/h.0.attn.c_attn.weight") == 0);
    const bool copies = !extra.empty() && extra[0] == "logging/save_frozen_base=true";
    CHECK(meta.contains("frozen_base") == !copies);
    CHECK(names.count("nf4/h.0.attn.c_attn.weight.codes") == (copies ? 1 : 0));
    CHECK(names.count("nf4/h.1.mlp.c_proj.weight.absmax_offset") == (copies ? 1 : 0));
    CHECK(names.count("params/wte.weight") == (copies ? 1 : 0));  // the bf16 part of a copied base

    // eval/sample rebuild the model: the trained logits; export merges into dequant(quant(W)).
    auto ids = torch::randint(0, 257, {2, 16}, torch::kLong);
    test::Loaded l = test::load(fin);
    CHECK(torch::equal(l.logits(ids), test::logits_of(*straight->model(), ids)));
    const NamedTensors exported = export_tensors(CheckpointMeta::read(fin), false);
    const std::string pre = d.dir / "out/checkpoints/general/default/straight/pre_lora_checkpoint";
    std::map<std::string, torch::Tensor> pre_params;
    for (const auto& [n, t] : read_checkpoint_tensors(pre)) pre_params[n] = t;
    for (const auto& [n, t] : exported)
      if (n == "params/h.1.attn.c_attn.weight") CHECK(torch::equal(t, nf4_round_trip(pre_params.at(n))));
    CHECK(std::none_of(exported.begin(), exported.end(), [](const auto& np) { return np.first.rfind("nf4/", 0) == 0; }));
    const MergedWeights merged = merged_weights(fin);
    CHECK(merged.merged == static_cast<int>(kBlockLinear.size()) - (saved ? 2 : 0));
    // The PEFT export is the ordinary adapter: A and B as trained (PEFT's (r, in) and (out, r)).
    const std::string peft = d.dir / "peft";
    export_peft(fin, peft);
    std::map<std::string, torch::Tensor> adapter;
    for (const auto& [n, t] : read_safetensors(peft + "/adapter_model.safetensors")) adapter[n] = t;
    int compared = 0;
    for (const auto& [n, t] : straight->lora_params().named())
      if (n == "h.1.attn.c_attn.lora_A") {
        CHECK(torch::equal(adapter.at("base_model.model.transformer.h.1.attn.c_attn.lora_A.weight"), t.detach().cpu().t()));
        ++compared;
      }
    CHECK(compared == 1);
  }
}

TEST_CASE("QLoRA's settings: a checkpoint of one base format is refused by a job of the other, naming the key, and an unknown "
          "format is refused", "[qlora][lora]") {
  test::TwoDatasets d;
  {
    auto t = test::make_lora(d, "q", kNf4);
    for (int i = 0; i < 7; ++i) t->train_step();
    t->save("ntoks/896");
  }
  auto plain = test::make_lora(d, "q");
  CHECK_THROWS_WITH(plain->restore_from_path("ntoks/896"),
                    test::Contains("optimization/lora/quantize_base=bf16") && test::Contains("stored as NF4"));
  CHECK_THROWS_WITH(test::make_lora(d, "bad", {"optimization/lora/quantize_base=nf8"}),
                    test::Contains("optimization/lora/quantize_base"));
}

TEST_CASE("QLoRA from a Hugging Face directory: each block weight quantized as it is read, the checkpoints refer to the "
          "directory, export merges into dequant(quant(W))", "[qlora][huggingface]") {
  const std::string hf = test::hf_golden("llama") + "/model_bf16_sharded";
  test::TempDir d;
  test::make_byte_dataset(d / "data", "gen", 1);
  Config c(Trainer::lora_schema());
  for (const auto& o : test::tiny_overrides(d / "data"))
    if (o.rfind("architecture/", 0) != 0 || o.rfind("architecture/block_size", 0) == 0) c.apply_override(o);
  for (const auto& a : hf_architecture(read_json_file(hf + "/config.json"), hf))
    if (a.rfind("architecture/block_size", 0) != 0) c.apply_override(a);
  for (const auto& o : {"training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[1280]",
                        R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])", "optimization/lora/rank=4",
                        "optimization/lora/alpha=8", "optimization/lora/lr=0.01", "runtime/precision=f32",
                        "logging/checkpoint_interval=4", "optimization/lora/quantize_base=nf4"})
    c.apply_override(o);
  auto t = std::make_unique<Trainer>(test::job_spec("adapt"), c, d / "out", TrainingPlan::from_lora_config(c));
  t->restore_from_path(hf);
  // Quantized at the load, before the transition: no bf16 copy of a block weight stays.
  const auto storages = frozen_storages(*t->model());
  REQUIRE(storages.count("model.layers.0.self_attn.q_proj.weight") == 1);
  CHECK(storages.count("lm_head.weight") + storages.count("model.embed_tokens.weight") == 0);
  NamedTensors expected;
  for (const auto& [n, p] : base_params(*t->model())) expected.emplace_back(n, torch::empty(p.sizes()));
  const NamedTensors file = from_hf(ModelFamily::Llama, read_safetensors_model(hf), expected, hf);
  std::map<std::string, torch::Tensor> file_of;
  for (const auto& [n, v] : file) file_of[n] = v;
  const std::string q_proj = "model.layers.1.self_attn.q_proj.weight";
  CHECK(torch::equal(storages.at(q_proj)->for_matmul(torch::zeros({1}, torch::kFloat32).to(t->model()->parameters()[0].device())).cpu(),
                     nf4_round_trip(file_of.at(q_proj))));
  t->run();
  const std::string fin = d / "out/checkpoints/general/default/adapt/final/1280";
  const json meta = read_checkpoint_metadata(fin);
  REQUIRE(meta.contains("frozen_base"));
  CHECK(meta["frozen_base"]["format"] == "hf");
  auto ids = torch::randint(0, 300, {2, 16}, torch::kLong);
  test::Loaded l = test::load(fin);
  CHECK(torch::equal(l.logits(ids), test::logits_of(*t->model(), ids)));
  // The merged export: dequant(quant(W)) + s B A in f32, rounded once.
  const MergedWeights m = merged_weights(fin);
  const auto lora = t->lora_params().named();
  auto find = [&](const std::string& n) {
    auto it = std::find_if(lora.begin(), lora.end(), [&](const auto& np) { return np.first == n; });
    REQUIRE(it != lora.end());
    return it->second.detach().cpu();
  };
  for (const auto& [n, v] : m.params)
    if (n == q_proj)
      CHECK(torch::equal(v, merge_lora_params(nf4_round_trip(file_of.at(q_proj)).to(torch::kFloat32), find(LoraParams::a_name(n)),
                                              find(LoraParams::b_name(n)), 8.0, 4, false, {})));
}

}  // namespace lt
