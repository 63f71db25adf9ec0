// CheckpointMeta (checkpoint.hpp): a checkpoint's metadata.json read, type-checked and checked for
// consistency once (its counters against its kind and step, its `lora` block against its config), then
// handed down as one typed value to every reader.
#include <algorithm>
#include <filesystem>
#include <string>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/peft/lora.hpp"

namespace fs = std::filesystem;

namespace lt {

namespace {

// Every field the trainers read, with its type: a damaged or hand-edited metadata.json is an error
// naming the field, not a JSON exception deep inside a restore.
void check_metadata_fields(const std::string& dir, const nlohmann::json& meta) {
  using J = nlohmann::json;
  auto fail = [&](const std::string& field, const std::string& expected) {
    std::string got = meta.contains(field) ? "it is " + meta[field].dump() : "it is missing";
    if (got.size() > 80) got = got.substr(0, 77) + "...";
    throw UserError(dir + "/metadata.json: field \"" + field + "\" must be " + expected + ", but " + got +
                    ". The checkpoint is damaged or was edited; use another (`lora_trainer checkpoints JOB OUT_DIR`)");
  };
  auto count = [](const J& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); };
  auto need = [&](const char* field, const std::function<bool(const J&)>& ok, const std::string& expected, bool required) {
    if (!meta.contains(field)) {
      if (required) fail(field, expected);
      return;
    }
    if (!ok(meta[field])) fail(field, expected);
  };
  auto is_object = [](const J& v) { return v.is_object(); };
  const std::vector<std::string>& kinds = state_kind_names();
  need("kind", [&](const J& v) { return v.is_string() && std::count(kinds.begin(), kinds.end(), v.get<std::string>()) > 0; },
       "\"" + join(kinds, "\" or \"") + "\"", true);
  need("step", count, "a non-negative integer", true);
  need("tokens", count, "a non-negative integer", true);
  need("weights_only", [](const J& v) { return v.is_boolean(); }, "true or false", false);
  const bool full_state = !meta.value("weights_only", false);
  need("job", [](const J& v) {
    if (!v.is_object()) return false;
    for (const char* k : {"name", "project", "group", "kind"})
      if (v.contains(k) && !v[k].is_string()) return false;
    return true;
  }, "an object of strings (name, project, group, kind)", full_state);
  need("config", is_object, "an object (the job's config)", full_state);
  need("total_steps", count, "a non-negative integer", full_state);
  need("best_score", [](const J& v) { return v.is_null() || v.is_number(); }, "a number or null", false);
  need("best_stage", count, "a non-negative integer", false);
  need("trainable_params", [](const J& v) {
    if (!v.is_array()) return false;
    for (const auto& e : v)
      if (!e.is_string()) return false;
    return true;
  }, "a list of parameter names", full_state);
  need("data", [&](const J& v) {
    if (!v.is_object() || !v.contains("cursors") || !v["cursors"].is_object()) return false;
    for (auto& [k, c] : v["cursors"].items())
      if (k.empty() || k.find_first_not_of("0123456789") != std::string::npos || k.size() > 4 || !count(c)) return false;
    return true;
  }, "an object with \"cursors\" ({\"stage\": rows drawn})", full_state);
  need("state_h5", [&](const J& v) {
    if (!v.is_object() || !v.contains("bytes") || !v["bytes"].is_number_unsigned() || !v.contains("structure_crc32") ||
        !v["structure_crc32"].is_string() || !v.contains("data") || !v["data"].is_array())
      return false;
    for (const auto& r : v["data"])
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_unsigned() || !r[1].is_number_unsigned()) return false;
    return true;
  }, "an object {\"bytes\", \"structure_crc32\", \"data\": [[offset, length], ...]}", false);
  need("ema", [](const J& v) {
    if (!v.is_object() || !v.contains("decay") || !v["decay"].is_number() || !v.contains("params") || !v["params"].is_array())
      return false;
    for (const auto& e : v["params"])
      if (!e.is_string()) return false;
    return true;
  }, "an object {\"decay\", \"params\": [names]}", false);
  const bool lora_state = parse_state_kind(meta["kind"].get<std::string>()) == StateKind::Lora;
  need("lora", [](const J& v) {
    if (!v.is_object()) return false;
    if (v.contains("rank") && !(v["rank"].is_number_integer() && v["rank"].get<int64_t>() > 0)) return false;
    if (v.contains("alpha") && !v["alpha"].is_number()) return false;
    if (v.contains("boundary_step") && !v["boundary_step"].is_number_integer()) return false;
    if (v.contains("in_lora_phase") && !v["in_lora_phase"].is_boolean()) return false;
    return true;
  }, "an object (rank > 0, alpha, boundary_step, in_lora_phase, targets)", lora_state);
  const J& t = meta.contains("tokenizer") ? meta["tokenizer"] : J();
  if (!t.is_null() && !t.is_string())
    throw UserError(dir + "/metadata.json: \"tokenizer\" must be a tokenizer's name (byte, gpt2, hf:DIR), not " +
                    t.dump() + "; the checkpoint is damaged or hand-edited");
  if (meta.contains("chat") && !meta["chat"].is_object())
    throw UserError(dir + "/metadata.json: \"chat\" must be an object (the chat template and stop tokens its job's "
                    "conversations were rendered with), not " + meta["chat"].dump().substr(0, 80) +
                    "; the checkpoint is damaged or hand-edited");
}

