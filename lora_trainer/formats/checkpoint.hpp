// The on-disk checkpoint format: files and metadata, nothing about trainers.
//
// A checkpoint is a directory holding
//   state.h5       (state_h5.hpp) one HDF5 dataset per tensor, at its name ("params/h.0.attn.c_attn.weight",
//                  "optim/exp_avg/...", "rng/cpu"); each has a string attribute "dtype" (float32,
//                  bfloat16, int64, ...) and a string attribute "crc32" (8 hex digits: zlib's CRC-32
//                  of the tensor's bytes, checked at every load). bfloat16 and float16 are stored as
//                  uint16 bit patterns, so every dtype round-trips bit for bit.
//   metadata.json  {"format_version", "step", "tokens", "kind", ...}; written last.
// It is built in a hidden temporary directory beside its final place and renamed into place only when
// complete, so a crash mid-save never leaves a directory that looks like a checkpoint. A job's
// directory also holds `latest`, a text file naming the newest complete checkpoint's suffix.
// checkpoints/README.md describes the layout for users.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/formats/frozen_base_ref.hpp"
#include "lora_trainer/formats/lora_metadata.hpp"
#include "lora_trainer/formats/state_h5.hpp"

namespace lt {

// 2: the adapters are parameters of their layers, stored as params/<layer>.lora_A (and .lora_B,
//    .lora_magnitude, <embedding>.trainable_tokens_delta).
// 1: they were stored as lora/<name>. A format-1 checkpoint is read as format 2 (read_checkpoint_tensors
//    renames them), so every reader sees one layout; `inspect` shows the names as stored.
inline constexpr int kCheckpointFormatVersion = 2;
inline constexpr int kOldestReadableFormatVersion = 1;

// What a checkpoint's state is, its metadata's "kind": "plain" (a whole model, trained in full) or
// "lora" (a frozen bf16 base and adapters).
enum class StateKind { Plain, Lora };
const std::vector<std::string>& state_kind_names();  // in StateKind's order
StateKind parse_state_kind(const std::string& name);  // std::invalid_argument naming the known ones
std::string state_kind_name(StateKind kind);

// The prefixes of the tensor names in state.h5 that a trainer reads back by part: the model's
// parameters, the adapters' included ("params/h.0.attn.c_attn.weight", "params/h.0.attn.c_attn.lora_A")
// the moving average of the trained tensors ("ema/<name>", optimization/ema/decay), and a QLoRA base's
// NF4 storage in place of its quantized parameters ("nf4/<weight>.codes", ".absmax_codes",
// ".absmax_scales", ".absmax_offset": kernels/nf4.hpp's Nf4Tensor) when the checkpoint copies its base.
inline const std::string kParamsPrefix = "params/";
inline const std::string kEmaPrefix = "ema/";
inline const std::string kNf4Prefix = "nf4/";

// params/* of a checkpoint's tensors without the prefix, in order, split into the model's own and the
// adapters' (lora.hpp's is_adapter_param: "<layer>.lora_A", "<embedding>.trainable_tokens_delta").
struct ParamTensors {
  NamedTensors base;
  std::map<std::string, torch::Tensor> adapters;
};
ParamTensors param_tensors(const NamedTensors& tensors);

// Writes tensors and metadata to `dir` atomically (replacing an existing checkpoint there; other files
// in it are kept, but for the names in `ours`: publish_dir).
void save_checkpoint(const std::string& dir, const NamedTensors& tensors, const nlohmann::json& metadata,
                     const std::vector<std::string>& ours = {});
// The same from tensors made one at a time (TensorStream: one of them in memory at once).
void save_checkpoint(const std::string& dir, const TensorStream& tensors, const nlohmann::json& metadata,
                     const std::vector<std::string>& ours = {});

// True when `dir` holds a complete checkpoint.
bool is_checkpoint(const std::string& dir);

// A checkpoint's metadata.json, read and checked once and handed down: a restore passes this one value
// from the registry through the trainers to the tensor loader instead of each re-reading the file.
struct CheckpointMeta {
  std::string dir;            // the checkpoint directory
  int format_version = kCheckpointFormatVersion;  // as written (kOldestReadableFormatVersion or later)
  StateKind kind = StateKind::Plain;
  int64_t step = 0, tokens = 0;
  bool weights_only = false;  // made by `export` or `import-hf`: weights, no training state
  std::string job_name;       // the job that saved it; "?" when not recorded
  std::optional<LoraMetadata> lora;  // its "lora" block (LoRA kinds' full states), parsed and checked
  // Its "job" block (job.hpp's JobSpec, absent keys at JobSpec's defaults); nullopt when not recorded.
  struct Job {
    std::string name, project = "general", group = "default", kind;
    nlohmann::json to_json() const;
  };
  std::optional<Job> job;
  bool has_config = false;    // "config" recorded (every full state and export has it)
  nlohmann::json config = nlohmann::json::object();  // the saved job's resolved config ({} when not recorded)
  std::string tokenizer;      // the tokenizer its job's data was tokenized with (byte, gpt2, hf:DIR); "" none
  nlohmann::json chat;        // the chat format its job's conversations were rendered with (ChatFormat); null none
  nlohmann::json base_model;  // where its model came from (base_weights.hpp's base_model()); null when none
  int64_t total_steps = 0;    // its schedule's length (full states)
  std::optional<double> best_score;  // the best validation score so far; nullopt when none
  int best_stage = 0;         // the stage it was reached in
  std::vector<std::string> trainable_params;  // the optimizer's parameters, in order (full states)
  struct Ema {
    double decay = 0;
    std::vector<std::string> params;
  };
  std::optional<Ema> ema;     // its "ema" block: it holds the moving average (ema/<name>); nullopt when not
  std::map<int, uint64_t> cursors;  // data.cursors: rows drawn, by stage (full states)
  std::optional<FrozenBaseRef> frozen_base;  // the frozen base it refers to instead of holding it (frozen_base.hpp)
  // Where a weights-only checkpoint came from: "exported_from" (export) or "imported_from" (import-hf);
  // "?" where the value is not a string, nullopt when not recorded.
  std::optional<std::string> exported_from, imported_from;
  nlohmann::json raw;         // the whole file: `inspect` prints it, recipes read their own blocks (dpo, forgetting)

