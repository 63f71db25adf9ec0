// LoRATrainer: two phases in one job.
//
//   phase 1 (pre-LoRA)   full-parameter training over the stages of training/pre_lora_tokens and
//                        training/pre_lora_dataset, with optimization/lr and training/schedule.
//   boundary             the sum of the pre-LoRA budgets. run() calls transition_to_lora there: it
//                        saves `pre_lora_checkpoint` (a plain state) and puts on the adapters.
//   phase 2 (post-LoRA)  only the adapters train, over the stages of training/post_lora_tokens and
//                        training/post_lora_dataset, with optimization/lora/* (its own lr, schedule,
//                        weight decay; AdamW as in phase 1). The step counter runs on across phases.
//                        Base modules named in optimization/lora/modules_to_save (e.g. the token
//                        embedding) train in full beside the adapters: f32, their own moments, the
//                        LoRA lr times optimization/lora/modules_to_save_lr_ratio.
//                        Or, cheaper, only chosen rows of the token embedding train
//                        (optimization/lora/trainable_token_indices, PEFT's): f32 values that
//                        replace those rows, at the adapters' lr.
//
// Empty pre-LoRA lists start the job in phase 2: give it a pretrained base with
// `run ... --restore <plain checkpoint>` (its weights become the frozen base; this job's counters
// start at zero).
#pragma once

#include <string>

#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {

// The LoRA trainer's own options: optimization/lora/* (the adapters, their recipe and the phase-2
// optimizer) and training/allow_random_base, each key declared once bound to the field it sets
// (lora_trainer.cpp's OptionGroup, with its default and doc): add_lora_options adds them to a schema
// (LoRATrainer::schema, dpo/train's), from_config reads them once (in LoRATrainer's constructor).
struct LoraOptions {
  int64_t rank{};                         // optimization/lora/rank
  double alpha{};                         // optimization/lora/alpha
  std::vector<std::string> target_modules;  // optimization/lora/target_modules (as given: "all-linear" unexpanded)
  LoraInit init{};                        // optimization/lora/init
  bool rslora{};                          // optimization/lora/rslora: scale alpha / sqrt(r) instead of alpha / r
  bool dora{};                            // optimization/lora/dora: a trained magnitude per output feature (DoRA)
  double lr_ratio{};                      // optimization/lora/lr_ratio (LoRA+): B's learning rate over A's
  std::vector<std::string> modules_to_save;  // optimization/lora/modules_to_save, entries as given (module or
                                             // parameter names, or suffixes)
  double modules_to_save_lr_ratio{};      // optimization/lora/modules_to_save_lr_ratio
  // optimization/lora/trainable_token_indices: the embedding module named by PEFT's dict form ("" for
  // a plain list: the token embedding) and the ids whose rows train; no ids = off.
  std::string token_module;
  std::vector<int64_t> token_ids;
  std::string init_from;                  // optimization/lora/init_from: an earlier run's adapters to start from
                                          // (adapter_source.hpp); "" = drawn by init
  // Phase 2's optimizer: AdamW with phase 1's betas and epsilon (TrainingOptions) and these.
  ScheduleOptions schedule;  // optimization/lora/{schedule, lr, warmup_pct, decay_pct}, optimization/min_lr_ratio
  double weight_decay{};     // optimization/lora/weight_decay
  bool allow_random_base{};  // training/allow_random_base: with no phase 1, the adapters may train on random weights
  static LoraOptions from_config(const Config& cfg);
};

void add_lora_options(ConfigSchema& s);

class LoRATrainer : public BaseTrainer {
 public:
  static ConfigSchema schema();
  LoRATrainer(JobSpec spec, Config cfg, std::string out_dir);

  // The report of a finished job: per-phase speed, parameter counts, validation perplexity per dataset
  // before and after the LoRA phase, written to report.md beside loss.svg (the loss curves with the
  // boundary marked) in the run directory; "" when no training was logged in it. run() prints it.
  // (lora_trainer_report.cpp)
  std::string report();

  StateKind state_kind() const override { return in_lora_ ? StateKind::Lora : StateKind::Plain; }

  bool in_lora_phase() const { return in_lora_; }
  int64_t boundary_step() const { return boundary_step_; }
  // The adapters, as lora_params_of finds them in the model's layers (empty before the LoRA phase).
  const LoraParams& lora_params() const { return lora_; }
  // The base parameters that train in full in the LoRA phase (f32), by name; empty before it.
  const std::vector<std::string>& saved_modules() const { return saved_; }
  // The token rows that train in the LoRA phase (trainable_token_indices); undefined when off.
  const TrainableTokens& trainable_tokens() const { return token_rows_; }

