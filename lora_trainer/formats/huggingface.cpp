#include "lora_trainer/formats/huggingface.hpp"

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "lora_trainer/formats/adapter_source.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

namespace {
std::vector<std::string> import_checked(const std::string& hf_dir, const std::string& config_path, const std::string& out,
                                        const std::vector<std::string>& ours, torch::ScalarType dtype);
}  // namespace

std::vector<std::string> import_hf(const std::string& hf_dir, const std::string& out, bool force, const std::string& dtype) {
  const torch::ScalarType as = parse_dtype_option(dtype, kHfDtypes, "import-hf");
  if (!fs::is_directory(hf_dir)) throw UserError("import-hf: " + hf_dir + " is not a directory");
  const std::string config_path = (fs::path(hf_dir) / "config.json").string();
  if (!fs::exists(config_path)) throw UserError("import-hf: " + hf_dir + " has no config.json (a Hugging Face model directory has one)");
  const auto ours = check_export_target(hf_dir, out, "import-hf", force);
  return_freed_tensors();  // one tensor at a time, and each one's memory returned
  // Every value read from config.json below: a type error names the file and the key.
  return json_context(config_path, [&] { return import_checked(hf_dir, config_path, out, ours, as); });
}

namespace {

std::vector<std::string> import_checked(const std::string& hf_dir, const std::string& config_path, const std::string& out,
                                        const std::vector<std::string>& ours, torch::ScalarType dtype) {
  const json hf_config = read_json_file(config_path);
  if (!hf_config.is_object()) throw UserError(config_path + ": not a JSON object");
  const ModelFamily family = hf_family(hf_config, config_path);
  const std::vector<std::string> arch = hf_architecture(hf_config, config_path);
  Config cfg = model_config();
  for (const auto& a : arch) cfg.apply_override(a);
  const ModelOptions o = ModelOptions::from_config(cfg);
  // The config a job restored from it starts from: a lora/train job without phase one on this model
  // (the keys it does not name take that kind's defaults when it is loaded).
  json job_config = cfg.to_json();
  job_config["job"] = {{"kind", "lora/train"}};
  job_config["training"]["pre_lora_tokens"] = json::array();
  job_config["training"]["pre_lora_dataset"] = json::array();
  // The model's own parameter list is the template the file must fill (allocated, never touched).
  NamedTensors expected;
  {
    CausalLM model = make_model(o);
    for (auto& [n, t] : named_params(*model)) expected.emplace_back(n, torch::empty(t.sizes()));
  }
  const auto src = BaseWeights::open_hf(hf_dir, family, expected);
  // Tensor by tensor from the mapped files into state.h5: the import holds one tensor, not the model.
  const bool source = dtype == c10::ScalarType::Undefined;
  const std::string written = source ? src->dtype() : dtype_name(dtype);
  const bool f32 = source ? written == dtype_name(torch::kFloat32) : dtype == torch::kFloat32;
  TensorStream stored;
  for (const auto& [n, t] : expected) {
    stored.names.push_back(kParamsPrefix + n);
    stored.bytes += static_cast<uint64_t>(t.numel()) * (f32 ? 4 : 2);
  }
  stored.get = [&](size_t i) {
    torch::Tensor v = src->read(expected[i].first);
    return source ? v : export_cast(v, dtype, stored.names[i], "import-hf --dtype " + written);
  };
  const json base_model = src->base_model();
  json meta = {{"kind", state_kind_name(StateKind::Plain)},
               {"weights_only", true},
               {"step", 0},
               {"tokens", 0},
               {"imported_from", base_model["hf_dir"]},
               {"base_model", base_model},
               {"job", {{"name", "import-hf"}, {"project", "general"}, {"group", "default"}, {"kind", "lora/train"}}},
               {"config", job_config}};
  save_checkpoint(out, stored, meta, ours);
  // "gpt2: ..." or "qwen2, llama family: ..."
  const std::string type = hf_config.value("model_type", std::string());
  const std::string kind = type == to_string(family) ? type : type + ", " + to_string(family) + " family";
  std::printf("imported %s (%s: %lld layers, d_model %lld, %lld heads, vocab %lld, context %lld, %s) -> %s (%zu tensors, "
              "%s)\n",
              hf_dir.c_str(), kind.c_str(), (long long)o.n_layer, (long long)o.d_model, (long long)o.n_head,
              (long long)o.vocab_size, (long long)o.block_size, activation_name(o.activation), out.c_str(),
              stored.names.size(), written.c_str());
  std::printf("a job that loads it (`run ... --restore %s`) needs this architecture:\n ", out.c_str());
  for (const auto& a : arch) std::printf(" %s", a.c_str());
  std::printf(" 'training/pre_lora_tokens=[]' 'training/pre_lora_dataset=[]'\n");
  return arch;
}

// The checkpoint's parameters in f32 with any adapters merged (what export_merged writes), its
// metadata and its architecture.
struct MergedCheckpoint {
  CheckpointMeta ck;
  ModelOptions options;
  NamedTensors params;  // our names, without "params/"
  torch::ScalarType dtype = torch::kFloat32;
};

// config.json's "dtype" for the weights' dtype: its name in state.h5 (dtype_name), for the dtypes a
// Hugging Face model's weights take.
std::string hf_dtype_name(torch::ScalarType t) {
  if (t != torch::kFloat32 && t != torch::kBFloat16 && t != torch::kFloat16)
    throw UserError(std::string("export --format hf: weights of dtype ") + c10::toString(t) + " have no config.json name");
  return dtype_name(t);
}

MergedCheckpoint read_merged(const std::string& checkpoint, bool use_ema, const std::string& base, torch::ScalarType dtype) {
  MergedWeights w = merged_weights(checkpoint, use_ema, base, dtype, "export --format hf");
  MergedCheckpoint m;
  m.ck = std::move(w.ck);
  m.options = checkpoint_model_options(m.ck);
  m.params = std::move(w.params);
  m.dtype = w.dtype;
  return m;
}

// A model trained on conversations (its checkpoint's "chat"): the files transformers reads to chat with
// it, written into `dir`: the tokenizer's (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// from the hf:DIR its data was tokenized with) with the template it was trained with as
// tokenizer_config.json's chat_template and as chat_template.jinja, and generation_config.json (the
// model directory's, if any, with eos_token_id the turn's stop ids). Returns what it wrote, for the
// message; nothing for a checkpoint without "chat".
std::vector<std::string> write_chat_files(const fs::path& dir, const CheckpointMeta& ck) {
  if (ck.chat.is_null()) return {};
  const ChatFormat chat = ChatFormat::from_json(ck.chat, ck.dir + "/metadata.json: chat");
  std::vector<std::string> wrote;
  const std::string src = ck.tokenizer.rfind("hf:", 0) == 0 ? ck.tokenizer.substr(3) : std::string();
  json tokenizer_config = json::object();
  if (!src.empty() && fs::exists(fs::path(src) / "tokenizer.json")) {
    write_file_atomic((dir / "tokenizer.json").string(), read_file((fs::path(src) / "tokenizer.json").string()));
    wrote.push_back("tokenizer.json");
    if (fs::exists(fs::path(src) / "special_tokens_map.json")) {
      write_file_atomic((dir / "special_tokens_map.json").string(), read_file((fs::path(src) / "special_tokens_map.json").string()));
      wrote.push_back("special_tokens_map.json");
    }
    if (fs::exists(fs::path(src) / "tokenizer_config.json"))
      tokenizer_config = read_json_file((fs::path(src) / "tokenizer_config.json").string());
  } else {
    std::printf("note: the tokenizer directory %s is gone; the export has the chat template and generation_config.json "
                "but no tokenizer files: copy them from the model's own directory\n", src.empty() ? "?" : src.c_str());
  }
  if (!tokenizer_config.is_object()) tokenizer_config = json::object();
  tokenizer_config["chat_template"] = chat.template_source;
  if (!chat.eos_token.empty()) tokenizer_config["eos_token"] = chat.eos_token;
  write_file_atomic((dir / "tokenizer_config.json").string(), tokenizer_config.dump(2) + "\n");
  write_file_atomic((dir / "chat_template.jinja").string(), chat.template_source);
  wrote.insert(wrote.end(), {"tokenizer_config.json", "chat_template.jinja"});
  json generation = json::object();
  if (!src.empty() && fs::exists(fs::path(src) / "generation_config.json")) {
    generation = read_json_file((fs::path(src) / "generation_config.json").string());
    if (!generation.is_object()) generation = json::object();
  }
  generation["eos_token_id"] = chat.stop_ids.size() == 1 ? json(chat.stop_ids[0]) : json(chat.stop_ids);
  write_file_atomic((dir / "generation_config.json").string(), generation.dump(2) + "\n");
  wrote.push_back("generation_config.json");
  return wrote;
}

}  // namespace

