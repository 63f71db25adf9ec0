#include "lora_trainer/huggingface.hpp"

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "lora_trainer/checkpoint.hpp"
#include "lora_trainer/config.hpp"
#include "lora_trainer/lora.hpp"
#include "lora_trainer/export.hpp"
#include "lora_trainer/lora_trainer.hpp"
#include "lora_trainer/safetensors.hpp"
#include "lora_trainer/util.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

namespace {

const char* kHfPrefix = "transformer.";
const char* kPeftPrefix = "base_model.model.transformer.";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The four projections are Conv1D layers in transformers: their weights are stored (in, out).
bool is_conv1d_weight(const std::string& ours) {
  return ours.rfind("h.", 0) == 0 && ends_with(ours, ".weight") &&
         (ours.find(".attn.c_attn.") != std::string::npos || ours.find(".attn.c_proj.") != std::string::npos ||
          ours.find(".mlp.c_fc.") != std::string::npos || ours.find(".mlp.c_proj.") != std::string::npos);
}

std::string shape_text(at::IntArrayRef s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

// HF's activation names -> ours. gelu_new, gelu_pytorch_tanh and gelu_fast are the same tanh formula.
const std::map<std::string, std::string>& activations() {
  static const std::map<std::string, std::string> m = {
      {"gelu", "gelu"}, {"gelu_new", "gelu_tanh"}, {"gelu_pytorch_tanh", "gelu_tanh"}, {"gelu_fast", "gelu_tanh"}};
  return m;
}

// The architecture of a GPT2 config.json as our overrides, or a UserError naming what our GPT cannot
// represent.
std::vector<std::string> gpt2_architecture(const json& c, const std::string& path) {
  const std::string type = c.value("model_type", std::string());
  if (type != "gpt2") {
    static const std::set<std::string> llama = {"llama", "qwen2", "mistral", "qwen3", "gemma", "gemma2", "phi3"};
    throw UserError(path + ": model_type \"" + type + "\" is not supported; import-hf reads gpt2 (GPT2LMHeadModel) only" +
                    (llama.count(type) ? ". The llama family (Llama, Qwen2, Mistral) is planned, not yet supported" : ""));
  }
  std::vector<std::string> problems;
  auto need_int = [&](const char* key) -> int64_t {
    if (!c.contains(key) || !c[key].is_number_integer() || c[key].get<int64_t>() <= 0) {
      problems.push_back(std::string(key) + " must be a positive integer");
      return 1;
    }
    return c[key].get<int64_t>();
  };
  const int64_t C = need_int("n_embd"), L = need_int("n_layer"), H = need_int("n_head"), T = need_int("n_positions"),
                V = need_int("vocab_size");
  if (C % H != 0) problems.push_back("n_embd " + std::to_string(C) + " is not divisible by n_head " + std::to_string(H));
  if (c.contains("n_inner") && !c["n_inner"].is_null() && c["n_inner"] != json(4 * C))
    problems.push_back("n_inner " + c["n_inner"].dump() + ": our MLP is 4 * n_embd = " + std::to_string(4 * C) + " wide");
  const std::string act = c.value("activation_function", std::string("gelu_new"));
  if (!activations().count(act))
    problems.push_back("activation_function \"" + act + "\": only gelu, gelu_new, gelu_pytorch_tanh and gelu_fast are supported");
  const double eps = c.value("layer_norm_epsilon", 1e-5);
  if (std::abs(eps - 1e-5) > 1e-12) problems.push_back("layer_norm_epsilon " + c["layer_norm_epsilon"].dump() + ": ours is 1e-5");
  if (!c.value("scale_attn_weights", true)) problems.push_back("scale_attn_weights false: ours scales by 1/sqrt(head size)");
  if (c.value("scale_attn_by_inverse_layer_idx", false)) problems.push_back("scale_attn_by_inverse_layer_idx true");
  if (c.value("add_cross_attention", false)) problems.push_back("add_cross_attention true");
  if (!c.value("tie_word_embeddings", true)) problems.push_back("tie_word_embeddings false: our output head is the token embedding");
  if (!problems.empty())
    throw UserError(path + ": this GPT-2 cannot be represented by lora_trainer's GPT: " + join(problems, "; ") +
                    ". Nothing was written");
  return {"architecture/vocab_size=" + std::to_string(V), "architecture/block_size=" + std::to_string(T),
          "architecture/n_layers=" + std::to_string(L),   "architecture/n_heads=" + std::to_string(H),
          "architecture/d_model=" + std::to_string(C),    "architecture/activation=" + activations().at(act)};
}

// Our parameter names and shapes for an architecture (the template an import must fill).
NamedTensors gpt2_template(int64_t V, int64_t T, int64_t L, int64_t C) {
  NamedTensors out;
  auto add = [&](const std::string& n, std::vector<int64_t> shape) {
    out.emplace_back(n, torch::empty(shape, torch::TensorOptions().dtype(torch::kFloat32)));
  };
  add("wte.weight", {V, C});
  add("wpe.weight", {T, C});
  for (int64_t i = 0; i < L; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    add(p + "ln_1.weight", {C});
    add(p + "ln_1.bias", {C});
    add(p + "attn.c_attn.weight", {3 * C, C});
    add(p + "attn.c_attn.bias", {3 * C});
    add(p + "attn.c_proj.weight", {C, C});
    add(p + "attn.c_proj.bias", {C});
    add(p + "ln_2.weight", {C});
    add(p + "ln_2.bias", {C});
    add(p + "mlp.c_fc.weight", {4 * C, C});
    add(p + "mlp.c_fc.bias", {4 * C});
    add(p + "mlp.c_proj.weight", {C, 4 * C});
    add(p + "mlp.c_proj.bias", {C});
  }
  add("ln_f.weight", {C});
  add("ln_f.bias", {C});
  return out;
}

void write_marker(const fs::path& dir, const std::string& checkpoint, const std::string& format) {
  json m = {{"exported_from", fs::absolute(checkpoint).string()}, {"format", format}, {"by", "lora_trainer export"}};
  write_file_atomic((dir / kExportMarker).string(), m.dump(2) + "\n");
}

}  // namespace

std::string peft_module_path(const std::string& base_weight_name) {
  std::string m = base_weight_name;
  if (ends_with(m, ".weight")) m.resize(m.size() - 7);
  return kPeftPrefix + m;
}

NamedTensors gpt2_to_hf(const NamedTensors& ours) {
  NamedTensors out;
  for (const auto& [name, t] : ours) {
    auto f = t.detach().to(torch::kCPU).to(torch::kFloat32);
    out.emplace_back(kHfPrefix + name, is_conv1d_weight(name) ? f.t().contiguous() : f.contiguous());
  }
  return out;
}

NamedTensors gpt2_from_hf(const NamedTensors& hf, const NamedTensors& expected, const std::string& source) {
  std::map<std::string, torch::Tensor> by_name;
  std::vector<std::string> problems;
  torch::Tensor lm_head;
  for (const auto& [raw, t] : hf) {
    std::string n = raw.rfind(kHfPrefix, 0) == 0 ? raw.substr(std::string(kHfPrefix).size()) : raw;
    if (n == "lm_head.weight") {
      lm_head = t;
      continue;
    }
    // Older GPT-2 files keep the causal-mask buffers; they are not weights.
    if (n.rfind("h.", 0) == 0 && (ends_with(n, ".attn.bias") || ends_with(n, ".attn.masked_bias"))) continue;
    const auto st = t.scalar_type();
    if (st != torch::kFloat32 && st != torch::kFloat16 && st != torch::kBFloat16) {
      problems.push_back(raw + ": dtype " + std::string(c10::toString(st)) + " (only F32, F16 and BF16 weights are read)");
      continue;
    }
    if (by_name.count(n)) problems.push_back(raw + ": given twice (with and without \"transformer.\")");
    by_name[n] = t;
  }
  NamedTensors out;
  for (const auto& [name, want] : expected) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      problems.push_back("missing " + std::string(kHfPrefix) + name + " " + shape_text(want.sizes()));
      continue;
    }
    auto t = it->second.to(torch::kFloat32);
    if (is_conv1d_weight(name)) t = t.dim() == 2 ? t.t() : t;
    if (t.sizes() != want.sizes()) {
      std::vector<int64_t> hf_shape = want.sizes().vec();
      if (is_conv1d_weight(name)) std::swap(hf_shape[0], hf_shape[1]);
      problems.push_back(std::string(kHfPrefix) + name + ": shape " + shape_text(it->second.sizes()) + ", expected " +
                         shape_text(hf_shape) + (is_conv1d_weight(name) ? " (Conv1D: (in, out))" : ""));
    } else {
      out.emplace_back(name, t.contiguous());
    }
    by_name.erase(it);
  }
  for (const auto& [name, t] : by_name) problems.push_back("unexpected tensor " + name + " " + shape_text(t.sizes()));
  if (lm_head.defined() && problems.empty()) {
    const auto& wte = std::find_if(out.begin(), out.end(), [](const auto& p) { return p.first == "wte.weight"; })->second;
    if (lm_head.sizes() != wte.sizes() || !torch::equal(lm_head.to(torch::kFloat32), wte))
      problems.push_back("lm_head.weight differs from transformer.wte.weight: our output head is tied to the token embedding");
  }
  if (!problems.empty()) {
    std::string msg = source + " does not hold the GPT-2 its config.json describes (" + std::to_string(problems.size()) +
                      " problems): ";
    for (size_t i = 0; i < problems.size() && i < 12; ++i) msg += (i ? "; " : "") + problems[i];
    if (problems.size() > 12) msg += "; ...";
    throw UserError(msg + ". Nothing was written");
  }
  return out;
}

