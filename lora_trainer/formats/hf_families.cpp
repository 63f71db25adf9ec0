#include "lora_trainer/formats/hf_families.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>

#include "lora_trainer/core/util.hpp"

using json = nlohmann::json;

namespace lt {

namespace {

const std::string kGpt2Prefix = "transformer.";
// The context a llama-family import sets as architecture/block_size when the model allows more: the
// rows a job trains on, not a property of the weights (rotary positions have no table).
const int64_t kLlamaImportContext = 1024;

// GPT-2's four projections are Conv1D layers in transformers: their weights are stored (in, out).
bool is_conv1d_weight(ModelFamily family, const std::string& ours) {
  return family == ModelFamily::Gpt2 && ours.rfind("h.", 0) == 0 && ends_with(ours, ".weight") &&
         (ours.find(".attn.c_attn.") != std::string::npos || ours.find(".attn.c_proj.") != std::string::npos ||
          ours.find(".mlp.c_fc.") != std::string::npos || ours.find(".mlp.c_proj.") != std::string::npos);
}

std::string hf_name(ModelFamily family, const std::string& ours) {
  return family == ModelFamily::Gpt2 ? kGpt2Prefix + ours : ours;
}

using Activation = ModelOptions::Activation;

// HF's activation names -> ours. gelu_new, gelu_pytorch_tanh and gelu_fast are the same tanh formula.
const std::map<std::string, Activation>& activations() {
  static const std::map<std::string, Activation> m = {{"gelu", Activation::Gelu},
                                                      {"gelu_new", Activation::GeluTanh},
                                                      {"gelu_pytorch_tanh", Activation::GeluTanh},
                                                      {"gelu_fast", Activation::GeluTanh},
                                                      {"silu", Activation::Silu},
                                                      {"swish", Activation::Silu}};
  return m;
}

const std::set<std::string>& llama_types() {
  static const std::set<std::string> s = {"llama", "qwen2", "mistral"};
  return s;
}

// Reads positive integers and collects what is wrong.
struct Reader {
  const json& c;
  std::vector<std::string>& problems;
  int64_t positive(const char* key, int64_t fallback = -1) const {
    if (!c.contains(key) || c[key].is_null()) {
      if (fallback > 0) return fallback;
      problems.push_back(std::string(key) + " is missing");
      return 1;
    }
    if (!c[key].is_number_integer() || c[key].get<int64_t>() <= 0) {
      problems.push_back(std::string(key) + " must be a positive integer (it is " + c[key].dump() + ")");
      return 1;
    }
    return c[key].get<int64_t>();
  }
  Activation activation(const char* key, const std::string& fallback) const {
    const std::string act = c.value(key, fallback);
    if (!activations().count(act)) {
      problems.push_back(std::string(key) + " \"" + act + "\": supported are gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, silu");
      return Activation::Gelu;
    }
    return activations().at(act);
  }
};

// The shortest decimal that reads back as v (1e-05, not 1.0000000000000001e-05).
std::string num(double v) {
  char b[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(b, sizeof b, "%.*g", digits, v);
    if (std::strtod(b, nullptr) == v) break;
  }
  return b;
}

std::vector<std::string> gpt2_architecture(const json& c, std::vector<std::string>& problems) {
  Reader r{c, problems};
  const int64_t C = r.positive("n_embd"), L = r.positive("n_layer"), H = r.positive("n_head"),
                T = r.positive("n_positions"), V = r.positive("vocab_size");
  const int64_t F = c.contains("n_inner") && !c["n_inner"].is_null() ? r.positive("n_inner") : 4 * C;
  if (C % H != 0) problems.push_back("n_embd " + std::to_string(C) + " is not divisible by n_head " + std::to_string(H));
  const Activation act = r.activation("activation_function", "gelu_new");
  if (act == Activation::Silu)
    problems.push_back("activation_function silu: our gpt2 MLP takes gelu, gelu_new, gelu_pytorch_tanh or gelu_fast");
  if (!c.value("scale_attn_weights", true)) problems.push_back("scale_attn_weights false: ours scales by 1/sqrt(head size)");
  if (c.value("scale_attn_by_inverse_layer_idx", false)) problems.push_back("scale_attn_by_inverse_layer_idx true");
  if (c.value("reorder_and_upcast_attn", false)) problems.push_back("reorder_and_upcast_attn true");
  if (c.value("add_cross_attention", false)) problems.push_back("add_cross_attention true");
  if (!c.value("tie_word_embeddings", true)) problems.push_back("tie_word_embeddings false: our gpt2 output head is the token embedding");
  return {std::string("architecture/family=") + to_string(ModelFamily::Gpt2),
          "architecture/vocab_size=" + std::to_string(V),
          "architecture/block_size=" + std::to_string(T),
          "architecture/n_layers=" + std::to_string(L),
          "architecture/n_heads=" + std::to_string(H),
          "architecture/d_model=" + std::to_string(C),
          "architecture/d_ff=" + std::to_string(F),
          std::string("architecture/activation=") + activation_name(act),
          "architecture/norm_eps=" + num(c.value("layer_norm_epsilon", 1e-5))};
}

// The rotary settings as overrides: rope_theta top-level (transformers 4) or inside rope_parameters
// (transformers 5), and the scaling (rope_scaling in 4, rope_parameters in 5): default, linear and llama3
// are read; the others (yarn, dynamic, longrope, ...) are refused by name.
std::vector<std::string> llama_rope(const json& c, std::vector<std::string>& problems) {
  double theta = 10000.0;
  const std::string scaling_key = "architecture/rope_scaling=";
  std::vector<std::string> scaling = {scaling_key + rope_scaling_name(RopeScaling::Kind::None)};
  if (c.contains("rope_theta") && c["rope_theta"].is_number()) theta = c["rope_theta"].get<double>();
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!c.contains(key) || c[key].is_null()) continue;
    const json& p = c[key];
    if (!p.is_object()) {
      problems.push_back(std::string(key) + " " + p.dump() + " is not an object");
      continue;
    }
    if (p.contains("rope_theta") && p["rope_theta"].is_number()) theta = p["rope_theta"].get<double>();
    const std::string type = p.value("rope_type", p.value("type", std::string("default")));
    auto number = [&](const char* k) {
      if (p.contains(k) && p[k].is_number()) return p[k].get<double>();
      problems.push_back(std::string(key) + " (rope_type " + type + ") has no number " + k);
      return 1.0;
    };
    if (type == "linear") {
      scaling = {scaling_key + rope_scaling_name(RopeScaling::Kind::Linear), "architecture/rope_factor=" + num(number("factor"))};
    } else if (type == "llama3") {
      scaling = {scaling_key + rope_scaling_name(RopeScaling::Kind::Llama3), "architecture/rope_factor=" + num(number("factor")),
                 "architecture/rope_low_freq_factor=" + num(number("low_freq_factor")),
                 "architecture/rope_high_freq_factor=" + num(number("high_freq_factor")),
                 "architecture/rope_original_context=" +
                     std::to_string(static_cast<int64_t>(number("original_max_position_embeddings")))};
    } else if (type != "default") {
      problems.push_back(std::string(key) + " rope_type \"" + type + "\": the rotary embeddings read are default, linear " +
                         "and llama3 (Llama 3.1/3.2); yarn, dynamic, longrope and the others are not supported");
    }
  }
  scaling.insert(scaling.begin(), "architecture/rope_theta=" + num(theta));
  return scaling;
}

