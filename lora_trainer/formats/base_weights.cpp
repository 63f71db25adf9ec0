#include "lora_trainer/formats/base_weights.hpp"

#include <filesystem>
#include <set>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/state_h5.hpp"
#include "lora_trainer/peft/lora.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

bool is_hf_model_dir(const std::string& path) {
  return fs::is_directory(path) && fs::exists(fs::path(path) / "config.json") && !fs::exists(fs::path(path) / "metadata.json");
}

json hf_base_model(const json& hf_config, const std::string& dir, ModelFamily family) {
  const std::string abs_dir = fs::absolute(dir).lexically_normal().string();
  // The Hub's name when the config carries it (transformers writes it on download), else this directory.
  const bool named = hf_config.contains("_name_or_path") && hf_config["_name_or_path"].is_string() &&
                     !hf_config["_name_or_path"].get<std::string>().empty();
  return {{"family", to_string(family)},
          {"hf_dir", abs_dir},
          {"name_or_path", named ? hf_config["_name_or_path"] : json(abs_dir)},
          {"hf_config", hf_config}};
}

namespace {

// The dtype of a set of tensors: their one dtype's name, or "mixed".
std::string common_dtype(const std::set<torch::ScalarType>& dtypes) {
  if (dtypes.size() != 1) return "mixed";
  return dtype_name(*dtypes.begin());
}

class HfWeights : public BaseWeights {
 public:
  HfWeights(const std::string& dir, ModelFamily family, const NamedTensors& expected) : model_(dir) {
    path_ = dir;
    const std::string config_path = (fs::path(dir) / "config.json").string();
    const json config = read_json_file(config_path);
    if (!config.is_object()) throw UserError(config_path + ": not a JSON object");
    json_context(config_path, [&] {
      const ModelFamily theirs = hf_family(config, config_path);
      if (theirs != family)
        throw UserError(config_path + " describes a " + config.value("model_type", std::string("?")) + " model (the " +
                        to_string(theirs) + " family); this job's architecture/family is " + to_string(family) +
                        ". Give the job the model's architecture (`lora_trainer run` does when --restore names the "
                        "directory), or use another model");
      architecture_ = hf_architecture(config, config_path);
    });
    base_model_ = hf_base_model(config, dir, family);
    map_ = match_hf(family, model_.entries(), expected, dir);
    std::set<torch::ScalarType> dtypes;
    for (const auto& [ours, src] : map_.of) {
      const SafetensorsEntry& e = model_.entry(src.hf_name);
      bytes_ += e.end - e.begin;
      dtypes.insert(e.dtype);
    }
    dtype_ = common_dtype(dtypes);
    map_.check_tied_head([this](const std::string& n) { return model_.tensor(n); });
  }

  torch::Tensor read(const std::string& name) const override {
    return map_.read(name, [this](const std::string& n) { return model_.tensor(n); }).contiguous();
  }
  torch::Tensor peek(const std::string& name) const override {
    return map_.read(name, [this](const std::string& n) { return model_.view(n); }).contiguous();
  }
  void prefetch(const std::string& name) const override {
    const auto it = map_.of.find(name);
    if (it != map_.of.end()) model_.prefetch(it->second.hf_name);
  }

 private:
  SafetensorsModel model_;
  HfTensorMap map_;
};

class CheckpointWeights : public BaseWeights {
 public:
  CheckpointWeights(const CheckpointMeta& ck, const NamedTensors& expected) : reader_(ck) {
    path_ = ck.dir;
    base_model_ = ck.base_model;
    std::set<std::string> unmatched;
    // A LoRA state's adapters are beside its base: they are not the model's.
    for (const auto& n : reader_.names())
      if (n.rfind(kParamsPrefix, 0) == 0 && !is_adapter_param(n.substr(kParamsPrefix.size()))) unmatched.insert(n);
    std::vector<std::string> problems;
    std::set<torch::ScalarType> dtypes;
    for (const auto& [name, want] : expected) {
      const std::string stored = kParamsPrefix + name;
      if (!unmatched.erase(stored)) {
        problems.push_back("missing " + stored);
        continue;
      }
      const StateH5Reader::Info info = reader_.info(stored);
      if (info.shape != want.sizes().vec())
        problems.push_back(stored + ": shape " + shape_text(info.shape) + " in the checkpoint, " +
                           shape_text(want.sizes().vec()) + " expected");
      else if (!c10::isFloatingType(info.dtype))
        problems.push_back(stored + ": dtype " + dtype_name(info.dtype) + " (weights are floating point)");
      uint64_t numel = 1;
      for (int64_t d : info.shape) numel *= static_cast<uint64_t>(d);
      bytes_ += numel * c10::elementSize(info.dtype);
      dtypes.insert(info.dtype);
    }
    for (const auto& name : unmatched) problems.push_back("unexpected " + name);
    if (!problems.empty()) {
      std::string msg = "checkpoint " + ck.dir + " does not hold this job's model (" + std::to_string(problems.size()) +
                        " problems): ";
      msg += first_problems(problems);
      throw UserError(msg + ". Is it the right checkpoint for this model size (architecture/*)?");
    }
    dtype_ = common_dtype(dtypes);
  }

  torch::Tensor read(const std::string& name) const override { return reader_.read(kParamsPrefix + name).contiguous(); }

 private:
  CheckpointReader reader_;
};

}  // namespace

std::unique_ptr<BaseWeights> BaseWeights::open_hf(const std::string& dir, ModelFamily family, const NamedTensors& expected) {
  return std::make_unique<HfWeights>(dir, family, expected);
}

std::unique_ptr<BaseWeights> BaseWeights::open_checkpoint(const CheckpointMeta& ck, const NamedTensors& expected) {
  return std::make_unique<CheckpointWeights>(ck, expected);
}

}  // namespace lt