  // base_model.hf_config (an imported model's own config.json), null when none; base_model.hf_dir ("" when none).
  nlohmann::json base_hf_config() const;
  std::string base_hf_dir() const;

  // UserError naming the directory when it is not a complete checkpoint of this format version, or
  // naming the field of metadata.json that is missing or has the wrong type. Absent optional fields
  // (older checkpoints) read as the defaults above.
  static CheckpointMeta read(const std::string& dir);
};

// CheckpointMeta::read(dir).raw: the metadata as JSON, checked (tests; readers take CheckpointMeta's typed fields).
nlohmann::json read_checkpoint_metadata(const std::string& dir);

// Every tensor in the checkpoint, on the CPU, sorted by name, named as format kCheckpointFormatVersion
// names them (an older file's names are upgraded). Each tensor's CRC-32 is checked against
// the one recorded at save (a mismatch is a UserError naming the tensor); `verified` (when given)
// counts the tensors that had one. The first form reads the metadata first.
NamedTensors read_checkpoint_tensors(const std::string& dir, int* verified = nullptr);
NamedTensors read_checkpoint_tensors(const CheckpointMeta& ck, int* verified = nullptr);

// A checkpoint's state.h5 open for reading one tensor at a time, under the names of format
// kCheckpointFormatVersion (as read_checkpoint_tensors names them). Opening checks the file's size and
// structure against the metadata; each read checks the tensor's CRC-32.
class CheckpointReader {
 public:
  explicit CheckpointReader(const CheckpointMeta& ck);
  ~CheckpointReader();
  const std::string& dir() const { return dir_; }
  const std::string& job_name() const { return job_name_; }
  const std::vector<std::string>& names() const { return names_; }  // sorted
  bool contains(const std::string& name) const;
  StateH5Reader::Info info(const std::string& name) const;  // dtype and shape, without reading the data
  torch::Tensor read(const std::string& name, int* verified = nullptr) const;  // on the CPU

