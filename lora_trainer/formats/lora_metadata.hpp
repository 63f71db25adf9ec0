// The `lora` block of a LoRA job's checkpoint metadata (checkpoints/README.md) as one typed value:
// the trainer of a LoRA job writes it (to_json), and every reader takes it from CheckpointMeta::lora, parsed
// and type-checked once by CheckpointMeta::read: restore, the merged and PEFT exports, init_from and
// the consistency checks. A field an older checkpoint lacks has the value it had before it existed.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/peft/lora.hpp"

namespace lt {

struct LoraMetadata {
  int64_t rank = 0;                 // required
  double alpha = 0;                 // required
  std::optional<int64_t> boundary_step;  // the step where the LoRA phase starts; absent in the oldest files
  std::optional<bool> in_lora_phase;     // kind "lora"; absent in the oldest files
  std::vector<std::string> targets;      // the adapted base weights; [] before the transition
  LoraInit init = LoraInit::Gaussian;
  bool rslora = false;
  bool dora = false;
  double lr_ratio = 1.0;                 // LoRA+
  std::vector<std::string> modules_to_save;  // base parameters trained in full, by name
  double modules_to_save_lr_ratio = 1.0;
  // The trainable token rows, {embedding weight: ids}: {} or one entry.
  std::map<std::string, std::vector<int64_t>> trainable_tokens;
  std::string adapters_from;  // init_from's source; "" = drawn
  // optimization/lora/quantize_base: the frozen storage of the blocks' linear weights (frozen_storage.hpp:
  // "bf16", written "none" by older versions, or "nf4"); `quantized` the base weights stored in it and
  // their shapes (<storage>/<name>.*, nf4/<name>.*, in a checkpoint that copies its base), none for bf16.
  FrozenFormat quantize_base = FrozenFormat::Bf16;
  std::map<std::string, std::vector<int64_t>> quantized;
  // Without phase 1: where the base came from, {"path", "job", "step"} of a checkpoint or {"path",
  // "format": "hf", "step": 0} of a Hugging Face model directory, or "random"; null otherwise.
  nlohmann::json base;

  // alpha / r, or alpha / sqrt(r) with rsLoRA: what the adapters are scaled by.
  double scale() const { return lora_scale(alpha, rank, rslora); }
  nlohmann::json to_json() const;
  // From a checkpoint's metadata "lora" object. A missing required field or a value of the wrong type
  // is a UserError naming `file` and the field.
  static LoraMetadata from_json(const nlohmann::json& block, const std::string& file);
};

}  // namespace lt