std::vector<std::string> import_hf(const std::string& hf_dir, const std::string& out) {
  if (!fs::is_directory(hf_dir)) throw UserError("import-hf: " + hf_dir + " is not a directory");
  const std::string config_path = (fs::path(hf_dir) / "config.json").string();
  if (!fs::exists(config_path)) throw UserError("import-hf: " + hf_dir + " has no config.json (a Hugging Face model directory has one)");
  check_export_target(hf_dir, out, "import-hf");
  const json hf_config = read_json_file(config_path);
  if (!hf_config.is_object()) throw UserError(config_path + ": not a JSON object");
  const std::vector<std::string> arch = gpt2_architecture(hf_config, config_path);
  Config cfg(LoRATrainer::schema());
  for (const auto& a : arch) cfg.apply_override(a);
  cfg.set("training/pre_lora_tokens", json::array(), "import-hf");
  cfg.set("training/pre_lora_dataset", json::array(), "import-hf");
  const int64_t V = cfg.get_int("architecture/vocab_size"), T = cfg.get_int("architecture/block_size"),
                L = cfg.get_int("architecture/n_layers"), C = cfg.get_int("architecture/d_model");
  NamedTensors params = gpt2_from_hf(read_safetensors_model(hf_dir), gpt2_template(V, T, L, C), hf_dir);
  NamedTensors stored;
  for (auto& [n, t] : params) stored.emplace_back(kParamsPrefix + n, t);
  const std::string abs_dir = fs::absolute(hf_dir).lexically_normal().string();
  // The Hub's name when the config carries it (transformers writes it on download), else this directory.
  const bool named = hf_config.contains("_name_or_path") && hf_config["_name_or_path"].is_string() &&
                     !hf_config["_name_or_path"].get<std::string>().empty();
  const json name_or_path = named ? hf_config["_name_or_path"] : json(abs_dir);
  json meta = {{"kind", state_kind_name(StateKind::Plain)},
               {"weights_only", true},
               {"step", 0},
               {"tokens", 0},
               {"imported_from", abs_dir},
               {"base_model",
                {{"family", "gpt2"},
                 {"hf_dir", abs_dir},
                 {"name_or_path", name_or_path},
                 {"hf_config", hf_config}}},
               {"job", {{"name", "import-hf"}, {"project", "general"}, {"group", "default"}, {"kind", "lora/train"}}},
               {"config", cfg.to_json()}};
  save_checkpoint(out, stored, meta);
  std::printf("imported %s (gpt2: %lld layers, d_model %lld, %lld heads, vocab %lld, context %lld, %s) -> %s (%zu tensors, float32)\n",
              hf_dir.c_str(), (long long)L, (long long)C, (long long)cfg.get_int("architecture/n_heads"), (long long)V,
              (long long)T, cfg.get_string("architecture/activation").c_str(), out.c_str(), params.size());
  std::printf("a job that loads it (`run ... --restore %s`) needs this architecture:\n ", out.c_str());
  for (const auto& a : arch) std::printf(" %s", a.c_str());
  std::printf(" 'training/pre_lora_tokens=[]' 'training/pre_lora_dataset=[]'\n");
  return arch;
}

