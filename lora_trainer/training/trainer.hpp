// Trainer: the step / validate / checkpoint loop of a restorable training job, over a plan of phases.
//
// One step consumes one global batch of `training/batch_size` rows of `architecture/block_size`
// tokens, split into micro-batches of `training/per_device_batch_size` rows (gradient accumulation),
// then clips the global gradient norm and takes an AdamW step:
//   total_steps = training/tokens / (batch_size * block_size)
// Training may be split into stages (a token budget and a dataset mixture each), grouped into phases
// (plan.hpp): the `train` job has one stage in one phase (a continual benchmark, several), lora/train
// a full-parameter phase and a LoRA phase:
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
// start at zero). Recipes are parts of a trainer, not subclasses (trainer_part.hpp: DPO, continual
// learning). The LoRA phase is a component the trainer holds (lora_phase.hpp) and calls at the
// boundary and at save/restore (trainer_lora.cpp); the data it draws from is a JobData (job_data.hpp:
// stages, samplers, cursors); where its weights and text come from (tokenizer, chat format, imported
// base) is a Provenance (provenance.hpp); the report of a LoRA job is lora_report.hpp's; the state as a
// checkpoint is in trainer_state.cpp.
//
// With several ranks (distributed.hpp) each rank takes an equal, disjoint share of every global batch
// (batch_size / ranks rows, in micro-batches of per_device_batch_size), the gradients are summed over
// the ranks before clipping, so the step is the one a single process takes on the whole batch.
// Rank 0 alone writes checkpoints (whole, unsharded: restorable on any number of ranks), metrics and
// reports. Everything the next step depends on — weights,
// optimizer moments, step, tokens, data cursor, RNG — is in the checkpoint, so a resumed run is
// bit-identical to an uninterrupted one.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/frozen_base.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/training/divergence.hpp"
#include "lora_trainer/training/ema.hpp"
#include "lora_trainer/training/evaluation.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/training/job_data.hpp"
#include "lora_trainer/training/metrics_log.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/training/optim.hpp"
#include "lora_trainer/training/plan.hpp"
#include "lora_trainer/training/provenance.hpp"
#include "lora_trainer/training/sharded_params.hpp"
#include "lora_trainer/training/lora_phase.hpp"
#include "lora_trainer/training/job_memory.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/training/step_loss.hpp"
#include "lora_trainer/training/trainer_part.hpp"
#include "lora_trainer/training/training_options.hpp"

namespace lt {

struct StepResult {
  int64_t step = 0;     // the step just taken (1-based count after it)
  double loss = 0.0;    // token-weighted mean over the global batch
  double grad_norm = 0.0;
  double lr = 0.0;
  double seconds = 0.0;
  bool skipped = false;  // non-finite loss or gradient norm: no update was made (training/on_nonfinite=skip)
};

class Trainer : public RestorableJob {
 public:
  // The `train` job's schema, and lora/train's (the pre- and post-LoRA stage lists, optimization/lora/*).
  static ConfigSchema schema();
  static ConfigSchema lora_schema();
  // The stages of `plan`; a LoRA phase when it has one (its options read and checked against the model
  // now, not at the boundary hours later).
  Trainer(JobSpec spec, Config cfg, std::string out_dir, const TrainingPlan& plan);
  // The `train` job: one stage, training/tokens over training/dataset, every parameter.
  Trainer(JobSpec spec, Config cfg, std::string out_dir);

  // Each part's before_run and check_can_start (a UserError when the job cannot start); the plan's phases
  // in order, each trained until its end step (train_until), the LoRA phase entered by
  // transition_to_lora; then the `final` checkpoint and, on rank 0, the report (a LoRA job's) and each
  // part's after_run (also when the job was finished already). A resumed run skips the phases it finished.
  void run() override;
  bool done() const override { return step_ >= total_steps_; }
  // A part may restore the checkpoint its own way (TrainerPart::restore); else restore_state does. Then
  // every part hears of it (TrainerPart::restored).
  void restore_from_checkpoint(const CheckpointMeta& ck) final;
  // Adds a recipe's part (trainer_part.hpp), before the job is restored or run. The trainer owns it.
  void add_part(std::unique_ptr<TrainerPart> part) { parts_.push_back(std::move(part)); }
  // The part of type P, or null.
  template <class P>
  P* part() const {
    for (const auto& p : parts_)
      if (auto* found = dynamic_cast<P*>(p.get())) return found;
    return nullptr;
  }

