#include "lora_trainer/formats/frozen_base.hpp"

#include <algorithm>
#include <filesystem>
#include <functional>

#include "lora_trainer/core/checksum.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/base_weights.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace lt {

namespace {

// A digest accumulated tensor by tensor, in name order.
class Digest {
 public:
  void add(const std::string& name, const torch::Tensor& t) { add(name, bf16_crc32(t)); }
  void add(const std::string& name, uint32_t crc) {
    const std::string entry = name + ":" + std::to_string(crc) + ";";
    h_ = fnv1a64(entry.data(), entry.size(), h_);
  }
  std::string hex() const { return hex64(h_); }

 private:
  uint64_t h_ = 1469598103934665603ULL;
};

}  // namespace

json FrozenBaseRef::to_json() const {
  json t = json::object();
  for (const auto& [n, shape] : tensors) t[n] = shape;
  return {{"path", path}, {"relative", relative}, {"format", format}, {"tensors", t}, {"bytes", bytes}, {"digest", digest}};
}

FrozenBaseRef FrozenBaseRef::from_json(const json& j, const std::string& dir) {
  const std::string where = dir + "/metadata.json: frozen_base";
  auto fail = [&](const char* key) {
    throw UserError(where + "." + key + " is missing or of the wrong type: the checkpoint is damaged or hand-edited; " +
                    use_another_checkpoint());
  };
  auto need = [&](const char* key, const std::function<bool(const json&)>& ok) {
    if (!j.is_object() || !j.contains(key) || !ok(j[key])) fail(key);
  };
  need("path", [](const json& v) { return v.is_string(); });
  need("format", [](const json& v) { return v == "hf" || v == "checkpoint"; });
  need("tensors", [](const json& v) { return v.is_object() && !v.empty(); });
  need("digest", [](const json& v) { return v.is_string(); });
  need("bytes", [](const json& v) { return v.is_number_unsigned(); });
  FrozenBaseRef r;
  r.path = j["path"].get<std::string>();
  r.relative = j.contains("relative") && j["relative"].is_string() ? j["relative"].get<std::string>() : "";
  r.format = j["format"].get<std::string>();
  // Each shape is allocated as it stands (an export that reads only the shapes): every dimension
  // positive, the product well inside 64 bits.
  for (const auto& [n, shape] : j["tensors"].items()) {
    bool fits = shape.is_array() && !shape.empty() && shape.size() <= 4;
    double elements = 1;
    for (const auto& d : fits ? shape : json::array()) {
      fits = fits && d.is_number_integer() && d.get<int64_t>() >= 1;
      elements *= fits ? d.get<double>() : 1;
    }
    if (!fits || elements > double(int64_t(1) << 40))
      throw UserError(where + ".tensors[\"" + n + "\"] is " + shape.dump() + ", not a tensor's shape (1 to 4 positive "
                      "dimensions, at most 2^40 elements): the checkpoint is damaged or hand-edited; " + use_another_checkpoint());
    r.tensors[n] = shape.get<std::vector<int64_t>>();
  }
  r.bytes = j["bytes"].get<uint64_t>();
  r.digest = j["digest"].get<std::string>();
  return r;
}

std::string frozen_base_digest(const NamedTensors& tensors, const std::map<std::string, uint32_t>& crcs) {
  NamedTensors sorted = tensors;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Digest d;
  for (const auto& [n, t] : sorted) {
    auto known = crcs.find(n);
    if (known != crcs.end()) d.add(n, known->second);
    else d.add(n, t);
  }
  return d.hex();
}

FrozenBaseRef make_frozen_base_ref(const std::string& source, const std::string& format, const NamedTensors& frozen,
                                   const std::string& job_dir, const std::map<std::string, uint32_t>& crcs) {
  FrozenBaseRef r;
  r.path = fs::absolute(source).lexically_normal().string();
  // From a checkpoint of the job (<job_dir>/<suffix>, the suffix one or two levels deep): recorded from
  // <job_dir> and resolved from the checkpoint by locate_frozen_base.
  const std::string rel = fs::path(r.path).lexically_relative(fs::absolute(job_dir).lexically_normal()).string();
  r.relative = rel.empty() || rel.rfind("..", 0) == 0 ? "" : rel;
  r.format = format;
  for (const auto& [n, t] : frozen) {
    r.tensors[n] = t.sizes().vec();
    r.bytes += static_cast<uint64_t>(t.numel()) * 2;
  }
  r.digest = frozen_base_digest(frozen, crcs);
  return r;
}