void export_hf(const std::string& checkpoint, const std::string& out, bool use_ema, bool force, const std::string& base,
               const std::string& dtype, uint64_t max_shard_bytes, const std::function<void(const std::string&)>& check) {
  const torch::ScalarType as = parse_dtype_option(dtype, kHfDtypes, "export");
  const auto ours = check_export_target(checkpoint, out, "export", force);
  return_freed_tensors();
  MergedCheckpoint m = read_merged(checkpoint, use_ema, base, as);
  const std::string dtype_name = hf_dtype_name(m.dtype);
  // An imported model keeps its own config (token ids, task settings); the architecture is ours.
  const json imported = m.ck.base_hf_config();
  const json hf = hf_config_for(m.options, imported, dtype_name);
  NamedTensors tensors = to_hf(m.options.family, m.params);
  m.params.clear();
  std::vector<std::string> files, chat_files;
  const size_t n_tensors = tensors.size();
  publish_dir(out, [&](const fs::path& dir) {
    files = write_safetensors_model(dir.string(), tensors, {{"format", "pt"}}, max_shard_bytes);
    tensors.clear();  // written: their memory is the check's
    write_file_atomic((dir / "config.json").string(), hf.dump(2) + "\n");
    chat_files = write_chat_files(dir, m.ck);
    write_export_marker(dir, checkpoint, "hf");
    if (check) check(dir.string());
  }, "", ours, export_owner(checkpoint));
  const std::string weights = files.size() == 1 ? files[0] : std::to_string(files.size() - 1) + " shards and " + files.back();
  std::printf("exported %s -> %s (Hugging Face %s: %s with %zu tensors, %s, adapters merged; config.json%s)\n",
              checkpoint.c_str(), out.c_str(), hf_class_name(hf).c_str(), weights.c_str(), n_tensors, dtype_name.c_str(),
              chat_files.empty() ? "" : ("; the chat template it was trained with: " + join(chat_files)).c_str());
}

