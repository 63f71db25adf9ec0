#include "lora_trainer/training/training_options.hpp"

#include <cstdio>

#include "lora_trainer/training/tasks.hpp"

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/data/data.hpp"
#include "lora_trainer/training/divergence.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/training/plan.hpp"
#include "lora_trainer/core/runtime.hpp"

namespace lt {

// The keys TrainingOptions holds, each bound to its field. distributed/shard_optimizer is declared by
// add_distributed_options (distributed.hpp) and read by from_config.
static const OptionGroup<TrainingOptions>& training_options() {
  using O = TrainingOptions;
  static const auto g =
      OptionGroup<O>()
          .add("training/seed", OptType::Int, 0, "seed for initialisation, data order and dropout",
               [](O& o, const json& v) { o.seed = static_cast<uint64_t>(v.get<int64_t>()); }, check_nonnegative())
          .add("training/batch_size", OptType::Int, 16, "global batch in rows of block_size tokens", &O::batch_size,
               check_positive())
          .add("training/per_device_batch_size", OptType::Int, -1,
               "rows per forward/backward (micro-batch); batch_size / (ranks x this) = gradient-accumulation steps; "
               "-1 = batch_size / ranks",
               &O::per_device_batch_size, check_positive_or_minus_one())
          .add("training/warmup_pct", OptType::Float, 0.01, "fraction of steps of linear warmup",
               [](O& o, const json& v) { o.optimizer.schedule.warmup_pct = v.get<double>(); }, check_range(0, 1))
          .add("training/decay_pct", OptType::Float, 0.1, "fraction of steps of final decay (wsd)",
               [](O& o, const json& v) { o.optimizer.schedule.decay_pct = v.get<double>(); }, check_range(0, 1))
          .add("training/schedule", OptType::String, "wsd", "learning-rate schedule: constant, wsd or cosine",
               [](O& o, const json& v) { o.optimizer.schedule.kind = parse_schedule_kind(v.get<std::string>()); },
               check_one_of(schedule_kind_names()))
          .add("training/validation", OptType::Bool, true, "run validation every logging/validation_interval steps",
               &O::validation)
          .add("training/validation_steps", OptType::Int, 64, "validation rows per dataset", &O::validation_steps,
               check_positive())
          .add("optimization/lr", OptType::Float, 6e-4, "peak learning rate",
               [](O& o, const json& v) { o.optimizer.schedule.lr = v.get<double>(); }, check_positive())
          .add("optimization/min_lr_ratio", OptType::Float, 0.1, "final lr as a fraction of the peak (wsd, cosine)",
               [](O& o, const json& v) { o.optimizer.schedule.min_lr_ratio = v.get<double>(); }, check_range(0, 1))
          .add("optimization/weight_decay", OptType::Float, 0.1, "AdamW decoupled weight decay (matrices only)",
               [](O& o, const json& v) { o.optimizer.adamw.weight_decay = v.get<double>(); }, check_nonnegative())
          .add("optimization/beta1", OptType::Float, 0.9, "AdamW beta1",
               [](O& o, const json& v) { o.optimizer.adamw.beta1 = v.get<double>(); }, check_range(0, 0.999999))
          .add("optimization/beta2", OptType::Float, 0.95, "AdamW beta2",
               [](O& o, const json& v) { o.optimizer.adamw.beta2 = v.get<double>(); }, check_range(0, 0.999999))
          .add("optimization/eps", OptType::Float, 1e-8, "AdamW epsilon",
               [](O& o, const json& v) { o.optimizer.adamw.eps = v.get<double>(); }, check_positive())
          .add("training/on_nonfinite", OptType::String, "stop",
               "a step whose loss or gradient norm is NaN or infinite: stop (exit 4 naming the step, loss, gradient norm "
               "and lr; every checkpoint stays finite) or skip (no update for that step, logged; stops after " +
                   std::to_string(kMaxSkippedInARow) + " in a row)",
               [](O& o, const json& v) { o.on_nonfinite = parse_on_nonfinite(v.get<std::string>()); },
               check_one_of(on_nonfinite_names()))
          .add("optimization/param_groups", OptType::ParamRules, json::array(),
               "per-parameter learning rate and weight decay by name, in both phases: rules [{\"match\": \"wte\", "
               "\"lr_ratio\": 0.1, \"weight_decay\": false}], the first whose match is a substring of a trainable "
               "parameter's name (e.g. \"ln_\", \"lora_B\") applying; lr_ratio multiplies its lr, weight_decay turns its "
               "decay on or off (default: matrices decay). [] = none",
               [](O& o, const json& v) { o.optimizer.param_rules = parse_param_rules(v); })
          .add("optimization/ema/decay", OptType::Float, 0.0,
               "keep an exponential moving average of the trainable parameters (the adapters in the LoRA phase): after "
               "every step avg = decay * avg + (1 - decay) * p, e.g. 0.999; saved in checkpoints; 0 = none",
               [](O& o, const json& v) { o.optimizer.ema_decay = v.get<double>(); }, check_range(0, 0.999999))
          .add("optimization/grad_clip", OptType::Float, 1.0, "global gradient-norm clip; 0 = off",
               [](O& o, const json& v) { o.optimizer.grad_clip = v.get<double>(); }, check_nonnegative())
          .add("eval/evaluations", OptType::StringList, json::array({"perplexity"}),
               "evaluations at every validation and stage boundary: \"perplexity\" = held-out loss and perplexity of "
               "every dataset of the plan ([] = only the datasets of the current stage); \"task:FILE\" = the accuracy "
               "(multiple choice) or exact match (generation) of a JSONL task file, as `eval --task FILE`",
               &O::evaluations,
               [](const json& v) {
                 for (const auto& e : v)
                   if (std::string p = evaluation_problem(e.get<std::string>()); !p.empty()) return p;
                 return std::string();
               })
          .add("eval/use_ema", OptType::Bool, false,
               "validation, eval and sample use the average of optimization/ema/decay instead of the trained weights "
               "(export takes --ema)",
               &O::use_ema)
          .add("data/dir", OptType::String, "datasets/data", "directory holding one sub-directory per tokenized dataset",
               &O::data_dir)
          .add("data/pack", OptType::Bool, false,
               "pack the examples of padded datasets (prompt/completion, chat) several to a row of block_size tokens, "
               "positions restarting and attention kept within each example (docs/chat.md), instead of one example a "
               "row with padding: more examples a step for the same compute",
               &O::pack)
          .add("logging/report_interval", OptType::Int, 10, "steps between metrics lines", &O::report_interval,
               check_positive())
          .add("logging/checkpoint_interval", OptType::Int, 200, "steps between periodic checkpoints",
               &O::checkpoint_interval, check_positive())
          .add("logging/keep_checkpoints", OptType::Int, 0,
               "keep only the newest N periodic checkpoints (ntoks/*) of the job, deleting older ones after each save; "
               "0 keeps them all. best, final, pre_lora_checkpoint and a benchmark's boundary checkpoints are always "
               "kept, and so is the one `latest` names",
               &O::keep_checkpoints, check_nonnegative())
          .add("logging/validation_interval", OptType::Int, 200, "steps between validations", &O::validation_interval,
               check_positive())
          .add("logging/tensorboard", OptType::Bool, true,
               "write the numbers of metrics.jsonl's events (loss, lr, gradient norm, tokens/s, validation losses and "
               "perplexities, the transition, DPO's figures) also as TensorBoard scalars, to an events.out.tfevents.* "
               "file in the run directory (tensorboard --logdir OUT_DIR/runs)",
               &O::tensorboard);
  return g;
}

void add_trainer_options(ConfigSchema& s) {
  add_runtime_options(s);
  add_distributed_options(s);
  training_options().declare(s);
  add_train_plan_options(s);  // the plain trainer's stage plan (TrainingPlan reads it; the LoRA kinds replace it)
  add_model_options(s);
}

TrainingOptions TrainingOptions::from_config(const Config& cfg) {
  TrainingOptions o = training_options().read(cfg);
  const DistributedOptions distributed = DistributedOptions::from_config(cfg);
  o.shard_optimizer = distributed.shard_optimizer;
  o.shard_params = distributed.shard_params;
  return o;
}

TrainingOptions::RankRows TrainingOptions::rank_rows(int64_t ranks, bool main) const {
  RankRows r;
  if (batch_size % ranks != 0)
    throw UserError("training/batch_size (" + std::to_string(batch_size) + ") must be a multiple of the number of ranks (" +
                    std::to_string(ranks) + "): each rank takes an equal share of every batch");
  r.rows = batch_size / ranks;
  const int64_t micro = per_device_batch_size;
  r.micro_batch = micro < 0 ? r.rows : micro;
  if (ranks > 1 && r.micro_batch > r.rows) {
    // More ranks than the config was written for: each rank's share is one micro-batch.
    if (main)
      std::printf("note: with %lld ranks each takes %lld rows a step, fewer than training/per_device_batch_size (%lld): "
                  "each rank runs them as one micro-batch\n",
                  (long long)ranks, (long long)r.rows, (long long)r.micro_batch);
    r.micro_batch = r.rows;
  }
  if (r.rows % r.micro_batch != 0)
    throw UserError(ranks == 1 ? "training/batch_size (" + std::to_string(batch_size) +
                                     ") must be a multiple of training/per_device_batch_size (" + std::to_string(r.micro_batch) + ")"
                               : "with " + std::to_string(ranks) + " ranks each takes training/batch_size / " + std::to_string(ranks) +
                                     " = " + std::to_string(r.rows) + " rows a step, which must be a multiple of "
                                     "training/per_device_batch_size (" + std::to_string(r.micro_batch) +
                                     "); set it to a divisor of " + std::to_string(r.rows) + ", or -1");
  return r;
}

}  // namespace lt