std::string locate_frozen_base(const FrozenBaseRef& ref, const std::string& checkpoint_dir, const std::string& moved_to) {
  if (!moved_to.empty()) {
    if (!fs::exists(moved_to))
      throw UserError("the frozen base was said to be at " + moved_to + " (training/frozen_base_path, or --base), "
                      "which does not exist");
    return moved_to;
  }
  // A job directory moved whole: its own boundary checkpoint, from the checkpoint (ntoks/N or best).
  if (!ref.relative.empty())
    for (const fs::path& job : {fs::path(checkpoint_dir).parent_path(), fs::path(checkpoint_dir).parent_path().parent_path()})
      if (fs::exists(job / ref.relative) && fs::exists(job / ref.relative / "metadata.json")) return (job / ref.relative).string();
  if (fs::exists(ref.path)) return ref.path;
  throw UserError(checkpoint_dir + " holds its LoRA adapters, not the frozen base they were trained on (" +
                  std::to_string(ref.tensors.size()) + " tensors, " + std::to_string(ref.bytes >> 20) +
                  " MiB in bf16); the base was at " + ref.path + ", which no longer exists. If it moved, say where: "
                  "`run ... --restore DIR`, training/frozen_base_path=DIR (restore, eval, sample) or `export --base DIR`; "
                  "or put it back at " + ref.path);
}

std::string read_frozen_base(const FrozenBaseRef& ref, const std::string& checkpoint_dir, const std::string& moved_to,
                      ModelFamily family, const NamedTensors& model,
                      const TakeTensor& take, Take how) {
  const std::string where = locate_frozen_base(ref, checkpoint_dir, moved_to);
  for (const auto& [n, shape] : ref.tensors) {
    auto it = std::find_if(model.begin(), model.end(), [&](const auto& p) { return p.first == n; });
    if (it == model.end() || it->second.sizes().vec() != shape)
      throw UserError(checkpoint_dir + "/metadata.json: its frozen base lists " + n + " " + shape_text(shape) +
                      ", which this model (architecture/*) " + (it == model.end() ? "does not have" : "has in another shape"));
  }
  std::unique_ptr<BaseWeights> src;
  if (is_hf_model_dir(where)) {
    src = BaseWeights::open_hf(where, family, model);
  } else {
    if (!is_checkpoint(where))
      throw UserError("the frozen base of " + checkpoint_dir + " was to be at " + where + ", which is neither a checkpoint "
                      "nor a Hugging Face model directory (config.json + safetensors)");
    const CheckpointMeta ck = CheckpointMeta::read(where);
    src = BaseWeights::open_checkpoint(ck, model);
  }
  Digest d;
  for (auto it = ref.tensors.begin(); it != ref.tensors.end(); ++it) {
    const std::string& n = it->first;
    const torch::Tensor t = (how == Take::Keeps ? src->read(n) : src->peek(n)).to(torch::kBFloat16);
    if (std::next(it) != ref.tensors.end()) src->prefetch(std::next(it)->first);  // read while this one is taken
    const std::optional<uint32_t> crc = take(n, t);
    if (crc) d.add(n, *crc);
    else d.add(n, t);
  }
  if (d.hex() != ref.digest)
    throw UserError("the frozen base at " + where + " is not the one " + checkpoint_dir + " was trained on: the digest "
                    "of its bf16 values is " + d.hex() + ", the checkpoint recorded " + ref.digest + " (metadata.json: "
                    "frozen_base.digest). Its adapters only mean something on that base: point at it with `run ... "
                    "--restore DIR`, training/frozen_base_path=DIR (restore, eval, sample) or `export --base DIR`, or put it "
                    "back where it was (" + ref.path + ")");
  return where;
}

}  // namespace lt
