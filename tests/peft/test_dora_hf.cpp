// DoRA on imported Hugging Face models (GPT-2's Conv1D, Llama's nn.Linear): the PEFT adapter's
// use_dora and lora_magnitude_vector, PEFT's DoRA merge rule applied by hand to transformers' own
// layouts, and the merged export. With LT_HF_CHECK_DIR set, both leave their files for
// scripts/hf_golden.py peft-logits (docs/huggingface.md).
#include <cmath>
#include <map>

#include "catch.hpp"

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "fixtures.hpp"
#include "hf_fixtures.hpp"

using namespace lt;

namespace {

// PEFT's DoRA merge (variants.py, DoraLinearVariant.merge_safe) on transformers' weights: with
// delta = scaling lora_B @ lora_A (out, in) and V = W (out, in) + delta, W' = (m / ||V||_row) V; a
// Conv1D weight is (in, out), so it is transposed for the norm and the factor scales its columns.
void check_peft_dora(ModelFamily family, const std::string& ck, const nlohmann::json& cfg,
                     const std::map<std::string, torch::Tensor>& adapter, test::Loaded& lora, const torch::Tensor& ids,
                     int expected_modules) {
  const bool conv1d = cfg["fan_in_fan_out"].get<bool>();
  const double scaling = cfg["lora_alpha"].get<double>() /
                         (cfg["use_rslora"].get<bool>() ? std::sqrt(cfg["r"].get<double>()) : cfg["r"].get<double>());
  NamedTensors params;  // the base the job trained against: its bf16 copy, in f32
  for (auto& [n, t] : test::checkpoint_tensors(ck))
    if (n.rfind("params/", 0) == 0 && !is_adapter_param(n.substr(7))) params.emplace_back(n.substr(7), t.to(torch::kFloat32));
  NamedTensors hf = to_hf(family, params);
  int applied = 0;
  double magnitude_vs_norm = 0;  // how far training moved m from the adapted weight's norms
  for (auto& [n, w] : hf) {
    const std::string mod = "base_model.model." + n.substr(0, n.size() - std::string(".weight").size());
    if (!adapter.count(mod + ".lora_A.weight")) continue;
    const torch::Tensor m = adapter.at(mod + ".lora_magnitude_vector");
    auto delta = scaling * torch::mm(adapter.at(mod + ".lora_B.weight"), adapter.at(mod + ".lora_A.weight"));  // (out, in)
    auto V = (conv1d ? w.t() : w) + delta;
    REQUIRE(m.sizes() == at::IntArrayRef({V.size(0)}));
    const torch::Tensor norm = V.norm(2, {1});
    magnitude_vs_norm = std::max(magnitude_vs_norm, (m - norm).abs().max().item<double>());
    auto merged = (m / norm).unsqueeze(1) * V;
    w = conv1d ? merged.t().contiguous() : merged;
    ++applied;
  }
  CHECK(applied == expected_modules);
  CHECK(magnitude_vs_norm > 1e-4);  // the magnitudes trained: the test would see them ignored
  CausalLM model = make_model(lora.trainer->model()->options());
  torch::NoGradGuard ng;
  auto merged = from_hf(family, hf, named_params(*model), "peft-dora-merged");
  std::map<std::string, torch::Tensor> by_name(merged.begin(), merged.end());
  for (auto& [n, t] : named_params(*model)) t.copy_(by_name.at(n));
  model->eval();
  const double diff = test::max_diff(model->forward(ids), lora.logits(ids));
  UNSCOPED_INFO("PEFT's DoRA rule by hand vs our model: " << diff);
  CHECK(diff < 1e-4);
}

std::map<std::string, torch::Tensor> read_adapter(const std::string& dir) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, t] : read_safetensors(dir + "/adapter_model.safetensors")) out[n] = t;
  return out;
}

}  // namespace

TEST_CASE("DoRA on an imported GPT-2 (Conv1D): use_dora, the magnitudes (out), PEFT's rule and the merged export", "[huggingface][dora]") {
  test::TempDir d;
  const std::string g = test::hf_golden("gpt2");
  const std::string ck = test::adapt_imported(d, g,
                                              {R"(optimization/lora/target_modules=["attn.c_attn","mlp.c_fc","mlp.c_proj"])",
                                               "optimization/lora/rslora=true", "optimization/lora/dora=true"});
  test::Loaded lora = test::load(ck);
  const torch::Tensor ids = test::golden_ids(g);
  export_peft(ck, d / "peft");
  auto cfg = nlohmann::json::parse(read_file(d / "peft/adapter_config.json"));
  CHECK(cfg["use_dora"] == true);
  CHECK(cfg["use_rslora"] == true);
  auto adapter = read_adapter(d / "peft");
  CHECK(adapter.size() == 3 * 3 * 2);
  // One per output feature of the (out, in) weight: c_attn's 96 (its Conv1D weight is (32, 96)).
  CHECK(adapter.at("base_model.model.transformer.h.0.attn.c_attn.lora_magnitude_vector").sizes() == at::IntArrayRef({96}));
  CHECK(adapter.at("base_model.model.transformer.h.1.mlp.c_proj.lora_magnitude_vector").sizes() == at::IntArrayRef({32}));
  check_peft_dora(ModelFamily::Gpt2, ck, cfg, adapter, lora, ids, 6);
  export_hf(ck, d / "hf", false, false, "", "float32");  // the merge checked in f32 (bf16 by default)
  import_hf(d / "hf", d / "hf_again");
  CHECK(test::max_diff(test::load(d / "hf_again").logits(ids), lora.logits(ids)) < 1e-4);
  test::keep_for_hf_check("dora", d.path.string(), {"peft", "hf"}, lora, ck, d / "imported", ids);
}

TEST_CASE("DoRA on an imported Llama (nn.Linear, untied head): the magnitudes, PEFT's rule and the merged export", "[huggingface][llama][dora]") {
  test::TempDir d;
  const std::string g = test::hf_golden("llama");
  const std::string ck = test::adapt_imported(
      d, g, {R"(optimization/lora/target_modules=["q_proj","v_proj","down_proj","lm_head"])", "optimization/lora/dora=true"});
  test::Loaded lora = test::load(ck);
  const torch::Tensor ids = test::golden_ids(g);
  export_peft(ck, d / "peft");
  auto cfg = nlohmann::json::parse(read_file(d / "peft/adapter_config.json"));
  CHECK(cfg["use_dora"] == true);
  CHECK(cfg["fan_in_fan_out"] == false);
  auto adapter = read_adapter(d / "peft");
  CHECK(adapter.size() == 7 * 3);
  CHECK(adapter.at("base_model.model.model.layers.0.self_attn.v_proj.lora_magnitude_vector").sizes() == at::IntArrayRef({16}));
  CHECK(adapter.at("base_model.model.lm_head.lora_magnitude_vector").sizes() == at::IntArrayRef({300}));
  check_peft_dora(ModelFamily::Llama, ck, cfg, adapter, lora, ids, 7);
  export_hf(ck, d / "hf", false, false, "", "float32");  // the merge checked in f32 (bf16 by default)
  import_hf(d / "hf", d / "hf_again");
  CHECK(test::max_diff(test::load(d / "hf_again").logits(ids), lora.logits(ids)) < 1e-4);
  test::keep_for_hf_check("dora_llama", d.path.string(), {"peft", "hf"}, lora, ck, d / "imported", ids);
}
