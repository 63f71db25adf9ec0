#include "lora_trainer/formats/export.hpp"

#include "lora_trainer/kernels/nf4.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <tuple>

#include "lora_trainer/formats/adapter_source.hpp"
#include "lora_trainer/core/config.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/frozen_base.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

using json = nlohmann::json;

void write_export_marker(const fs::path& dir, const std::string& checkpoint, const std::string& format) {
  const nlohmann::json m = {{"exported_from", fs::absolute(checkpoint).string()}, {"format", format}, {"by", "lora_trainer export"}};
  write_file_atomic((dir / kExportMarker).string(), m.dump(2) + "\n");
}

WriteOwner export_owner(const std::string& checkpoint) { return {"export", "export", fs::absolute(checkpoint).string()}; }

namespace {

// The files an export of `format` made before exports recorded theirs (its marker's "format"): fixed
// names only. A sharded export's shards and index cannot be told from files of the same names put there
// by somebody else, so they are not among them.
std::vector<std::string> legacy_export_files(const std::string& format) {
  if (format == "hf") return {"model.safetensors", "config.json", kExportMarker};
  if (format == "peft") return {"adapter_model.safetensors", "adapter_config.json", kExportMarker};
  if (format == "gguf") return {"model.gguf", kExportMarker};
  if (format == "gguf-adapter") return {"adapter.gguf", kExportMarker};
  return {kExportMarker};
}

}  // namespace

// An export writes only where nothing of anyone else's is lost: a new or empty directory, or an
// earlier export or import of ours (whose own files it replaces, saying so, keeping any other file);
// a directory of anyone else's only with --force; never the source itself or a directory holding it.
std::vector<std::string> check_export_target(const std::string& source, const std::string& out, const std::string& verb,
                                             bool force) {
  const fs::path src = fs::weakly_canonical(source), dst = fs::weakly_canonical(out);
  auto within = [](const fs::path& inner, const fs::path& outer) {
    auto rel = inner.lexically_relative(outer);
    return !rel.empty() && *rel.begin() != "..";
  };
  const std::string what = verb == "import-hf" ? "the model being imported" : "the checkpoint being exported";
  const char* clash = dst == src            ? " is "
                      : within(dst, src) ? " is inside "
                      : within(src, dst) ? " holds "
                                         : nullptr;
  if (clash) throw UserError(verb + ": OUT " + out + clash + what + " (" + source + "); give a new directory. Nothing was written");
  recover_interrupted_writes(dst.string());  // an earlier write killed mid-replace: OUT as it was before
  if (!fs::exists(dst)) return {};
  if (!fs::is_directory(dst)) throw UserError(verb + ": OUT " + out + " exists and is not a directory; give a directory. Nothing was written");
  if (fs::is_empty(dst)) return {};
  std::string earlier, earlier_kind = "export";  // what OUT holds, not what this command makes
  std::vector<std::string> legacy;               // its files, when it has no record
  const std::optional<WriteRecord> record = read_write_record(dst.string());
  if (record && record->kind == "export") {
    earlier = record->of.empty() ? "?" : record->of;
    if (record->by == "import-hf") earlier_kind = "import";
  } else if (!record) {
    json_context((dst / "metadata.json").string(), [&] {
      if (is_checkpoint(dst.string())) {
        const CheckpointMeta m = CheckpointMeta::read(dst.string());
        if (m.weights_only && m.exported_from) earlier = *m.exported_from;
        if (m.weights_only && m.imported_from) {
          earlier = *m.imported_from;
          earlier_kind = "import";
        }
        if (!earlier.empty()) legacy = {"metadata.json", "state.h5"};
      } else if (fs::exists(dst / kExportMarker)) {
        json marker = read_json_file((dst / kExportMarker).string());
        const bool object = marker.is_object();
        earlier = object && marker.contains("exported_from") && marker["exported_from"].is_string()
                      ? marker["exported_from"].get<std::string>()
                      : "?";
        legacy = legacy_export_files(object && marker.value("format", json()).is_string() ? marker["format"].get<std::string>() : "");
      }
    });
  }
  if (!earlier.empty()) {
    std::printf("%s: replacing the earlier %s at %s (of %s); other files there are kept\n", verb.c_str(),
                earlier_kind.c_str(), out.c_str(), earlier.c_str());
    if (!record) {
      std::vector<std::string> unproven;  // what the older export may have written, or somebody else
      for (const auto& e : fs::directory_iterator(dst)) {
        const std::string n = e.path().filename().string();
        if (is_hf_shard_name(n) || n == "model.safetensors.index.json") unproven.push_back(n);
      }
      if (!unproven.empty())
        note_once(dst.string(), out + " was written by an older lora_trainer, which kept no list of its files: " +
                  join(unproven) + " may be that export's or yours, so they are kept; delete them if they are the old export's");
    }
    return legacy;
  }
  if (force) {
    std::printf("%s: writing into %s (--force): files of the same names are replaced, others kept\n", verb.c_str(), out.c_str());
    return {};
  }
  throw UserError(verb + ": OUT " + out + " already exists and is not an earlier export or import of lora_trainer (it "
                  "holds files of its own); give a new or empty directory, or --force to write into it (files of the "
                  "names this command writes are then replaced, every other file is kept). Nothing was written");
}

