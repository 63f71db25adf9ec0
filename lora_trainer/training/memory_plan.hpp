// The memory plan of a job: what each phase holds, item by item, per rank, on the host and on the
// device, from the job's settings and its parameters' shapes alone (nothing is allocated, read or
// drawn), beside the memory the machine has. `lora_trainer plan` prints it; every run checks it before
// it allocates, and refuses a job that will not fit, naming the largest items and the settings that
// would make it fit; a run ends by printing its measured peak beside the plan's.
//
// Each phase's peak is the sum of what it holds at once:
//   weights, gradients, moments, EMA   f32 for what trains (AdamW's two moments; the average with
//                                      optimization/ema/decay), divided over the ranks by
//                                      distributed/shard_params and distributed/shard_optimizer
//   frozen base                        each frozen weight in its storage (bf16, NF4, ...:
//                                      FrozenStorage::stored_bytes), sharded 1/N plus the blocks gathered
//   activations                        what a micro-batch's forward keeps for its backward, per block, or
//                                      only each block's input with training/activation_checkpointing;
//                                      attention's weights where attention is not fused
//   logits and loss                    the head's output (N x V) and the loss's own arrays (GRPO's
//                                      log-probabilities unfused: f32 copies and their gradients); a
//                                      frozen head's chunked loss: one block of N x 4,096 and x's gradient
//   rollouts' KV cache                 GRPO: the keys and values of its completions generated at once,
//                                      held before the step, where they exceed the step's activations
//   casts, dequantization              bf16 copies autocast makes of f32 weights; an NF4 weight made
//                                      whole for each product
//   checkpoint save                    what a save gathers or fills in besides the state
//   BLAS's packing                     f32 on the CPU: what OpenBLAS keeps of the widest weight gradient
//                                      (BlasPacking), from the job's first product to its end
//   runtime                            the process's own allocations (LibTorch, threads)
// A job that starts in its LoRA phase from a base has a `load` too: the frozen base as it fills, plus
// the tensor being read and converted. The coefficients of the activations were measured on this
// project's models (docs/memory.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/frozen_storage.hpp"

namespace lt {

// A base parameter as the plan sees it.
struct PlannedParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool in_block = false;  // a transformer block's: what distributed/shard_params shards
  bool linear = false;    // a matrix of a product (autocast casts it for the product)
  // In the LoRA phase:
  bool trains = false;         // a modules_to_save: trains in full, f32
  bool quantized = false;      // stored in MemoryPlanInputs::storage (a quantize_base's), else bf16
  bool sharded = false;        // sharded across the ranks (the frozen block weights, shard_params=lora/all)
  int64_t adapter = 0;         // its adapter's parameters (A, B, DoRA's magnitude); 0 when not a target
};

struct MemoryPlanInputs {
  ModelOptions model;
  std::vector<PlannedParam> params;  // base_params' order
  bool phase_one = true;    // a full-parameter phase
  bool lora_phase = false;  // a LoRA phase
  FrozenFormat storage;     // optimization/lora/quantize_base
  int64_t token_rows = 0;   // optimization/lora/trainable_token_indices: the embedding rows that train
  int64_t rows = 1;         // a micro-batch's rows on one rank (training/per_device_batch_size)
  int64_t rows_per_sample = 1;  // 2 for preference pairs
  int ranks = 1;            // data-parallel ranks
  int ranks_here = 1;       // of them on this machine
  bool bf16 = false;        // bf16 autocast (runtime/precision)
  bool fused_loss = true, fused_attention = false;
  bool chunked_loss = false;  // a head that takes no gradient computes its loss in blocks (runtime/loss)
  bool ema = false;
  bool reference_copy = false;  // dpo/train's full-parameter form: a frozen bf16 copy of the starting weights
  int64_t rollout_rows = 0;     // GRPO: the completions generated at once (num_generations); 0 without rollouts
  int64_t rollout_width = 0;    // GRPO: the positions of a step's rows and of a rollout's cache (the longest
                                // prompt + max_completion_length, at most block_size); 0: block_size
  ShardMode shard_optimizer = ShardMode::None, shard_params = ShardMode::None;
  bool cuda = false;                // the device is a GPU: the state lives there, the host holds the runtime
  int source_bytes = 2;             // bytes a value of the base a job starting in its LoRA phase loads (bf16: 2)
  bool loads_base = false;          // the job starts in its LoRA phase from a base (a `load` entry)
  int64_t runtime = 0;              // the process's own allocations (LibTorch, threads), on the host
  BlasPacking blas;                 // what the BLAS keeps of the f32 products on the CPU (blas_packing)
  int64_t host_memory = 0;          // the machine's memory (each machine's, with ranks on several)
  int64_t device_memory = 0;        // each GPU's memory; 0 on the CPU
};

struct MemoryItem {
  std::string what;
  int64_t host = 0, device = 0;
};

// One phase's peak (or the load's): the items it holds at once, per rank.
struct PhaseMemory {
  std::string name;  // "phase 1 (full parameters)", "phase 2 (LoRA)", "load of the base"
  std::vector<MemoryItem> items;
  int64_t host() const;
  int64_t device() const;
};

// A job's setting changed to make a plan fit, and the plan's peak with it.
struct FitChange {
  std::string setting;   // "training/activation_checkpointing=true", "--nproc 2 ... (two machines)"
  int64_t host = 0, device = 0;  // the new peaks (host: this machine's; device: one GPU's)
};

struct MemoryPlan {
  MemoryPlanInputs inputs;
  std::vector<PhaseMemory> phases;
  // The peaks over the phases: the host's for this machine (every rank on it), one GPU's.
  int64_t host_peak() const;
  int64_t device_peak() const;
  // The host peak of one rank (the run compares its own measured peak with this).
  int64_t rank_host_peak() const;
  bool fits() const;
  // The table: each phase's items and total, the peaks beside the machine's memory.
  std::string text() const;
  nlohmann::json to_json() const;
  // The run's line: "memory plan: peak 7.9 GB of this machine's 25.3 GB (phase 2 (LoRA)); `lora_trainer plan` itemizes it".
  std::string summary() const;
  // Single changes of the job's settings, and where none is enough their combination, that make it fit.
  std::vector<FitChange> fit_changes() const;
  // The refusal of a job that does not fit: the peak beside the memory, the largest items of the phase
  // that peaks, and fit_changes() (or that none of them is enough).
  std::string refusal() const;
};

MemoryPlan plan_memory(const MemoryPlanInputs& inputs);

}  // namespace lt
