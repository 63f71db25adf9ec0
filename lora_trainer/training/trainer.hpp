// BaseTrainer: the step / validate / checkpoint loop of a restorable training job.
//
// One step consumes one global batch of `training/batch_size` rows of `architecture/block_size`
// tokens, split into micro-batches of `training/per_device_batch_size` rows (gradient accumulation),
// then clips the global gradient norm and takes an AdamW step:
//   total_steps = training/tokens / (batch_size * block_size)
// Training may be split into stages (a token budget and a dataset mixture each); the base trainer has
// one (a continual benchmark, several), the LoRA trainer those of both its phases. Recipes are parts of a
// trainer, not subclasses (trainer_part.hpp: DPO, continual learning).
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
#include <string>
#include <vector>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/data/data.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/training/divergence.hpp"
#include "lora_trainer/training/ema.hpp"
#include "lora_trainer/training/evaluation.hpp"
#include "lora_trainer/training/job.hpp"
#include "lora_trainer/training/metrics_log.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/training/optim.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/data/stage_plan.hpp"
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

// A phase of a job's plan: its steps, up to `end_step`, all train the same set of parameters with the
// same loss, on rows from the same source. Entering it, before its first step, changes what trains: the
// LoRA trainer's second phase is entered by transition_to_lora. Phases follow each other in the order of
// their end steps.
struct Phase {
  int64_t end_step = 0;         // the step count after its last step
  std::function<void()> enter;  // null: nothing changes (a job's first phase); else it does nothing when the
                                // state is the phase's already (a restored checkpoint of the phase)
  StepLoss* loss = nullptr;     // what its steps minimise: the trainer's next-token loss, or a part's (DPO's);
                                // every phase names one (train_step refuses a phase without)
  BatchSource* batches = nullptr;  // where its rows come from (continual learning's fades); null: the
                                   // current stage's mixture
};

class BaseTrainer : public RestorableJob {
 public:
  static ConfigSchema schema();
  // One stage: training/tokens over training/dataset.
  BaseTrainer(JobSpec spec, Config cfg, std::string out_dir);

  // Each part's before_run and check_can_start (a UserError when the job cannot start); the plan's phases
  // in order, each entered (Phase::enter) before its first step and trained until its end step
  // (train_until); then the `final` checkpoint and, on rank 0, report_finished and each part's
  // after_run (also when the job was finished already). A resumed run skips the phases it finished.
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

  // One optimizer step. It first enters the phase of the step (Phase::enter, e.g. transition_to_lora:
  // nothing when run() or an earlier step has), so that a caller stepping by hand crosses the phases as
  // run() does.
  StepResult train_step();
  // The plan: the trainer's phases (own_phases) as its parts shape them (TrainerPart::plan).
  std::vector<Phase> phases();
  // Held-out loss of the model (base + adapters in the LoRA phase) on the first `rows` validation
  // samples of each dataset; a part measures the styles it knows (DPO's loss, margin and accuracy of a
  // contrastive one). A UserError for a style nothing measures.
  std::vector<DatasetEval> evaluate(const std::vector<Sampling>& datasets, int64_t rows);
  // With eval/use_ema: the EMA weights in place of the trainable parameters while the result lives
  // (evaluate() takes it itself; `sample` holds it while generating); else null.
  std::unique_ptr<Ema::Swap> ema_weights();
  // Every distinct dataset of the plan, in order of first use.
  std::vector<Sampling> plan_datasets() const;
  // The periodic validation: `training/validation_steps` rows of the datasets of the stage just
  // trained (of every dataset of the plan when eval/evaluations has "perplexity"); the score (`loss`)
  // is token-weighted over the datasets of the stage just trained.
  ValResult validate();
  // Opens every dataset of the plan (UserError naming a missing one).
  void check_datasets();
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
  CausalLM& model() { return model_; }
  // Trainable parameters in their fixed order (the optimizer's order).
  const NamedTensors& trainable() const { return optimizer_->params(); }

  // Where the weights came from when imported (import-hf's base_model record: family, hf_dir, ...), else null.
  const nlohmann::json& base_model() const { return base_model_; }
  // Rank 0, or the only process: the one that writes files and prints.
  bool is_main() const { return dist_.is_main(); }
  AdamW& optimizer() { return *optimizer_; }
  const Runtime& runtime() const { return rt_; }
  Distributed& dist() { return dist_; }
  const std::vector<Stage>& stages() const { return stages_; }
  int current_stage() const;  // the stage of the step about to be taken
  int trained_stage() const;  // the stage of the step just taken
  int stage_of(int64_t step) const;
  // The sampler of a stage's mixture, made when first asked for (at the cursor a restore gave, or the
  // one the step count implies).
  MixtureSampler& sampler(int stage);
  // Opens a dataset and checks its vocabulary fits the model.
  const Dataset& open_dataset(const Sampling& smp);
  // Loads only the model's parameters ("params/*") from a checkpoint; step and tokens stay as they are.
  void load_weights_from(const CheckpointMeta& ck);
  // Fresh optimizer moments over the same parameters, weight decay and per-parameter lr.
  void reset_optimizer();
  // Appends an event to the run's metrics.jsonl (rank 0 only).
  void log_event(const nlohmann::json& event) const { metrics_.event(event); }

  // Every tensor a checkpoint of this state holds, by name (with a sharded optimizer, the moments held
  // by other ranks are zeros here; save() gathers them). No collectives: restoring reads into these.
  NamedTensors state_tensors();
  virtual StateKind state_kind() const { return StateKind::Plain; }