// The fields check_metadata_fields checked, as values.
void read_metadata_fields(const nlohmann::json& meta, CheckpointMeta& ck) {
  using J = nlohmann::json;
  if (meta.contains("job")) {
    const J& j = meta["job"];
    CheckpointMeta::Job job;
    job.name = j.value("name", job.name);
    job.project = j.value("project", job.project);
    job.group = j.value("group", job.group);
    job.kind = j.value("kind", job.kind);
    ck.job = job;
  }
  ck.has_config = meta.contains("config");
  if (ck.has_config) ck.config = meta["config"];
  if (meta.contains("tokenizer") && meta["tokenizer"].is_string()) ck.tokenizer = meta["tokenizer"].get<std::string>();
  if (meta.contains("chat")) ck.chat = meta["chat"];
  ck.base_model = meta.value("base_model", J());
  ck.total_steps = meta.value("total_steps", int64_t(0));
  const J best = meta.value("best_score", J());
  if (best.is_number()) ck.best_score = best.get<double>();
  ck.best_stage = meta.value("best_stage", 0);
  ck.trainable_params = meta.value("trainable_params", std::vector<std::string>());
  if (meta.contains("ema"))
    ck.ema = CheckpointMeta::Ema{meta["ema"]["decay"].get<double>(), meta["ema"]["params"].get<std::vector<std::string>>()};
  if (meta.contains("data"))
    for (auto& [k, v] : meta["data"]["cursors"].items()) ck.cursors[std::stoi(k)] = v.get<uint64_t>();
  if (meta.contains("frozen_base")) ck.frozen_base = FrozenBaseRef::from_json(meta["frozen_base"], ck.dir);
  auto source = [&](const char* key) -> std::optional<std::string> {
    if (!meta.contains(key)) return std::nullopt;
    return meta[key].is_string() ? meta[key].get<std::string>() : std::string("?");
  };
  ck.exported_from = source("exported_from");
  ck.imported_from = source("imported_from");
}

}  // namespace

nlohmann::json CheckpointMeta::Job::to_json() const {
  return {{"name", name}, {"project", project}, {"group", group}, {"kind", kind}};
}

nlohmann::json CheckpointMeta::base_hf_config() const {
  return base_model.is_object() && base_model.contains("hf_config") ? base_model["hf_config"] : nlohmann::json();
}

std::string CheckpointMeta::base_hf_dir() const {
  return base_model.is_object() && base_model.value("hf_dir", nlohmann::json()).is_string()
             ? base_model["hf_dir"].get<std::string>() : "";
}

