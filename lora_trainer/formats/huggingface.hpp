// Hugging Face in and out, for both model families (transformers' GPT2LMHeadModel; LlamaForCausalLM,
// Qwen2ForCausalLM, MistralForCausalLM):
//   import_hf     a transformers model directory (config.json + safetensors) -> a weights-only plain
//                 checkpoint of ours, usable by `run ... --restore`, `eval` and `sample`
//   export_hf     any checkpoint of ours -> merged weights as model.safetensors + config.json
//   export_peft   a LoRA checkpoint of ours -> a PEFT LoRA adapter (adapter_config.json +
//                 adapter_model.safetensors)
//
// Names and layouts of each family: hf_families.hpp.
//
// PEFT's LoRA layout (peft/tuners/lora/layer.py): lora_A is nn.Linear(in, r), so lora_A.weight is
// (r, in); lora_B is nn.Linear(r, out), lora_B.weight (out, r); the layer adds
// scaling * lora_B(lora_A(x)) with scaling = lora_alpha / r (use_rslora false). For a Conv1D base
// (GPT-2's, fan_in_fan_out true) the shapes are the same and only the merged delta is transposed:
// W_conv1d (in, out) += (lora_B.weight @ lora_A.weight)^T * scaling. Our adapters are A (in, r) and
// B (r, out) with W (out, in) += (alpha / r) (A B)^T, so lora_A.weight = A^T and lora_B.weight = B^T,
// with the same alpha and r, in both families. Keys: base_model.model.<HF module path>.lora_{A,B}.weight
// (transformer.h.i.attn.c_attn; model.layers.i.self_attn.q_proj).
// DoRA (use_dora): each module also has <module>.lora_magnitude_vector, (out), one per output feature of
// the (out, in) weight whatever the layer's layout: our lora/<weight>.lora_magnitude unchanged.
#pragma once

#include <functional>
#include <string>

#include "lora_trainer/formats/safetensors.hpp"

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

// Reads HF_DIR/config.json and its safetensors weights (f32, f16 or bf16; one file or sharded) and
// writes OUT, a weights-only plain checkpoint whose config is a lora/train config with this model's
// architecture and empty pre-LoRA lists. `dtype`: "source" keeps each tensor's own dtype (a bf16 model
// stays bf16: the checkpoint is the size of the files), "float32" or "bfloat16" converts. Refuses, naming what is wrong and writing nothing:
// a model_type of neither family, a config our models cannot represent, missing, unexpected or mis-shaped
// tensors. OUT follows export's rule (check_export_target). Returns the architecture overrides
// (architecture/...=...) a job needs to load it.
std::vector<std::string> import_hf(const std::string& hf_dir, const std::string& out, bool force = false,
                                   const std::string& dtype = "source");

// Writes the weights (HF names and layouts, adapters merged in f32 and then rounded once to `dtype`)
// as OUT/model.safetensors, or as shards of at most `max_shard_bytes` with model.safetensors.index.json
// (write_safetensors_model), and OUT/config.json (the family's class, its "dtype"; an imported model's
// own config with our architecture values on top). `dtype`: "source" (the checkpoint's stored base
// dtype: bf16 for a LoRA-phase checkpoint or a bf16 import, f32 for phase one's), "float32" or
// "bfloat16". With `use_ema`, the moving average of the trained tensors (export --ema; export.hpp's
// export_tensors). A checkpoint that refers to its frozen base (frozen_base.hpp) reads it from where
// it records, or from `base` when given (export --base). `check`, when given, is called with the
// directory the files were written to before it takes OUT's place (export --check): what it throws
// publishes nothing.
void export_hf(const std::string& checkpoint, const std::string& out, bool use_ema = false, bool force = false,
               const std::string& base = "", const std::string& dtype = "source",
               uint64_t max_shard_bytes = kHfMaxShardBytes, const std::function<void(const std::string&)>& check = nullptr);

// Writes OUT/adapter_config.json and OUT/adapter_model.safetensors (f32) from a LoRA checkpoint.
void export_peft(const std::string& checkpoint, const std::string& out, bool use_ema = false, bool force = false,
                 const std::string& base = "");

}  // namespace lt