std::vector<std::string> llama_architecture(const json& c, std::vector<std::string>& problems) {
  Reader r{c, problems};
  const std::string type = c.value("model_type", std::string());
  const int64_t C = r.positive("hidden_size"), L = r.positive("num_hidden_layers"), H = r.positive("num_attention_heads"),
                V = r.positive("vocab_size"), F = r.positive("intermediate_size"), P = r.positive("max_position_embeddings", 2048);
  const int64_t KV = r.positive("num_key_value_heads", H);
  if (C % H != 0) problems.push_back("hidden_size " + std::to_string(C) + " is not divisible by num_attention_heads " + std::to_string(H));
  if (H % KV != 0)
    problems.push_back("num_key_value_heads " + std::to_string(KV) + " does not divide num_attention_heads " + std::to_string(H));
  if (c.contains("head_dim") && !c["head_dim"].is_null() && c["head_dim"] != json(C / H))
    problems.push_back("head_dim " + c["head_dim"].dump() + ": ours is hidden_size / num_attention_heads = " + std::to_string(C / H));
  const Activation act = r.activation("hidden_act", "silu");
  const std::vector<std::string> rope = llama_rope(c, problems);
  // Llama's attention_bias puts a bias on o_proj too; Qwen2 has q/k/v biases and none on o_proj.
  const bool qkv_bias = type == "qwen2";
  if (type != "qwen2" && c.value("attention_bias", false))
    problems.push_back("attention_bias true (a bias on o_proj too): only q/k/v biases (Qwen2's) are supported");
  if (c.value("mlp_bias", false)) problems.push_back("mlp_bias true: our gated MLP has no biases");
  int64_t T = std::min(P, kLlamaImportContext);
  const bool sliding = type == "mistral" || c.value("use_sliding_window", false);
  if (sliding && c.contains("sliding_window") && c["sliding_window"].is_number_integer())
    T = std::min(T, c["sliding_window"].get<int64_t>());  // within the window, sliding attention is causal attention
  std::vector<std::string> arch = {std::string("architecture/family=") + to_string(ModelFamily::Llama),
          "architecture/vocab_size=" + std::to_string(V),
          "architecture/block_size=" + std::to_string(T),
          "architecture/n_layers=" + std::to_string(L),
          "architecture/n_heads=" + std::to_string(H),
          "architecture/n_kv_heads=" + std::to_string(KV),
          "architecture/d_model=" + std::to_string(C),
          "architecture/d_ff=" + std::to_string(F),
          std::string("architecture/activation=") + activation_name(act),
          "architecture/norm_eps=" + num(c.value("rms_norm_eps", 1e-6)),
          std::string("architecture/tie_embeddings=") + (c.value("tie_word_embeddings", false) ? "true" : "false"),
          std::string("architecture/qkv_bias=") + (qkv_bias ? "true" : "false")};
  arch.insert(arch.end(), rope.begin(), rope.end());
  return arch;
}

}  // namespace

