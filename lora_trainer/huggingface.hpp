// Hugging Face in and out, for the gpt2 family (transformers' GPT2LMHeadModel):
//   import_hf     a transformers model directory (config.json + safetensors) -> a weights-only plain
//                 checkpoint of ours, usable by `run ... --restore`, `eval` and `sample`
//   export_hf     any checkpoint of ours -> merged weights as model.safetensors + config.json
//   export_peft   a LoRA checkpoint of ours -> a PEFT LoRA adapter (adapter_config.json +
//                 adapter_model.safetensors)
//
// Names and layouts. Our parameter names are GPT-2's; transformers puts them under `transformer.`
// (older files: without it) and keeps the four projections as Conv1D layers, whose weight is
// (in, out), the transpose of ours (out, in):
//   ours                          Hugging Face
//   wte.weight (V, C)             transformer.wte.weight (V, C)          (lm_head.weight: tied to it)
//   wpe.weight (T, C)             transformer.wpe.weight (n_positions, C)
//   h.i.attn.c_attn.weight (3C,C) transformer.h.i.attn.c_attn.weight (C, 3C)   q, k, v in that order
//   h.i.attn.c_proj.weight (C,C)  transformer.h.i.attn.c_proj.weight (C, C)    transposed
//   h.i.mlp.c_fc.weight (4C,C)    transformer.h.i.mlp.c_fc.weight (C, 4C)      transposed
//   h.i.mlp.c_proj.weight (C,4C)  transformer.h.i.mlp.c_proj.weight (4C, C)    transposed
//   biases, ln_1, ln_2, ln_f      the same names under transformer., same layout
//
// PEFT's LoRA layout (peft/tuners/lora/layer.py): lora_A is nn.Linear(in, r), so lora_A.weight is
// (r, in); lora_B is nn.Linear(r, out), lora_B.weight (out, r); the layer adds
// scaling * lora_B(lora_A(x)) with scaling = lora_alpha / r (use_rslora false). For a Conv1D base
// (fan_in_fan_out true) the shapes are the same and only the merged delta is transposed:
// W_conv1d (in, out) += (lora_B.weight @ lora_A.weight)^T * scaling. Our adapters are A (in, r) and
// B (r, out) with W (out, in) += (alpha / r) (A B)^T, so lora_A.weight = A^T and lora_B.weight = B^T,
// with the same alpha and r. Keys: base_model.model.transformer.h.i.<module>.lora_{A,B}.weight.
//
// The llama family (Llama, Qwen2, Mistral) is not supported yet: import refuses its model_type.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "lora_trainer/named_tensors.hpp"

namespace lt {

// Reads HF_DIR/config.json and its safetensors weights (f32, f16 or bf16; one file or sharded) and
// writes OUT, a weights-only plain checkpoint (f32) whose config is a lora/train config with this
// model's architecture and empty pre-LoRA lists. Refuses, naming what is wrong and writing nothing:
// a model_type other than gpt2, a config our GPT cannot represent, missing, unexpected or mis-shaped
// tensors. OUT follows export's rule (check_export_target). Returns the architecture overrides
// (architecture/...=...) a job needs to load it.
std::vector<std::string> import_hf(const std::string& hf_dir, const std::string& out);

// Writes OUT/model.safetensors (f32, HF names and layouts, adapters merged) and OUT/config.json
// (GPT2LMHeadModel; an imported model's own config with our architecture values on top).
void export_hf(const std::string& checkpoint, const std::string& out);

// Writes OUT/adapter_config.json and OUT/adapter_model.safetensors (f32) from a LoRA checkpoint.
void export_peft(const std::string& checkpoint, const std::string& out);

// Our parameters (names of named_parameters(), our layouts) as Hugging Face GPT2LMHeadModel tensors,
// and back. The second checks the names and shapes against `expected` (ours) and lists every problem
// in one UserError naming `source`; it takes f32, f16 and bf16 and returns f32.
NamedTensors gpt2_to_hf(const NamedTensors& ours);
NamedTensors gpt2_from_hf(const NamedTensors& hf, const NamedTensors& expected, const std::string& source);

// The PEFT module path of one of our adapted weights: "h.0.attn.c_attn.weight" ->
// "base_model.model.transformer.h.0.attn.c_attn".
std::string peft_module_path(const std::string& base_weight_name);

}  // namespace lt