namespace {

// A checkpoint's architecture, from its saved (resolved) config.
struct Gpt2Arch {
  int64_t V, T, L, H, C;
  bool gelu_tanh;
  double dropout;
};

Gpt2Arch arch_of(const json& meta, const std::string& checkpoint) {
  const json& c = meta.value("config", json::object());
  if (!c.contains("architecture") || !c["architecture"].is_object())
    throw UserError(checkpoint + ": its metadata has no saved config with architecture/*");
  const json& a = c["architecture"];
  try {
    return {a.at("vocab_size").get<int64_t>(), a.at("block_size").get<int64_t>(), a.at("n_layers").get<int64_t>(),
            a.at("n_heads").get<int64_t>(),    a.at("d_model").get<int64_t>(),
            a.value("activation", std::string("gelu")) == "gelu_tanh", a.value("dropout", 0.0)};
  } catch (const json::exception& e) {
    throw UserError(checkpoint + ": its saved architecture/* is incomplete (" + e.what() + ")");
  }
}

// The checkpoint's parameters in f32 with any adapters merged (what export_merged writes), its
// metadata and its architecture.
struct MergedCheckpoint {
  json meta;
  Gpt2Arch arch;
  NamedTensors params;  // our names, without "params/"
};

MergedCheckpoint read_merged(const std::string& checkpoint) {
  MergedWeights w = merged_weights(checkpoint);
  MergedCheckpoint m;
  m.meta = std::move(w.meta);
  m.arch = arch_of(m.meta, checkpoint);
  m.params = std::move(w.params);
  return m;
}

}  // namespace