  // One optimizer step. It first enters the phase of the step (transition_to_lora at the LoRA phase's
  // first step, when run() or an earlier step has not), so that a caller stepping by hand crosses the
  // phases as run() does.
  StepResult train_step();
  // The plan: the trainer's phases (own_phases) as its parts shape them (TrainerPart::plan).
  std::vector<Phase> phases() const;
  // Held-out loss of the model (base + adapters in the LoRA phase) on the first `rows` validation
  // samples of each dataset; a part measures the styles it knows (DPO's loss, margin and accuracy of a
  // contrastive one). A UserError for a style nothing measures.
  std::vector<DatasetEval> evaluate(const std::vector<Sampling>& datasets, int64_t rows);
  // With eval/use_ema: the EMA weights in place of the trainable parameters while the result lives
  // (evaluate() takes it itself; `sample` holds it while generating); else null.
  std::unique_ptr<Ema::Swap> ema_weights();
  // The periodic validation: `training/validation_steps` rows of the datasets of the stage just
  // trained (of every dataset of the plan when eval/evaluations has "perplexity"); the score (`loss`)
  // is token-weighted over the datasets of the stage just trained.
  ValResult validate();
  // The tasks of eval/evaluations ("task:FILE"), read now (a UserError names a missing or bad file).
  void check_tasks() { tasks_.read(task_paths(opts_.evaluations)); }
  // Runs task files (eval --task, and validate()'s "task:FILE" evaluations) with tokenizer_name()'s
  // tokenizer, on the EMA weights with eval/use_ema. Every rank runs every example.
  std::vector<TaskResult> run_tasks(const std::vector<std::string>& paths);
  // The tokenizer this model reads text with (`--tokenizer auto`, provenance.hpp); a UserError naming
  // `command` when nothing tells.
  std::string tokenizer_name(const std::string& command = "eval") const {
    return provenance_->tokenizer_name(command, step_ > 0);
  }
  // Where the weights and the text come from: the loaded base, the chat format (provenance.hpp).
  const Provenance& provenance() const { return *provenance_; }
  // Saves a checkpoint under job_dir()/suffix; `latest` follows unless told not to. With several
  // ranks every rank calls it: a sharded optimizer state is gathered, rank 0 writes, and all wait at a
  // barrier until the checkpoint is complete.
  void save(const std::string& suffix, bool update_latest = true);

  int64_t step() const { return step_; }
  int64_t tokens() const { return tokens_; }
  int64_t total_steps() const { return total_steps_; }
  int64_t tokens_per_step() const { return batch_size_ * block_size_; }
  int64_t batch_size() const { return batch_size_; }  // the global batch's rows (training/batch_size)
  int64_t micro_batch() const { return micro_batch_; }
  int64_t block_size() const { return block_size_; }
  // The model (a job waiting for its base gets its random initialisation first: settle_random_weights;
  // with plan_only, its parameters as allocated: their shapes, no values).
  CausalLM& model();
  // Trainable parameters in their fixed order (the optimizer's order; with phase 1's parameters
  // sharded, this rank's pieces of them).
  const NamedTensors& trainable() const { return optimizer_->params(); }
  // Calls visit(name, value) for each parameter of the model, in named_params' order, with its whole
  // value: with phase 1's parameters sharded each block is gathered for it (a collective: every rank
  // calls this at the same point), else the parameter itself.
  void visit_whole_params(const std::function<void(const std::string&, const torch::Tensor&)>& visit);

