// Golden files of the real transformers (tests/data/hf_*, made by scripts/hf_golden.py) and a
// checkpoint's model as `eval` and `sample` rebuild it: shared by the Hugging Face tests.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/huggingface.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "catch.hpp"
#include "fixtures.hpp"

namespace lt::test {

inline std::string hf_golden(const std::string& family) { return std::string(LT_SOURCE_DIR) + "/tests/data/hf_" + family; }

inline torch::Tensor golden_ids(const std::string& dir) {  // (2, 16) int64
  auto rows = nlohmann::json::parse(read_file(dir + "/ids.json"))["ids"].get<std::vector<std::vector<int64_t>>>();
  std::vector<torch::Tensor> t;
  for (auto& r : rows) t.push_back(torch::tensor(r, torch::kLong));
  return torch::stack(t);
}

inline torch::Tensor golden_logits(const std::string& dir) {  // (2, 16, V)
  return SafetensorsFile(dir + "/logits.safetensors").tensor("logits");
}

// The model of a checkpoint as `eval` and `sample` rebuild it (adapters attached, unmerged, on the
// runtime's device), and its f32 logits without autocast, on the CPU.
struct Loaded {
  std::unique_ptr<RestorableJob> job;
  Trainer* trainer;
  torch::Tensor logits(const torch::Tensor& ids) {
    torch::NoGradGuard ng;
    auto m = trainer->model();
    m->eval();
    return m->forward(ids.to(m->parameters()[0].device())).to(torch::kFloat32).cpu();  // the model may be on CUDA
  }
};
inline Loaded load(const std::string& checkpoint, std::vector<std::string> overrides = {}) {
  Loaded l;
  overrides.push_back("runtime/threads=2");
  l.job = from_checkpoint_path(checkpoint, "", "/nonexistent-lt-test-out", overrides);
  l.trainer = dynamic_cast<Trainer*>(l.job.get());
  REQUIRE(l.trainer);
  return l;
}

// A lora/train config without phase one on an imported model: its saved architecture, the tiny test
// settings otherwise (fixtures.hpp), 1280 tokens of the dataset "gen" in `data`, rank 4, alpha 8,
// lr 0.01, f32; then `extra`.
inline Config imported_lora_config(const std::string& imported, const std::string& data, const std::vector<std::string>& extra) {
  Config c(Trainer::lora_schema());
  c.merge_json(read_checkpoint_metadata(imported)["config"], "import");
  for (const auto& o : tiny_overrides(data))
    if (o.rfind("architecture/", 0) != 0) c.apply_override(o);
  for (const auto& o : {"training/post_lora_tokens=[1280]", R"(training/post_lora_dataset=[[{"name":"gen","rate":1}]])",
                        "optimization/lora/rank=4", "optimization/lora/alpha=8", "optimization/lora/lr=0.01",
                        "runtime/precision=f32"})
    c.apply_override(o);
  for (const auto& o : extra) c.apply_override(o);
  return c;
}

// Runs the LoRA job "adapt" of config `c` on `imported` as its frozen base, writing under `out`;
// returns its final checkpoint (1280 tokens, as imported_lora_config plans).
inline std::string run_imported_lora(Config c, const std::string& imported, const std::string& out) {
  JobSpec s;
  s.name = "adapt";
  Trainer t(s, c, out, TrainingPlan::from_lora_config(c));
  t.restore_from_path(imported);
  t.run();
  return out + "/checkpoints/general/default/adapt/final/1280";
}

// The golden Hugging Face model in `golden` (hf_golden) imported into d/imported, and the LoRA job of
// imported_lora_config + `extra` run on it over the dataset "gen" made in d/data: its final checkpoint.
inline std::string adapt_imported(const TempDir& d, const std::string& golden, const std::vector<std::string>& extra) {
  make_byte_dataset(d / "data", "gen", 1);
  import_hf(golden + "/model", d / "imported");
  return run_imported_lora(imported_lora_config(d / "imported", d / "data", extra), d / "imported", d / "out");
}

inline double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// With LT_HF_CHECK_DIR set, what scripts/hf_golden.py checks with the real libraries
// (docs/huggingface.md) of the LoRA `checkpoint`: under $LT_HF_CHECK_DIR/<name>/ copies of the export directories `dirs`
// (peft, hf), our LoRA model's logits of `ids` (and `ids` as ids.json), and the same adapters on the f32 base as imported (the
// job trained them on its bf16 copy; with its modules_to_save and trainable token rows), which is what
// PEFT computes on the original Hugging Face model.
inline void keep_for_hf_check(const std::string& name, const std::string& from, const std::vector<std::string>& dirs,
                              Loaded& lora, const std::string& checkpoint, const std::string& imported,
                              const torch::Tensor& ids) {
  const char* keep = std::getenv("LT_HF_CHECK_DIR");
  if (!keep) return;
  namespace fs = std::filesystem;
  const std::string k = std::string(keep) + (name.empty() ? "" : "/" + name);
  fs::create_directories(k);
  for (const auto& sub : dirs) {
    remove_tree(k + "/" + sub);
    fs::create_directories(k + "/" + sub);  // flat directories; no recursive std::filesystem (util.hpp says why)
    for (auto& e : fs::directory_iterator(from + "/" + sub)) fs::copy_file(e.path(), fs::path(k) / sub / e.path().filename());
  }
  write_safetensors(k + "/lora_logits.safetensors", {{"logits", lora.logits(ids).contiguous()}});
  nlohmann::json rows = nlohmann::json::array();  // the ids those logits are of, as golden_ids reads them
  for (int64_t r = 0; r < ids.size(0); ++r)
    rows.push_back(std::vector<int64_t>(ids[r].data_ptr<int64_t>(), ids[r].data_ptr<int64_t>() + ids.size(1)));
  write_file_atomic(k + "/ids.json", nlohmann::json{{"ids", rows}}.dump() + "\n");
  auto& trained = dynamic_cast<Trainer&>(*lora.trainer);
  const nlohmann::json lm = read_checkpoint_metadata(checkpoint)["lora"];
  Loaded f32 = load(imported, {"optimization/lora/rank=" + std::to_string(lm["rank"].get<int64_t>())});
  attach_lora(*f32.trainer->model(), trained.lora_params(), lm["alpha"].get<double>(), lm["rank"].get<int64_t>(),
              lm.value("rslora", false));
  if (trained.trainable_tokens().defined()) attach_token_rows(*f32.trainer->model(), trained.trainable_tokens());
  {
    torch::NoGradGuard ng;  // and the modules_to_save as trained
    auto from_params = named_params(*trained.model());
    auto into = named_params(*f32.trainer->model());
    for (size_t i = 0; i < into.size(); ++i)
      for (const auto& n : trained.saved_modules())
        if (into[i].first == n) into[i].second.copy_(from_params[i].second);
  }
  write_safetensors(k + "/lora_on_f32_base_logits.safetensors", {{"logits", f32.logits(ids).contiguous()}});
}

}  // namespace lt::test
