#include "lora_trainer/training/training_options.hpp"

#include "lora_trainer/data/data.hpp"
#include "lora_trainer/training/divergence.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/core/runtime.hpp"

namespace lt {

static const json kDefaultDataset = json::array({{{"name", "english"}, {"rate", 1}, {"style", "pmd"}}});

void add_trainer_options(ConfigSchema& s) {
  add_runtime_options(s);
  add_distributed_options(s);
  s.add("training/seed", OptType::Int, 0, "seed for initialisation, data order and dropout", check_nonnegative());
  s.add("training/batch_size", OptType::Int, 16, "global batch in rows of block_size tokens", check_positive());
  s.add("training/per_device_batch_size", OptType::Int, -1,
        "rows per forward/backward (micro-batch); batch_size / (ranks x this) = gradient-accumulation steps; "
        "-1 = batch_size / ranks",
        check_positive_or_minus_one());
  s.add("training/tokens", OptType::Int, 4194304, "token budget of the run", check_positive());
  s.add("training/dataset", OptType::Samplings, kDefaultDataset,
        "datasets of the run with sampling rates (summing to 1); names are directories under data/dir");
  s.add("training/warmup_pct", OptType::Float, 0.01, "fraction of steps of linear warmup", check_range(0, 1));
  s.add("training/decay_pct", OptType::Float, 0.1, "fraction of steps of final decay (wsd)", check_range(0, 1));
  s.add("training/schedule", OptType::String, "wsd", "learning-rate schedule: constant, wsd or cosine",
        check_one_of(schedule_kind_names()));
  s.add("training/validation", OptType::Bool, true, "run validation every logging/validation_interval steps");
  s.add("training/validation_steps", OptType::Int, 64, "validation rows per dataset", check_positive());
  s.add("optimization/lr", OptType::Float, 6e-4, "peak learning rate", check_positive());
  s.add("optimization/min_lr_ratio", OptType::Float, 0.1, "final lr as a fraction of the peak (wsd, cosine)",
        check_range(0, 1));
  s.add("optimization/weight_decay", OptType::Float, 0.1, "AdamW decoupled weight decay (matrices only)",
        check_nonnegative());
  s.add("optimization/beta1", OptType::Float, 0.9, "AdamW beta1", check_range(0, 0.999999));
  s.add("optimization/beta2", OptType::Float, 0.95, "AdamW beta2", check_range(0, 0.999999));
  s.add("optimization/eps", OptType::Float, 1e-8, "AdamW epsilon", check_positive());
  s.add("training/on_nonfinite", OptType::String, "stop",
        "a step whose loss or gradient norm is NaN or infinite: stop (exit 4 naming the step, loss, gradient norm "
        "and lr; every checkpoint stays finite) or skip (no update for that step, logged; stops after " +
            std::to_string(kMaxSkippedInARow) + " in a row)",
        check_one_of({"stop", "skip"}));
  s.add("optimization/param_groups", OptType::ParamRules, json::array(),
        "per-parameter learning rate and weight decay by name, in both phases: rules [{\"match\": \"wte\", \"lr_ratio\": "
        "0.1, \"weight_decay\": false}], the first whose match is a substring of a trainable parameter's name (e.g. "
        "\"ln_\", \"lora_B\") applying; lr_ratio multiplies its lr, weight_decay turns its decay on or off (default: "
        "matrices decay). [] = none");
  s.add("optimization/ema/decay", OptType::Float, 0.0,
        "keep an exponential moving average of the trainable parameters (the adapters in the LoRA phase): after "
        "every step avg = decay * avg + (1 - decay) * p, e.g. 0.999; saved in checkpoints; 0 = none",
        check_range(0, 0.999999));
  s.add("optimization/grad_clip", OptType::Float, 1.0, "global gradient-norm clip; 0 = off", check_nonnegative());
  add_model_options(s);
  s.add("eval/evaluations", OptType::StringList, json::array({"perplexity"}),
        "evaluations at every validation and stage boundary: \"perplexity\" = held-out loss and perplexity of "
        "every dataset of the plan ([] = only the datasets of the current stage)",
        check_each_one_of({"perplexity"}));
  s.add("eval/use_ema", OptType::Bool, false,
        "validation, eval and sample use the average of optimization/ema/decay instead of the trained weights "
        "(export takes --ema)");
  s.add("data/dir", OptType::String, "datasets/data", "directory holding one sub-directory per tokenized dataset");
  s.add("logging/report_interval", OptType::Int, 10, "steps between metrics lines", check_positive());
  s.add("logging/checkpoint_interval", OptType::Int, 200, "steps between periodic checkpoints", check_positive());
  s.add("logging/validation_interval", OptType::Int, 200, "steps between validations", check_positive());
}

TrainingOptions TrainingOptions::from_config(const Config& cfg) {
  TrainingOptions o;
  o.seed = static_cast<uint64_t>(cfg.get_int("training/seed"));
  o.batch_size = cfg.get_int("training/batch_size");
  o.per_device_batch_size = cfg.get_int("training/per_device_batch_size");
  o.data_dir = cfg.get_string("data/dir");
  OptimizerOptions& opt = o.optimizer;
  opt.adamw.beta1 = cfg.get_double("optimization/beta1");
  opt.adamw.beta2 = cfg.get_double("optimization/beta2");
  opt.adamw.eps = cfg.get_double("optimization/eps");
  opt.adamw.weight_decay = cfg.get_double("optimization/weight_decay");
  opt.grad_clip = cfg.get_double("optimization/grad_clip");
  opt.ema_decay = cfg.get_double("optimization/ema/decay");
  opt.param_rules = parse_param_rules(cfg.get("optimization/param_groups"));
  opt.schedule.kind = parse_schedule_kind(cfg.get_string("training/schedule"));
  opt.schedule.lr = cfg.get_double("optimization/lr");
  opt.schedule.min_lr_ratio = cfg.get_double("optimization/min_lr_ratio");
  opt.schedule.warmup_pct = cfg.get_double("training/warmup_pct");
  opt.schedule.decay_pct = cfg.get_double("training/decay_pct");
  o.shard_optimizer = parse_shard_mode(cfg.get_string("distributed/shard_optimizer"));
  o.skip_nonfinite = cfg.get_string("training/on_nonfinite") == "skip";
  o.validation = cfg.get_bool("training/validation");
  o.validation_steps = cfg.get_int("training/validation_steps");
  o.evaluations = cfg.get("eval/evaluations").get<std::vector<std::string>>();
  o.use_ema = cfg.get_bool("eval/use_ema");
  o.report_interval = cfg.get_int("logging/report_interval");
  o.checkpoint_interval = cfg.get_int("logging/checkpoint_interval");
  o.validation_interval = cfg.get_int("logging/validation_interval");
  return o;
}

}  // namespace lt