 private:
  std::string dir_;
  int format_version_;
  std::string job_name_;
  std::unique_ptr<StateH5Reader> file_;
  std::vector<std::string> names_;
};

// Reads every tensor (checking each checksum); returns a one-line summary, or throws naming the first
// corrupt tensor. `inspect --verify`.
std::string verify_checkpoint(const std::string& dir);

// Copies the checkpoint's tensors into `into` (same names, shapes and dtypes required; `into` may live
// on any device), one tensor at a time: the names, shapes and dtypes are all compared before anything
// is copied. Only names starting with one of `prefixes` are compared (all when empty). Every
// mismatch is listed in one UserError.
// `write` (when given) is offered each tensor as it is read and may take it instead of the copy into
// `into` (returning true): a sharded state keeps only its part of a tensor, its target a stand-in of
// the whole tensor's shape and dtype for the comparison.
using TensorWriter = std::function<bool(const std::string& name, const torch::Tensor& value)>;
void load_checkpoint_into(const CheckpointMeta& ck, const NamedTensors& into,
                          const std::vector<std::string>& prefixes = {}, const TensorWriter& write = nullptr);
void load_checkpoint_into(const std::string& dir, const NamedTensors& into,
                          const std::vector<std::string>& prefixes = {});

// Metadata plus, per tensor, dtype, shape, its CRC-32 and a 64-bit FNV-1a digest of its bytes.
nlohmann::json inspect_checkpoint(const std::string& dir);

// <job_dir>/latest: the checkpoint it names; nullopt when there is no such file; UserError when it is
// empty (restarting from step 0 would silently train over the job's checkpoints).
std::optional<std::string> read_latest(const std::string& job_dir);
void write_latest(const std::string& job_dir, const std::string& suffix);

// Deletes a checkpoint so that a kill at any point leaves either the whole checkpoint under its name or
// none: it is first renamed to the hidden `.NAME.del-TAG` (in one step; TAG proves it ours: temp_tag),
// then removed; a leftover is cleared by the job's next run (remove_interrupted_saves), never put back.
void delete_checkpoint(const std::string& dir);

// logging/keep_checkpoints: deletes the periodic checkpoints (<job_dir>/ntoks/<tokens>) of job
// `job_name` beyond the newest `keep` (0: none), oldest first, never the one `latest` names. Only a
// checkpoint whose record (kWriteRecord) says this job's run saved it at that path is deleted: another
// job's or project's checkpoint (copied in, whatever its run name), one saved before records were kept,
// an incomplete one and any other file are left alone (a note names each once), and so are the job's
// other checkpoints (best, final, pre_lora_checkpoint, a benchmark's boundaries). Returns the suffixes
// deleted.
std::vector<std::string> prune_periodic_checkpoints(const std::string& job_dir, const std::string& job_name, int64_t keep);

// Suffixes of the complete checkpoints under a job directory, e.g. {"ntoks/4096", "best", "final/8192"}.
std::vector<std::string> list_checkpoints(const std::string& job_dir);

// Clears the leftovers that interrupted saves and deletes of ours left below job_dir (hidden directories
// and temporary files whose TAG proves them ours, at any depth), putting back a checkpoint that a kill
// between two renames left only as `.NAME.old-TAG`, and printing each path; a hidden directory that only
// looks like a leftover is left alone with a note (only a job's one writer may call it: another's save in
// progress looks the same). Returns how many.
int remove_interrupted_saves(const std::string& job_dir);

}  // namespace lt
