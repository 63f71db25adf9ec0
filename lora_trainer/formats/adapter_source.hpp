// Adapters into a fresh run (`optimization/lora/init_from`, seed 000's lora_restore_path): the A and B of
// an earlier run, read from one of our LoRA checkpoints or from a PEFT adapter directory
// (adapter_config.json + adapter_model.safetensors, as `export --format peft` or PEFT's
// save_pretrained writes it), for the weights this job adapts.
//
// PEFT's lora_A.weight is (r, in) and lora_B.weight (out, r): our A (in, r) and B (r, out) are their
// transposes (huggingface.hpp). DoRA's magnitudes come along: ours params/<layer>.lora_magnitude,
// PEFT's <module>.lora_magnitude_vector (use_dora), (out) in both. The source must adapt exactly this
// job's weights, with this job's rank, the same scale (alpha / r, or alpha / sqrt(r) with rsLoRA) and
// DoRA on both sides or neither, so that the adapters compute what they computed there; anything else is
// a UserError naming the setting to change.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

struct AdapterSource {
  std::string path;
  enum class Format { Checkpoint, Peft } format = Format::Checkpoint;  // one of our LoRA checkpoints, or PEFT's files
  int64_t rank = 0;
  double alpha = 0;
  bool rslora = false;
  bool dora = false;
  LoraParams adapters;  // f32, ours layouts, in the order of the job's targets; magnitudes with DoRA
  // The source's own names of each adapter's A and B (params/<w>.lora_A, or PEFT's
  // <module>.lora_A.weight), as adapters.names orders them: what a message about a shape names.
  std::vector<std::pair<std::string, std::string>> keys;
  // The shape the source stores a tensor of ours in: PEFT's is the transpose.
  std::vector<int64_t> stored_shape(const torch::Tensor& ours) const;
  std::vector<std::string> modules_to_save;  // what the source also trained (not loaded: reported)
  // The token rows the source trained (trainable_token_indices), loaded with the adapters: name is ours
  // ("wte.weight") where it is the model's token embedding, else the source's module; undefined when
  // it trained none.
  TrainableTokens tokens;
};

// Reads `path` for the weights `targets` (our names) of a `family` model and checks it against the
// job's rank, alpha, rsLoRA and DoRA, and its trainable token rows against the job's: `token_ids` of the
// model's token embedding `token_embedding` (our name), none when empty. The same ids of the same
// embedding, or none on both sides.
AdapterSource read_adapter_source(const std::string& path, ModelFamily family, const std::vector<std::string>& targets,
                                  int64_t rank, double alpha, bool rslora, bool dora, const std::string& token_embedding,
                                  const std::vector<int64_t>& token_ids);

}  // namespace lt
