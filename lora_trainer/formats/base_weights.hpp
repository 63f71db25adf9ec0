// A pretrained model's weights as a job's starting point, read one tensor at a time under our parameter
// names and layouts: a Hugging Face model directory (config.json + safetensors, one file or sharded) or
// a checkpoint of ours holding a whole model (a plain state, an `export`, an `import-hf` output). Each
// tensor comes in the dtype it is stored in, so that the trainer casts it once, straight to the dtype
// and device it lives in (trainer_state.cpp's load_weights_from): a bf16 base of 1B parameters is read
// as 2 GB of bf16, never as a float32 copy, with one tensor in flight.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/safetensors.hpp"

namespace lt {

// True when `path` is a Hugging Face model directory: it has a config.json and no metadata.json (ours).
bool is_hf_model_dir(const std::string& path);

class BaseWeights {
 public:
  // A model directory: its config.json must be of `family` and its tensors must be `expected`'s (our
  // names and shapes: a model's base_params); every problem is listed in one UserError naming the
  // directory. Nothing is read but the headers.
  static std::unique_ptr<BaseWeights> open_hf(const std::string& dir, ModelFamily family, const NamedTensors& expected);
  // A checkpoint's params/*: every name and shape of `expected` (with the prefix) must be there.
  static std::unique_ptr<BaseWeights> open_checkpoint(const CheckpointMeta& ck, const NamedTensors& expected);
  virtual ~BaseWeights() = default;

  // Our parameter `name`, on the CPU, contiguous, in the dtype the source stores it in (CRC-checked for
  // a checkpoint; an HF model's tied lm_head is checked against the embedding once, when first read).
  virtual torch::Tensor read(const std::string& name) const = 0;
  // The same values for a reader that converts, quantizes or copies them and keeps nothing of them: a
  // model directory's are its files' mapped pages, read-only, without a copy (valid while this source
  // lives; never written to, never kept: one kept as it came, is_mapped_view, is cloned first). Else read(name).
  virtual torch::Tensor peek(const std::string& name) const { return read(name); }
  // A hint that `name` is read next: a model directory's files start reading its pages in the
  // background while the caller works on the tensor before (for a checkpoint, nothing).
  virtual void prefetch(const std::string& name) const {}
  const std::string& path() const { return path_; }
  // What checkpoints record about the base (their metadata's base_model): for a model directory,
  // import-hf's record (family, hf_dir, name_or_path, hf_config); for a checkpoint, its own base_model.
  const nlohmann::json& base_model() const { return base_model_; }
  // For a model directory: the architecture/* settings its config.json gives (import-hf's); else empty.
  const std::vector<std::string>& architecture() const { return architecture_; }
  // The bytes its tensors take where they are stored (the sum over `expected`).
  uint64_t bytes() const { return bytes_; }
  // "bfloat16", "float32", or "mixed" (of the tensors in `expected`).
  const std::string& dtype() const { return dtype_; }

 protected:
  std::string path_;
  nlohmann::json base_model_;
  std::vector<std::string> architecture_;
  uint64_t bytes_ = 0;
  std::string dtype_;
};

// import-hf's record of a model directory (a checkpoint's base_model): family, hf_dir (absolute),
// name_or_path (the config's _name_or_path when set, else the directory) and the config itself.
nlohmann::json hf_base_model(const nlohmann::json& hf_config, const std::string& dir, ModelFamily family);

}  // namespace lt