  // Where the weights came from when imported (import-hf's base_model record: family, hf_dir, ...), else null.
  const nlohmann::json& base_model() const { return provenance_->base_model(); }
  // Rank 0, or the only process: the one that writes files and prints.
  bool is_main() const { return dist_.is_main(); }
  AdamW& optimizer() { return *optimizer_; }
  const TrainingOptions& options() const { return opts_; }
  const Runtime& runtime() const { return rt_; }
  Distributed& dist() { return dist_; }
  // The plan's stages, their datasets and samplers (job_data.hpp).
  JobData& data() { return *data_; }
  const JobData& data() const { return *data_; }
  int current_stage() const { return data_->stage_of(step_); }                  // of the step about to be taken
  int trained_stage() const { return step_ == 0 ? 0 : data_->stage_of(step_ - 1); }  // of the step just taken
  // Loads only the model's parameters ("params/*") from a checkpoint; step and tokens stay as they are.
  void load_weights_from(const CheckpointMeta& ck);
  // Loads the model's parameters from `src`, one tensor at a time, each cast once to the dtype and put on
  // the device it lives in (no float32 copy of a weight that lives in bf16): in a job that starts in
  // its LoRA phase, a weight that phase freezes stays bf16 when the source stores it so (a float32 one
  // is rounded by the transition), those it trains (the modules_to_save, an embedding whose token rows
  // train) are float32; float32 in any other job.
  void load_weights_from(const BaseWeights& src);
  // A Hugging Face model directory as the job's starting weights (`run ... --restore HF_DIR`): the base
  // of a LoRA job without phase one, or the starting point of full-parameter training. Its config.json
  // must describe this job's architecture (a UserError lists the settings that differ).
  void restore_from_model_dir(const std::string& dir) override;
  // Fresh optimizer moments over the same parameters, weight decay and per-parameter lr.
  void reset_optimizer();
  // Appends an event to the run's metrics.jsonl (rank 0 only).
  void log_event(const nlohmann::json& event) const { metrics_.event(event); }

  // Every tensor a checkpoint of this state holds, by name (with a sharded optimizer, the moments held
  // by other ranks are zeros here; save() gathers them; with phase 1's parameters sharded, their values,
  // moments and averages are stand-ins of the whole tensors' shapes: save() gathers them, a restore
  // keeps its part). No collectives: restoring reads into these.
  NamedTensors state_tensors();
  StateKind state_kind() const { return in_lora_phase() ? StateKind::Lora : StateKind::Plain; }

  // The LoRA phase (trainer_lora.cpp). A plan without one has no boundary (boundary_step() is the last
  // step), no adapters and no LoRA options.
  bool has_lora_phase() const { return lora_ != nullptr; }
  bool in_lora_phase() const { return lora_ && lora_->entered(); }
  // The LoRA phase (lora_phase.hpp), or null.
  const LoraPhase* lora_phase() const { return lora_.get(); }
  // The step count at the transition: the end of the full-parameter phase.
  int64_t boundary_step() const { return boundary_step_; }
  // The boundary, the mission's entry: saves `pre_lora_checkpoint` when phase 1 ran and it is not there
  // yet; freezes the base as bf16, gives param_filter's targets adapters (inject_lora_params) and trains
  // only those (and any modules_to_save) from here on; reports count_lora_params and the
  // frozen/trainable totals (printed and logged as the `transition` event). Entering the LoRA phase
  // calls it (run(), or train_step at the first LoRA step); a test may call it at any step, but the
  // steps before the boundary still take phase 1's loss (a DPO job's: next-token, on adapters then).
  void transition_to_lora();
  // The adapters, as lora_params_of finds them in the model's layers (empty before the LoRA phase).
  const LoraParams& lora_params() const;
  // The base parameters that train in full in the LoRA phase (f32), by name; empty before it.
  const std::vector<std::string>& saved_modules() const;
  // The token rows that train in the LoRA phase (trainable_token_indices); undefined when off.
  const TrainableTokens& trainable_tokens() const;
  // The LoRA phase's options (a logic error without a LoRA phase).
  const LoraOptions& lora_config() const;
  // The report of a finished LoRA job: per-phase speed, parameter counts, validation perplexity per
  // dataset before and after the LoRA phase, written to report.md beside loss.svg (the loss curves with
  // the boundary marked) in the run directory; "" when no training was logged in it. run() prints it.
  std::string report();

