// A frozen storage added in one file (docs/design.md's worked example): a test-only int8 storage, each
// row of the bf16 W quantized to int8 by its absmax (W ~ codes * scale, scale = max|row| / 127), made a
// FrozenWeight here and registered by name with register_frozen_storage (frozen_storage.hpp) at static
// initialization. Nothing else knows it: optimization/lora/quantize_base=int8 stores the blocks' linear
// weights in it, the checkpoint keeps its state() as int8/<weight>.codes and .scales, a restore and the
// export's merge make W through it. A LoRA job on it trains the adapters of a bf16 base holding
// dequant(quant(W)), bit for bit, and resumes bit-identically.
#include <set>

#include "hf_fixtures.hpp"
#include "lora_fixtures.hpp"
#include "lora_trainer/core/checksum.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/lora_metadata.hpp"
#include "lora_trainer/peft/frozen_weight.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {
namespace {

// codes = round(W / scale) (out, in) int8, scale = max|row| / 127 (out) f32 (1 for a row of zeros).
std::pair<torch::Tensor, torch::Tensor> quantize_int8(const torch::Tensor& W) {
  const torch::Tensor w = W.detach().to(torch::kFloat32);
  torch::Tensor scales = w.abs().amax(1) / 127.0;
  scales = torch::where(scales > 0, scales, torch::ones_like(scales));
  return {torch::round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch::kInt8), scales};
}

torch::Tensor dequantize_int8(const torch::Tensor& codes, const torch::Tensor& scales) {
  return (codes.to(torch::kFloat32) * scales.unsqueeze(1)).to(torch::kBFloat16);
}

extern const FrozenFormat kInt8;

// The storage: its codes and scales on the weight's device; W made in bf16 for each product (in the
// forward and again in the backward, as nf4's), never kept between.
class Int8Weight : public FrozenWeight {
 public:
  explicit Int8Weight(const torch::Tensor& weight) : shape_(weight.sizes().vec()) {
    if (!is_frozen_stand_in(weight)) {
      assign(weight);
      return;
    }
    // A restore's template: allocated, for the checkpoint's codes and scales (or assign) to fill.
    codes_ = torch::zeros(shape_, torch::TensorOptions().dtype(torch::kInt8).device(weight.device()));
    scales_ = torch::ones({shape_[0]}, torch::TensorOptions().dtype(torch::kFloat32).device(weight.device()));
  }
  torch::Tensor for_matmul(const torch::Tensor& x) const override {
    return dequantize_int8(codes_.to(x.device()), scales_.to(x.device()));
  }
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& b) const override { return made_weight_linear(*this, x, b); }
  torch::Tensor linear_with_adapter(const torch::Tensor& x, const torch::Tensor& b, const torch::Tensor& A, const torch::Tensor& B,
                                    double scale) const override {
    return made_weight_lora_linear(*this, x, b, A, B, scale);
  }
  int64_t bytes() const override { return codes_.numel() + scales_.numel() * 4; }
  FrozenFormat format() const override { return kInt8; }
  std::vector<int64_t> shape() const override { return shape_; }
  void assign(const torch::Tensor& W) override {
    const torch::Tensor bf16 = W.detach().to(torch::kBFloat16);
    crc_ = bf16_crc32(bf16);
    std::tie(codes_, scales_) = quantize_int8(bf16);
  }
  std::vector<std::pair<std::string, torch::Tensor>> state() const override { return {{"codes", codes_}, {"scales", scales_}}; }
  std::optional<uint32_t> values_crc() const override { return crc_; }

 private:
  std::vector<int64_t> shape_;
  torch::Tensor codes_, scales_;
  std::optional<uint32_t> crc_;
};

// The registration: its name, how messages call it, how it is made, its bytes for the memory plan
// (a byte a value and an f32 scale a row: Int8Weight::bytes()).
const FrozenFormat kInt8 = register_frozen_storage(
    {"int8", "int8", [](torch::Tensor weight) -> std::shared_ptr<FrozenWeight> { return std::make_shared<Int8Weight>(weight); },
     [](const std::vector<int64_t>& shape) { return shape.at(0) * shape.at(1) + shape.at(0) * 4; }});

const std::vector<std::string> kInt8Job = {"optimization/lora/quantize_base=int8"};

