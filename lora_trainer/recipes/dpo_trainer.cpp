#include "lora_trainer/recipes/dpo_trainer.hpp"

#include <algorithm>
#include <cstdio>

#include "lora_trainer/core/util.hpp"

namespace lt {

namespace {

const std::string kRefPrefix = "ref/";  // full-parameter DPO: the frozen reference's weights

ConfigSchema dpo_schema() {
  ConfigSchema s;
  add_job_options(s, "dpo/train");
  add_trainer_options(s);
  s.remove("training/dataset");
  s.add("training/dataset", OptType::Samplings,
        json::array({{{"name", "preferences"}, {"rate", 1}, {"style", "contrastive"}}}),
        "mixture of contrastive datasets (preference pairs: `tokenize --format pairs`) to train on");
  // The adapters' keys, as lora/train declares them (LoraOptions reads them in the LoRA form).
  const ConfigSchema lora = LoRATrainer::schema();
  for (const OptionSpec& o : lora.options())
    if (o.path.rfind("optimization/lora/", 0) == 0 || o.path == "training/allow_random_base")
      s.add(o.path, o.type, o.default_value, o.doc, o.check);
  add_dpo_options(s);
  return s;
}

StagePlan dpo_stage_plan(const Config& cfg) {
  return {{cfg.get_int("training/tokens")}, {parse_samplings(cfg.get("training/dataset"))}};
}

}  // namespace

template <class Base>
ConfigSchema DpoTrainer<Base>::schema() {
  return dpo_schema();
}

template <>
DpoTrainer<BaseTrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir)
    : BaseTrainer(std::move(spec), std::move(cfg), std::move(out_dir)) {
  init();
}

template <>
DpoTrainer<LoRATrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir)
    : LoRATrainer(std::move(spec), cfg, std::move(out_dir), dpo_stage_plan(cfg), /*pre_lora_stages=*/0) {
  init();
}

template <>
DpoTrainer<LoRATrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir, const StagePlan& plan,
                                    size_t pre_lora_stages)
    : LoRATrainer(std::move(spec), cfg, std::move(out_dir), plan, pre_lora_stages), lora_train_(true) {
  init();
}

template <class Base>
void DpoTrainer<Base>::init() {
  dpo_ = DpoOptions::from_config(this->cfg_);
  if constexpr (kLora) {
    // The reference is the model with its adapters off: modules trained beside them would leak into it.
    if (!this->lora_config().modules_to_save.empty())
      throw UserError("optimization/lora/modules_to_save must be [] in " +
                      std::string(lora_train_ ? "a lora/train job whose post-LoRA datasets are preference pairs (DPO)"
                                              : "dpo/train") +
                      ": the reference model is the base with the adapters switched off, and trained base modules "
                      "would change it too");
  } else {
    reference_ = make_model(this->model_->options());
    reference_->to(this->rt_.device);
    reference_->to(torch::kBFloat16);
    for (auto& p : reference_->parameters()) p.requires_grad_(false);
    reference_->eval();
    copy_reference();
  }
}

template <class Base>
void DpoTrainer<Base>::copy_reference() {
  torch::NoGradGuard ng;
  auto from = named_params(*this->model_), to = named_params(*reference_);
  for (size_t i = 0; i < from.size(); ++i) to[i].second.copy_(from[i].second);
}

template <class Base>
std::vector<Phase> DpoTrainer<Base>::phases() {
  std::vector<Phase> plan = Base::phases();
  plan.back().loss = &pair_loss_;  // lora/train's phase 1 stays next-token training
  return plan;
}

template <class Base>
void DpoTrainer<Base>::check_dataset_styles(const std::vector<Sampling>& datasets) const {
  // lora/train: lora_phase_is_dpo checked each phase's styles when the job was made (text before the
  // boundary, pairs after it); here a stage's list comes without its phase.
  if (lora_train_) return;
  for (const auto& s : datasets)
    if (s.style != DatasetStyle::CONTRASTIVE)
      throw UserError("dpo/train trains on preference pairs, but training/dataset has \"" + s.name + "\" of style " +
                      style_name(s.style) + ": give contrastive datasets (`lora_trainer tokenize --format pairs` of "
                      "JSONL {\"prompt\",\"chosen\",\"rejected\"} records, sampled with \"style\": \"contrastive\")");
}

template <class Base>
void DpoTrainer<Base>::run() {
  // lora/train: its phase 1 trains the base, or LoRATrainer::run asks for one as for any lora/train job.
  if (!lora_train_ && this->step_ == 0 && !has_base_ && !this->cfg_.get_bool("training/allow_random_base"))
    throw UserError("job " + this->spec_.name + " (dpo/train) tunes a pretrained model on preferences: add `--restore "
                    "CHECKPOINT` (a plain checkpoint, an `export`, or an `import-hf` output). To train on randomly "
                    "initialised weights on purpose, set training/allow_random_base=true");
  Base::run();
}