  // Set by SIGINT/SIGTERM; the loop saves and exits after the step in flight (with several ranks, after
  // the step in which any rank saw the signal).
  static std::atomic<bool> stop_requested;

  // The stages of `plan` (a continual benchmark's, dpo/train's).
  BaseTrainer(JobSpec spec, Config cfg, std::string out_dir, const StagePlan& plan);

 protected:
  // Splits token budgets into consecutive stages of whole steps (split_stages) and sets the schedule.
  void plan_stages(const StagePlan& plan);
  // The full-parameter learning-rate schedule over `steps` steps (opts_.optimizer.schedule:
  // training/schedule, optimization/lr, optimization/min_lr_ratio, training/warmup_pct, training/decay_pct).
  Schedule full_schedule(int64_t steps) const;
  // The trainer's phases: one here, every parameter to the end with the next-token loss.
  virtual std::vector<Phase> own_phases();
  // Restores the trainer's state: a full state restores everything (weights, optimizer, counters, data
  // position, RNG); a weights-only checkpoint (`export`) initialises the weights and leaves the counters
  // at zero.
  virtual void restore_state(const CheckpointMeta& ck);
  // Before a run's first step, after the parts': a UserError when it cannot start (the LoRA trainer also
  // records a random base it was allowed to start from). Nothing here.
  virtual void check_can_start() {}
  // After a run that finished the job (or found it finished), before the parts': the trainer's report.
  virtual void report_finished() {}
  // Whether the optimizer being built keeps only this rank's share of the moments (ZeRO-1), from
  // distributed/shard_optimizer ("all" here; the LoRA trainer adds "lora" for its adapters).
  virtual bool shard_optimizer_state() const;
  virtual nlohmann::json extra_metadata() const { return nlohmann::json::object(); }
  // Whether the step just taken ends a step line (and its `train` event): every logging/report_interval
  // steps and at the last (the LoRA trainer adds its boundary, where the loss may change meaning).
  virtual bool step_line_due() const;
  // A UserError when a dataset of `datasets` is contrastive (preference pairs) and no part measures it
  // (DPO does); text datasets the trainer measures itself.
  void check_measurable(const std::vector<Sampling>& datasets) const;
  // check_measurable, then each part's check of the datasets the job trains on.
  void check_training_datasets(const std::vector<Sampling>& datasets) const;
  // After a full state's restore: what the trainer keeps in its own metadata (extra_metadata).
  virtual void restore_extra(const CheckpointMeta& ck) {}
  // The learning rate for the step about to be taken.
  virtual double current_lr() const { return schedule_.at(step_); }
  // (Re)builds the optimizer over `params` (which must require gradients) with the configured betas
  // and epsilon, the given weight decay and per-parameter lr multipliers (empty: 1 for all).
  void build_optimizer(NamedTensors params, double weight_decay, std::vector<double> lr_scale = {});
  // The parameters each optimization/param_groups rule took (rule_of[i]: the rule of trainable i, or -1).
  void log_param_groups(const std::vector<int>& rule_of) const;
  nlohmann::json checkpoint_metadata() const;
  // A UserError naming the architecture/ key when the checkpoint's model computes differently from ours
  // with the same shapes (activation, heads, norm epsilon, rotary base, family).
  void check_same_architecture(const CheckpointMeta& ck) const;
  // The micro-batch loop, the one of every job: this rank's micro-batches of `batch`, each through
  // `loss` (forward and backward of its part of the step's mean; gradients accumulate). Returns this
  // rank's part of the step's mean loss.
  double forward_backward(const Batch& batch, StepLoss& loss);
  // The phase the step about to be taken belongs to.
  Phase phase_of_next_step();
  // Reads the stop flag; with several ranks, sums the gradients, `loss` and the flag over the ranks.
  // Returns the step's global loss.
  double sum_over_ranks(double loss);
  // After a sharded optimizer step: every rank gets each parameter from the rank that updated it.
  void sync_sharded_params();
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

  const TrainingOptions opts_;  // declared first: the members after it are built from it
  Distributed& dist_;
  MetricsLog metrics_;  // the run directory's metrics.jsonl and config.json, and the lines printed with them
  Runtime rt_;
  CausalLM model_;
  NextTokenLoss next_token_loss_{model_, rt_, dist_};
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<Ema> ema_;  // with optimization/ema/decay > 0: the average of optimizer_'s parameters
  std::vector<std::unique_ptr<TrainerPart>> parts_;  // the recipes' parts, in the order added
  std::unique_ptr<DataCatalog> catalog_;
  std::vector<Stage> stages_;
  std::vector<std::unique_ptr<MixtureSampler>> samplers_;
  std::map<int, uint64_t> restored_cursors_;  // from a checkpoint, applied when the sampler is rebuilt
  Schedule schedule_;
  int64_t batch_size_, micro_batch_, block_size_, total_steps_ = 0;
  int64_t rank_rows_ = 0;  // this rank's share of the global batch
  bool stopping_ = false;  // a signal was seen (by any rank) during the last step
  DivergenceGuard divergence_;  // training/on_nonfinite
  int64_t step_ = 0, tokens_ = 0;
  std::optional<double> best_score_;  // of stage best_stage_: `best` is the best of the latest stage
  int best_stage_ = 0;
  // Where the weights came from when the job started from another's (load_weights_from): the source's
  // `base_model` metadata (an import's Hugging Face name and config), carried into every checkpoint
  // of this job so that exports can name the base. null when the job trained its own.
  nlohmann::json base_model_;
};


}  // namespace lt