  // Set by SIGINT/SIGTERM; the loop saves and exits after the step in flight (with several ranks, after
  // the step in which any rank saw the signal).
  static std::atomic<bool> stop_requested;
  // Set by `lora_trainer plan`: a trainer made while it is true makes its memory plan and nothing else
  // (no weights drawn, no optimizer, nothing written); it is then only asked for memory_plan().
  static bool plan_only;
  // What the job holds in memory, phase by phase (memory_plan.hpp), made before anything is allocated;
  // a job that does not fit was refused then, and one that loads a base is planned again with its dtype.
  const MemoryPlan& memory_plan() const { return memory_plan_; }
  // The plan for `ranks` ranks, `ranks_here` of them on this machine (`plan --nproc`; a run plans its
  // own), loading a base of `source_bytes` a value when given. A UserError (MemoryPlan::refusal) when it
  // does not fit, unless plan_only.
  void check_memory(int ranks, int ranks_here, std::optional<int> source_bytes);
  // check_memory with the ranks and load of the plan so far (after a part has said what it adds).
  void check_memory_again();
  // A part that keeps a frozen bf16 copy of the model's starting weights (DPO's reference in its
  // full-parameter form) says so before it allocates it: the plan counts it from then on, and a job that
  // no longer fits is refused here (a UserError, unless plan_only).
  void plan_reference_copy();
  // A part that generates `rows` completions at once before each step (GRPO's rollouts) and scores them
  // with unfused log-probabilities says so the same way: the plan counts their KV cache and logits, and
  // the step's rows as `width` positions long (0: block_size).
  void plan_rollouts(int64_t rows, int64_t width);


 private:
  // A job that starts in its LoRA phase allocates its model's parameters without initialising them or
  // putting them on the device (weights_pending_): the base it loads replaces them (load_weights_from),
  // or a LoRA state loads into them (LoraPhase::allocate_base_for_load), so no random draw is made and
  // no float32 copy is placed. Where neither comes (a random base, or a test stepping without one), this
  // gives them the family's random initialisation.
  void settle_random_weights();
  // The full-parameter learning-rate schedule over `steps` steps (opts_.optimizer.schedule:
  // training/schedule, optimization/lr, optimization/min_lr_ratio, training/warmup_pct, training/decay_pct).
  Schedule full_schedule(int64_t steps) const;
  // The trainer's phases, from its plan: every parameter to the boundary (none when the plan starts
  // with adapters), then the adapters to the end (when it has a LoRA phase); the next-token loss.
  std::vector<Phase> own_phases() const;
  // Restores the trainer's state: a full state restores everything (weights, optimizer, counters, data
  // position, RNG); a weights-only checkpoint (`export`) initialises the weights and leaves the counters
  // at zero. A LoRA job first checks the state against its phases (restore_lora_template).
  void restore_state(const CheckpointMeta& ck);
  // Before a run's first step, after the parts': a UserError when it cannot start (a LoRA job without
  // phase 1 and without a base; an init_from source that does not fit).
  void check_can_start();
  // After a run that finished the job (or found it finished), before the parts': a LoRA job's report.
  void report_finished();
  // Whether the optimizer being built keeps only this rank's share of the moments (ZeRO-1), from
  // distributed/shard_optimizer: "all" in both phases, "lora" in the LoRA phase.
  bool shard_optimizer_state() const;
  // Whether the step just taken ends a step line (and its `train` event): every logging/report_interval
  // steps and at the end of each phase (a line never averages two phases' losses: DPO's, in a
  // lora/train job on preference pairs, is not a cross-entropy; the report's per-phase speeds stay apart).
  bool step_line_due() const;
  // A UserError when a dataset of `datasets` is contrastive (preference pairs) and no part measures it
  // (DPO does); text datasets the trainer measures itself.
  void check_measurable(const std::vector<Sampling>& datasets) const;
  // check_measurable, then each part's check of the datasets the job trains on.
  void check_training_datasets(const std::vector<Sampling>& datasets) const;
  // The learning rate for the step about to be taken: the schedule of the phase that trains what
  // trains now.
  double current_lr() const;
  // (Re)builds the optimizer over `params` (which must require gradients) with the configured betas
  // and epsilon, the given weight decay and per-parameter lr multipliers (empty: 1 for all).
  void build_optimizer(NamedTensors params, double weight_decay, std::vector<double> lr_scale = {});
  nlohmann::json checkpoint_metadata() const;
  // The micro-batch loop, the one of every job: this rank's micro-batches of `batch`, each through
  // `loss` (forward and backward of its part of the step's mean; gradients accumulate). Returns this
  // rank's part of the step's mean loss.
  double forward_backward(const Batch& batch, StepLoss& loss);
  // The phase the step about to be taken belongs to.
  Phase phase_of_next_step() const;
  // Reads the stop flag; with several ranks, sums the gradients, `loss` and the flag over the ranks.
  // Returns the step's global loss.
  double sum_over_ranks(double loss);
  // After a sharded optimizer step: every rank gets each parameter from the rank that updated it.
  void sync_sharded_params();
  // The global gradient norm (clipped to optimization/grad_clip), phase 1's sharded pieces' squares
  // summed over the ranks.
  double clip_gradients();
  // state_tensors() as this rank holds them: a sharded parameter's piece, its moments' and average's
  // pieces, under the whole tensors' names.
  NamedTensors local_state_tensors();
  // save() with phase 1's parameters sharded: every rank gathers the sharded tensors block by block, in
  // the order rank 0 writes them.
  void save_sharded(const std::string& dir, const std::string& suffix);
  // The periodic validation's line and event, and the `best` checkpoint when the score improved.
  void validate_and_keep_best(bool stage_end);
  // Saves the periodic checkpoint when one is due or a signal asked to stop; true when the run stops.
  bool save_or_stop();
  // Steps until step `end_step`, each with its step line, validation and periodic checkpoint when due;
  // false when a signal stopped the run (after saving).
  bool train_until(int64_t end_step);
  // The phases not finished yet, each entered and trained to its end; false when a signal stopped them.
  bool train_phases();
  // On rank 0 of a finished job: report_finished, then each part's after_run.
  void finish();