  // The boundary, the mission's entry: saves `pre_lora_checkpoint` when phase 1 ran and it is not there
  // yet; freezes the base as bf16, gives param_filter's targets adapters (inject_lora_params) and trains
  // only those (and any modules_to_save) from here on; reports count_lora_params and the
  // frozen/trainable totals (printed and logged as the `transition` event). Entering the LoRA phase
  // calls it (run(), or train_step at the first LoRA step); a test may call it at any step, but the
  // steps before the boundary still take phase 1's loss (a DPO job's: next-token, on adapters then).
  void transition_to_lora();

  const LoraOptions& lora_config() const { return lora_cfg_; }

  // The stages of `plan`, the first `pre_lora_stages` of them full-parameter (dpo/train: none).
  LoRATrainer(JobSpec spec, Config cfg, std::string out_dir, const StagePlan& plan, size_t pre_lora_stages);

 protected:
  // The two phases: pre-LoRA (every parameter) to the boundary, then LoRA, entered by transition_to_lora.
  std::vector<Phase> own_phases() override;
  // Reads the checkpoint's step and kind from its metadata: a LoRA state (past the boundary) is loaded
  // into a LoRA template (transitioning first); a plain state at or before the boundary is loaded as
  // plain (pre_lora_checkpoint included) and the transition follows at the boundary; a plain state of
  // another job given to a job without phase 1 becomes the frozen base (skip phase one).
  void restore_state(const CheckpointMeta& ck) override;
  // Without phase 1, a base must have been given (or training/allow_random_base); an init_from source
  // must fit before phase 1 starts.
  void check_can_start() override;
  // Prints report().
  void report_finished() override;
  double current_lr() const override;
  // Also at the boundary: a line never averages the two phases' losses (DPO's, in a lora/train job on
  // preference pairs, is not a cross-entropy), and the report's per-phase speeds stay apart.
  bool step_line_due() const override { return BaseTrainer::step_line_due() || step_ == boundary_step_; }
  // distributed/shard_optimizer "lora" or "all" shard the adapters' moments; "all" phase 1's too.
  bool shard_optimizer_state() const override;
  nlohmann::json extra_metadata() const override;
  void restore_extra(const CheckpointMeta& ck) override;

 private:
  // transition_to_lora's change of state alone: freezes the base as bf16 (no gradients, no optimizer
  // state) except the modules_to_save, creates adapters for param_filter's targets with
  // inject_lora_params (on the trainer's device, deterministic from the seed), attaches them, and
  // rebuilds the optimizer over the adapters and the modules_to_save. A restore of a LoRA state calls it
  // to build the template its tensors load into.
  void freeze_base_and_inject();
  // What the LoRA settings select in this model, resolved once by the constructor (so a setting that
  // does not fit fails before phase 1, not at the boundary) and used by run() and the transition. The
  // masks are over base_params(*model_), whose names and order no restore changes.
  struct Selection {
    std::vector<bool> targets;   // param_filter: the weights that get adapters
    std::vector<bool> saved;     // modules_to_save: the base parameters that train in full
    std::string token_embedding;  // the weight whose rows trainable_token_indices trains; "" when off
    std::vector<std::string> target_names;  // the targets' names, in model order
  };
  Selection select_lora_params() const;
  void log_transition();
  // optimization/lora/init_from: the source's A and B (and DoRA magnitudes) copied into the fresh adapters (at the transition
  // only; a restore in the LoRA phase reads them from its checkpoint).
  void load_initial_adapters();
  LoraOptions lora_cfg_;
  Selection selection_;
  LoraParams lora_;
  std::vector<std::string> saved_;  // parameter names selected by modules_to_save, in model order
  TrainableTokens token_rows_;      // trainable_token_indices' rows, in the LoRA phase
  std::string adapters_from_;       // where the adapters started from (init_from), "" = drawn
  bool in_lora_ = false;
  int64_t boundary_step_ = 0;
  // Without phase one: where the frozen base came from ({"path", "job", "step"}), or "random" when
  // training/allow_random_base let it start from initialised weights; null before either.
  nlohmann::json base_;
  Schedule lora_schedule_;
};

// The stages of both phases, pre-LoRA first, from the config (UserError when token and dataset lists
// differ in length).
StagePlan lora_stage_plan(const Config& cfg);

}  // namespace lt
