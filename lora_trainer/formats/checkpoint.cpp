#include "lora_trainer/formats/checkpoint.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <filesystem>
#include <map>
#include <set>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/state_h5.hpp"
#include "lora_trainer/peft/lora.hpp"

namespace fs = std::filesystem;

namespace lt {

const std::vector<std::string>& state_kind_names() {
  static const std::vector<std::string> names = {"plain", "lora"};  // in StateKind's order
  return names;
}

StateKind parse_state_kind(const std::string& name) {
  if (auto value = enum_from_name<StateKind>(state_kind_names(), name)) return *value;
  throw std::invalid_argument("unknown state kind \"" + name + "\" (known: " + join(state_kind_names()) + ")");
}

std::string state_kind_name(StateKind kind) { return enum_name(state_kind_names(), kind); }

// A save writes into the hidden sibling `.NAME.tmp-TAG` and renames it into place; the checkpoint it
// replaces goes aside as `.NAME.old-TAG` until the rename is done (publish_dir). Either left behind is an
// interrupted save; `.NAME.del-TAG` is an interrupted delete_checkpoint. Their TAG proves them ours
// (temp_tag); a hidden directory that merely looks like one is somebody else's.
static bool looks_like_leftover(const std::string& name) {
  return name.size() > 1 && name[0] == '.' &&
         (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos ||
          name.find(".del-") != std::string::npos);
}

int remove_interrupted_saves(const std::string& job_dir) {
  std::vector<std::string> targets;  // the checkpoint (or file) each leftover was a write of
  walk_tree(job_dir, [&](const std::string& p, bool is_dir) {
    const std::string target = temporary_target(p);
    if (!target.empty()) {
      targets.push_back(target);
      return false;
    }
    if (is_dir && looks_like_leftover(fs::path(p).filename().string())) {
      note_once(p, "left " + p + " alone: it looks like the leftover of an interrupted save but was not made by this job "
                "(a directory of yours, or an older lora_trainer's); delete it if you do not need it");
      return false;
    }
    return is_dir;
  });
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  int handled = 0;
  for (const auto& t : targets) handled += recover_interrupted_writes(t, /*locked=*/true);
  return handled;
}

// Who saves a checkpoint, for its record: a job's run, or an export or import (weights only).
static WriteOwner checkpoint_owner(const nlohmann::json& meta) {
  auto text = [&](const char* key) { return meta.contains(key) && meta[key].is_string() ? meta[key].get<std::string>() : ""; };
  if (meta.value("weights_only", false))
    return {"export", meta.contains("imported_from") ? "import-hf" : "export",
            text(meta.contains("imported_from") ? "imported_from" : "exported_from")};
  const nlohmann::json job = meta.value("job", nlohmann::json::object());
  auto part = [&](const char* key) { return job.is_object() && job.value(key, nlohmann::json()).is_string() ? job[key].get<std::string>() : ""; };
  return {"checkpoint", "run", part("project") + "/" + part("group") + "/" + part("name")};
}

void save_checkpoint(const std::string& dir, const NamedTensors& tensors, const nlohmann::json& metadata,
                     const std::vector<std::string>& ours) {
  save_checkpoint(dir, TensorStream::of(tensors), metadata, ours);
}

void save_checkpoint(const std::string& dir, const TensorStream& tensors, const nlohmann::json& metadata,
                     const std::vector<std::string>& ours) {
  publish_dir(dir, [&](const fs::path& tmp) {
    const std::string state = (tmp / "state.h5").string();
    const DataRanges ranges = write_state_h5(state, tensors);
    fsync_file(state);
    nlohmann::json meta = metadata;  // metadata.json last: a directory holding it is complete
    meta["format_version"] = kCheckpointFormatVersion;
    // HDF5's structures are checked before HDF5 parses them (HDF5 1.10 reads past its buffers on some
    // damaged files); the tensors' bytes have their own CRC-32s.
    const auto [crc, bytes] = structure_crc32(state, ranges);
    nlohmann::json data = nlohmann::json::array();
    for (const auto& [at, len] : ranges) data.push_back({at, len});
    meta["state_h5"] = {{"bytes", bytes}, {"structure_crc32", crc}, {"data", data}};
    write_file_atomic((tmp / "metadata.json").string(), meta.dump(2) + "\n");
  }, "save checkpoint " + dir, ours, checkpoint_owner(metadata));
}

bool is_checkpoint(const std::string& dir) {
  return fs::exists(fs::path(dir) / "metadata.json") && fs::exists(fs::path(dir) / "state.h5");
}

NamedTensors read_checkpoint_tensors(const std::string& dir, int* verified) {
  return read_checkpoint_tensors(CheckpointMeta::read(dir), verified);
}

// read_checkpoint_tensors; `crcs` (when given) receives each tensor's CRC-32, in the same order: the
// one computed for the check, so `inspect` does not compute it again.
// state.h5's size and the CRC-32 of its HDF5 structures against what the save recorded (metadata's
// state_h5; checkpoints written before it have none): HDF5 never parses a damaged file.
static void check_state_file(const CheckpointMeta& ck, const std::string& path) {
  if (!ck.raw.contains("state_h5")) return;
  const nlohmann::json& s = ck.raw["state_h5"];
  const std::string tail = ": the file is damaged (a truncated copy, a flipped bit?); " +
                           use_another_checkpoint(ck.job_name);
  const uint64_t bytes = s["bytes"].get<uint64_t>();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw UserError("could not read " + path + ": " + std::strerror(errno));
  if (static_cast<uint64_t>(st.st_size) != bytes)
    throw UserError(path + " has " + std::to_string(st.st_size) + " bytes; its save wrote " + std::to_string(bytes) +
                    " (metadata.json: state_h5.bytes)" + tail);
  DataRanges ranges;
  uint64_t end = 0;
  for (const auto& r : s["data"]) {
    const uint64_t at = r[0].get<uint64_t>(), len = r[1].get<uint64_t>();
    if (at < end || len == 0 || len > bytes || at > bytes - len)
      throw UserError(ck.dir + "/metadata.json: state_h5.data [" + std::to_string(at) + ", " + std::to_string(len) +
                      "] does not lie in order inside the file's " + std::to_string(bytes) + " bytes" + tail);
    ranges.emplace_back(at, len);
    end = at + len;
  }
  const std::string want = s["structure_crc32"].get<std::string>();
  const auto [crc, read] = structure_crc32(path, ranges);
  if (crc != want || read != bytes)
    throw UserError(path + ": its HDF5 structures (everything but the tensors' bytes) have CRC-32 " + crc + ", its save "
                    "recorded " + want + " (metadata.json: state_h5.structure_crc32)" + tail);
}

static NamedTensors read_tensors(const CheckpointMeta& ck, int* verified, std::vector<std::string>* crcs) {
  std::string path = (fs::path(ck.dir) / "state.h5").string();
  check_state_file(ck, path);
  return read_state_h5(path, verified, crcs);
}

// Format 1 kept the adapters apart, as lora/<name>; format 2 keeps them with the parameters of their
// layers, as params/<name>.
static void upgrade_names(int from_version, NamedTensors& tensors) {
  if (from_version >= 2) return;
  const std::string old_prefix = "lora/";
  for (auto& [name, t] : tensors)
    if (name.rfind(old_prefix, 0) == 0) name = kParamsPrefix + name.substr(old_prefix.size());
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
}

NamedTensors read_checkpoint_tensors(const CheckpointMeta& ck, int* verified) {
  NamedTensors tensors = read_tensors(ck, verified, nullptr);
  upgrade_names(ck.format_version, tensors);
  return tensors;
}

ParamTensors param_tensors(const NamedTensors& tensors) {
  ParamTensors out;
  for (const auto& [n, t] : tensors) {
    if (n.rfind(kParamsPrefix, 0) != 0) continue;
    const std::string name = n.substr(kParamsPrefix.size());
    if (is_adapter_param(name)) out.adapters[name] = t;
    else out.base.emplace_back(name, t);
  }
  return out;
}

void load_checkpoint_into(const std::string& dir, const NamedTensors& into,
                          const std::vector<std::string>& prefixes) {
  load_checkpoint_into(CheckpointMeta::read(dir), into, prefixes);
}

// Format 1's name of a tensor that format 2 names `name` (the adapters were lora/<name>).
static std::string stored_name(int format_version, const std::string& name) {
  if (format_version >= 2 || name.rfind(kParamsPrefix, 0) != 0 || !is_adapter_param(name.substr(kParamsPrefix.size())))
    return name;
  return "lora/" + name.substr(kParamsPrefix.size());
}

CheckpointReader::CheckpointReader(const CheckpointMeta& ck)
    : dir_(ck.dir), format_version_(ck.format_version), job_name_(ck.job_name) {
  const std::string path = (fs::path(ck.dir) / "state.h5").string();
  check_state_file(ck, path);
  file_ = std::make_unique<StateH5Reader>(path);
  NamedTensors names;
  for (const auto& n : file_->names()) names.emplace_back(n, torch::Tensor());
  upgrade_names(format_version_, names);
  for (auto& [n, t] : names) names_.push_back(n);
}

CheckpointReader::~CheckpointReader() = default;

bool CheckpointReader::contains(const std::string& name) const {
  return std::binary_search(names_.begin(), names_.end(), name);
}

StateH5Reader::Info CheckpointReader::info(const std::string& name) const {
  return file_->info(stored_name(format_version_, name));
}

torch::Tensor CheckpointReader::read(const std::string& name, int* verified) const {
  return file_->read(stored_name(format_version_, name), verified);
}

void load_checkpoint_into(const CheckpointMeta& ck, const NamedTensors& into,
                          const std::vector<std::string>& prefixes, const TensorWriter& write) {
  const std::string& dir = ck.dir;
  auto selected = [&](const std::string& name) {
    if (prefixes.empty()) return true;
    for (const auto& p : prefixes)
      if (name.rfind(p, 0) == 0) return true;
    return false;
  };
  // Every name, shape and dtype is compared first, from the file's records, so that a checkpoint that
  // does not fit changes nothing; then each tensor is read, checked and copied in turn: one tensor in
  // memory at a time beside the state it loads into.
  const CheckpointReader reader(ck);
  std::set<std::string> unmatched;
  for (const auto& n : reader.names())
    if (selected(n)) unmatched.insert(n);
  std::vector<std::string> problems;
  for (const auto& [name, target] : into) {
    if (!selected(name)) continue;
    if (!unmatched.erase(name)) {
      problems.push_back("missing " + name);
      continue;
    }
    const StateH5Reader::Info src = reader.info(name);
    if (src.shape != target.sizes().vec())
      problems.push_back(name + ": shape " + shape_text(src.shape) + " in the checkpoint, " +
                         shape_text(target.sizes().vec()) + " expected");
    else if (src.dtype != target.scalar_type())
      problems.push_back(name + ": dtype " + dtype_name(src.dtype) + " in the checkpoint, " +
                         dtype_name(target.scalar_type()) + " expected");
  }
  for (const auto& name : unmatched) problems.push_back("unexpected " + name);
  if (!problems.empty()) {
    std::string msg = "checkpoint " + dir + " does not match this job's state (" +
                      std::to_string(problems.size()) + " problems): ";
    msg += first_problems(problems);
    msg += ". Is it the right checkpoint for this model size (architecture/*) and phase?";
    throw UserError(msg);
  }
  torch::NoGradGuard ng;
  for (const auto& [name, target] : into) {
    if (!selected(name)) continue;
    const torch::Tensor value = reader.read(name);
    if (!write || !write(name, value)) target.copy_(value);
  }
}

nlohmann::json inspect_checkpoint(const std::string& dir) {
  nlohmann::json out;
  out["path"] = dir;
  const CheckpointMeta ck = CheckpointMeta::read(dir);
  out["metadata"] = ck.raw;
  nlohmann::json tensors = nlohmann::json::array();
  std::vector<std::string> crcs;
  const NamedTensors all = read_tensors(ck, nullptr, &crcs);
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& [name, t] = all[i];
    auto c = t.contiguous();
    tensors.push_back({{"name", name},
                       {"dtype", dtype_name(c.scalar_type())},
                       {"shape", c.sizes().vec()},
                       {"crc32", crcs[i]},
                       {"fnv1a64", hex64(fnv1a64(c.data_ptr(), c.numel() * c.element_size()))}});
  }
  out["tensors"] = tensors;
  return out;
}