// A checkpoint's "lora" section against the rest of its metadata: in_lora_phase and boundary_step
// against its kind and step, rank, alpha, rslora and dora against its config's optimization/lora/*.
// A contradiction is a damaged or hand-edited file; merging or resuming it would use one of two
// scales or phases.
static void check_lora_metadata(const CheckpointMeta& ck) {
  if (!ck.lora) return;
  const LoraMetadata& l = *ck.lora;
  const nlohmann::json& meta = ck.raw;
  const std::string file = (fs::path(ck.dir) / "metadata.json").string();
  const std::string tail = ". The checkpoint is damaged or hand-edited and would compute or resume wrongly; " +
                           use_another_checkpoint();
  const bool lora_kind = ck.kind == StateKind::Lora;
  const std::string kind = state_kind_name(ck.kind);
  if (l.in_lora_phase && *l.in_lora_phase != lora_kind)
    throw UserError(file + ": lora.in_lora_phase is " + (*l.in_lora_phase ? "true" : "false") + " but kind is \"" + kind +
                    "\": a " + (lora_kind ? "LoRA" : "plain") + " state is " + (lora_kind ? "" : "not ") +
                    "in the LoRA phase" + tail);
  if (l.boundary_step) {
    const int64_t boundary = *l.boundary_step;
    if (boundary < 0 || (lora_kind && boundary > ck.step) || (!lora_kind && ck.step > boundary))
      throw UserError(file + ": lora.boundary_step " + std::to_string(boundary) + " and step " + std::to_string(ck.step) +
                      " contradict kind \"" + kind + "\": the LoRA phase starts at the " + "boundary, so a " +
                      (lora_kind ? "LoRA state's step is at or after it" : "plain state's step is at or before it") + tail);
  }
  // The lora section repeats the job's optimization/lora/* settings: both were written from one value.
  // Compared where the file has both (older files lack some).
  json_context(file, [&] {
    const nlohmann::json none = nlohmann::json::object();
    const nlohmann::json& block = meta.at("lora");
    const nlohmann::json cfg = meta.value("config", none).value("optimization", none).value("lora", none);
    for (const std::string key : {"rank", "alpha", "rslora", "dora"}) {
      if (!block.contains(key) || !cfg.contains(key)) continue;
      const nlohmann::json &a = block[key], &b = cfg[key];
      const bool same = a == b || (a.is_number() && b.is_number() && a.get<double>() == b.get<double>());
      if (!same)
        throw UserError(file + ": lora." + key + " is " + a.dump() + " but its config's optimization/lora/" + key +
                        " is " + b.dump() + ": the metadata contradicts itself about the adapters it holds" + tail);
    }
  });
}

// A full state's counters against each other: step within its own schedule (total_steps, finished),
// tokens and the data cursors against the step (exactly where its per_step record says every step
// was alike; a sampler's cursor counts the rows it drew, from a counter-based hash, so no dataset
// has an end: what is impossible is more rows than the steps drew). A contradiction is a damaged or
// hand-edited metadata.json, which would resume at another place in the schedule or the data.
static void check_counters(const CheckpointMeta& ck) {
  const nlohmann::json& meta = ck.raw;
  const std::string file = ck.dir + "/metadata.json";
  const std::string damaged = ": its metadata contradicts itself (damaged or hand-edited); " +
                              use_another_checkpoint(ck.job_name);
  const std::string step = "step " + std::to_string(ck.step), steps = std::to_string(ck.step) + " steps";
  json_context(file, [&] {
    const int64_t total = meta.at("total_steps").get<int64_t>();
    if (ck.step > total)
      throw UserError(file + ": " + step + " is past its own schedule's end (total_steps " + std::to_string(total) + ")" +
                      damaged);
    if (meta.contains("finished") && meta["finished"].get<bool>() != (ck.step >= total))
      throw UserError(file + ": finished is " + meta["finished"].dump() + " at " + step + " of total_steps " +
                      std::to_string(total) + damaged);
    // Every step trains at least one token, and no token comes without a step.
    if (ck.tokens < ck.step || (ck.step == 0) != (ck.tokens == 0))
      throw UserError(file + ": tokens " + std::to_string(ck.tokens) + " cannot have been trained in " + steps +
                      " (every step trains tokens, and only steps do)" + damaged);
    const nlohmann::json per_step = meta.value("per_step", nlohmann::json());
    const nlohmann::json& cursors = meta.at("data").at("cursors");
    if (!per_step.is_object()) return;  // older checkpoints, and jobs resumed with another batch size
    const int64_t rows = per_step.at("rows").get<int64_t>(), tokens = per_step.at("tokens").get<int64_t>();
    if (rows <= 0 || tokens <= 0 || tokens % rows != 0)
      throw UserError(file + ": per_step " + per_step.dump() + " is not rows > 0 of a whole number of tokens each" + damaged);
    if (ck.tokens / tokens != ck.step || ck.tokens % tokens != 0)
      throw UserError(file + ": tokens " + std::to_string(ck.tokens) + " is not " + step + " x " + std::to_string(tokens) +
                      " tokens a step (per_step.tokens)" + damaged);
    uint64_t could = 0;  // the rows the steps drew; saturated (a hand-edited step may be huge)
    if (__builtin_mul_overflow(static_cast<uint64_t>(ck.step), static_cast<uint64_t>(rows), &could)) could = UINT64_MAX;
    uint64_t drawn = 0;
    for (auto& [stage, c] : cursors.items()) {
      const uint64_t n = c.get<uint64_t>();
      if (n > could - drawn)
        throw UserError(file + ": data.cursors[\"" + stage + "\"] is " + std::to_string(n) + " rows drawn by stage " + stage +
                        (n > could ? "" : " (with the other stages' " + std::to_string(drawn) + ")") + ", more than the " +
                        std::to_string(could) + " rows that " + steps + " of " + std::to_string(rows) +
                        " rows (per_step.rows) drew" + damaged);
      drawn += n;
    }
  });
}