namespace {

void write_peft(const std::string& checkpoint, const std::string& out, bool use_ema, const std::vector<std::string>& ours,
                const std::string& base);

}  // namespace

void export_peft(const std::string& checkpoint, const std::string& out, bool use_ema, bool force, const std::string& base) {
  const auto ours = check_export_target(checkpoint, out, "export", force);
  // Every value read below comes from the checkpoint's metadata.json: a type error names it.
  json_context(checkpoint + "/metadata.json", [&] { write_peft(checkpoint, out, use_ema, ours, base); });
}

namespace {

// A checkpoint's stored parameters, by name: the base's and the adapters'.
struct StoredParams {
  std::map<std::string, torch::Tensor> base, adapters;
};

// Each target's A and B (and DoRA magnitude) as PEFT stores them, appended to `tensors`; returns the
// adapted modules' HF paths without base_model.model.
std::set<std::string> add_adapters(const std::string& checkpoint, const LoraMetadata& l, ModelFamily family,
                                   const std::vector<std::string>& adaptable, const StoredParams& stored,
                                   NamedTensors& tensors) {
  const std::string root = "base_model.model.";
  const auto& lora = stored.adapters;
  std::set<std::string> adapted;
  for (const auto& w : l.targets) {
    if (std::find(adaptable.begin(), adaptable.end(), w) == adaptable.end())
      throw UserError(checkpoint + ": adapted weight " + w + " is not a linear layer of this " + to_string(family) +
                      " model. Nothing was written");
    auto a = lora.find(LoraParams::a_name(w)), b = lora.find(LoraParams::b_name(w));
    if (a == lora.end() || b == lora.end())
      throw UserError(checkpoint + ": the adapter of " + w + " is missing (params/" + LoraParams::a_name(w) + "). Nothing was written");
    auto W = stored.base.find(w);
    if (W == stored.base.end())
      throw UserError(checkpoint + ": adapted weight " + w + " is not among its parameters (params/" + w + "). Nothing was written");
    check_adapter_shapes(w, W->second, a->second, b->second, l.rank);
    const std::string mod = peft_module_path(family, w);
    const std::string peft = "export --format peft";
    tensors.emplace_back(mod + ".lora_A.weight", export_cast(a->second, torch::kFloat32, kParamsPrefix + a->first, peft).t().contiguous());  // (r, in)
    tensors.emplace_back(mod + ".lora_B.weight", export_cast(b->second, torch::kFloat32, kParamsPrefix + b->first, peft).t().contiguous());  // (out, r)
    if (l.dora) {  // (out): one per output feature, for a Conv1D layer too (PEFT's norm is of the (out, in) weight's rows)
      auto mg = lora.find(LoraParams::magnitude_name(w));
      if (mg == lora.end())
        throw UserError(checkpoint + ": a DoRA checkpoint without the magnitude of " + w + " (params/" +
                        LoraParams::magnitude_name(w) + "). Nothing was written");
      tensors.emplace_back(mod + ".lora_magnitude_vector",
                           export_cast(mg->second, torch::kFloat32, kParamsPrefix + mg->first, "export --format peft").contiguous());
    }
    adapted.insert(mod.substr(root.size()));
  }
  return adapted;
}

// target_modules: the shortest name suffixes that PEFT (which matches a module when its name equals
// a target or ends in "." + target) would resolve to exactly the adapted modules among `all`.
std::vector<std::string> peft_target_modules(const std::set<std::string>& adapted, const std::vector<std::string>& all) {
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
    if (matched == adapted) return {suffixes.begin(), suffixes.end()};
  }
  return {adapted.begin(), adapted.end()};
}