std::string verify_checkpoint(const std::string& dir) {
  int verified = 0;
  NamedTensors all = read_checkpoint_tensors(dir, &verified);
  int64_t bytes = 0;
  for (const auto& [n, t] : all) bytes += t.numel() * t.element_size();
  std::string out = dir + ": " + std::to_string(all.size()) + " tensors (" + std::to_string(bytes) + " bytes) read; ";
  if (verified == static_cast<int>(all.size())) return out + "every CRC-32 matches the one recorded at save";
  return out + std::to_string(verified) + " verified by their CRC-32, " + std::to_string(all.size() - verified) +
         " without a recorded checksum (saved by a build before checksums)";
}

std::optional<std::string> read_latest(const std::string& job_dir) {
  fs::path p = fs::path(job_dir) / "latest";
  if (!fs::exists(p)) return std::nullopt;
  std::string s = read_file(p.string());
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  // Empty (a hand edit, a copy gone wrong): starting over from step 0 would silently train over the
  // job's checkpoints, so it is an error that says what to do.
  if (s.empty())
    throw UserError(p.string() + " is empty: it should name the checkpoint to resume from. Write the name of one "
                    "listed by `lora_trainer checkpoints JOB OUT_DIR` into it (e.g. final/1280 or ntoks/2048), or "
                    "delete it to start the job over from step 0");
  // It names a checkpoint of this job: below the job directory, never another job's or an absolute path.
  const bool outside = s[0] == '/' || s == ".." || s.rfind("../", 0) == 0 || s.find("/../") != std::string::npos ||
                       (s.size() >= 3 && s.compare(s.size() - 3, 3, "/..") == 0);
  if (outside || s.find('\0') != std::string::npos || s.find('\n') != std::string::npos)
    throw UserError(p.string() + " names \"" + s.substr(0, 80) + "\", which is not a checkpoint inside the job directory "
                    "(a hand edit, or a damaged file). Write the name of one listed by `lora_trainer checkpoints JOB "
                    "OUT_DIR` into it (e.g. final/1280 or ntoks/2048), or delete it to start the job over from step 0");
  return s;
}