void export_hf(const std::string& checkpoint, const std::string& out) {
  check_export_target(checkpoint, out, "export");
  MergedCheckpoint m = read_merged(checkpoint);
  const auto [V, T, L, H, C, tanh, dropout] = m.arch;
  // An imported model keeps its own config (token ids, task settings); the architecture is ours.
  json hf = m.meta.contains("base_model") && m.meta["base_model"].contains("hf_config") ? m.meta["base_model"]["hf_config"]
                                                                                         : json::object();
  if (hf.value("model_type", std::string("gpt2")) != "gpt2") hf = json::object();
  const std::string act_before = hf.value("activation_function", std::string());
  hf["architectures"] = {"GPT2LMHeadModel"};
  hf["model_type"] = "gpt2";
  hf["vocab_size"] = V;
  hf["n_positions"] = T;
  hf["n_embd"] = C;
  hf["n_layer"] = L;
  hf["n_head"] = H;
  hf["n_inner"] = nullptr;
  hf["activation_function"] = tanh ? (activations().count(act_before) && act_before != "gelu" ? act_before : "gelu_new") : "gelu";
  hf["layer_norm_epsilon"] = 1e-5;
  hf["scale_attn_weights"] = true;
  hf["scale_attn_by_inverse_layer_idx"] = false;
  hf["tie_word_embeddings"] = true;
  hf["dtype"] = "float32";
  for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"})
    if (!hf.contains(k)) hf[k] = dropout;
  // Our tokenizers' end-of-text ids (gpt2: 50256, byte: 256); none for another vocabulary (GPT2Config's
  // default, 50256, would lie outside it).
  if (!hf.contains("eos_token_id")) hf["bos_token_id"] = hf["eos_token_id"] = V == 50257 || V == 257 ? json(V - 1) : json(nullptr);
  hf.erase("_name_or_path");
  hf.erase("transformers_version");
  NamedTensors tensors = gpt2_to_hf(m.params);
  publish_dir(out, [&](const fs::path& dir) {
    write_safetensors((dir / "model.safetensors").string(), tensors, {{"format", "pt"}});
    write_file_atomic((dir / "config.json").string(), hf.dump(2) + "\n");
    write_marker(dir, checkpoint, "hf");
  });
  std::printf("exported %s -> %s (Hugging Face GPT2LMHeadModel: model.safetensors with %zu tensors, float32, adapters merged; "
              "config.json)\n", checkpoint.c_str(), out.c_str(), tensors.size());
}