// modules_to_save: PEFT saves the whole module (every parameter, e.g. a norm's gain and bias) under
// its own name, base_model.model.<module>.<param>, and lists the module. A tied token embedding is
// also the output head; PEFT would give each of the two tied modules its own copy, so both are
// listed and both get the trained tensor; ensure_weight_tying (peft >= 0.18; older versions ignore the key)
// then makes PEFT tie the two copies again, so a merged model stays tied as ours is.
struct PeftModulesToSave {
  std::vector<std::string> modules;  // PEFT's list, without base_model.model.
  bool tied_embedding = false;       // the tied embedding is among them (ensure_weight_tying)
};

PeftModulesToSave add_modules_to_save(const LoraMetadata& l, const ModelOptions& options, const StoredParams& stored,
                                      NamedTensors& tensors) {
  const std::string root = "base_model.model.";
  const ModelFamily family = options.family;
  std::set<std::string> saved_modules;  // ours: "wte", "h.0.ln_1"
  const std::string tied_embedding =
      !options.tie_embeddings ? "" : family == ModelFamily::Gpt2 ? "wte.weight" : "model.embed_tokens.weight";
  for (const auto& p : l.modules_to_save) saved_modules.insert(p.substr(0, p.rfind('.')));
  PeftModulesToSave out;
  for (const auto& m : saved_modules) {
    for (const auto& [n, t] : stored.base) {
      if (n.rfind(m + ".", 0) != 0 || n.find('.', m.size() + 1) != std::string::npos) continue;
      for (auto& [hf, v] : to_hf(family, {{n, export_cast(t, torch::kFloat32, kParamsPrefix + n, "export --format peft")}}))
        tensors.emplace_back(root + hf, v);
      if (n == tied_embedding) tensors.emplace_back(root + "lm_head.weight", tensors.back().second);
    }
    out.modules.push_back(peft_module_path(family, m + ".weight").substr(root.size()));
    if (m + ".weight" == tied_embedding) {
      out.modules.push_back("lm_head");
      out.tied_embedding = true;
    }
  }
  return out;
}

// trainable_token_indices: PEFT saves the rows' values of the embedding under
// <module>.token_adapter.trainable_tokens_delta and lists the ids (the list form: the input
// embedding; PEFT ties a tied head to it, saving nothing for it). null when none train.
json add_token_rows(const std::string& checkpoint, const LoraMetadata& l, ModelFamily family, const StoredParams& stored,
                    NamedTensors& tensors) {
  if (l.trainable_tokens.empty()) return nullptr;
  const auto& [name, ids] = *l.trainable_tokens.begin();  // one embedding at most (LoraMetadata::from_json checks)
  auto v = stored.adapters.find(TrainableTokens::values_name(name));
  if (v == stored.adapters.end())
    throw UserError(checkpoint + ": the trainable token rows of " + name + " are missing (params/" +
                    TrainableTokens::values_name(name) + "). Nothing was written");
  tensors.emplace_back(peft_module_path(family, name) + ".token_adapter.trainable_tokens_delta",
                       export_cast(v->second, torch::kFloat32, kParamsPrefix + v->first, "export --format peft").contiguous());
  return json(ids);
}

