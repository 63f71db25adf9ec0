// What differs between model families on the Hugging Face side (huggingface.cpp holds what does not):
// reading a transformers config.json into our architecture/*, our parameter names and layouts as
// transformers' and back, and the config.json an export writes.
//
//   gpt2   GPT2LMHeadModel. Our names are GPT-2's; transformers puts them under `transformer.` (older
//          files: without it) and keeps the four projections as Conv1D layers, whose weight is (in, out),
//          the transpose of ours (out, in):
//            ours                           Hugging Face
//            wte.weight (V, C)              transformer.wte.weight (V, C)       (lm_head.weight: tied to it)
//            wpe.weight (T, C)              transformer.wpe.weight (n_positions, C)
//            h.i.attn.c_attn.weight (3C,C)  transformer.h.i.attn.c_attn.weight (C, 3C)   q, k, v in that order
//            h.i.attn.c_proj.weight (C,C)   transformer.h.i.attn.c_proj.weight (C, C)    transposed
//            h.i.mlp.c_fc.weight (F,C)      transformer.h.i.mlp.c_fc.weight (C, F)       transposed
//            h.i.mlp.c_proj.weight (C,F)    transformer.h.i.mlp.c_proj.weight (F, C)     transposed
//            biases, ln_1, ln_2, ln_f       the same names under transformer., same layout
//   llama  LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM: our names and layouts are theirs
//          (nn.Linear weights are (out, in) on both sides); a tied head has no lm_head.weight.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

// A transformers config.json as our architecture/* overrides ("architecture/d_model=32", ...), or a
// UserError naming every setting our models cannot represent. `path` names the file in errors.
std::vector<std::string> hf_architecture(const nlohmann::json& hf_config, const std::string& path);

// The family a config.json's model_type belongs to (gpt2; llama, qwen2, mistral), or a UserError.
ModelFamily hf_family(const nlohmann::json& hf_config, const std::string& path);

// Our parameters (our names and layouts) as transformers tensors (their dtype, CPU, contiguous).
NamedTensors to_hf(ModelFamily family, const NamedTensors& ours);

// Where each of our parameters lies among a transformers model's tensors, found from their names, dtypes
// and shapes alone (no data read): the tensor's name and whether it is stored transposed (GPT-2's Conv1D
// weights are (in, out)). match_hf lists every missing, unexpected or mis-shaped tensor, and every
// dtype other than F32, F16 and BF16, in one UserError naming `source`.
struct HfTensorMap {
  struct Source {
    std::string hf_name;
    bool transposed = false;
  };
  std::string source;                   // the model directory, for errors
  std::map<std::string, Source> of;     // our parameter name -> its tensor in the files
  std::string embedding;                // our name of the token embedding
  std::string tied_head;                // an lm_head.weight the files hold although the head is tied; "" when none
  // Our parameter `ours` in our layout (contiguous), in the dtype it is stored in, through `read_hf`
  // (a tensor of the files by its name).
  torch::Tensor read(const std::string& ours, const std::function<torch::Tensor(const std::string&)>& read_hf) const;
  // A UserError when the files hold an lm_head.weight other than the tied embedding.
  void check_tied_head(const std::function<torch::Tensor(const std::string&)>& read_hf) const;
};
HfTensorMap match_hf(ModelFamily family, const std::vector<SafetensorsEntry>& hf, const NamedTensors& expected,
                     const std::string& source);

// transformers tensors -> ours, in the order and shapes of `expected` (a model's named_params). Takes
// f32, f16 and bf16 and returns f32; lists every missing, unexpected or mis-shaped tensor in one
// UserError naming `source`.
NamedTensors from_hf(ModelFamily family, const NamedTensors& hf, const NamedTensors& expected, const std::string& source);

// The PEFT module path of one of our weights: "h.0.attn.c_attn.weight" ->
// "base_model.model.transformer.h.0.attn.c_attn"; "model.layers.0.self_attn.q_proj.weight" ->
// "base_model.model.model.layers.0.self_attn.q_proj".
std::string peft_module_path(ModelFamily family, const std::string& our_weight_name);
// Whether PEFT sees the layer as a Conv1D (fan_in_fan_out: gpt2's projections).
bool hf_fan_in_fan_out(ModelFamily family);

// The config.json that export --format hf writes for a model of `o` with weights in `dtype`
// ("float32", "bfloat16", "float16"); `imported` is the config.json of the model it was imported from
// (null if none): its other settings (token ids, ...) are kept.
nlohmann::json hf_config_for(const ModelOptions& o, const nlohmann::json& imported, const std::string& dtype = "float32");

// The transformers class of an exported config (for messages).
std::string hf_class_name(const nlohmann::json& hf_config);

}  // namespace lt
