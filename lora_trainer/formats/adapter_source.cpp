#include "lora_trainer/formats/adapter_source.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/core/util.hpp"

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

// One adapter of the source, ours A (in, r) and B (r, out), named in messages by the source's own keys
// and shapes: a tensor stored transposed is told apart from adapters of another rank than the stated one.
void add(AdapterSource& s, const std::string& w, torch::Tensor A, torch::Tensor B, const std::string& where,
         const std::string& a_key, const std::string& b_key) {
  const std::string rank_key = s.format == AdapterSource::Format::Peft ? "r in adapter_config.json" : "lora.rank in its metadata.json";
  const std::string head = std::string(kKey) + ": " + where + ": the adapter of " + w + ": ";
  const std::string tail = ". Give an adapter written whole by one run";
  const int64_t r = s.rank;
  for (const auto& [key, t] : {std::pair<std::string, const torch::Tensor*>{a_key, &A}, {b_key, &B}})
    if (t->dim() != 2)
      throw UserError(head + key + " has shape " + shape_text(s.stored_shape(*t)) + "; an adapter's tensors have two dimensions" + tail);
  // The rank is A's second dimension and B's first (ours); a tensor with r in the other place only is transposed.
  for (const auto& [key, t, rank_dim] : {std::tuple<std::string, const torch::Tensor*, int>{a_key, &A, 1}, {b_key, &B, 0}})
    if (t->size(rank_dim) != r && t->size(1 - rank_dim) == r)
      throw UserError(head + key + " has shape " + shape_text(s.stored_shape(*t)) + ", expected " +
                      shape_text(s.stored_shape(t->t())) + ": it is stored transposed" + tail);
  if (A.size(1) != r || B.size(0) != r)
    throw UserError(head + a_key + " has shape " + shape_text(s.stored_shape(A)) + " and " + b_key + " " +
                    shape_text(s.stored_shape(B)) + ", not those of rank " + std::to_string(r) + " (" + rank_key +
                    "): the source contradicts itself" + tail);
  s.adapters.names.push_back(w);
  s.keys.emplace_back(a_key, b_key);
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
  const CheckpointMeta ck = CheckpointMeta::read(path);
  if (ck.kind != StateKind::Lora || !ck.lora)
    throw UserError(std::string(kKey) + ": " + path + " is a " + state_kind_name(ck.kind) +
                    " checkpoint; adapters come from a LoRA-phase checkpoint (kind lora) or a PEFT adapter directory");
  const LoraMetadata& l = *ck.lora;
  AdapterSource s;
  s.format = AdapterSource::Format::Checkpoint;
  s.rank = l.rank;
  s.alpha = l.alpha;
  s.rslora = l.rslora;
  s.dora = l.dora;
  s.modules_to_save = l.modules_to_save;
  const std::vector<std::string>& theirs = l.targets;
  std::vector<std::string> missing, extra;
  for (const auto& w : targets)
    if (std::find(theirs.begin(), theirs.end(), w) == theirs.end()) missing.push_back(w);
  for (const auto& w : theirs)
    if (std::find(targets.begin(), targets.end(), w) == targets.end()) extra.push_back(w);
  check_same_targets(path, missing, extra);
  const std::map<std::string, torch::Tensor> lora = param_tensors(read_checkpoint_tensors(ck)).adapters;
  for (const auto& w : targets) {
    auto a = lora.find(LoraParams::a_name(w)), b = lora.find(LoraParams::b_name(w));
    if (a == lora.end() || b == lora.end())
      throw UserError(std::string(kKey) + ": " + path + " lists " + w + " as adapted but holds no " + kParamsPrefix +
                      LoraParams::a_name(w) + "; is the checkpoint complete?");
    add(s, w, a->second, b->second, path, kParamsPrefix + a->first, kParamsPrefix + b->first);
    if (!s.dora) continue;
    auto m = lora.find(LoraParams::magnitude_name(w));
    add_magnitude(s, w, m != lora.end(), m != lora.end() ? m->second : torch::Tensor(),
                  kParamsPrefix + LoraParams::magnitude_name(w), path);
  }
  for (const auto& [name, ids] : l.trainable_tokens) {
    auto v = lora.find(TrainableTokens::values_name(name));
    if (v == lora.end())
      throw UserError(std::string(kKey) + ": " + path + " lists trainable token rows of " + name + " but holds no " +
                      kParamsPrefix + TrainableTokens::values_name(name) + "; is the checkpoint complete?");
    s.tokens = {name, ids, v->second.to(torch::kFloat32).contiguous()};
  }
  return s;
}