CheckpointMeta CheckpointMeta::read(const std::string& dir) {
  if (!fs::is_directory(dir)) throw UserError("checkpoint " + dir + " does not exist");
  if (!is_checkpoint(dir))
    throw UserError(dir + " is not a complete checkpoint (no metadata.json/state.h5): an interrupted save, or "
                    "a job directory? `lora_trainer checkpoints NAME OUT_DIR` lists the checkpoints");
  nlohmann::json meta = read_json_file((fs::path(dir) / "metadata.json").string(),
                                       "the checkpoint is damaged; use another (`lora_trainer checkpoints JOB OUT_DIR`)");
  if (!meta.is_object()) throw UserError(dir + "/metadata.json is not a JSON object; the checkpoint is damaged");
  const auto& fv = meta.contains("format_version") ? meta["format_version"] : nlohmann::json();
  const int64_t version = fv.is_number_integer() ? fv.get<int64_t>() : 0;
  if (version < kOldestReadableFormatVersion || version > kCheckpointFormatVersion)
    throw UserError(dir + ": checkpoint format version " + std::to_string(version) + ", this build reads versions " +
                    std::to_string(kOldestReadableFormatVersion) + " to " + std::to_string(kCheckpointFormatVersion) +
                    (version > kCheckpointFormatVersion ? ": it was written by a newer lora_trainer; use that one"
                                                        : ": a damaged or hand-edited metadata.json?"));
  CheckpointMeta ck;
  ck.format_version = static_cast<int>(version);
  json_context(dir + "/metadata.json", [&] {
    check_metadata_fields(dir, meta);
    ck.dir = dir;
    ck.kind = parse_state_kind(meta["kind"].get<std::string>());
    ck.step = meta["step"].get<int64_t>();
    ck.tokens = meta["tokens"].get<int64_t>();
    ck.weights_only = meta.value("weights_only", false);
    ck.job_name = meta.contains("job") ? meta["job"].value("name", std::string("?")) : "?";
    ck.raw = std::move(meta);
    // What the metadata says must agree with itself, for every reader (restore, eval, export, init_from).
    if (!ck.weights_only) {
      check_counters(ck);
      if (ck.raw.contains("lora")) ck.lora = LoraMetadata::from_json(ck.raw["lora"], dir + "/metadata.json");
      check_lora_metadata(ck);
    }
    read_metadata_fields(ck.raw, ck);
  });
  return ck;
}

nlohmann::json read_checkpoint_metadata(const std::string& dir) { return CheckpointMeta::read(dir).raw; }

}  // namespace lt