ModelFamily hf_family(const json& c, const std::string& path) {
  const std::string type = c.value("model_type", std::string());
  if (type == "gpt2") return ModelFamily::Gpt2;
  if (llama_types().count(type)) return ModelFamily::Llama;
  throw UserError(path + ": model_type \"" + type + "\" is not supported; import-hf reads gpt2 (GPT2LMHeadModel) and the " +
                  "llama family: llama, qwen2, mistral (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)");
}

std::vector<std::string> hf_architecture(const json& c, const std::string& path) {
  const ModelFamily family = hf_family(c, path);
  std::vector<std::string> problems;
  std::vector<std::string> arch =
      family == ModelFamily::Gpt2 ? gpt2_architecture(c, problems) : llama_architecture(c, problems);
  if (!problems.empty())
    throw UserError(path + ": this " + c.value("model_type", std::string()) + " model cannot be represented by lora_trainer's " +
                    to_string(family) + " family: " + join(problems, "; ") + ". Nothing was written");
  return arch;
}

NamedTensors to_hf(ModelFamily family, const NamedTensors& ours) {
  NamedTensors out;
  for (const auto& [name, t] : ours) {
    auto f = t.detach().to(torch::kCPU);
    out.emplace_back(hf_name(family, name), is_conv1d_weight(family, name) ? f.t().contiguous() : f.contiguous());
  }
  return out;
}

namespace {

[[noreturn]] void throw_problems(const std::string& source, const std::vector<std::string>& problems) {
  std::string msg = source + " does not hold the model its config.json describes (" + std::to_string(problems.size()) +
                    " problems): ";
  msg += first_problems(problems);
  throw UserError(msg + ". Nothing was written");
}

}  // namespace