// The tiny GPT's linear weights of the blocks: what quantize_base=int8 stores as int8.
const std::vector<std::string> kBlockLinear = {"h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.weight",
                                               "h.0.mlp.c_proj.weight",  "h.1.attn.c_attn.weight", "h.1.attn.c_proj.weight",
                                               "h.1.mlp.c_fc.weight",    "h.1.mlp.c_proj.weight"};

torch::Tensor int8_round_trip(const torch::Tensor& W) {
  auto [codes, scales] = quantize_int8(W.detach().to(torch::kBFloat16));
  return dequantize_int8(codes, scales);
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("the frozen storages' one name table: bf16, nf4 and a registered int8, printed and parsed alike, \"none\" read "
          "as bf16's older name", "[storage][lora]") {
  CHECK(std::string(to_string(FrozenFormat::Bf16)) == "bf16");
  CHECK(std::string(to_string(FrozenFormat::Nf4)) == "nf4");
  CHECK(std::string(to_string(kInt8)) == "int8");
  for (FrozenFormat f : {FrozenFormat::Bf16, FrozenFormat::Nf4, kInt8}) CHECK(parse_frozen_format(to_string(f)) == f);
  CHECK(parse_frozen_format("none") == FrozenFormat::Bf16);
  CHECK_THROWS_WITH(parse_frozen_format("nf8"), test::Contains("bf16, nf4") && test::Contains("int8"));
  CHECK(frozen_storage(FrozenFormat::Nf4).state_prefix() == kNf4Prefix);  // the checkpoint's nf4/<weight>.<field>
  CHECK(frozen_storage(kInt8).state_prefix() == "int8/");
  CHECK(!frozen_storage(FrozenFormat::Bf16).quantizes());
  CHECK(frozen_storage(kInt8).quantizes());
  CHECK_THROWS(register_frozen_storage({"int8", "", frozen_storage(kInt8).make, {}}));  // taken
  CHECK_THROWS(register_frozen_storage({"none", "", frozen_storage(kInt8).make, {}}));
  CHECK(!shardable(kInt8));

  // The checkpoint's lora.quantize_base: typed, read once; "none" (older files) is bf16 and is written "bf16".
  json block = {{"rank", 4}, {"alpha", 8.0}, {"quantize_base", "none"}};
  CHECK(LoraMetadata::from_json(block, "m.json").quantize_base == FrozenFormat::Bf16);
  CHECK(LoraMetadata::from_json(block, "m.json").to_json()["quantize_base"] == "bf16");
  block.erase("quantize_base");
  CHECK(LoraMetadata::from_json(block, "m.json").quantize_base == FrozenFormat::Bf16);
  block["quantize_base"] = "int8";
  CHECK(LoraMetadata::from_json(block, "m.json").quantize_base == kInt8);
  block["quantize_base"] = "int4";
  CHECK_THROWS_WITH(LoraMetadata::from_json(block, "m.json"),
                    test::Contains("m.json") && test::Contains("lora.quantize_base") && test::Contains("int4"));

  // The config key takes each name, and "none"; another is refused, naming the key and the names.
  test::TwoDatasets d;
  CHECK_THROWS_WITH(test::make_lora(d, "bad", {"optimization/lora/quantize_base=int4"}),
                    test::Contains("optimization/lora/quantize_base") && test::Contains("int8"));
  CHECK_NOTHROW(test::make_lora(d, "old", {"optimization/lora/quantize_base=none"}));
}

TEST_CASE("a LoRA job on the registered int8 storage trains the adapters of a bf16 base holding dequant(quant(W)), bit for "
          "bit", "[storage][lora]") {
  test::TwoDatasets d;
  auto q = test::make_lora(d, "q", kInt8Job);
  auto ref = test::make_lora(d, "ref");
  for (int i = 0; i < 5; ++i) REQUIRE(q->train_step().loss == ref->train_step().loss);  // phase one: nothing differs
  q->transition_to_lora();
  ref->transition_to_lora();
  {
    torch::NoGradGuard ng;
    for (auto& [name, p] : base_params(*ref->model()))
      if (std::find(kBlockLinear.begin(), kBlockLinear.end(), name) != kBlockLinear.end()) p.copy_(int8_round_trip(p));
  }
  const auto storages = frozen_storages(*q->model());
  std::set<std::string> stored;
  for (const auto& [name, s] : storages) {
    stored.insert(name);
    CHECK(s->format() == kInt8);
  }
  CHECK(stored == std::set<std::string>(kBlockLinear.begin(), kBlockLinear.end()));
  for (const auto& [name, p] : base_params(*q->model())) {
    INFO(name);
    if (stored.count(name)) {
      CHECK(p.stride(0) == 0);  // a stand-in: the codes hold W, a byte a value and a scale a row
      CHECK(storages.at(name)->bytes() < p.numel() * 1.2);
    } else {
      CHECK(p.scalar_type() == torch::kBFloat16);
    }
  }
  for (int i = 5; i < 10; ++i) {
    INFO("step " << i);
    REQUIRE(q->train_step().loss == ref->train_step().loss);
  }
  const auto theirs = ref->lora_params().named();
  for (const auto& [name, t] : q->lora_params().named()) {
    INFO(name);
    auto it = std::find_if(theirs.begin(), theirs.end(), [&](const auto& np) { return np.first == name; });
    REQUIRE(it != theirs.end());
    CHECK(torch::equal(t, it->second));
  }
}

TEST_CASE("a LoRA job on the registered int8 storage resumes bit-identically from checkpoints that refer to its base or copy "
          "it as int8/<weight>.<field>, and eval and export read it", "[storage][lora]") {
  for (const auto& extra : std::vector<std::vector<std::string>>{{}, {"logging/save_frozen_base=true"}}) {
    INFO(json(extra).dump());
    test::TwoDatasets d;
    auto [straight, resumed] = test::check_resume_mid_phase2_and_final(d, with(kInt8Job, extra));
    const std::string fin = d.dir / "out/checkpoints/general/default/straight/final/1280";
    const json meta = read_checkpoint_metadata(fin);
    CHECK(meta["lora"]["quantize_base"] == "int8");
    CHECK(meta["lora"]["quantized"].size() == kBlockLinear.size());
    std::set<std::string> names;
    for (const auto& [n, t] : read_checkpoint_tensors(fin)) names.insert(n);
    const bool copies = !extra.empty();
    CHECK(names.count("params/h.0.attn.c_attn.weight") == 0);
    CHECK(names.count("int8/h.0.attn.c_attn.weight.codes") == (copies ? 1 : 0));
    CHECK(names.count("int8/h.1.mlp.c_proj.weight.scales") == (copies ? 1 : 0));

    auto ids = torch::randint(0, 257, {2, 16}, torch::kLong);
    test::Loaded l = test::load(fin);
    CHECK(torch::equal(l.logits(ids), test::logits_of(*straight->model(), ids)));
    // The export merges into dequant(quant(W)), made by the storage from its fields or the base's values.
    const NamedTensors exported = export_tensors(CheckpointMeta::read(fin), false);
    std::map<std::string, torch::Tensor> pre;
    const std::string pre_lora = d.dir / "out/checkpoints/general/default/straight/pre_lora_checkpoint";
    for (const auto& [n, t] : read_checkpoint_tensors(pre_lora)) pre[n] = t;
    int compared = 0;
    for (const auto& [n, t] : exported)
      if (n == "params/h.1.attn.c_attn.weight") {
        CHECK(torch::equal(t, int8_round_trip(pre.at(n))));
        ++compared;
      }
    CHECK(compared == 1);
    CHECK(std::none_of(exported.begin(), exported.end(), [](const auto& np) { return np.first.rfind("int8/", 0) == 0; }));
  }
  // A checkpoint of the int8 base is refused by a job of another storage, naming both.
  test::TwoDatasets d;
  {
    auto t = test::make_lora(d, "q", kInt8Job);
    for (int i = 0; i < 7; ++i) t->train_step();
    t->save("ntoks/896");
  }
  auto nf4 = test::make_lora(d, "q", {"optimization/lora/quantize_base=nf4"});
  CHECK_THROWS_WITH(nf4->restore_from_path("ntoks/896"), test::Contains("stored as int8") &&
                                                             test::Contains("optimization/lora/quantize_base=nf4"));
}

}  // namespace lt