// adapter_config.json holds every field of PEFT's LoraConfig (peft/tuners/lora/config.py, checked at
// 0.20.1.dev0), most at their defaults. Each field that changes what the adapter computes, or how it
// trains on, and that this trainer does not implement is refused by name unless it is at its
// default: loading such an adapter as plain LoRA would compute another function without a word.
// Fields that only describe the source (its base model, its task, which modules it chose) are
// harmless whatever their value; the ones read (r, lora_alpha, use_rslora, use_dora,
// trainable_token_indices, modules_to_save) are checked where they are read. A field PEFT adds later
// is refused unless it is empty (null, false, 0, "", [], {}).
bool empty_value(const json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_number() && v.get<double>() == 0) ||
         (v.is_string() && v.get<std::string>().empty()) || ((v.is_array() || v.is_object()) && v.empty());
}

void check_peft_fields(const std::string& config_path, const json& c) {
  static const std::set<std::string> harmless = {
      "base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping", "peft_version",
      "peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "lora_dropout", "fan_in_fan_out", "target_modules",
      "exclude_modules", "modules_to_save", "trainable_token_indices", "ensure_weight_tying", "megatron_core",
      "runtime_config", "qalora_group_size",
      // Parameters of initialisations: what init_lora_weights names decides (PEFT keeps them when it
      // converts a PiSSA/CorDA/OLoRA adapter into a plain one and sets init_lora_weights to true).
      "eva_config", "corda_config", "loftq_config", "lora_ga_config"};
  // What each refused field does in PEFT, to say why it cannot be ignored, and its values that do
  // nothing (PEFT's default first; a falsy value where PEFT tests the field's truth).
  struct Refused {
    std::string why;
    std::vector<json> defaults;
  };
  const json null;
  static const std::map<std::string, Refused> refused = {
      {"alpha_pattern", {"gives some modules another lora_alpha, so another scale", {json::object(), null}}},
      {"rank_pattern", {"gives some modules another rank", {json::object(), null}}},
      {"layers_to_transform", {"restricts the adapters to some layers", {null}}},
      {"layers_pattern", {"names the layers that layers_to_transform selects", {null, "", json::array()}}},
      {"bias", {"trains the base layers' biases too, saved beside the adapters", {"none"}}},
      {"lora_bias", {"gives every lora_B a bias", {false}}},
      {"use_qalora", {"pools the adapters' inputs in groups (QALoRA)", {false}}},
      {"layer_replication", {"repeats layers of the base model, each copy with its own adapter", {null, json::array()}}},
      {"target_parameters", {"adapts parameters that are not linear layers' weights", {null, json::array()}}},
      {"alora_invocation_tokens", {"applies the adapters only from the invocation tokens on (Activated LoRA)", {null}}},
      {"megatron_config", {"builds Megatron's parallel layers", {null, json::object()}}},
      {"use_bdlora", {"makes the adapters block-diagonal (BD-LoRA)", {null}}},
      {"velora_config", {"replaces the adapters' backward (VeLoRA)", {null}}},
      {"monteclora_config", {"samples the adapters (MonteCLoRA)", {null}}},
      {"arrow_config", {"routes between several adapters (Arrow)", {null}}},
      {"kasa_config", {"inserts trained singular values between lora_A and lora_B (KaSA)", {null}}}};
  auto refuse = [&](const std::string& key, const std::string& why) {
    std::string value = c[key].dump();
    if (value.size() > 80) value = value.substr(0, 77) + "...";
    throw UserError(std::string(kKey) + ": " + config_path + " has " + key + " " + value + ", which " + why +
                    ". This trainer does not implement it: loaded as plain LoRA, the adapter would compute (or train) "
                    "otherwise than it did in PEFT. Give an adapter saved without it (" + key + " at PEFT's default)");
  };
  for (auto it = c.begin(); it != c.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "init_lora_weights") {
      // true (PEFT's default), false (random A and B: a debugging aid), "gaussian", "orthogonal" and "eva"
      // only draw the first adapters, which the saved ones replace. The others change the base weights
      // at initialisation (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA) or train lora_A alone (MiCA).
      const bool fine = v.is_boolean() || v == "gaussian" || v == "orthogonal" || v == "eva";
      if (!fine)
        refuse(key, v.is_string() && v.get<std::string>() == "mica"
                        ? "trains lora_A alone, lora_B frozen (MiCA)"
                        : "initialised the adapters from the base weights and changed those weights to match (an "
                          "adapter PEFT did not convert with path_initial_model_for_weight_conversion needs that "
                          "changed base)");
      continue;
    }
    if (harmless.count(key)) continue;
    auto known = refused.find(key);
    if (known != refused.end()) {
      const auto& d = known->second.defaults;
      if (std::find(d.begin(), d.end(), v) == d.end()) refuse(key, known->second.why);
      continue;
    }
    if (!empty_value(v))
      refuse(key, "this trainer does not know (a newer PEFT's field?) and which may change what the adapter computes");
  }
  const json& r = c.contains("r") ? c["r"] : json();
  if (!r.is_number_integer() || r.get<int64_t>() <= 0)
    throw UserError(std::string(kKey) + ": " + config_path + ": r must be the adapters' rank, a positive integer, not " +
                    (c.contains("r") ? r.dump() : std::string("missing")));
  if (!c.contains("lora_alpha") || !c["lora_alpha"].is_number())
    throw UserError(std::string(kKey) + ": " + config_path + ": lora_alpha must be a number, not " +
                    (c.contains("lora_alpha") ? c["lora_alpha"].dump() : std::string("missing")));
}