HfTensorMap match_hf(ModelFamily family, const std::vector<SafetensorsEntry>& hf, const NamedTensors& expected,
                     const std::string& source) {
  const bool gpt2 = family == ModelFamily::Gpt2;
  const bool tied = std::none_of(expected.begin(), expected.end(), [](const auto& p) { return p.first == "lm_head.weight"; });
  HfTensorMap map;
  map.source = source;
  map.embedding = gpt2 ? "wte.weight" : "model.embed_tokens.weight";
  std::map<std::string, const SafetensorsEntry*> by_name;  // our name -> the file's entry
  std::vector<std::string> problems;
  for (const auto& e : hf) {
    const std::string& raw = e.name;
    std::string n = gpt2 && raw.rfind(kGpt2Prefix, 0) == 0 ? raw.substr(kGpt2Prefix.size()) : raw;
    if (n == "lm_head.weight" && tied) {
      map.tied_head = raw;
      continue;
    }
    // Buffers some files keep: GPT-2's causal masks, older Llama files' rotary frequencies.
    if (gpt2 && n.rfind("h.", 0) == 0 && (ends_with(n, ".attn.bias") || ends_with(n, ".attn.masked_bias"))) continue;
    if (!gpt2 && ends_with(n, ".rotary_emb.inv_freq")) continue;
    const auto st = e.dtype;
    if (st != torch::kFloat32 && st != torch::kFloat16 && st != torch::kBFloat16) {
      problems.push_back(raw + ": dtype " + std::string(c10::toString(st)) + " (only F32, F16 and BF16 weights are read)");
      continue;
    }
    if (by_name.count(n)) problems.push_back(raw + ": given twice (with and without \"transformer.\")");
    by_name[n] = &e;
  }
  for (const auto& [name, want] : expected) {
    const bool conv1d = is_conv1d_weight(family, name);
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      problems.push_back("missing " + hf_name(family, name) + " " + shape_text(want.sizes().vec()));
      continue;
    }
    std::vector<int64_t> shape = it->second->shape;
    const bool transposed = conv1d && shape.size() == 2;
    if (transposed) std::swap(shape[0], shape[1]);
    if (shape != want.sizes().vec()) {
      std::vector<int64_t> hf_shape = want.sizes().vec();
      if (conv1d) std::swap(hf_shape[0], hf_shape[1]);
      // The file's own key (with or without GPT-2's "transformer."), and whether it holds the transpose.
      const auto& got = it->second->shape;
      const bool swapped = got.size() == 2 && hf_shape.size() == 2 && got[0] == hf_shape[1] && got[1] == hf_shape[0];
      problems.push_back(it->second->name + ": shape " + shape_text(got) + ", expected " + shape_text(hf_shape) +
                         (conv1d ? " (Conv1D: (in, out))" : " ((out, in))") + (swapped ? ", its transpose" : ""));
    } else {
      map.of[name] = {it->second->name, transposed};
    }
    by_name.erase(it);
  }
  for (const auto& [name, e] : by_name) problems.push_back("unexpected tensor " + e->name + " " + shape_text(e->shape));
  if (!problems.empty()) throw_problems(source, problems);
  return map;
}

torch::Tensor HfTensorMap::read(const std::string& ours, const std::function<torch::Tensor(const std::string&)>& read_hf) const {
  const Source& s = of.at(ours);
  torch::Tensor t = read_hf(s.hf_name);
  return s.transposed ? t.t().contiguous() : t;
}

void HfTensorMap::check_tied_head(const std::function<torch::Tensor(const std::string&)>& read_hf) const {
  if (tied_head.empty()) return;
  const torch::Tensor head = read_hf(tied_head), emb = read(embedding, read_hf);
  if (head.sizes() != emb.sizes() || !torch::equal(head.to(torch::kFloat32), emb.to(torch::kFloat32)))
    throw_problems(source, {"lm_head.weight differs from " + of.at(embedding).hf_name +
                            ": this model's config ties the output head to the token embedding"});
}

NamedTensors from_hf(ModelFamily family, const NamedTensors& hf, const NamedTensors& expected, const std::string& source) {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& [name, t] : hf) {
    entries.push_back({name, t.scalar_type(), t.sizes().vec(), 0, 0});
    by_name[name] = t;
  }
  const HfTensorMap map = match_hf(family, entries, expected, source);
  auto read = [&](const std::string& name) { return by_name.at(name); };
  map.check_tied_head(read);
  NamedTensors out;
  for (const auto& [name, want] : expected) out.emplace_back(name, map.read(name, read).to(torch::kFloat32).contiguous());
  return out;
}

std::string peft_module_path(ModelFamily family, const std::string& our_weight_name) {
  std::string m = our_weight_name;
  if (ends_with(m, ".weight")) m.resize(m.size() - 7);
  return "base_model.model." + hf_name(family, m);
}

bool hf_fan_in_fan_out(ModelFamily family) { return family == ModelFamily::Gpt2; }

