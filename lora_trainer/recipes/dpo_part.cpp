#include "lora_trainer/recipes/dpo_part.hpp"

#include <algorithm>
#include <cstdio>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/training/lora_options.hpp"

namespace lt {

namespace {

const std::string kRefPrefix = "ref/";  // full-parameter DPO: the frozen reference's weights

}  // namespace

void check_no_modules_to_save(const Trainer& t, const char* job) {
  if (!t.lora_config().modules_to_save.empty())
    throw UserError(std::string("optimization/lora/modules_to_save must be [] in ") + job +
                    ": the reference model is the base with the adapters switched off, and trained base modules "
                    "would change it too");
}

DpoPart::DpoPart(Trainer& trainer, DpoOptions options, bool after_next_token_phase)
    : trainer_(trainer), dpo_(options), lora_train_(after_next_token_phase) {
  if (dpo_.lora) return;
  trainer_.plan_reference_copy();  // counted, and refused if it does not fit, before it is allocated
  if (Trainer::plan_only) return;  // `plan`: the plan is all that is asked for
  reference_ = make_model(trainer_.model()->options());
  reference_->to(trainer_.runtime().device);
  reference_->to(torch::kBFloat16);
  for (auto& p : reference_->parameters()) p.requires_grad_(false);
  reference_->eval();
  copy_reference();
}

void DpoPart::copy_reference() {
  torch::NoGradGuard ng;
  const NamedTensors to = named_params(*reference_);
  size_t i = 0;  // the same model: the same parameters in the same order
  trainer_.visit_whole_params([&](const std::string&, const torch::Tensor& value) { to.at(i++).second.copy_(value); });
}

void DpoPart::plan(std::vector<Phase>& phases) {
  phases.back().loss = &pair_loss_;  // lora/train's phase 1 stays next-token training
}

void DpoPart::check_training_datasets(const std::vector<Sampling>& datasets) const {
  // lora/train: lora_phase_objective checked each phase's styles when the job was made (text before the
  // boundary, pairs after it); here a stage's list comes without its phase.
  if (lora_train_) return;
  for (const auto& s : datasets)
    if (s.style != DatasetStyle::CONTRASTIVE)
      throw UserError("dpo/train trains on preference pairs, but training/dataset has \"" + s.name + "\" of style " +
                      style_name(s.style) + ": give contrastive datasets (`lora_trainer tokenize --format pairs` of "
                      "JSONL {\"prompt\",\"chosen\",\"rejected\"} records, sampled with \"style\": \"contrastive\")");
}

void DpoPart::before_run() {
  // lora/train: its phase 1 trains the base, or the trainer asks for one as for any lora/train job.
  // dpo/train's schema has the LoRA keys in both forms (dpo_train_schema), training/allow_random_base among them.
  if (!lora_train_ && trainer_.step() == 0 && !has_base_ && !LoraOptions::from_config(trainer_.config()).allow_random_base)
    throw UserError("job " + trainer_.spec().name + " (dpo/train) tunes a pretrained model on preferences: add `--restore "
                    "CHECKPOINT` (a plain checkpoint, an `export`, or an `import-hf` output). To train on randomly "
                    "initialised weights on purpose, set training/allow_random_base=true");
}

bool DpoPart::restore(const CheckpointMeta& ck) {
  if (dpo_.lora) return false;  // the trainer's: a LoRA state continues; a plain one or an export is the base
  const json dpo = ck.raw.value("dpo", json());
  const bool own_form = !ck.weights_only && ck.kind == StateKind::Plain && dpo.is_object() && !dpo.value("lora", true);
  if (own_form) return false;  // the reference comes back from its ref/* tensors
  if (trainer_.step() != 0)
    throw UserError("a pretrained base can only be loaded before training starts; " + ck.dir + " came too late");
  trainer_.load_weights_from(ck);
  copy_reference();
  return true;
}

void DpoPart::restored(const CheckpointMeta&) { has_base_ = true; }

void DpoPart::add_state(NamedTensors& tensors) {
  if (reference_)
    for (auto& [name, t] : named_params(*reference_)) tensors.emplace_back(kRefPrefix + name, t);
}

void DpoPart::add_metadata(json& meta) const {
  meta["dpo"] = {{"beta", dpo_.beta},
                 {"label_smoothing", dpo_.label_smoothing},
                 {"lora", dpo_.lora},
                 {"reference", dpo_.lora ? "the base with the adapters off" : "a frozen bf16 copy (ref/*)"}};
}

torch::Tensor DpoPart::reference_logps(const torch::Tensor& idx, const torch::Tensor& targets) {
  torch::NoGradGuard ng;
  AutocastGuard autocast(trainer_.runtime());
  if (reference_) return sequence_logps(*reference_, idx, targets);
  // The reference computes without dropout, as the frozen copy does (eval mode).
  CausalLM& model = trainer_.model();
  AdaptersOff off(*model);
  const bool training = model->is_training();
  model->eval();
  auto out = sequence_logps(*model, idx, targets);
  if (training) model->train();
  return out;
}

DpoTerms DpoPart::pair_terms(const torch::Tensor& inputs, const torch::Tensor& targets) {
  const int64_t T = trainer_.block_size();
  auto idx = inputs.reshape({-1, T});  // (2P, T): chosen, rejected, chosen, ...
  auto tgt = targets.reshape({-1, T});
  auto ref = reference_logps(idx, tgt);
  AutocastGuard autocast(trainer_.runtime());
  auto policy = sequence_logps(*trainer_.model(), idx, tgt);
  using torch::indexing::None;
  using torch::indexing::Slice;
  return dpo_loss(policy.index({Slice(0, None, 2)}), policy.index({Slice(1, None, 2)}), ref.index({Slice(0, None, 2)}),
                  ref.index({Slice(1, None, 2)}), dpo_);
}

void DpoPart::PairLoss::begin_step(const Batch&, int64_t step) {
  stats_ = DpoStats();
  step_ = step;
}

torch::Tensor DpoPart::PairLoss::forward_backward(const Batch& micro) {
  const double pairs = static_cast<double>(part_.trainer_.batch_size());  // the global batch's: every sample is a pair
  DpoTerms terms = part_.pair_terms(micro.inputs, micro.targets);  // preference pairs are never packed
  auto scaled = terms.losses.sum() / pairs;  // f64 (dpo_loss)
  scaled.backward();
  stats_.add(terms);
  return scaled.detach();
}

void DpoPart::PairLoss::end_step() {
  Distributed& dist = part_.trainer_.dist();
  if (dist.active()) {  // the step line's figures are the global batch's
    auto t = stats_.to_tensor().to(part_.trainer_.runtime().device);
    dist.all_reduce_sum({t}, "the DPO figures of step " + std::to_string(step_));
    part_.last_ = DpoStats::from_tensor(t);
  } else {
    part_.last_ = stats_;
  }
  part_.window_.add(part_.last_);
}

void DpoPart::add_window_metrics(json& metrics) {
  if (window_.pairs == 0) return;  // lora/train's phase 1: no DPO step since the last line
  metrics.update(window_.figures().step_json());  // the step line's loss already is the DPO loss
  window_ = DpoStats();
}

std::vector<DatasetEval> DpoPart::measure(const std::vector<Sampling>& datasets, int64_t rows) {
  torch::NoGradGuard ng;
  CausalLM& model = trainer_.model();
  Distributed& dist = trainer_.dist();
  const int64_t micro = trainer_.micro_batch();
  const bool was_training = model->is_training();
  model->eval();
  const int64_t D = static_cast<int64_t>(datasets.size());
  auto sums = torch::zeros({D, 6}, torch::kFloat64);  // [dataset, DpoStats]
  for (int64_t d = 0; d < D; ++d) {
    if (datasets[static_cast<size_t>(d)].style != DatasetStyle::CONTRASTIVE) continue;
    const Dataset& ds = trainer_.data().open(datasets[static_cast<size_t>(d)]);
    DpoStats stats;
    for_rank_micro_batches(rows, micro, dist, !model->block_shards().empty(), [&](int64_t first, int64_t n, bool counted) {
      Batch b = validation_rows(ds, trainer_.block_size(), static_cast<uint64_t>(first), n);
      const auto terms = pair_terms(trainer_.runtime().to_device(b.inputs), trainer_.runtime().to_device(b.targets));
      if (counted) stats.add(terms);
    });
    sums[d] = stats.to_tensor();
  }
  dist.all_reduce_sum({sums}, "the validation DPO sums");
  if (was_training) model->train();
  std::vector<DatasetEval> out;
  for (int64_t d = 0; d < D; ++d) {
    if (datasets[static_cast<size_t>(d)].style != DatasetStyle::CONTRASTIVE) continue;
    DatasetEval e;
    e.name = datasets[static_cast<size_t>(d)].name;
    e.style = datasets[static_cast<size_t>(d)].style;
    e.dpo = DpoStats::from_tensor(sums[d]).figures();
    e.loss = e.dpo.loss;
    e.tokens = e.dpo.pairs;
    out.push_back(e);
  }
  return out;
}

ConfigSchema dpo_train_schema() {
  ConfigSchema s;
  add_job_options(s, "dpo/train");
  add_trainer_options(s);
  s.remove("training/dataset");  // declared again below (last, as before) with DPO's own default and doc
  add_train_plan_options(s, json::array({{{"name", "preferences"}, {"rate", 1}, {"style", "contrastive"}}}),
                         "mixture of contrastive datasets (preference pairs: `tokenize --format pairs`) to train on");
  add_lora_options(s);  // the adapters' keys, as lora/train has them (LoraOptions reads them in the LoRA form)
  add_dpo_options(s);
  return s;
}

std::unique_ptr<Trainer> make_dpo_train(JobSpec spec, Config cfg, std::string out_dir) {
  const DpoOptions dpo = DpoOptions::from_config(cfg);
  TrainingPlan plan = TrainingPlan::from_train_config(cfg);
  if (dpo.lora) plan.full_stages = 0;  // one phase: the adapters, from step 0
  auto t = std::make_unique<Trainer>(std::move(spec), cfg, std::move(out_dir), plan);
  if (dpo.lora) check_no_modules_to_save(*t, "dpo/train");
  t->add_part(std::make_unique<DpoPart>(*t, dpo, /*after_next_token_phase=*/false));
  return t;
}

}  // namespace lt
