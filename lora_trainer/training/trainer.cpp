#include "lora_trainer/training/trainer.hpp"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>

#include "lora_trainer/core/util.hpp"

namespace lt {

std::atomic<bool> Trainer::stop_requested{false};
bool Trainer::plan_only = false;

ConfigSchema Trainer::schema() {
  ConfigSchema s;
  add_job_options(s, "train");
  add_trainer_options(s);
  return s;
}

Trainer::Trainer(JobSpec spec, Config cfg, std::string out_dir)
    : Trainer(spec, cfg, out_dir, TrainingPlan::from_train_config(cfg)) {}

Trainer::Trainer(JobSpec spec, Config cfg, std::string out_dir, const TrainingPlan& plan)
    : RestorableJob(std::move(spec), std::move(cfg), std::move(out_dir)),
      opts_(TrainingOptions::from_config(cfg_)),
      dist_(distributed()),
      metrics_(run_dir(), dist_.is_main() && !plan_only, opts_.tensorboard),
      divergence_(opts_.on_nonfinite, spec_.name, job_dir()) {
  rt_ = Runtime::from_config(cfg_);
  batch_size_ = opts_.batch_size;
  const TrainingOptions::RankRows rows = opts_.rank_rows(dist_.world_size(), dist_.is_main());
  rank_rows_ = rows.rows;
  micro_batch_ = rows.micro_batch;
  torch::manual_seed(opts_.seed);
  runtime_memory_ = runtime_memory();  // before the model: its construction's pages are the job's, reused later
  model_ = make_model(ModelOptions::from_config(cfg_));
  block_size_ = model_->options().block_size;
  // A job that starts in its LoRA phase takes its base from a checkpoint or a model directory: until
  // then its parameters are allocated (untouched pages) and neither drawn nor placed.
  const bool starts_with_adapters = plan.has_lora_phase() && plan.full_stages == 0;
  weights_pending_ = true;
  data_ = std::make_unique<JobData>(opts_.data_dir, model_->options().vocab_size, opts_.pack, plan.stages, batch_size_,
                                    block_size_, opts_.seed,
                                    [this](const std::vector<Sampling>& datasets) { check_training_datasets(datasets); });
  total_steps_ = data_->total_steps();
  std::vector<std::string> datasets;
  for (const auto& smp : data_->datasets()) datasets.push_back(smp.name);
  provenance_ = std::make_unique<Provenance>(opts_.data_dir, std::move(datasets), model_->options().vocab_size,
                                             "the model of job " + spec_.name);
  if (opts_.use_ema && opts_.optimizer.ema_decay <= 0)
    throw UserError("eval/use_ema is true but optimization/ema/decay is 0, so there is no average to use: set "
                    "optimization/ema/decay (e.g. 0.999), or eval/use_ema=false");
  check_param_rules(opts_.optimizer.param_rules, base_params(*model_));  // before the first optimizer is built
  full_stages_ = static_cast<int>(plan.full_stages);
  boundary_step_ = full_stages_ > 0 ? data_->stages()[static_cast<size_t>(full_stages_ - 1)].end_step : 0;
  schedule_ = full_schedule(boundary_step_);  // phase 1's schedule ends at the boundary
  if (plan.has_lora_phase())
    lora_ = std::make_unique<LoraPhase>(cfg_, model_, dist_, rt_.device, opts_.shard_params, opts_.seed,
                                        total_steps_ - boundary_step_);
  check_memory(dist_.world_size(), env_int("LOCAL_WORLD_SIZE", dist_.world_size()), std::nullopt);  // before anything is allocated
  if (plan_only) return;
  if (!starts_with_adapters) settle_random_weights();
  // distributed/shard_params=all: phase one's block parameters kept 1/N a rank from here on.
  if (opts_.shard_params == ShardMode::All && dist_.active() && !starts_with_adapters)
    sharded_params_ = std::make_unique<ShardedParams>(model_, dist_, rt_.device);
  // Phase one's optimizer over every parameter (this rank's pieces of the sharded ones); none for a job
  // that starts with adapters (the transition builds the LoRA phase's): its moments would be twice the
  // base's size, in float32.
  NamedTensors phase_one;
  if (!starts_with_adapters) phase_one = sharded_params_ ? sharded_params_->pieces_of(named_params(*model_)) : named_params(*model_);
  build_optimizer(std::move(phase_one), opts_.optimizer.adamw.weight_decay);
}

void Trainer::check_memory(int ranks, int ranks_here, std::optional<int> source_bytes) {
  bool pairs = false;
  for (const auto& s : data_->datasets()) pairs = pairs || s.style == DatasetStyle::CONTRASTIVE;  // GRPO's rows are single
  MemoryPlanInputs in = job_memory_inputs(model_, opts_, rt_, lora_.get(), full_stages_ > 0, pairs, ranks, ranks_here,
                                            runtime_memory_);
  in.loads_base = source_bytes.has_value();
  in.source_bytes = source_bytes.value_or(2);
  in.reference_copy = reference_copy_;
  in.rollout_rows = rollout_rows_;
  in.rollout_width = rollout_width_;
  memory_plan_ = plan_memory(in);
  if (!memory_plan_.fits() && !plan_only) throw UserError(memory_plan_.refusal());
}

void Trainer::plan_reference_copy() {
  reference_copy_ = true;
  check_memory_again();
}

void Trainer::plan_rollouts(int64_t rows, int64_t width) {
  rollout_rows_ = rows;
  rollout_width_ = width;
  check_memory_again();
}

void Trainer::check_memory_again() {
  const MemoryPlanInputs& was = memory_plan_.inputs;
  check_memory(was.ranks, was.ranks_here, was.loads_base ? std::optional<int>(was.source_bytes) : std::nullopt);
}

CausalLM& Trainer::model() {
  if (weights_pending_ && !plan_only) settle_random_weights();
  return model_;
}

void Trainer::settle_random_weights() {
  if (!weights_pending_) return;
  auto gen = at::detail::createCPUGenerator(opts_.seed);
  model_->init_weights(gen);
  model_->to(rt_.device);
  weights_pending_ = false;
}

void Trainer::build_optimizer(NamedTensors params, double weight_decay, std::vector<double> lr_scale) {
  AdamWOptions o = opts_.optimizer.adamw;  // the configured betas and epsilon
  o.weight_decay = weight_decay;
  const auto& rules = opts_.optimizer.param_rules;
  if (lr_scale.empty()) lr_scale.assign(params.size(), 1.0);
  const std::vector<int> rule_of = apply_param_rules(rules, params, lr_scale);
  optimizer_ = std::make_unique<AdamW>(std::move(params), o, std::move(lr_scale));
  if (sharded_params_)  // a piece is 1-D: it decays as the matrix it is part of
    for (size_t i = 0; i < optimizer_->params().size(); ++i)
      if (sharded_params_->contains(optimizer_->params()[i].first))
        optimizer_->set_decay(i, sharded_params_->shape(optimizer_->params()[i].first).size() >= 2);
  for (size_t i = 0; i < rule_of.size(); ++i)
    if (rule_of[i] >= 0 && rules[static_cast<size_t>(rule_of[i])].weight_decay >= 0)
      optimizer_->set_decay(i, rules[static_cast<size_t>(rule_of[i])].weight_decay == 1);
  if (!rules.empty() && is_main()) {
    std::printf("%s", describe_param_groups(rules, rule_of, optimizer_->params()).c_str());
    std::fflush(stdout);
  }
  if (dist_.active() && shard_optimizer_state()) optimizer_->shard(dist_.rank(), dist_.world_size());
  // A new trainable set (the start, the LoRA transition) starts a new average; a rebuilt optimizer over
  // the same parameters (a benchmark's reset_optimizer) keeps it.
  if (opts_.optimizer.ema_decay > 0 && (!ema_ || optimizer_->param_names() != names_of(ema_->params())))
    ema_ = std::make_unique<Ema>(optimizer_->params(), opts_.optimizer.ema_decay);
}

bool Trainer::shard_optimizer_state() const {
  if (sharded_params_ && !in_lora_phase()) return false;  // the pieces' moments are this rank's already
  const ShardMode mode = opts_.shard_optimizer;
  return in_lora_phase() ? mode != ShardMode::None : mode == ShardMode::All;
}

void Trainer::sync_sharded_params() {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> params;
  const auto& trained = trainable();
  for (size_t i = 0; i < trained.size(); ++i) {
    // x + 0 + ... + 0 == x exactly: the sum over the ranks hands out each owner's value unchanged.
    if (!optimizer_->owns(i)) trained[i].second.zero_();
    params.push_back(trained[i].second);
  }
  dist_.all_reduce_sum(params, "sharing the parameters updated by each rank (step " + std::to_string(step_) + ")");
}

Schedule Trainer::full_schedule(int64_t steps) const {
  return opts_.optimizer.schedule.make(steps);
}

double Trainer::forward_backward(const Batch& batch, StepLoss& loss) {
  loss.begin_step(batch, step_ + 1);
  optimizer_->zero_grad();
  torch::Tensor loss_total;  // f64 on the device: read once a step, not once a micro-batch
  for (int64_t first = 0; first < rank_rows_; first += micro_batch_) {
    const Batch micro = batch.map([&](const torch::Tensor& t) { return rt_.to_device(t.slice(0, first, first + micro_batch_)); });
    auto part = loss.forward_backward(micro).to(torch::kFloat64);
    loss_total = loss_total.defined() ? loss_total + part : part;
  }
  loss.end_step();
  return loss_total.item<double>();
}

void Trainer::reset_optimizer() {
  // The same parameters, weight decay and per-parameter lr (a LoRA stage's modules_to_save keep their ratio).
  auto params = optimizer_->params();
  build_optimizer(params, optimizer_->weight_decay(), optimizer_->lr_scale());
}

Phase Trainer::phase_of_next_step() const {
  for (Phase& phase : phases())
    if (step_ < phase.end_step) {
      TORCH_CHECK(phase.loss, "the phase ending at step ", phase.end_step, " names no StepLoss (Phase::loss)");
      return phase;
    }
  throw std::logic_error("no phase holds step " + std::to_string(step_ + 1) + " of " + std::to_string(total_steps_));
}

double Trainer::sum_over_ranks(double loss) {
  stopping_ = stop_requested.load();
  if (!dist_.active()) return loss;
  // One sum over the ranks: the gradients (so clipping sees the global norm), the loss, and
  // whether any rank was asked to stop (so all stop after the same step).
  std::vector<torch::Tensor> sums;
  for (const auto& [name, p] : trainable()) {
    if (sharded_params_ && sharded_params_->contains(name)) continue;  // summed in the backward, block by block
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    sums.push_back(p.grad());
  }
  auto extra = torch::tensor({static_cast<float>(loss), stopping_ ? 1.0f : 0.0f}, torch::kFloat32).to(rt_.device);
  sums.push_back(extra);
  dist_.all_reduce_sum(sums, "the gradient sum of step " + std::to_string(step_ + 1));
  auto host = extra.cpu();
  stopping_ = host[1].item<float>() > 0;
  return host[0].item<double>();
}

double Trainer::clip_gradients() {
  if (!sharded_params_) return clip_grad_norm(trainable(), opts_.optimizer.grad_clip);
  std::vector<bool> piece;
  for (const auto& [name, p] : trainable()) piece.push_back(sharded_params_->contains(name));
  return clip_grad_norm(trainable(), opts_.optimizer.grad_clip, piece, [&](double pieces_sq) {
    auto t = torch::tensor({pieces_sq}, torch::kFloat64);
    dist_.all_reduce_sum({t}, "the gradient norm of step " + std::to_string(step_ + 1));
    return t.item<double>();
  });
}

StepResult Trainer::train_step() {
  TORCH_CHECK(step_ < total_steps_, "train_step past the end of training");
  const Phase phase = phase_of_next_step();
  // Entering the phase, as run() does: a caller stepping by hand crosses the boundary here.
  if (phase.trains == Trainable::Adapters && !in_lora_phase()) transition_to_lora();
  double t0 = now_seconds();
  model_->train();
  if (dist_.active())  // each rank its own dropout masks, the same after a restore
    torch::manual_seed(mix64(opts_.seed ^ mix64((static_cast<uint64_t>(step_) << 16) + static_cast<uint64_t>(dist_.rank()))));
  const int64_t first = rank_rows_ * dist_.rank();
  Batch batch = phase.batches ? phase.batches->next_share(first, rank_rows_)
                              : data_->sampler(current_stage(), step_).next_share(batch_size_, first, rank_rows_);
  const double loss = sum_over_ranks(forward_backward(batch, *phase.loss));
  StepResult r;
  r.grad_norm = clip_gradients();
  r.lr = current_lr();
  r.loss = loss;
  // Every rank sees the same global loss and norm, so all take the same branch.
  r.skipped = !std::isfinite(loss) || !std::isfinite(r.grad_norm);
  if (r.skipped) {
    divergence_.on_nonfinite(step_ + 1, r.loss, r.grad_norm, r.lr, metrics_);  // throws unless the policy is to skip
  } else {
    divergence_.on_finite();
    optimizer_->step(r.lr);
    if (optimizer_->sharded()) sync_sharded_params();
    if (ema_) ema_->update();
  }
  ++step_;
  tokens_ += tokens_per_step();
  r.step = step_;
  r.seconds = now_seconds() - t0;
  return r;
}

bool Trainer::step_line_due() const {
  if (step_ % opts_.report_interval == 0) return true;
  for (const Phase& phase : own_phases())
    if (step_ == phase.end_step) return true;
  return false;
}

void Trainer::check_training_datasets(const std::vector<Sampling>& datasets) const {
  check_measurable(datasets);
  for (const auto& part : parts_) part->check_training_datasets(datasets);
}

void Trainer::check_measurable(const std::vector<Sampling>& datasets) const {
  for (const auto& s : datasets)
    if (s.style == DatasetStyle::CONTRASTIVE && !some_part_measures(parts_, s.style))
      throw UserError("dataset \"" + s.name + "\" is contrastive (preference pairs): it trains with DPO, in a `dpo/train` "
                      "job or the LoRA phase of a `lora/train` job (as its post-LoRA datasets), not in a " + spec_.kind +
                      " job");
    else if (s.style == DatasetStyle::PROMPTS && !some_part_measures(parts_, s.style))
      throw UserError("dataset \"" + s.name + "\" holds prompts: they train with GRPO, in a `grpo/train` job or the LoRA "
                      "phase of a `lora/train` job (as its post-LoRA datasets), not in a " + spec_.kind + " job");
}

std::unique_ptr<Ema::Swap> Trainer::ema_weights() {
  if (!opts_.use_ema) return nullptr;
  if (!ema_)
    throw UserError("eval/use_ema is true but this job keeps no average: set optimization/ema/decay (for eval and "
                    "sample, on a checkpoint of a run that had it)");
  return std::make_unique<Ema::Swap>(*ema_);
}

std::vector<DatasetEval> Trainer::evaluate(const std::vector<Sampling>& datasets, int64_t rows) {
  check_measurable(datasets);
  auto ema = ema_weights();  // the average in place of the weights while evaluating, with eval/use_ema
  return measure_datasets(parts_, datasets, rows, [&](const std::vector<Sampling>& text) {  // held-out cross-entropy
    return held_out_loss(model_, text, rows, [this](const Sampling& smp) -> const Dataset& { return data_->open(smp); },
                         {micro_batch_, block_size_}, rt_, dist_);
  });
}

ValResult Trainer::validate() {
  const Stage& scored = data_->stages()[static_cast<size_t>(trained_stage())];
  const auto& evals = opts_.evaluations;
  bool perplexity = std::find(evals.begin(), evals.end(), "perplexity") != evals.end();
  ValResult v = validation_score(evaluate(perplexity ? data_->datasets() : scored.samplings, opts_.validation_steps),
                                 scored.samplings);
  v.tasks = run_tasks(task_paths(evals));
  return v;
}

std::vector<TaskResult> Trainer::run_tasks(const std::vector<std::string>& paths) {
  if (paths.empty()) return {};
  auto ema = ema_weights();
  return tasks_.run(model_, rt_, paths, [this] { return tokenizer_name("eval/evaluations"); });
}

void Trainer::validate_and_keep_best(bool stage_end) {
  ValResult v = validate();
  metrics_.log_validation(step_, tokens_, trained_stage(), v, stage_end);
  if (!std::isfinite(v.loss)) {
    std::printf("  warning: the validation loss is not finite; `best` is not updated\n");
  } else if (!best_score_ || v.loss < *best_score_ || best_stage_ != trained_stage()) {
    best_score_ = v.loss;
    best_stage_ = trained_stage();
    save("best", false);
  }
}

bool Trainer::save_or_stop() {
  // One process stops on a signal seen any time; ranks on the one they agreed on in the step.
  const bool stop = dist_.active() ? stopping_ : stop_requested.load();
  if (step_ >= total_steps_ || (step_ % opts_.checkpoint_interval != 0 && !stop)) return false;
  save("ntoks/" + std::to_string(tokens_));
  if (opts_.keep_checkpoints > 0 && is_main()) {  // after the save: a kill before this leaves one more
    const auto deleted = prune_periodic_checkpoints(job_dir(), spec_.name, opts_.keep_checkpoints);
    if (!deleted.empty())
      std::printf("deleted %s (logging/keep_checkpoints=%lld)\n", join(deleted).c_str(), (long long)opts_.keep_checkpoints);
  }
  if (stop)
    std::printf("stopped by signal after step %lld; checkpoint %s/ntoks/%lld saved.\n"
                "Resume with the same `lora_trainer run %s ...` command (it continues from `latest`).\n",
                (long long)step_, job_dir().c_str(), (long long)tokens_, spec_.name.c_str());
  return stop;
}

extern "C" void lt_on_signal(int) { Trainer::stop_requested.store(true); }

void Trainer::run() {
  for (const auto& part : parts_) part->before_run();
  check_can_start();
  settle_random_weights();  // a job that neither loaded a base nor restored a state: the family's init
  int64_t first = step_;  // every rank must continue from the same state: rank 0's step, on every rank
  if (dist_.active() && !dist_.same_on_every_rank(step_, "comparing the ranks' starting steps", &first))
    throw UserError("the ranks start from different steps (rank 0 at step " + std::to_string(first) + ", this rank at " +
                    std::to_string(step_) + "): every rank must see the same checkpoints under OUT_DIR (" + out_dir_ +
                    "); on several machines, put OUT_DIR on a shared file system");
  metrics_.write_config(cfg_.to_json());
  if (done()) {
    std::printf("job %s already finished at step %lld (%lld tokens); checkpoints in %s\n", spec_.name.c_str(),
                (long long)step_, (long long)tokens_, job_dir().c_str());
    finish();
    return;
  }
  if (lora_ && !lora_->base_note().empty() && is_main()) std::printf("%s\n", lora_->base_note().c_str());
  int64_t n_params = 0;
  for (auto& [n, t] : base_params(*model_)) n_params += t.numel();
  std::printf("job %s (%s): %.2fM parameters, %s%s, step %lld of %lld (%lld tokens per step)\n", spec_.name.c_str(),
              spec_.kind.c_str(), n_params / 1e6, rt_.describe().c_str(),
              dist_.active() ? (" per rank, " + std::to_string(dist_.world_size()) + " ranks (" +
                                std::to_string(rank_rows_) + " rows each a step)").c_str() : "",
              (long long)step_, (long long)total_steps_, (long long)tokens_per_step());
  if (sharded_params_ && is_main()) std::printf("%s\n", sharded_params_->describe(dist_.world_size(), opts_.shard_params).c_str());
  if (is_main()) std::printf("%s\n", memory_plan_.summary().c_str());
  if (is_main() && !provenance_->chat_conflict().empty())  // conversations from two templates: the checkpoints record neither
    std::printf("note: %s; the checkpoints record no chat template, so their exports carry none\n",
                provenance_->chat_conflict().c_str());
  std::fflush(stdout);
  data_->open_all();  // a missing dataset is found now, not at its stage
  check_tasks();     // and a missing or malformed task file
  metrics_.truncate_after(step_);  // a resumed run drops the lines of steps it will redo
  stop_requested = false;
  stopping_ = false;
  SignalGuard signals(lt_on_signal);  // the previous handlers come back however run() ends
  const bool finished = train_phases();
  if (is_main()) {  // the measured peak beside the plan's
    const MeasuredMemory m = measure_memory(memory_plan_, rt_);
    std::printf("%s\n", m.line.c_str());
    log_event(m.event(step_));
  }
  if (!finished) return;  // a signal stopped the run: saved
  save("final/" + std::to_string(tokens_));
  std::printf("finished: %lld steps, %lld tokens; final checkpoint %s/final/%lld\n", (long long)step_,
              (long long)tokens_, job_dir().c_str(), (long long)tokens_);
  finish();
}

void Trainer::finish() {
  if (!is_main()) return;
  report_finished();
  for (const auto& part : parts_) part->after_run();
}

bool Trainer::train_phases() {
  for (const Phase& phase : phases()) {
    if (step_ >= phase.end_step) continue;  // finished before this run (a resumed job)
    if (phase.trains == Trainable::Adapters && !in_lora_phase()) transition_to_lora();  // the boundary
    if (!train_until(phase.end_step)) return false;
  }
  return true;
}

std::vector<Phase> Trainer::own_phases() const {
  StepLoss* next_token = &next_token_loss_;
  std::vector<Phase> out;
  if (!lora_ || full_stages_ > 0)
    out.push_back({Trainable::AllParameters, 0, full_stages_, 0, boundary_step_, schedule_, next_token, nullptr});
  if (lora_)
    out.push_back({Trainable::Adapters, full_stages_, static_cast<int>(data_->stages().size()), boundary_step_, total_steps_,
                   lora_->schedule(), next_token, nullptr});
  return out;
}

double Trainer::current_lr() const {
  const Trainable now = in_lora_phase() ? Trainable::Adapters : Trainable::AllParameters;
  for (const Phase& phase : own_phases())
    if (phase.trains == now) return phase.schedule.at(step_ - phase.first_step);
  throw std::logic_error("no phase of the plan trains what trains at step " + std::to_string(step_ + 1));
}

void Trainer::check_can_start() {
  if (lora_) lora_->check_can_start(spec_.name, boundary_step_, step_);
  if (opts_.shard_params != ShardMode::None && !(lora_ && lora_->shards_base()) && !sharded_params_ && is_main()) {
    std::printf("note: distributed/shard_params=%s has no effect in this run: %s\n", shard_mode_name(opts_.shard_params).c_str(),
                dist_.active() ? "the job has no LoRA phase, whose frozen base it shards (distributed/shard_params=all "
                                 "shards the parameters phase 1 trains too)"
                               : "it runs as one process, and the parameters are split across ranks");
    std::fflush(stdout);
  }
}

void Trainer::report_finished() {
  if (!lora_) return;
  std::string text = report();
  if (text.empty()) {  // no training was logged under this name (e.g. `restore` of a finished job)
    std::printf("no report: no training steps were logged in %s (the report of the run that trained this job is in "
                "that run's directory)\n", run_dir().c_str());
    return;
  }
  std::printf("%s", text.c_str());
  std::fflush(stdout);
}

std::vector<Phase> Trainer::phases() const {
  std::vector<Phase> plan = own_phases();
  for (const auto& part : parts_) part->plan(plan);
  return plan;
}

bool Trainer::train_until(int64_t end_step) {
  StepWindow window;  // the steps since the last step line
  while (step_ < end_step) {
    StepResult r = train_step();
    window.add(r.loss, r.seconds);
    if (step_line_due()) {
      json figures = json::object();  // the parts' (DPO's margin and accuracy) besides the loss
      for (const auto& part : parts_) part->add_window_metrics(figures);
      if (rt_.device.is_cuda()) figures["gpu_peak_gb"] = static_cast<double>(rt_.device_peak_bytes()) / 1e9;  // since the start
      metrics_.log_train({r.step, total_steps_, tokens_, trained_stage(), r.lr, r.grad_norm, figures}, window,
                         tokens_per_step());
    }
    const bool stage_end = step_ == data_->stages()[static_cast<size_t>(trained_stage())].end_step;
    if (stage_end)  // before validation, so `best` includes its effects
      for (const auto& part : parts_) part->on_stage_end(trained_stage());
    if (opts_.validation && (step_ % opts_.validation_interval == 0 || stage_end)) validate_and_keep_best(stage_end);
    if (save_or_stop()) return false;
  }
  return true;
}

}  // namespace lt
