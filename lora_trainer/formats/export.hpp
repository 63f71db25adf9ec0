// Exports of our own format, and the rule every export and import follows for its OUT.
//
// merged_weights reads a checkpoint's parameters with its adapters merged in (the one merge loop that
// `export`, `export --format hf` and the tests use); export_merged writes them as a weights-only plain
// checkpoint; check_export_target decides whether OUT may be written. Depends on checkpoint and lora,
// not on the trainers.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/frozen_base.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

// The parameters of a checkpoint, by name (without "params/"), with its adapters merged in (the scale
// its metadata records: alpha, rank, rslora; with dora, DoRA's rule and the saved magnitudes); `merged`
// counts them. Trainable token rows (trainable_token_indices) replace their rows of the embedding (a
// tied head is that same tensor); `token_rows` counts them. What every export writes. Each tensor is
// merged in f32 and then cast once to `dtype` (the stored base's own dtype when `dtype` is Undefined:
// base_dtype), one tensor at a time, so no f32 copy of the whole model is made for a bf16 export.
struct MergedWeights {
  CheckpointMeta ck;  // its metadata
  NamedTensors params;
  torch::ScalarType dtype = torch::kFloat32;
  int merged = 0;
  int64_t token_rows = 0;
};
// Each is cast with export_cast (`command` names the export in its messages).
MergedWeights merged_weights(const std::string& checkpoint, bool use_ema = false, const std::string& base = "",
                             torch::ScalarType dtype = torch::kFloat32, const std::string& command = "export");

// `t` (tensor `name`) cast to `dtype` for a file an export writes (`command`: "export --format gguf
// --dtype float16", ...). A UserError, before anything is written, when a value would be written as
// inf or NaN: one the rounding overflows (past float16's largest, 65504, or bfloat16's) names the
// tensor, its largest magnitude and the dtype's limit and suggests a wider dtype; one that is not
// finite already says the checkpoint's weights are not. Never writes what the checkpoint does not hold.
torch::Tensor export_cast(const torch::Tensor& t, torch::ScalarType dtype, const std::string& name, const std::string& command);

// The --dtype of import-hf and export: "source" (Undefined: each tensor in the dtype it is stored in)
// or, of `allowed`, a dtype by the name state.h5 records it under (dtype_name: "float32", "bfloat16",
// "float16"). Another is a UserError: "<command> --dtype <name>: expected source, float32 or bfloat16".
torch::ScalarType parse_dtype_option(const std::string& name, const std::vector<torch::ScalarType>& allowed,
                                     const std::string& command);
// The names parse_dtype_option takes: "source", then those of `allowed` (the command line's check).
std::vector<std::string> dtype_option_names(const std::vector<torch::ScalarType>& allowed);
// The dtypes Hugging Face files take (import-hf, export --format hf) and GGUF's (--format gguf, gguf-adapter).
inline const std::vector<torch::ScalarType> kHfDtypes = {torch::kFloat32, torch::kBFloat16};
inline const std::vector<torch::ScalarType> kGgufDtypes = {torch::kFloat32, torch::kFloat16, torch::kBFloat16};

// The dtype most of a checkpoint's stored base parameters are in (by element count): bf16 for a
// LoRA-phase checkpoint (its frozen base) or an import that kept bf16, f32 for phase one's.
torch::ScalarType base_dtype(const NamedTensors& base);

// A checkpoint's tensors for an export: as saved, or with `use_ema` (export --ema) each trained
// tensor (params/<n>, the adapters' included) replaced by its moving average (ema/<n>, optimization/ema/decay); a
// checkpoint without one is then a UserError.
// A checkpoint that refers to its frozen base (frozen_base.hpp) gets the base's params/* (bf16) from
// where it records, or from `base` (export --base), their digest checked; with `base_values` false
// only their shapes (uninitialised tensors: an export that writes the adapters alone).
NamedTensors export_tensors(const CheckpointMeta& ck, bool use_ema, const std::string& base = "", bool base_values = true);

// The frozen base a checkpoint refers to (its metadata's frozen_base): read tensor by tensor through
// `take` (bf16, on the CPU) from where it records, or from `base` when it moved, its digest checked
// (read_frozen_base); returns where it was read from. The one reader of a referenced base outside a job
// (export, inspect --verify).
std::string read_referenced_base(const CheckpointMeta& ck, const std::string& base,
                                 const TakeTensor& take, Take how);

// A checkpoint's model options, from its saved (resolved) config (keys an older checkpoint lacks had
// their defaults); a UserError when it has none.
ModelOptions checkpoint_model_options(const CheckpointMeta& ck);

// Writes a weights-only plain checkpoint of `checkpoint` with any adapters merged in; it initialises
// another job (`run ... --restore OUT`), e.g. as the pretrained base of a LoRA job.
void export_merged(const std::string& checkpoint, const std::string& out, bool use_ema = false, bool force = false,
                   const std::string& base = "");

// The file that marks a directory written by `export --format hf|peft` (JSON: exported_from, format).
inline constexpr const char* kExportMarker = "lora_trainer_export.json";
// Writes DIR/kExportMarker for an export of `checkpoint` in `format`.
void write_export_marker(const std::filesystem::path& dir, const std::string& checkpoint, const std::string& format);

// The owner an export of `checkpoint` records in its OUT (publish_dir's WriteOwner, kind "export"): a
// later export or import into OUT drops what this one recorded and does not write again, nothing else.
WriteOwner export_owner(const std::string& checkpoint);

// The rule for every export's (and import-hf's) OUT: a new or empty directory, or an earlier export or
// import of lora_trainer (its record says so, or, written before records, a weights-only checkpoint with
// exported_from/imported_from or a directory with kExportMarker), which is then replaced, saying so:
// the files it recorded that this write does not write again go (for one without a record, the fixed
// names of its format: `metadata.json` and `state.h5`, or those its marker's format writes; shards and
// an index, which it may or may not have written, are kept with a note), every other file stays.
// Any other existing directory is refused unless `force` (then only the files this command writes are
// replaced). OUT being the source, inside it or holding it is a UserError. Either refusal says nothing
// was written. `verb` names the command. Returns the names to pass publish_dir as `ours`.
std::vector<std::string> check_export_target(const std::string& source, const std::string& out, const std::string& verb,
                                             bool force = false);

}  // namespace lt
