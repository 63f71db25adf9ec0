// A LoRA-phase checkpoint's frozen base by reference: instead of a copy of the base (the size of the
// model, in every checkpoint), the checkpoint records where the base is and a digest of it, and every
// reader (a restore, eval, sample, export) reads it from there and checks the digest.
//
// The metadata's "frozen_base" block:
//   {"path": "/abs/dir", "relative": "../../pre_lora_checkpoint", "format": "hf" | "checkpoint",
//    "tensors": {"model.layers.0.self_attn.q_proj.weight": [64, 64], ...},
//    "bytes": N, "digest": "16 hex digits"}
// `path` is where the base was when the checkpoint was saved (a Hugging Face model directory, or a
// checkpoint of ours: the job's own pre_lora_checkpoint, an import-hf output, another job's plain
// state); `relative` the same from the checkpoint's directory, so that a job directory moved whole
// still finds its own boundary checkpoint. `tensors` are the frozen parameters (our names, shapes): the
// base's parameters but those that train (modules_to_save). They live in bf16; the digest is of their
// bf16 values (frozen_base_digest), so it does not depend on the source's dtype or file layout: a base
// re-saved in another form with the same values still matches, a changed value does not.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/frozen_base_ref.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

// FNV-1a (64-bit) over each tensor's name and the CRC-32 of its bf16 bytes, in name order, as 16 hex
// digits. The tensors may be of any dtype and device; they are taken as bf16. `crcs` gives the CRC of
// those whose bf16 values are no longer in memory (an NF4 base keeps the CRC of the values it quantized:
// peft/frozen_weight.hpp); their tensors then only give the shape.
std::string frozen_base_digest(const NamedTensors& tensors, const std::map<std::string, uint32_t>& crcs = {});

// The reference to a base at `source` (an HF model directory or a checkpoint) for the frozen tensors
// `frozen` (bf16, as they are in memory, or with their CRC in `crcs`), saved in checkpoints under `job_dir`.
FrozenBaseRef make_frozen_base_ref(const std::string& source, const std::string& format, const NamedTensors& frozen,
                                   const std::string& job_dir, const std::map<std::string, uint32_t>& crcs = {});

// Where a checkpoint's frozen base is: `moved_to` when given (training/frozen_base_path, export --base),
// else the recorded path relative to the checkpoint when that exists, else the absolute one; a UserError
// saying what to do when none exists.
std::string locate_frozen_base(const FrozenBaseRef& ref, const std::string& checkpoint_dir, const std::string& moved_to);

// Reads the frozen tensors (bf16, on the CPU, in the order of ref.tensors) from where the base is, one
// at a time, each through `take` (name, tensor), and checks the digest of all of them against the
// recorded one. `model` names the whole base's parameters and shapes (the source must hold exactly the
// model: a modules_to_save parameter is in it too, and skipped). A UserError names the base, what
// differs, and how to point at a moved one. Returns where the base was read from. A `take` that keeps
// the tensors gets copies of their own (Take::Keeps); one that converts, quantizes or copies them
// (Take::Copies) may get a model directory's read-only mapped pages, valid only during the call. It
// returns the CRC-32 of the tensor's bf16 values when it computed it (a storage's values_crc), which the
// digest then takes instead of computing it again; else none.
enum class Take { Copies, Keeps };
using TakeTensor = std::function<std::optional<uint32_t>(const std::string& name, const torch::Tensor& bf16)>;
std::string read_frozen_base(const FrozenBaseRef& ref, const std::string& checkpoint_dir, const std::string& moved_to,
                      ModelFamily family, const NamedTensors& model,
                      const TakeTensor& take, Take how);

}  // namespace lt