template <class Base>
void DpoTrainer<Base>::restore_from_checkpoint(const CheckpointMeta& ck) {
  if constexpr (kLora) {
    Base::restore_from_checkpoint(ck);  // a LoRA state continues; a plain one or an export is the base
  } else {
    const json dpo = ck.raw.value("dpo", json());
    const bool own_form = !ck.weights_only && ck.kind == StateKind::Plain && dpo.is_object() && !dpo.value("lora", true);
    if (own_form) {
      BaseTrainer::restore_from_checkpoint(ck);  // the reference comes back from its ref/* tensors
    } else {
      if (this->step_ != 0)
        throw UserError("a pretrained base can only be loaded before training starts; " + ck.dir + " came too late");
      this->load_weights_from(ck);
      copy_reference();
    }
  }
  has_base_ = true;
}

template <class Base>
NamedTensors DpoTrainer<Base>::state_tensors() {
  NamedTensors out = Base::state_tensors();
  if (reference_)
    for (auto& [name, t] : named_params(*reference_)) out.emplace_back(kRefPrefix + name, t);
  return out;
}

template <class Base>
json DpoTrainer<Base>::extra_metadata() const {
  json m = Base::extra_metadata();
  m["dpo"] = {{"beta", dpo_.beta},
              {"label_smoothing", dpo_.label_smoothing},
              {"lora", dpo_.lora},
              {"reference", kLora ? "the base with the adapters off" : "a frozen bf16 copy (ref/*)"}};
  return m;
}

template <class Base>
torch::Tensor DpoTrainer<Base>::reference_logps(const torch::Tensor& idx, const torch::Tensor& targets) {
  torch::NoGradGuard ng;
  AutocastGuard autocast(this->rt_);
  if (reference_) return sequence_logps(*reference_, idx, targets);
  // The reference computes without dropout, as the frozen copy does (eval mode).
  AdaptersOff off(*this->model_);
  const bool training = this->model_->is_training();
  this->model_->eval();
  auto out = sequence_logps(*this->model_, idx, targets);
  if (training) this->model_->train();
  return out;
}

template <class Base>
DpoTerms DpoTrainer<Base>::pair_terms(const torch::Tensor& inputs, const torch::Tensor& targets) {
  const int64_t T = this->block_size_;
  auto idx = inputs.reshape({-1, T});  // (2P, T): chosen, rejected, chosen, ...
  auto tgt = targets.reshape({-1, T});
  auto ref = reference_logps(idx, tgt);
  AutocastGuard autocast(this->rt_);
  auto policy = sequence_logps(*this->model_, idx, tgt);
  using torch::indexing::Slice;
  return dpo_loss(policy.index({Slice(0, torch::indexing::None, 2)}), policy.index({Slice(1, torch::indexing::None, 2)}),
                  ref.index({Slice(0, torch::indexing::None, 2)}), ref.index({Slice(1, torch::indexing::None, 2)}), dpo_);
}

template <class Base>
void DpoTrainer<Base>::PairLoss::begin_step(const Batch&, int64_t step) {
  stats_ = DpoStats();
  step_ = step;
}

template <class Base>
torch::Tensor DpoTrainer<Base>::PairLoss::forward_backward(const torch::Tensor& inputs, const torch::Tensor& targets) {
  const double pairs = static_cast<double>(t_.batch_size_);  // the global batch's: every sample is a pair
  DpoTerms terms = t_.pair_terms(inputs, targets);
  auto scaled = terms.losses.sum() / pairs;  // f64 (dpo_loss)
  scaled.backward();
  stats_.add(terms);
  return scaled.detach();
}

template <class Base>
void DpoTrainer<Base>::PairLoss::end_step() {
  if (t_.dist_.active()) {  // the step line's figures are the global batch's
    auto t = stats_.to_tensor().to(t_.rt_.device);
    t_.dist_.all_reduce_sum({t}, "the DPO figures of step " + std::to_string(step_));
    t_.last_ = DpoStats::from_tensor(t);
  } else {
    t_.last_ = stats_;
  }
  t_.window_.add(t_.last_);
}

template <class Base>
json DpoTrainer<Base>::window_metrics() {
  if (window_.pairs == 0) return json::object();  // lora/train's phase 1: no DPO step since the last line
  json m = window_.means();
  m.erase("dpo_loss");  // the step line's loss already is
  window_ = DpoStats();
  return m;
}