json peft_config(const LoraMetadata& l, ModelFamily family, const std::vector<std::string>& target_modules,
                 const PeftModulesToSave& saved, const json& token_indices, const json& base_model) {
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"r", l.rank},
          {"lora_alpha", l.alpha},
          {"lora_dropout", 0.0},
          {"target_modules", target_modules},
          {"fan_in_fan_out", hf_fan_in_fan_out(family)},
          {"bias", "none"},
          {"use_rslora", l.rslora},
          {"use_dora", l.dora},
          {"modules_to_save", saved.modules.empty() ? json(nullptr) : json(saved.modules)},
          {"ensure_weight_tying", saved.tied_embedding},
          {"trainable_token_indices", token_indices},
          // PEFT's value for the init the adapters were drawn with (only used when PEFT creates new ones)
          {"init_lora_weights", l.init == LoraInit::Gaussian ? json("gaussian") : json(true)},
          {"layers_to_transform", nullptr},
          {"layers_pattern", nullptr},
          {"rank_pattern", json::object()},
          {"alpha_pattern", json::object()},
          {"inference_mode", true},
          {"revision", nullptr},
          {"base_model_name_or_path",
           base_model.is_object() && base_model.contains("name_or_path") ? base_model["name_or_path"] : json(nullptr)}};
}

void write_peft(const std::string& checkpoint, const std::string& out, bool use_ema, const std::vector<std::string>& ours,
                const std::string& base) {
  const CheckpointMeta ck = CheckpointMeta::read(checkpoint);
  if (ck.kind != StateKind::Lora || !ck.lora)
    throw UserError("export --format peft: " + checkpoint + " is a " + state_kind_name(ck.kind) +
                    " checkpoint without adapters; a PEFT adapter comes from a LoRA-phase checkpoint. For full weights "
                    "use --format hf. Nothing was written");
  const LoraMetadata& l = *ck.lora;
  // The adapters and what trained beside them; of a frozen base the checkpoint refers to, only its shapes.
  ParamTensors params = param_tensors(export_tensors(ck, use_ema, base, /*base_values=*/false));
  const StoredParams stored{{params.base.begin(), params.base.end()}, std::move(params.adapters)};
  const ModelOptions options = checkpoint_model_options(ck);
  const ModelFamily family = options.family;
  // Every weight of this model that can take an adapter, as a PEFT module path without base_model.model.
  std::vector<std::string> all, adaptable;
  {
    CausalLM model = make_model(options);
    adaptable = adaptable_weights(*model);
  }
  const std::string root = "base_model.model.";
  for (const auto& w : adaptable) all.push_back(peft_module_path(family, w).substr(root.size()));
  if (l.targets.empty()) throw UserError(checkpoint + ": its lora metadata lists no adapted weights. Nothing was written");
  NamedTensors tensors;
  const std::set<std::string> adapted = add_adapters(checkpoint, l, family, adaptable, stored, tensors);
  const PeftModulesToSave saved = add_modules_to_save(l, options, stored, tensors);
  const json token_indices = add_token_rows(checkpoint, l, family, stored, tensors);
  const json config = peft_config(l, family, peft_target_modules(adapted, all), saved, token_indices,
                                  ck.base_model);
  publish_dir(out, [&](const fs::path& dir) {
    write_safetensors((dir / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
    write_file_atomic((dir / "adapter_config.json").string(), config.dump(2) + "\n");
    write_export_marker(dir, checkpoint, "peft");
  }, "", ours, export_owner(checkpoint));
  std::printf("exported %s -> %s (PEFT LoRA adapter: %zu adapted modules, r %lld, lora_alpha %g, scaling %s = %g, "
              "fan_in_fan_out %s%s%s%s%s%s; base %s)\n", checkpoint.c_str(), out.c_str(), adapted.size(), (long long)l.rank,
              l.alpha, l.rslora ? "alpha/sqrt(r)" : "alpha/r", lora_scale(l.alpha, l.rank, l.rslora),
              hf_fan_in_fan_out(family) ? "true" : "false", l.dora ? "; use_dora, a lora_magnitude_vector per module" : "",
              saved.modules.empty() ? "" : "; modules_to_save ", join(saved.modules).c_str(),
              token_indices.is_null() ? "" : "; trainable_token_indices ",
              token_indices.is_null() ? "" : token_indices.dump().c_str(),
              config["base_model_name_or_path"].is_string() ? config["base_model_name_or_path"].get<std::string>().c_str()
                                                            : "unknown: set base_model_name_or_path in adapter_config.json");
}

}  // namespace

}  // namespace lt
