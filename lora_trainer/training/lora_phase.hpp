// LoraPhase: the LoRA phase of a job as one component. It owns the phase's options (optimization/lora/*),
// what they select in the model (param_filter's targets, the modules_to_save, the token rows), the
// frozen-base policy (how the base is stored: bf16, NF4 or another storage of frozen_storage.hpp's
// registry, a FrozenWeight each; whether it is sharded across the ranks; whether checkpoints copy it or
// refer to the file that holds it), the
// transition's change of state (freeze the base, inject_lora_params, attach the adapters), its block of
// the checkpoint metadata (LoraMetadata, written here and read back by CheckpointMeta once), the checks a
// restore makes against this job's settings, and the lines it reports.
//
// The trainer holds one when its plan has a LoRA phase and calls it at the points it owns:
//   construction       options read and checked against the model (select), now, not at the boundary
//   load of a base     quantized_weights / sharded_weights / shard_base: a base without phase one is
//                      frozen, quantized or sharded as it loads
//   boundary           Trainer::transition_to_lora saves pre_lora_checkpoint, then enter() (freeze,
//                      inject, what trains for the optimizer), refer_to_frozen_base, load_initial_adapters,
//                      log_transition
//   save               add_metadata (the `lora` and `frozen_base` blocks), drop_frozen_base
//   restore            check_restorable (recipe), check_selection (after the template), load_frozen_base,
//                      restored (where the base came from)
//   report             base_text (phase 1 skipped: where the base is)
//
// The phase knows the model, the ranks and the device; not the trainer. Its loss is the trainer's
// (next-token) or a recipe part's (DPO's): an objective is a StepLoss (step_loss.hpp), not part of it.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/frozen_base.hpp"
#include "lora_trainer/formats/lora_metadata.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/training/lora_options.hpp"
#include "lora_trainer/training/optim.hpp"

namespace lt {

class LoraPhase {
 public:
  // What the LoRA settings select in this model, resolved once (so a setting that does not fit fails
  // before phase 1, not at the boundary); the masks are over base_params(model), whose names and order
  // no restore changes.
  struct Selection {
    std::vector<bool> targets;    // param_filter: the weights that get adapters
    std::vector<bool> saved;      // modules_to_save: the base parameters that train in full
    std::string token_embedding;  // the weight whose rows trainable_token_indices trains; "" when off
    std::vector<std::string> target_names;  // the targets' names, in model order
  };
  // What trains in the phase, for its optimizer: the adapters (B and DoRA's magnitude at LoRA+'s lr
  // ratio), the modules_to_save (at their ratio), the token rows; with the phase's weight decay.
  struct Trained {
    NamedTensors params;
    std::vector<double> lr_scale;
    double weight_decay = 0;
  };

  // Reads optimization/lora/* from `cfg` and selects in `model` (a UserError naming the key that does not
  // fit). `steps`: the phase's length, for its schedule.
  LoraPhase(const Config& cfg, CausalLM model, Distributed& dist, torch::Device device, ShardMode shard_params,
            uint64_t seed, int64_t steps);

  const LoraOptions& options() const { return options_; }
  const Selection& selection() const { return selection_; }
  const Schedule& schedule() const { return schedule_; }
  // Whether enter() ran: the adapters are on and the base is frozen.
  bool entered() const { return entered_; }
  const LoraParams& adapters() const { return adapters_; }
  // The base parameters that train in full (f32), by name, in model order; empty before enter().
  const std::vector<std::string>& saved() const { return saved_; }
  const TrainableTokens& token_rows() const { return token_rows_; }

  // Whether the i-th base parameter (named `name`) is frozen in the phase (neither a modules_to_save nor
  // the embedding whose rows train): a job that starts in the phase keeps it in bf16 from the start.
  bool freezes(size_t i, const std::string& name) const;
  // The adaptable (linear) weights of the blocks but the modules_to_save: what a QLoRA base quantizes
  // and a sharded base shards.
  std::set<std::string> frozen_block_weights() const;
  // Those stored quantized, in quantize_base()'s storage (optimization/lora/quantize_base=nf4, or another
  // storage of the registry but bf16); none without it.
  std::set<std::string> quantized_weights() const;
  FrozenFormat quantize_base() const { return options_.quantize_base; }
  // Whether the frozen base is sharded across the ranks (distributed/shard_params=lora or all, with
  // several ranks), and which weights: frozen_block_weights() then, else none.
  bool shards_base() const;
  std::set<std::string> sharded_weights() const;
  // Puts the sharded_weights (frozen already) into one BlockShard a block, gathered by the model around
  // each block's forward (block_shard.hpp); once, when shards_base(). A UserError for a quantize_base
  // that cannot be sharded (shardable(): bf16 and nf4 can).
  void shard_base();