namespace {

// HF's name of our activation; a tanh GELU keeps the imported model's spelling of it.
std::string hf_activation(const ModelOptions& o, const std::string& before, const char* tanh_name) {
  if (o.activation == Activation::Silu) return "silu";
  if (o.activation == Activation::Gelu) return "gelu";
  return activations().count(before) && activations().at(before) == Activation::GeluTanh ? before : tanh_name;
}

json gpt2_config(const ModelOptions& o, json hf) {
  hf["architectures"] = {"GPT2LMHeadModel"};
  hf["model_type"] = "gpt2";
  hf["vocab_size"] = o.vocab_size;
  hf["n_positions"] = o.block_size;
  hf["n_embd"] = o.d_model;
  hf["n_layer"] = o.n_layer;
  hf["n_head"] = o.n_head;
  hf["n_inner"] = o.ff() == 4 * o.d_model ? json(nullptr) : json(o.ff());
  hf["activation_function"] = hf_activation(o, hf.value("activation_function", std::string()), "gelu_new");
  hf["layer_norm_epsilon"] = o.norm_eps;
  hf["scale_attn_weights"] = true;
  hf["scale_attn_by_inverse_layer_idx"] = false;
  hf["tie_word_embeddings"] = true;
  for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"})
    if (!hf.contains(k)) hf[k] = o.dropout;
  // Our tokenizers' end-of-text ids (gpt2: 50256, byte: 256); none for another vocabulary (GPT2Config's
  // default, 50256, would lie outside it).
  if (!hf.contains("eos_token_id"))
    hf["bos_token_id"] = hf["eos_token_id"] = o.vocab_size == 50257 || o.vocab_size == 257 ? json(o.vocab_size - 1) : json(nullptr);
  return hf;
}

json llama_config(const ModelOptions& o, json hf) {
  // Qwen2 is the llama family with q/k/v biases; an imported Mistral or Llama keeps its class.
  std::string type = hf.value("model_type", std::string("llama"));
  if (o.qkv_bias) type = "qwen2";
  else if (type == "qwen2" || !llama_types().count(type)) type = "llama";
  static const std::map<std::string, std::string> cls = {
      {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"mistral", "MistralForCausalLM"}};
  hf["architectures"] = {cls.at(type)};
  hf["model_type"] = type;
  hf["vocab_size"] = o.vocab_size;
  hf["hidden_size"] = o.d_model;
  hf["intermediate_size"] = o.ff();
  hf["num_hidden_layers"] = o.n_layer;
  hf["num_attention_heads"] = o.n_head;
  hf["num_key_value_heads"] = o.kv_heads();
  hf["head_dim"] = o.head_dim();
  hf["max_position_embeddings"] = std::max<int64_t>(o.block_size, hf.value("max_position_embeddings", int64_t{0}));
  hf["hidden_act"] = hf_activation(o, hf.value("hidden_act", std::string()), "gelu_pytorch_tanh");
  hf["rms_norm_eps"] = o.norm_eps;
  hf["tie_word_embeddings"] = o.tie_embeddings;
  hf["attention_dropout"] = o.dropout;
  if (type == "llama") {
    hf["attention_bias"] = false;
    hf["mlp_bias"] = false;
  }
  if (type == "qwen2") hf["use_sliding_window"] = false;
  if (type == "mistral") hf["sliding_window"] = nullptr;
  // Both spellings of the rotary settings: transformers 5 reads rope_parameters, 4.x rope_theta and
  // rope_scaling.
  json rope = {{"rope_type", "default"}, {"rope_theta", o.rope_theta}};
  const RopeScaling& s = o.rope_scaling;
  if (s.kind == RopeScaling::Kind::Linear) rope = {{"rope_type", "linear"}, {"rope_theta", o.rope_theta}, {"factor", s.factor}};
  if (s.kind == RopeScaling::Kind::Llama3)
    rope = {{"rope_type", "llama3"},
            {"rope_theta", o.rope_theta},
            {"factor", s.factor},
            {"low_freq_factor", s.low_freq_factor},
            {"high_freq_factor", s.high_freq_factor},
            {"original_max_position_embeddings", s.original_context}};
  hf["rope_theta"] = o.rope_theta;
  hf["rope_parameters"] = rope;
  if (s.kind == RopeScaling::Kind::None) hf.erase("rope_scaling");
  else hf["rope_scaling"] = rope;
  return hf;
}

}  // namespace

json hf_config_for(const ModelOptions& o, const json& imported, const std::string& dtype) {
  json hf = imported.is_object() ? imported : json::object();
  // An imported config of the other family has nothing to keep.
  const std::string type = hf.value("model_type", std::string());
  const bool same_family = (o.family == ModelFamily::Gpt2) == (type == "gpt2") && (type == "gpt2" || llama_types().count(type));
  if (!same_family) hf = json::object();
  hf = o.family == ModelFamily::Gpt2 ? gpt2_config(o, hf) : llama_config(o, hf);
  hf["dtype"] = dtype;
  hf.erase("torch_dtype");
  hf.erase("_name_or_path");
  hf.erase("transformers_version");
  return hf;
}

std::string hf_class_name(const json& hf_config) {
  return hf_config.contains("architectures") && hf_config["architectures"].is_array() && !hf_config["architectures"].empty()
             ? hf_config["architectures"][0].get<std::string>()
             : "?";
}

}  // namespace lt