ModelOptions checkpoint_model_options(const CheckpointMeta& ck) {
  const std::string& checkpoint = ck.dir;
  const json& c = ck.config;
  if (!c.contains("architecture") || !c["architecture"].is_object())
    throw UserError(checkpoint + ": its metadata has no saved config with architecture/*");
  Config cfg = model_config();
  cfg.merge_json({{"architecture", c["architecture"]}}, checkpoint + "/metadata.json");
  return ModelOptions::from_config(cfg);
}

std::string read_referenced_base(const CheckpointMeta& ck, const std::string& base,
                                 const TakeTensor& take, Take how) {
  const FrozenBaseRef ref = ck.frozen_base ? *ck.frozen_base : FrozenBaseRef::from_json(json(), ck.dir);  // names the field
  const ModelOptions options = checkpoint_model_options(ck);
  CausalLM model = make_model(options);  // the parameters' names and shapes (allocated, never touched)
  return read_frozen_base(ref, ck.dir, base, options.family, base_params(*model), take, how);
}

namespace {

// A QLoRA checkpoint's NF4 weights (any quantizing storage's: lora.quantize_base) as the values its
// products used, dequant(quant(W)) in bf16: from its nf4/<name>.* (<storage>/<name>.*) when it copies
// its base, else quantized again from the referenced base's values (`all` holds them as params/<name>);
// with `base_values` false only their shapes. The storage makes W as for a product (frozen_values), from
// a template of the recorded shape its fields are loaded into, as a restore loads them.
void dequantize_base(const CheckpointMeta& ck, NamedTensors& all, bool base_values) {
  if (!ck.lora || ck.lora->quantized.empty()) return;
  const FrozenFormat format = ck.lora->quantize_base;  // a quantizing one (LoraMetadata::from_json)
  const std::string prefix = frozen_storage(format).state_prefix();  // nf4/
  std::map<std::string, torch::Tensor> stored_fields;
  for (const auto& [n, t] : all)
    if (n.rfind(prefix, 0) == 0) stored_fields[n.substr(prefix.size())] = t;
  all.erase(std::remove_if(all.begin(), all.end(), [&](const auto& t) { return t.first.rfind(prefix, 0) == 0; }), all.end());
  std::map<std::string, torch::Tensor*> params;
  for (auto& [n, t] : all)
    if (n.rfind(kParamsPrefix, 0) == 0) params[n.substr(kParamsPrefix.size())] = &t;
  torch::NoGradGuard ng;
  for (const auto& [name, shape] : ck.lora->quantized) {
    auto stored = params.find(name);
    if (!base_values) {
      if (stored == params.end()) all.emplace_back(kParamsPrefix + name, torch::empty(shape, torch::kBFloat16));
      continue;
    }
    if (stored != params.end()) {  // the referenced base's values
      if (stored->second->sizes().vec() != shape)
        throw UserError(ck.dir + "/metadata.json: lora.quantized gives " + name + " the shape " + shape_text(shape) +
                        ", its frozen base holds it as " + shape_text(stored->second->sizes().vec()) +
                        "; the checkpoint is damaged or hand-edited. " + use_another_checkpoint(ck.job_name));
      *stored->second = frozen_values(*frozen_storage(format).make(stored->second->to(torch::kBFloat16)));
      continue;
    }
    // The stored fields loaded into a template storage of the recorded shape, each of its size and dtype.
    const auto storage = frozen_storage(format).make(frozen_stand_in(shape, torch::kCPU));
    for (auto& [f, t] : storage->state()) {
      auto it = stored_fields.find(name + "." + f);
      if (it == stored_fields.end())
        throw UserError(ck.dir + ": its metadata lists " + name + " as stored in " + frozen_storage(format).shown() +
                        " (lora.quantized) but it holds no " + prefix + name + "." + f + "; is the checkpoint complete? " +
                        use_another_checkpoint(ck.job_name));
      if (it->second.sizes() != t.sizes() || it->second.scalar_type() != t.scalar_type())
        throw UserError(ck.dir + ": the " + frozen_storage(format).shown() + " storage of " + name + " (" + prefix + name + "." + f +
                        ") does not fit its shape " + shape_text(shape) + " in lora.quantized; the checkpoint is damaged. " +
                        use_another_checkpoint(ck.job_name));
      t.copy_(it->second);
    }
    all.emplace_back(kParamsPrefix + name, frozen_values(*storage));
  }
}

}  // namespace