  // A job that starts in the phase loads its base (`read(name)` gives each base parameter in the source's
  // dtype, one at a time, perhaps its file's read-only mapped pages (BaseWeights::peek): nothing keeps
  // them, a value kept as it came is copied) in the form the phase keeps it, on its device: the blocks' linear weights
  // quantized (quantize_base) or sharded as they come, so the whole base is never in memory in bf16 nor
  // on one rank; the weights the phase freezes kept in bf16 when the source stores bf16 (one stored wider
  // is float32 until the transition rounds it, so that `eval` of a float32 model measures it as it is);
  // those it trains float32. `prefetch(next)`, when given, is called with the parameter read next once
  // the current one is read, so that reading overlaps storing. `text` says what was done, for the load's line.
  struct BaseLoad {
    int64_t bf16 = 0, quantized = 0, sharded = 0;
    std::string text;
  };
  BaseLoad load_base(const std::function<torch::Tensor(const std::string&)>& read,
                     const std::function<void(const std::string&)>& prefetch = {});
  // The base of a job that starts in the phase, allocated for a LoRA state to load into, uninitialised
  // and on the device: stand-ins (no storage) for the quantized and sharded weights, bf16 the weights
  // it freezes, float32 the rest; the buffers placed.
  void allocate_base_for_load();

  // The transition's change of state: freezes the base (bf16, the quantized_weights NF4; no gradients)
  // but the modules_to_save, gives param_filter's targets adapters with inject_lora_params (on the
  // model's device, deterministic from the seed), attaches them and the token rows, shards the base when
  // shards_base(). Returns what trains, for the phase's optimizer. A restore of a LoRA state calls it to
  // build the template its tensors load into.
  Trained enter();
  // optimization/lora/init_from: the source's A and B (and DoRA magnitudes, token rows) copied into the
  // fresh adapters (at the transition only; a restore in the phase reads them from its checkpoint).
  void load_initial_adapters();
  // The frozen base's reference for this job's checkpoints: `source` (the job's own
  // pre_lora_checkpoint, or the base it loaded; "" when none) of `format` ("checkpoint" or "hf"), unless
  // logging/save_frozen_base asks for copies or it is gone; a UserError when a sharded base has nothing
  // to refer to. `job` names the job in messages; `job_dir` is where its checkpoints are.
  void refer_to_frozen_base(const std::string& source, const std::string& format, const std::string& job,
                            const std::string& job_dir, bool main);
  // Prints the transition's line (counts of what trains and what is frozen, the recipe, the base's bytes)
  // and returns its `transition` event, at step/tokens.
  nlohmann::json log_transition(int64_t step, int64_t tokens);

  // The LoRA phase's frozen base parameters (the base's but the modules_to_save), by name, in model
  // order; empty before enter().
  NamedTensors frozen_tensors() const;
  // The checkpoint's `lora` block (and `frozen_base`, when its checkpoints refer to the base) into `m`.
  void add_metadata(nlohmann::json& m, int64_t boundary_step) const;
  // Without the params/* (and nf4/*) of the frozen base when `referenced` (a save whose checkpoints refer
  // to it, or the tensors a restore loads from a checkpoint that does).
  void drop_frozen_base(NamedTensors& tensors, bool referenced) const;
  bool refers_to_base() const { return entered_ && frozen_base_.has_value(); }

  // A LoRA state `ck` against this job's recipe (rank, quantize_base, DoRA) and boundary, and whether
  // its base can be read (sharded): a UserError naming the setting, before the template is built.
  void check_restorable(const CheckpointMeta& ck, int64_t boundary_step) const;
  // What `ck` trained beside its adapters (modules_to_save, token rows) against this job's selection,
  // once the template is built.
  void check_selection(const CheckpointMeta& ck) const;
  // A LoRA state's frozen base from the place its checkpoint refers to, its digest checked
  // (training/frozen_base_path when it moved), or nothing when the checkpoint holds it.
  void load_frozen_base(const CheckpointMeta& ck);
  // After a full restore: where the base came from, where the adapters started from.
  void restored(const CheckpointMeta& ck);
  // Where the frozen base came from without phase one: {"path", "job", "step"} of a checkpoint,
  // {"path", "format": "hf", "step": 0} of a model directory, or "random".
  void set_base(nlohmann::json base) { base_ = std::move(base); }
  const nlohmann::json& base() const { return base_; }
  // Said when the job runs: where a restore read the base from ("" when it did not).
  const std::string& base_note() const { return base_note_; }
  // Before a run's first step: a UserError when the phase cannot start (no phase one and no base, a
  // sharded base with copies or without a file, an init_from that does not fit).
  void check_can_start(const std::string& job, int64_t boundary_step, int64_t step);
  // "phase 1: skipped; the frozen base is ...": the report's line of a job without phase one.
  std::string skipped_phase_one_text() const;

 private:
  Selection select() const;
  std::map<std::string, uint32_t> frozen_crcs() const;

  LoraOptions options_;
  CausalLM model_;
  Distributed& dist_;
  torch::Device device_;
  ShardMode shard_params_;
  uint64_t seed_;
  Selection selection_;
  Schedule schedule_;
  bool entered_ = false;
  LoraParams adapters_;
  std::vector<std::string> saved_;  // parameter names selected by modules_to_save, in model order
  TrainableTokens token_rows_;      // trainable_token_indices' rows
  std::string adapters_from_;       // where the adapters started from (init_from), "" = drawn
  // Without phase one: where the frozen base came from, or "random"; null before either.
  nlohmann::json base_;
  // What this job's LoRA-phase checkpoints refer to instead of copying the frozen base (frozen_base.hpp);
  // none: they hold a copy (logging/save_frozen_base, a random base, a restored self-contained state).
  std::optional<FrozenBaseRef> frozen_base_;
  std::string base_note_;
};

}  // namespace lt
