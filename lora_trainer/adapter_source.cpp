#include "lora_trainer/adapter_source.hpp"

#include <filesystem>
#include <map>
#include <set>

#include "lora_trainer/checkpoint.hpp"
#include "lora_trainer/hf_families.hpp"
#include "lora_trainer/safetensors.hpp"
#include "lora_trainer/util.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

namespace {

const char* kKey = "optimization/lora/init_from";

// The source's adapted weights (our names for a checkpoint, PEFT module paths for PEFT) that this job
// does not adapt, or the job's that the source lacks: one error listing both.
void check_same_targets(const std::string& path, const std::vector<std::string>& missing,
                        const std::vector<std::string>& extra) {
  if (missing.empty() && extra.empty()) return;
  std::string msg = std::string(kKey) + ": " + path + " does not adapt the weights this job adapts";
  if (!missing.empty()) msg += "; it has no adapter for " + join(missing);
  if (!extra.empty()) msg += "; it adapts " + join(extra) + ", which this job does not";
  throw UserError(msg + ". Set optimization/lora/target_modules to the source's targets");
}

void add(AdapterSource& s, const std::string& w, torch::Tensor A, torch::Tensor B, const std::string& where) {
  if (A.dim() != 2 || B.dim() != 2 || A.size(1) != s.rank || B.size(0) != s.rank)
    throw UserError(std::string(kKey) + ": " + where + ": the adapter of " + w + " has shapes A " + shape_text(A.sizes().vec()) +
                    ", B " + shape_text(B.sizes().vec()) + ", not rank " + std::to_string(s.rank));
  s.adapters.names.push_back(w);
  s.adapters.A.push_back(A.to(torch::kFloat32).contiguous());
  s.adapters.B.push_back(B.to(torch::kFloat32).contiguous());
}

// A DoRA source's magnitude of `w`, (out) as B's columns: `found` is false when the source has none.
void add_magnitude(AdapterSource& s, const std::string& w, bool found, const torch::Tensor& m, const std::string& key,
                   const std::string& where) {
  if (!found)
    throw UserError(std::string(kKey) + ": " + where + " is a DoRA adapter but holds no " + key + "; is it complete?");
  const int64_t out = s.adapters.B.back().size(1);
  if (m.dim() != 1 || m.size(0) != out)
    throw UserError(std::string(kKey) + ": " + where + ": the DoRA magnitude of " + w + " (" + key + ") has shape " +
                    shape_text(m.sizes().vec()) + ", not (" + std::to_string(out) + "), one per output feature");
  s.adapters.magnitude.push_back(m.to(torch::kFloat32).contiguous());
}

AdapterSource from_checkpoint(const std::string& path, const std::vector<std::string>& targets) {
  const json meta = read_checkpoint_metadata(path);
  if (meta.value("kind", std::string()) != "lora" || !meta.contains("lora"))
    throw UserError(std::string(kKey) + ": " + path + " is a " + meta.value("kind", std::string("?")) +
                    " checkpoint; adapters come from a LoRA-phase checkpoint (kind lora) or a PEFT adapter directory");
  AdapterSource s;
  s.format = "checkpoint";
  s.rank = meta["lora"].value("rank", int64_t{0});
  s.alpha = meta["lora"].value("alpha", 0.0);
  s.rslora = meta["lora"].value("rslora", false);
  s.dora = meta["lora"].value("dora", false);
  s.modules_to_save = meta["lora"].value("modules_to_save", std::vector<std::string>());
  const auto theirs = meta["lora"].value("targets", std::vector<std::string>());
  std::vector<std::string> missing, extra;
  for (const auto& w : targets)
    if (std::find(theirs.begin(), theirs.end(), w) == theirs.end()) missing.push_back(w);
  for (const auto& w : theirs)
    if (std::find(targets.begin(), targets.end(), w) == targets.end()) extra.push_back(w);
  check_same_targets(path, missing, extra);
  std::map<std::string, torch::Tensor> lora;
  for (auto& [n, t] : read_checkpoint_tensors(path))
    if (n.rfind(kLoraPrefix, 0) == 0) lora[n.substr(kLoraPrefix.size())] = t;
  for (const auto& w : targets) {
    auto a = lora.find(LoraParams::a_name(w)), b = lora.find(LoraParams::b_name(w));
    if (a == lora.end() || b == lora.end())
      throw UserError(std::string(kKey) + ": " + path + " lists " + w + " as adapted but holds no " + kLoraPrefix +
                      LoraParams::a_name(w) + "; is the checkpoint complete?");
    add(s, w, a->second, b->second, path);
    if (!s.dora) continue;
    auto m = lora.find(LoraParams::magnitude_name(w));
    add_magnitude(s, w, m != lora.end(), m != lora.end() ? m->second : torch::Tensor(),
                  kLoraPrefix + LoraParams::magnitude_name(w), path);
  }
  const json token_rows = meta["lora"].value("trainable_tokens", json::object());
  for (auto& [name, ids] : token_rows.items()) {
    auto v = lora.find(TrainableTokens::values_name(name));
    if (v == lora.end())
      throw UserError(std::string(kKey) + ": " + path + " lists trainable token rows of " + name + " but holds no " +
                      kLoraPrefix + TrainableTokens::values_name(name) + "; is the checkpoint complete?");
    s.tokens = {name, ids.get<std::vector<int64_t>>(), v->second.to(torch::kFloat32).contiguous()};
  }
  return s;
}

AdapterSource from_peft(const std::string& path, ModelFamily family, const std::vector<std::string>& targets,
                        const std::string& token_embedding) {
  const std::string config_path = (fs::path(path) / "adapter_config.json").string();
  const json c = read_json_file(config_path);
  if (c.value("peft_type", std::string()) != "LORA")
    throw UserError(std::string(kKey) + ": " + config_path + ": peft_type " + c.value("peft_type", std::string("?")) +
                    ", not LORA");
  AdapterSource s;
  s.format = "peft";
  s.rank = c.value("r", int64_t{0});
  s.alpha = c.value("lora_alpha", 0.0);
  s.rslora = c.value("use_rslora", false);
  s.dora = c.value("use_dora", false);
  if (c.contains("modules_to_save") && c["modules_to_save"].is_array())
    s.modules_to_save = c["modules_to_save"].get<std::vector<std::string>>();
  const std::string file = (fs::path(path) / "adapter_model.safetensors").string();
  std::map<std::string, torch::Tensor> by_key;
  for (auto& [k, t] : read_safetensors(file)) by_key[k] = t;
  std::set<std::string> theirs;  // PEFT module paths with a lora_A
  for (const auto& [k, t] : by_key)
    if (ends_with(k, ".lora_A.weight")) theirs.insert(k.substr(0, k.size() - std::string(".lora_A.weight").size()));
  std::vector<std::string> missing, extra;
  std::set<std::string> ours;
  for (const auto& w : targets) {
    const std::string mod = peft_module_path(family, w);
    ours.insert(mod);
    if (!theirs.count(mod)) missing.push_back(w + " (" + mod + ".lora_A.weight)");
  }
  for (const auto& m : theirs)
    if (!ours.count(m)) extra.push_back(m);
  check_same_targets(file, missing, extra);
  for (const auto& w : targets) {
    const std::string mod = peft_module_path(family, w);
    auto b = by_key.find(mod + ".lora_B.weight");
    if (b == by_key.end()) throw UserError(std::string(kKey) + ": " + file + " has " + mod + ".lora_A.weight but no .lora_B.weight");
    add(s, w, by_key.at(mod + ".lora_A.weight").t(), b->second.t(), file);  // (r, in) -> (in, r); (out, r) -> (r, out)
    if (!s.dora) continue;
    auto m = by_key.find(mod + ".lora_magnitude_vector");  // (out), for a Conv1D layer too
    add_magnitude(s, w, m != by_key.end(), m != by_key.end() ? m->second : torch::Tensor(), mod + ".lora_magnitude_vector", file);
  }
  // trainable_token_indices: a list (the input embedding) or {module: ids}; the rows' values under
  // <module>.token_adapter.trainable_tokens_delta (a tied head's copy is not saved).
  const std::string delta_suffix = ".token_adapter.trainable_tokens_delta";
  for (const auto& [k, t] : by_key) {
    if (!ends_with(k, delta_suffix)) continue;
    if (s.tokens.defined())
      throw UserError(std::string(kKey) + ": " + file + " trains token rows of more than one module; only the token "
                      "embedding's are supported");
    const std::string mod = k.substr(0, k.size() - delta_suffix.size());
    const json& ids = c.value("trainable_token_indices", json());
    if (!(ids.is_array() || (ids.is_object() && ids.size() == 1)))
      throw UserError(std::string(kKey) + ": " + config_path + ": trainable_token_indices " + ids.dump() +
                      " does not give the ids of the rows in " + k);
    const bool ours = peft_module_path(family, token_embedding) == mod;
    s.tokens = {ours ? token_embedding : mod.substr(std::string("base_model.model.").size()),
                (ids.is_array() ? ids : ids.begin().value()).get<std::vector<int64_t>>(), t.to(torch::kFloat32).contiguous()};
  }
  return s;
}

}  // namespace