NamedTensors export_tensors(const CheckpointMeta& ck, bool use_ema, const std::string& base, bool base_values) {
  const std::string& checkpoint = ck.dir;
  NamedTensors all = read_checkpoint_tensors(ck);
  if (ck.frozen_base) {
    if (base_values) {
      read_referenced_base(
          ck, base,
          [&](const std::string& n, const torch::Tensor& t) -> std::optional<uint32_t> {
            all.emplace_back(kParamsPrefix + n, t);
            return std::nullopt;
          },
          Take::Keeps);
    } else {
      for (const auto& [n, shape] : ck.frozen_base->tensors) all.emplace_back(kParamsPrefix + n, torch::empty(shape, torch::kBFloat16));
    }
  }
  if (ck.frozen_base || (ck.lora && !ck.lora->quantized.empty())) {
    dequantize_base(ck, all, base_values);
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  if (!use_ema) return all;
  std::map<std::string, torch::Tensor> ema;
  for (auto& [n, t] : all)
    if (n.rfind(kEmaPrefix, 0) == 0) ema[n.substr(kEmaPrefix.size())] = t;
  if (ema.empty())
    throw UserError("export --ema: " + checkpoint + " holds no moving average (its run had optimization/ema/decay 0). "
                    "Nothing was written");
  for (auto& [n, t] : all) {
    const size_t slash = n.find('/');
    if (slash == std::string::npos || n.rfind(kEmaPrefix, 0) == 0) continue;
    auto it = ema.find(n.substr(slash + 1));
    if (it != ema.end() && n.rfind(kParamsPrefix, 0) == 0) t = it->second;
  }
  return all;
}

torch::ScalarType base_dtype(const NamedTensors& base) {
  std::map<torch::ScalarType, int64_t> elements;
  for (const auto& [n, t] : base) elements[t.scalar_type()] += t.numel();
  torch::ScalarType most = torch::kFloat32;
  int64_t seen = -1;
  for (const auto& [dtype, count] : elements)
    if (count > seen) std::tie(most, seen) = std::make_pair(dtype, count);
  return most;
}

torch::Tensor export_cast(const torch::Tensor& t, torch::ScalarType dtype, const std::string& name, const std::string& command) {
  torch::Tensor out = t.to(dtype);
  if (!c10::isFloatingType(dtype) || torch::isfinite(out).all().item<bool>()) return out;
  const torch::Tensor f = t.to(torch::kFloat32);
  const torch::Tensor finite = torch::isfinite(f);
  if (!finite.all().item<bool>())
    throw UserError(command + ": " + name + " holds " + std::to_string((~finite).sum().item<int64_t>()) +
                    " values that are not finite (inf or NaN): the checkpoint's weights are not (a diverged run, or a "
                    "damaged file; `lora_trainer inspect --verify` checks its data); export an earlier checkpoint. "
                    "Nothing was written");
  const double limit = dtype == torch::kFloat16 ? 65504.0 : dtype == torch::kBFloat16 ? 3.3895313892515355e38 : 3.4028234663852886e38;
  const std::string named = dtype_name(dtype);
  char figures[160];
  std::snprintf(figures, sizeof figures, "values up to %.6g in magnitude, past %s's largest, %.6g", f.abs().max().item<double>(),
                named.c_str(), limit);
  throw UserError(command + ": " + name + " holds " + figures + ": written as " + named + " they would be inf. Write "
                  "it in a dtype that holds them (" + (dtype == torch::kFloat16 ? "--dtype bfloat16 or float32" : "--dtype float32") +
                  "). Nothing was written");
}

std::vector<std::string> dtype_option_names(const std::vector<torch::ScalarType>& allowed) {
  std::vector<std::string> names = {"source"};
  for (torch::ScalarType t : allowed) names.push_back(dtype_name(t));
  return names;
}

torch::ScalarType parse_dtype_option(const std::string& name, const std::vector<torch::ScalarType>& allowed,
                                     const std::string& command) {
  if (name == "source") return c10::ScalarType::Undefined;
  for (torch::ScalarType t : allowed)
    if (name == dtype_name(t)) return t;
  const std::vector<std::string> names = dtype_option_names(allowed);
  throw UserError(command + " --dtype " + name + ": expected " +
                  join(std::vector<std::string>(names.begin(), names.end() - 1)) + " or " + names.back() +
                  ". Nothing was written");
}

MergedWeights merged_weights(const std::string& checkpoint, bool use_ema, const std::string& base, torch::ScalarType dtype,
                             const std::string& command) {
  MergedWeights m;
  const CheckpointMeta ck = CheckpointMeta::read(checkpoint);
  m.ck = ck;
  ParamTensors stored = param_tensors(export_tensors(ck, use_ema, base));
  const std::map<std::string, torch::Tensor>& lora = stored.adapters;
  if (stored.base.empty()) throw UserError(checkpoint + " holds no parameters (params/*)");
  if (!lora.empty() && !ck.lora) throw UserError(checkpoint + ": adapters without lora metadata (rank, alpha)");
  m.dtype = dtype == c10::ScalarType::Undefined ? base_dtype(stored.base) : dtype;
  const LoraMetadata none;
  const LoraMetadata& l = ck.lora ? *ck.lora : none;
  for (const auto& [name, ids] : l.trainable_tokens)
    if (std::none_of(stored.base.begin(), stored.base.end(), [&](const auto& np) { return np.first == name; }) ||
        !lora.count(TrainableTokens::values_name(name)))
      throw UserError(checkpoint + ": its metadata lists trainable token rows of " + name + " but it holds no " + kParamsPrefix +
                      (lora.count(TrainableTokens::values_name(name)) ? name : TrainableTokens::values_name(name)));
  for (auto& [n, stored_t] : stored.base) {
    torch::Tensor t = stored_t.to(torch::kFloat32);
    stored_t = torch::Tensor();  // the stored copy goes as its merged form comes: one f32 tensor at a time
    auto a = lora.find(LoraParams::a_name(n)), b = lora.find(LoraParams::b_name(n));
    if (a != lora.end() && b != lora.end()) {
      torch::Tensor magnitude;
      if (l.dora) {
        auto mg = lora.find(LoraParams::magnitude_name(n));
        if (mg == lora.end())
          throw UserError(checkpoint + ": its metadata says DoRA (lora.dora) but it holds no " + kParamsPrefix +
                          LoraParams::magnitude_name(n) + "; is the checkpoint complete?");
        magnitude = mg->second;
      }
      check_adapter_shapes(n, t, a->second, b->second, l.rank);  // named here: the merge knows no names
      t = merge_lora_params(t, a->second, b->second, l.alpha, l.rank, l.rslora, magnitude);
      ++m.merged;
    }
    auto rows = l.trainable_tokens.find(n);
    if (rows != l.trainable_tokens.end()) {
      t = replace_token_rows(t, rows->second, lora.at(TrainableTokens::values_name(n)));
      m.token_rows += static_cast<int64_t>(rows->second.size());
    }
    m.params.emplace_back(n, export_cast(t, m.dtype, kParamsPrefix + n, command));  // rounded once, after the merge
  }
  return m;
}

void export_merged(const std::string& checkpoint, const std::string& out, bool use_ema, bool force,
                   const std::string& base) {
  const auto ours = check_export_target(checkpoint, out, "export", force);
  MergedWeights m = merged_weights(checkpoint, use_ema, base);
  const CheckpointMeta& ck = m.ck;
  NamedTensors params;
  for (auto& [n, t] : m.params) params.emplace_back(kParamsPrefix + n, t);
  const int merged = m.merged;
  json out_meta = {{"kind", state_kind_name(StateKind::Plain)},
                   {"weights_only", true},
                   {"step", ck.step},
                   {"tokens", ck.tokens},
                   {"exported_from", fs::absolute(checkpoint).string()},
                   {"merged_adapters", merged},
                   {"job", ck.job ? ck.job->to_json() : json::object()},
                   {"config", ck.config}};
  if (!ck.base_model.is_null()) out_meta["base_model"] = ck.base_model;
  if (!ck.tokenizer.empty()) out_meta["tokenizer"] = ck.tokenizer;  // what its weights read text with
  if (!ck.chat.is_null()) out_meta["chat"] = ck.chat;                 // and the chat template they were trained on
  save_checkpoint(out, params, out_meta, ours);
  std::printf("exported %s -> %s (%zu tensors, %d adapters merged%s, float32)\n", checkpoint.c_str(), out.c_str(),
              params.size(), merged,
              m.token_rows ? (", " + std::to_string(m.token_rows) + " trainable token rows replaced").c_str() : "");
}

}  // namespace lt