  // The LoRA phase's side of the trainer (trainer_lora.cpp). enter_lora_phase: phase one's sharded
  // parameters whole again, the phase entered (LoraPhase::enter), its optimizer built; a restore of a
  // LoRA state calls it to build the template its tensors load into.
  void enter_lora_phase();
  // A LoRA job's side of a restore, before the trainer's: a plain state or export given to a job
  // without phase 1 becomes the frozen base (true: loaded, nothing more to do); a LoRA state (past the
  // boundary) is checked against this job's settings and gets its LoRA template (the transition); a
  // plain state must be at or before the boundary.
  bool restore_lora_template(const CheckpointMeta& ck);

  const TrainingOptions opts_;  // declared first: the members after it are built from it
  Distributed& dist_;
  MetricsLog metrics_;  // the run directory's metrics.jsonl and config.json, and the lines printed with them
  Runtime rt_;
  CausalLM model_;
  mutable NextTokenLoss next_token_loss_{model_, rt_, dist_};  // mutable: the phases of a const plan name it
  // distributed/shard_params=all with several ranks, in phase 1: the blocks' parameters kept 1/N a rank
  // (the optimizer steps their pieces); null otherwise, and from the LoRA transition on.
  std::unique_ptr<ShardedParams> sharded_params_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<Ema> ema_;  // with optimization/ema/decay > 0: the average of optimizer_'s parameters
  TaskSet tasks_;  // eval/evaluations' task files and eval --task's
  TrainerParts parts_;  // the recipes' parts, in the order added
  std::unique_ptr<JobData> data_;
  MemoryPlan memory_plan_;
  bool reference_copy_ = false;  // plan_reference_copy
  int64_t rollout_rows_ = 0, rollout_width_ = 0;  // plan_rollouts
  int64_t runtime_memory_ = 0;  // the process's own memory before the model was made (job_memory.hpp)
  Schedule schedule_;  // the full-parameter phase's, over its steps
  std::unique_ptr<LoraPhase> lora_;  // null when the plan has no LoRA phase
  int full_stages_ = 0;              // the plan's first stages, those of the full-parameter phase
  int64_t boundary_step_ = 0;        // the full-parameter phase's end step (total_steps_ without LoRA)
  int64_t batch_size_, micro_batch_, block_size_, total_steps_ = 0;
  int64_t rank_rows_ = 0;  // this rank's share of the global batch
  bool stopping_ = false;  // a signal was seen (by any rank) during the last step
  bool weights_pending_ = false;  // the parameters are allocated, not yet initialised, loaded nor placed
  DivergenceGuard divergence_;  // training/on_nonfinite
  int64_t step_ = 0, tokens_ = 0;
  std::optional<double> best_score_;  // of stage best_stage_: `best` is the best of the latest stage
  int best_stage_ = 0;
  // Where the weights and the text come from: the loaded base, the restored checkpoint's tokenizer and chat
  // format, the datasets' records (provenance.hpp).
  std::unique_ptr<Provenance> provenance_;
};


}  // namespace lt