AdapterSource read_adapter_source(const std::string& path, ModelFamily family, const std::vector<std::string>& targets,
                                  int64_t rank, double alpha, bool rslora, bool dora, const std::string& token_embedding,
                                  const std::vector<int64_t>& token_ids) {
  if (!fs::is_directory(path))
    throw UserError(std::string(kKey) + ": " + path + " is not a directory (give a LoRA checkpoint or a PEFT adapter directory)");
  AdapterSource s;
  if (is_checkpoint(path)) s = from_checkpoint(path, targets);
  else if (fs::exists(fs::path(path) / "adapter_config.json")) s = from_peft(path, family, targets, token_embedding);
  else
    throw UserError(std::string(kKey) + ": " + path + " is neither one of our checkpoints (metadata.json) nor a PEFT adapter " +
                    "directory (adapter_config.json)");
  s.path = path;
  char theirs[96], ours[96];
  std::snprintf(theirs, sizeof theirs, "rank %lld, alpha %g%s (scale %g)", (long long)s.rank, s.alpha,
                s.rslora ? ", rsLoRA" : "", lora_scale(s.alpha, std::max<int64_t>(1, s.rank), s.rslora));
  std::snprintf(ours, sizeof ours, "rank %lld, alpha %g%s (scale %g)", (long long)rank, alpha, rslora ? ", rsLoRA" : "",
                lora_scale(alpha, rank, rslora));
  if (s.rank != rank)
    throw UserError(std::string(kKey) + ": " + path + " holds adapters of " + theirs + "; this job has " + ours +
                    ". Set optimization/lora/rank=" + std::to_string(s.rank));
  if (lora_scale(s.alpha, s.rank, s.rslora) != lora_scale(alpha, rank, rslora))
    throw UserError(std::string(kKey) + ": " + path + " holds adapters of " + theirs + "; this job has " + ours +
                    ": they would compute another function. Set optimization/lora/alpha and optimization/lora/rslora "
                    "as the source's");
  if (s.dora != dora)
    throw UserError(std::string(kKey) + ": " + path + (s.dora ? " holds DoRA adapters (a magnitude per output feature)"
                                                            : " holds plain LoRA adapters, without DoRA's magnitudes") +
                    "; this job has optimization/lora/dora=" + (dora ? "true" : "false") + ". Set it as the source's");
  auto rows = [](const std::string& name, const std::vector<int64_t>& ids) {
    return ids.empty() ? std::string("none") : json{{name, ids}}.dump();
  };
  const std::string theirs_rows = rows(s.tokens.name, s.tokens.ids), ours_rows = rows(token_embedding, token_ids);
  if (theirs_rows != ours_rows)
    throw UserError(std::string(kKey) + ": " + path + " trained the token rows " + theirs_rows + "; this job's " +
                    "optimization/lora/trainable_token_indices selects " + ours_rows + ". Set it as the source had it");
  if (s.tokens.defined() && (s.tokens.values.dim() != 2 || s.tokens.values.size(0) != static_cast<int64_t>(token_ids.size())))
    throw UserError(std::string(kKey) + ": " + path + ": the trainable token rows have shape " +
                    shape_text(s.tokens.values.sizes().vec()) + " for " + std::to_string(token_ids.size()) + " ids");
  return s;
}

}  // namespace lt
