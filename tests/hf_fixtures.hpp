// Golden files of the real transformers (tests/data/hf_*, made by scripts/hf_golden.py) and a
// checkpoint's model as `eval` and `sample` rebuild it: shared by the Hugging Face tests.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/registry.hpp"
#include "lora_trainer/safetensors.hpp"
#include "lora_trainer/trainer.hpp"
#include "lora_trainer/util.hpp"
#include "catch.hpp"

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
  std::unique_ptr<RestoreableJob> job;
  BaseTrainer* trainer;
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
  l.trainer = dynamic_cast<BaseTrainer*>(l.job.get());
  REQUIRE(l.trainer);
  return l;
}

inline double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

}  // namespace lt::test