template <class Base>
std::vector<DatasetEval> DpoTrainer<Base>::evaluate(const std::vector<Sampling>& datasets, int64_t rows) {
  std::vector<Sampling> text;
  for (const auto& s : datasets)
    if (s.style != DatasetStyle::CONTRASTIVE) text.push_back(s);
  auto ema = this->ema_weights();  // the average in place of the weights while evaluating, with eval/use_ema
  std::vector<DatasetEval> others;
  if (!text.empty())
    others = held_out_loss(this->model_, text, rows, [this](const Sampling& s) -> const Dataset& { return this->open_dataset(s); },
                           {this->micro_batch_, this->block_size_}, this->rt_, this->dist_);
  torch::NoGradGuard ng;
  const bool was_training = this->model_->is_training();
  this->model_->eval();
  const int64_t D = static_cast<int64_t>(datasets.size());
  auto sums = torch::zeros({D, 6}, torch::kFloat64);  // [dataset, DpoStats]
  for (int64_t d = 0; d < D; ++d) {
    if (datasets[static_cast<size_t>(d)].style != DatasetStyle::CONTRASTIVE) continue;
    const Dataset& ds = this->open_dataset(datasets[static_cast<size_t>(d)]);
    DpoStats stats;
    int64_t k = 0;
    for (int64_t first = 0; first < rows; first += this->micro_batch_, ++k) {
      if (k % this->dist_.world_size() != this->dist_.rank()) continue;
      Batch b = validation_rows(ds, this->block_size_, static_cast<uint64_t>(first), std::min(this->micro_batch_, rows - first));
      stats.add(pair_terms(this->rt_.to_device(b.inputs), this->rt_.to_device(b.targets)));
    }
    sums[d] = stats.to_tensor();
  }
  this->dist_.all_reduce_sum({sums}, "the validation DPO sums");
  if (was_training) this->model_->train();
  std::vector<DatasetEval> out;
  size_t next_text = 0;
  for (int64_t d = 0; d < D; ++d) {
    const Sampling& s = datasets[static_cast<size_t>(d)];
    if (s.style != DatasetStyle::CONTRASTIVE) {
      out.push_back(others[next_text++]);
      continue;
    }
    const DpoStats stats = DpoStats::from_tensor(sums[d]);
    const json means = stats.means();
    DatasetEval e;
    e.name = s.name;
    e.style = s.style;
    e.loss = means["dpo_loss"].get<double>();
    e.tokens = static_cast<int64_t>(stats.pairs);
    e.reward_margin = means["reward_margin"].get<double>();
    e.accuracy = means["accuracy"].get<double>();
    out.push_back(e);
  }
  return out;
}

template class DpoTrainer<BaseTrainer>;
template class DpoTrainer<LoRATrainer>;

bool lora_phase_is_dpo(const StagePlan& plan, size_t pre_lora_stages) {
  auto listed = [](const std::vector<Sampling>& list) {
    std::string out;
    for (const auto& s : list) out += std::string(out.empty() ? "" : ", ") + "\"" + s.name + "\" (" + style_name(s.style) + ")";
    return out;
  };
  std::vector<Sampling> pre, post, pairs;
  for (size_t i = 0; i < plan.datasets.size(); ++i)
    for (const auto& s : plan.datasets[i]) {
      auto& list = i < pre_lora_stages ? pre : post;
      if (std::none_of(list.begin(), list.end(), [&](const Sampling& o) { return o.name == s.name && o.style == s.style; }))
        list.push_back(s);
    }
  for (const auto& s : pre)
    if (s.style == DatasetStyle::CONTRASTIVE) pairs.push_back(s);
  if (!pairs.empty())
    throw UserError("training/pre_lora_dataset has preference pairs: " + listed(pairs) + ". Phase 1 trains every "
                    "parameter on next-token prediction, which pairs cannot feed: put them in training/post_lora_dataset "
                    "(the LoRA phase then trains the adapters with DPO) and text datasets (pmd, padded) before the "
                    "boundary");
  const size_t n_pairs = static_cast<size_t>(std::count_if(
      post.begin(), post.end(), [](const Sampling& s) { return s.style == DatasetStyle::CONTRASTIVE; }));
  if (n_pairs != 0 && n_pairs != post.size())
    throw UserError("training/post_lora_dataset mixes preference pairs with single rows: " + listed(post) +
                    ". The LoRA phase trains with DPO when every post-LoRA dataset is contrastive and with the "
                    "next-token loss when none is: make them all one or the other (a second job, --restore'd from "
                    "this one's export, can train the other kind)");
  return n_pairs != 0;
}

ConfigSchema lora_train_schema() {
  ConfigSchema s = LoRATrainer::schema();
  add_dpo_loss_options(s);
  return s;
}

std::unique_ptr<RestorableJob> make_lora_train(JobSpec spec, Config cfg, std::string out_dir) {
  const StagePlan plan = lora_stage_plan(cfg);
  const size_t pre_lora_stages = cfg.get("training/pre_lora_tokens").size();
  if (lora_phase_is_dpo(plan, pre_lora_stages))
    return std::make_unique<DpoTrainer<LoRATrainer>>(std::move(spec), std::move(cfg), std::move(out_dir), plan,
                                                     pre_lora_stages);
  return std::make_unique<LoRATrainer>(std::move(spec), std::move(cfg), std::move(out_dir));
}

}  // namespace lt