void write_latest(const std::string& job_dir, const std::string& suffix) {
  write_file_atomic((fs::path(job_dir) / "latest").string(), suffix + "\n");
}

void delete_checkpoint(const std::string& dir) {
  fs::path target = fs::absolute(dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  const fs::path doomed = target.parent_path() / ("." + target.filename().string() + ".del-" + temp_tag(target.string()));
  if (::rename(target.c_str(), doomed.c_str()) != 0)
    throw UserError("could not delete checkpoint " + target.string() + ": rename to " + doomed.string() + ": " +
                    std::strerror(errno));
  fsync_dir(target.parent_path().string());
  std::string error;
  if (!remove_tree(doomed.string(), &error))
    std::fprintf(stderr, "warning: %s was taken out of the checkpoints but could not be removed (%s); the next run of "
                 "the job removes it\n", doomed.c_str(), error.c_str());
}

std::vector<std::string> prune_periodic_checkpoints(const std::string& job_dir, const std::string& job_name, int64_t keep) {
  const fs::path periodic = fs::path(job_dir) / "ntoks";
  if (keep <= 0 || !fs::is_directory(periodic)) return {};
  const std::optional<std::string> latest = read_latest(job_dir);
  std::vector<std::pair<uint64_t, std::string>> ours;  // (tokens, suffix), this job's complete ones
  for (const auto& entry : fs::directory_iterator(periodic)) {
    const std::string e = entry.path().filename().string();
    if (e.empty() || e.find_first_not_of("0123456789") != std::string::npos || e.size() > 19) continue;
    const std::string dir = (periodic / e).string();
    if (!is_checkpoint(dir)) continue;
    // The proof that this job saved it there: its record (a save of this job's run, at this path). Without
    // one (another job's or project's checkpoint copied in, or one saved before records were kept) it
    // is kept, and said so once.
    const std::optional<WriteRecord> record = read_write_record(dir);
    const std::string of = record ? record->of : "";
    if (!record || record->kind != "checkpoint" || of.substr(of.rfind('/') + 1) != job_name) {
      note_once(dir, "logging/keep_checkpoints: left " + dir + " alone: it holds no record that job " + job_name +
                " saved it there (another job's or project's checkpoint, one copied in, or one saved by a lora_trainer "
                "before such records); delete it yourself if it is not needed");
      continue;
    }
    ours.emplace_back(std::stoull(e), "ntoks/" + e);
  }
  std::sort(ours.begin(), ours.end());
  std::vector<std::string> deleted;
  for (size_t i = 0; i + static_cast<size_t>(keep) < ours.size(); ++i) {
    if (latest && *latest == ours[i].second) continue;  // what a resume would read is never deleted
    delete_checkpoint((fs::path(job_dir) / ours[i].second).string());
    deleted.push_back(ours[i].second);
  }
  return deleted;
}

std::vector<std::string> list_checkpoints(const std::string& job_dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(job_dir)) return out;
  walk_tree(job_dir, [&](const std::string& path, bool is_dir) {
    if (!is_dir) return false;
    if (fs::path(path).filename().string().rfind(".", 0) == 0) return false;  // temporaries of a save in progress
    if (is_checkpoint(path)) {
      out.push_back(fs::relative(path, job_dir).string());
      return false;
    }
    return true;
  });
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace lt