void export_peft(const std::string& checkpoint, const std::string& out) {
  check_export_target(checkpoint, out, "export");
  json meta = read_checkpoint_metadata(checkpoint);
  if (meta.value("kind", std::string()) != "lora" || !meta.contains("lora"))
    throw UserError("export --format peft: " + checkpoint + " is a " + meta.value("kind", std::string("?")) +
                    " checkpoint without adapters; a PEFT adapter comes from a LoRA-phase checkpoint. For full weights "
                    "use --format hf. Nothing was written");
  const double alpha = meta["lora"].at("alpha").get<double>();
  const int64_t r = meta["lora"].at("rank").get<int64_t>();
  std::map<std::string, torch::Tensor> lora, base;
  for (auto& [n, t] : read_checkpoint_tensors(checkpoint)) {
    if (n.rfind(kLoraPrefix, 0) == 0) lora[n.substr(kLoraPrefix.size())] = t;
    if (n.rfind(kParamsPrefix, 0) == 0) base[n.substr(kParamsPrefix.size())] = t;
  }
  const auto targets = meta["lora"].value("targets", std::vector<std::string>());
  if (targets.empty()) throw UserError(checkpoint + ": its lora metadata lists no adapted weights. Nothing was written");
  NamedTensors tensors;
  std::set<std::string> adapted;  // HF module paths, without base_model.model.
  for (const auto& w : targets) {
    if (!is_conv1d_weight(w))
      throw UserError(checkpoint + ": adapted weight " + w + " is not one of GPT-2's Conv1D projections. Nothing was written");
    auto a = lora.find(LoraParams::a_name(w)), b = lora.find(LoraParams::b_name(w));
    if (a == lora.end() || b == lora.end())
      throw UserError(checkpoint + ": the adapter of " + w + " is missing (lora/" + LoraParams::a_name(w) + "). Nothing was written");
    const std::string mod = peft_module_path(w);
    tensors.emplace_back(mod + ".lora_A.weight", a->second.to(torch::kFloat32).t().contiguous());  // (r, in)
    tensors.emplace_back(mod + ".lora_B.weight", b->second.to(torch::kFloat32).t().contiguous());  // (out, r)
    adapted.insert(mod.substr(std::string("base_model.model.").size()));
  }
  // target_modules: the shortest name suffixes that PEFT (which matches a module when its name equals
  // a target or ends in "." + target) would resolve to exactly the adapted modules of this model.
  std::vector<std::string> all;
  const int64_t L = arch_of(meta, checkpoint).L;
  for (int64_t i = 0; i < L; ++i)
    for (const char* m : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"})
      all.push_back("transformer.h." + std::to_string(i) + "." + m);
  std::vector<std::string> target_modules(adapted.begin(), adapted.end());
  for (int parts = 1; parts <= 3; ++parts) {
    std::set<std::string> suffixes;
    for (const auto& m : adapted) {
      size_t at = m.size();
      for (int k = 0; k < parts && at != std::string::npos; ++k) at = at == 0 ? std::string::npos : m.rfind('.', at - 1);
      suffixes.insert(at == std::string::npos ? m : m.substr(at + 1));
    }
    std::set<std::string> matched;
    for (const auto& m : all)
      for (const auto& s : suffixes)
        if (m == s || ends_with(m, "." + s)) matched.insert(m);
    if (matched == adapted) {
      target_modules.assign(suffixes.begin(), suffixes.end());
      break;
    }
  }
  // modules_to_save: PEFT saves the whole module (every parameter, e.g. a norm's gain and bias) under
  // its own name, base_model.model.<module>.<param>, and lists the module. Our token embedding is also
  // the output head (tied); PEFT would give each of GPT2LMHeadModel's two tied modules its own copy,
  // so both are listed and both get the trained tensor.
  const auto saved = meta["lora"].value("modules_to_save", std::vector<std::string>());
  std::set<std::string> saved_modules;  // ours: "wte", "h.0.ln_1"
  for (const auto& p : saved) saved_modules.insert(p.substr(0, p.rfind('.')));
  std::vector<std::string> peft_modules_to_save;
  for (const auto& m : saved_modules) {
    for (const auto& [n, t] : base) {
      if (n.rfind(m + ".", 0) != 0 || n.find('.', m.size() + 1) != std::string::npos) continue;
      for (auto& [hf, v] : gpt2_to_hf({{n, t}})) tensors.emplace_back("base_model.model." + hf, v);
      if (n == "wte.weight") tensors.emplace_back("base_model.model.lm_head.weight", tensors.back().second);
    }
    peft_modules_to_save.push_back(std::string(kHfPrefix) + m);
    if (m == "wte") peft_modules_to_save.push_back("lm_head");
  }
  const std::string init = meta["lora"].value("init", std::string("gaussian"));
  const json base_model = meta.value("base_model", json());
  json config = {{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"r", r},
                 {"lora_alpha", alpha},
                 {"lora_dropout", 0.0},
                 {"target_modules", target_modules},
                 {"fan_in_fan_out", true},
                 {"bias", "none"},
                 {"use_rslora", meta["lora"].value("rslora", false)},
                 {"modules_to_save", peft_modules_to_save.empty() ? json(nullptr) : json(peft_modules_to_save)},
                 // PEFT's value for the init the adapters were drawn with (only used when PEFT creates new ones)
                 {"init_lora_weights", init == "gaussian" ? json("gaussian") : json(true)},
                 {"layers_to_transform", nullptr},
                 {"layers_pattern", nullptr},
                 {"rank_pattern", json::object()},
                 {"alpha_pattern", json::object()},
                 {"inference_mode", true},
                 {"revision", nullptr},
                 {"base_model_name_or_path",
                  base_model.is_object() && base_model.contains("name_or_path") ? base_model["name_or_path"] : json(nullptr)}};
  publish_dir(out, [&](const fs::path& dir) {
    write_safetensors((dir / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
    write_file_atomic((dir / "adapter_config.json").string(), config.dump(2) + "\n");
    write_marker(dir, checkpoint, "peft");
  });
  const bool rslora = meta["lora"].value("rslora", false);
  std::printf("exported %s -> %s (PEFT LoRA adapter: %zu adapted modules, r %lld, lora_alpha %g, scaling %s = %g, "
              "fan_in_fan_out true%s%s; base %s)\n", checkpoint.c_str(), out.c_str(), adapted.size(), (long long)r, alpha,
              rslora ? "alpha/sqrt(r)" : "alpha/r", lora_scale(alpha, r, rslora), peft_modules_to_save.empty() ? "" : "; modules_to_save ",
              join(peft_modules_to_save).c_str(),
              config["base_model_name_or_path"].is_string() ? config["base_model_name_or_path"].get<std::string>().c_str()
                                                            : "unknown: set base_model_name_or_path in adapter_config.json");
}

}  // namespace lt
