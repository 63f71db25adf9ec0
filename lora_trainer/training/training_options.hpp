// The trainers' typed options. Each key is declared once, bound to the field it sets
// (training_options.cpp's OptionGroup, core/options.hpp): add_trainer_options adds the keys to a
// schema, TrainingOptions::from_config reads them once, for Trainer's constructor.
// The model's options are ModelOptions (model.hpp), the runtime's Runtime (runtime.hpp), the LoRA
// phase's LoraOptions (lora_options.hpp), the continual kinds' ContinualOptions (continual.hpp).
#pragma once

#include <string>
#include <vector>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/training/divergence.hpp"
#include "lora_trainer/training/optim.hpp"

namespace lt {

// A learning-rate schedule's settings, as Schedule::make takes them; make(steps) is lr(step) over
// `steps` steps. Filled from the config: TrainingOptions::from_config (the full-parameter schedule)
// and LoraOptions::from_config (the LoRA phase's); the defaults are the schema's.
struct ScheduleOptions {
  ScheduleKind kind{};
  double lr{}, min_lr_ratio{}, warmup_pct{}, decay_pct{};
  Schedule make(int64_t steps) const { return Schedule::make(kind, lr, min_lr_ratio, steps, warmup_pct, decay_pct); }
};

// The full-parameter optimizer (AdamW, gradient clipping, the lr schedule). The LoRA phase keeps the
// betas, epsilon and clip, with its own schedule and weight decay (LoraOptions).
struct OptimizerOptions {
  AdamWOptions adamw;         // optimization/beta1, optimization/beta2, optimization/eps, optimization/weight_decay
  double grad_clip{};         // optimization/grad_clip; 0 = off
  double ema_decay{};         // optimization/ema/decay; 0 = no average (ema.hpp)
  std::vector<ParamRule> param_rules;  // optimization/param_groups: lr ratio and weight decay by name, both phases
  ScheduleOptions schedule;   // training/schedule, optimization/lr, optimization/min_lr_ratio,
                              // training/warmup_pct, training/decay_pct
};

// Every trainer's options besides the architecture (ModelOptions), the runtime (Runtime) and the
// stage plan: the keys add_trainer_options declares, each bound to its field (and
// distributed/shard_optimizer, which add_distributed_options declares), read once by Trainer's
// constructor.
struct TrainingOptions {
  uint64_t seed{};                  // training/seed
  int64_t batch_size{};             // training/batch_size: the global batch in rows
  int64_t per_device_batch_size{};  // training/per_device_batch_size; -1 = batch_size / ranks
  std::string data_dir;             // data/dir
  bool pack = false;                // data/pack
  OptimizerOptions optimizer;       // optimization/* and training/{schedule, warmup_pct, decay_pct}
  ShardMode shard_optimizer{};      // distributed/shard_optimizer
  ShardMode shard_params{};         // distributed/shard_params
  OnNonfinite on_nonfinite{};       // training/on_nonfinite
  bool validation{};                // training/validation
  int64_t validation_steps{};       // training/validation_steps: rows per dataset
  std::vector<std::string> evaluations;  // eval/evaluations
  bool use_ema{};                   // eval/use_ema: validation, eval and sample on the EMA weights
  // logging/report_interval, logging/checkpoint_interval, logging/validation_interval (in steps).
  int64_t report_interval{}, checkpoint_interval{}, validation_interval{};
  int64_t keep_checkpoints{};  // logging/keep_checkpoints: the newest periodic checkpoints kept; 0 = all
  bool tensorboard{};          // logging/tensorboard: a TensorBoard event file beside metrics.jsonl
  static TrainingOptions from_config(const Config& cfg);

  // Each rank's share of the global batch with `ranks` ranks, and its micro-batch (gradient
  // accumulation): a UserError naming training/batch_size or training/per_device_batch_size when they do
  // not divide; a per_device_batch_size larger than a rank's share becomes the share (noted on `main`).
  struct RankRows {
    int64_t rows = 0, micro_batch = 0;
  };
  RankRows rank_rows(int64_t ranks, bool main) const;
};

// Options of every trainer (runtime, optimizer, model, data, logging) and the plain trainer's
// training/tokens and training/dataset. They are read by TrainingOptions::from_config (above), by
// ModelOptions::from_config (architecture/*) and Runtime::from_config (runtime/*); the plain trainer's
// two by TrainingPlan::from_train_config (its stage plan, plan.hpp).
void add_trainer_options(ConfigSchema& s);

}  // namespace lt