AdapterSource from_peft(const std::string& path, ModelFamily family, const std::vector<std::string>& targets,
                        const std::string& token_embedding) {
  const std::string config_path = (fs::path(path) / "adapter_config.json").string();
  const json c = read_json_file(config_path);
  if (!c.is_object()) throw UserError(std::string(kKey) + ": " + config_path + " is not a JSON object");
  AdapterSource s;
  s.format = AdapterSource::Format::Peft;
  json_context(config_path, [&] {
    if (c.value("peft_type", std::string()) != "LORA")
      throw UserError(std::string(kKey) + ": " + config_path + ": peft_type " + c.value("peft_type", json("?")).dump() +
                      ", not \"LORA\"");
    check_peft_fields(config_path, c);
    s.rank = c["r"].get<int64_t>();
    s.alpha = c["lora_alpha"].get<double>();
    s.rslora = c.value("use_rslora", false);
    s.dora = c.value("use_dora", false);
    if (c.contains("modules_to_save") && !c["modules_to_save"].is_null())
      s.modules_to_save = c["modules_to_save"].get<std::vector<std::string>>();
  });
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
    const torch::Tensor& a = by_key.at(mod + ".lora_A.weight");
    // (r, in) -> (in, r); (out, r) -> (r, out); a tensor of another rank than 2 is named as it is
    add(s, w, a.dim() == 2 ? a.t() : a, b->second.dim() == 2 ? b->second.t() : b->second, file, mod + ".lora_A.weight",
        mod + ".lora_B.weight");
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
    const auto id_list = json_context(config_path, [&] { return (ids.is_array() ? ids : ids.begin().value()).get<std::vector<int64_t>>(); });
    s.tokens = {ours ? token_embedding : mod.substr(std::string("base_model.model.").size()), id_list,
                t.to(torch::kFloat32).contiguous()};
  }
  return s;
}

}  // namespace

std::vector<int64_t> AdapterSource::stored_shape(const torch::Tensor& ours) const {
  std::vector<int64_t> shape = ours.sizes().vec();
  if (format == Format::Peft && shape.size() == 2) std::swap(shape[0], shape[1]);
  return shape;
}

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
