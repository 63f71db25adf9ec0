#include "lora_trainer/recipes/grpo_part.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/prompts.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/models/generate.hpp"
#include "lora_trainer/recipes/dpo_part.hpp"
#include "lora_trainer/training/lora_options.hpp"

namespace lt {

namespace {

const std::string kRollouts = "grpo/rollouts/";  // the checkpoint's tensors of the rollouts being trained on

// The sum of `t` over the ranks, where each rank filled its own rows and left the others zero.
void share_rows(Distributed& dist, const torch::Tensor& t, const std::string& what) {
  if (dist.active()) dist.all_reduce_sum({t}, what);
}

}  // namespace

GrpoPart::GrpoPart(Trainer& trainer, GrpoOptions options, bool after_next_token_phase)
    : trainer_(trainer), opts_(std::move(options)), lora_train_(after_next_token_phase) {
  RewardSet check(opts_.rewards, opts_.max_completion_length, "optimization/grpo/rewards");  // a bad spec fails now
  // Counted, and refused if it does not fit, before a rollout: the step's rows as long as the longest
  // prompt and a whole completion (where the prompts cannot be read yet, as `plan` without the data, block_size).
  int64_t longest = 0;
  for (const Sampling& s : trainer_.data().datasets()) {
    if (s.style != DatasetStyle::PROMPTS) continue;
    try {
      longest = std::max<int64_t>(longest, static_cast<int64_t>(opened_prompts(s).longest_prompt()));
    } catch (const UserError&) {
      longest = 0;  // the run's own opening says what is wrong
      break;
    }
  }
  trainer_.plan_rollouts(opts_.num_generations,
                         longest > 0 ? std::min(trainer_.block_size(), longest + opts_.max_completion_length) : 0);
  if (opts_.num_iterations > 1) {  // the rollouts outlive a step: a checkpoint keeps them
    const int64_t B = trainer_.batch_size(), T = trainer_.block_size();
    rollouts_.inputs = torch::zeros({B, T}, torch::kLong);
    rollouts_.targets = torch::full({B, T}, -1, torch::kLong);
    rollouts_.old_logps = torch::zeros({B, T}, torch::kFloat32);
    rollouts_.advantages = torch::zeros({B}, torch::kFloat64);
    if (opts_.beta > 0) rollouts_.ref_logps = torch::zeros({B, T}, torch::kFloat32);
  }
}

GrpoPart::~GrpoPart() = default;

void GrpoPart::plan(std::vector<Phase>& phases) {
  phases.back().loss = &loss_;  // lora/train's phase 1 stays next-token training
  phases.back().batches = &source_;
}

void GrpoPart::check_training_datasets(const std::vector<Sampling>& datasets) const {
  if (lora_train_) return;  // lora_phase_objective checked each phase's styles when the job was made
  for (const auto& s : datasets)
    if (s.style != DatasetStyle::PROMPTS)
      throw UserError("grpo/train trains on prompts, but training/dataset has \"" + s.name + "\" of style " +
                      style_name(s.style) + ": give prompts datasets (`lora_trainer tokenize --format prompts` of JSONL "
                      "{\"prompt\", \"answer\"} records, sampled with \"style\": \"prompts\")");
}

void GrpoPart::before_run() {
  const std::string job = trainer_.spec().name + " (" + trainer_.spec().kind + ")";
  if (!lora_train_ && trainer_.step() == 0 && !has_base_ && !LoraOptions::from_config(trainer_.config()).allow_random_base)
    throw UserError("job " + job + " sharpens a pretrained model with rewards: add `--restore CHECKPOINT` (a plain "
                    "checkpoint, an `export`, an `import-hf` output or a Hugging Face model directory). To start from "
                    "random weights on purpose, set training/allow_random_base=true");
  const int64_t G = opts_.num_generations, ranks = trainer_.dist().world_size();
  const int64_t rank_rows = trainer_.batch_size() / ranks;
  if (trainer_.batch_size() % G != 0 || rank_rows % G != 0)
    throw UserError("job " + job + ": training/batch_size (" + std::to_string(trainer_.batch_size()) + ") counts completions, " +
                    std::to_string(G) + " a prompt (optimization/grpo/num_generations), and each of the " +
                    std::to_string(ranks) + " rank(s) draws whole groups: make batch_size a multiple of " +
                    std::to_string(G * ranks) + " (e.g. " + std::to_string(G * ranks * std::max<int64_t>(1, trainer_.batch_size() / (G * ranks))) + ")");
  const auto* lp = trainer_.lora_phase();
  if (lp && lp->shards_base())
    throw UserError("job " + job + ": GRPO cannot run with distributed/shard_params: a sharded base gathers its blocks in "
                    "every forward on every rank together, and ranks generating completions of different lengths do not "
                    "keep in step. Set distributed/shard_params=none");
}

std::vector<std::vector<uint32_t>> GrpoPart::complete(const std::vector<uint32_t>& prompt, int64_t n, bool greedy,
                                                       uint64_t seed) {
  GenerateOptions g;
  g.max_new_tokens = opts_.max_completion_length;
  g.temperature = greedy ? 0.0 : opts_.temperature;
  g.top_k = opts_.top_k;
  g.top_p = opts_.top_p;
  g.seed = seed;
  g.stop_ids = stop_ids_;
  g.vocab_limit = tokenizer_ ? static_cast<int64_t>(tokenizer_->vocab_size()) : -1;
  g.tokenizer = tokenizer_ ? tokenizer_->name() : "";
  g.where = "a GRPO prompt";
  auto out = generate_batch(trainer_.model(), trainer_.runtime(), prompt, n, g);
  for (auto& c : out) c = cut_at_stop(c);
  return out;
}

void GrpoPart::read_text_format(const PromptsDataset& ds) {
  if (tokenizer_) return;
  const std::string name = ds.meta().value("tokenizer", std::string());
  try {
    tokenizer_ = make_tokenizer(name.empty() ? trainer_.tokenizer_name("grpo") : name);
  } catch (const UserError& e) {
    throw UserError("the completions of prompts dataset \"" + ds.name() + "\" are decoded with its tokenizer \"" + name +
                    "\" for the rewards, which cannot be read: " + e.what());
  }
  stop_ids_ = {static_cast<uint32_t>(ds.meta().value("eot_id", tokenizer_->eot_id()))};
  if (ds.meta().contains("chat"))
    for (uint32_t id : ChatFormat::from_json(ds.meta()["chat"], "prompts dataset \"" + ds.name() + "\" meta.json").stop_ids)
      if (std::find(stop_ids_.begin(), stop_ids_.end(), id) == stop_ids_.end()) stop_ids_.push_back(id);
}

RewardSet& GrpoPart::reward_set() {
  if (!rewards_) rewards_ = std::make_unique<RewardSet>(opts_.rewards, opts_.max_completion_length, "optimization/grpo/rewards");
  return *rewards_;
}

const PromptsDataset& GrpoPart::opened_prompts(const Sampling& s) const {
  const auto* ds = dynamic_cast<const PromptsDataset*>(&trainer_.data().open(s));
  if (!ds) throw std::logic_error("dataset " + s.name + " of style prompts did not open as one");
  return *ds;
}

const PromptsDataset& GrpoPart::prompts(const Sampling& s) {
  const PromptsDataset& ds = opened_prompts(s);
  read_text_format(ds);
  return ds;
}

std::vector<uint32_t> GrpoPart::cut_at_stop(const std::vector<uint32_t>& c) const {
  if (opts_.stop.empty()) return c;
  for (size_t k = 1; k <= c.size(); ++k) {  // the shortest prefix whose text holds a stop string
    const std::string text = tokenizer_->decode(std::vector<uint32_t>(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(k)));
    for (const auto& s : opts_.stop)
      if (text.find(s) != std::string::npos) return std::vector<uint32_t>(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(k));
  }
  return c;
}

std::vector<RewardInput> GrpoPart::reward_inputs(const PromptsDataset& ds, Split split, uint64_t row,
                                                 const std::vector<uint32_t>& prompt,
                                                 const std::vector<std::vector<uint32_t>>& completions) {
  std::vector<RewardInput> out;
  const std::string prompt_text = tokenizer_->decode(prompt);
  for (const auto& c : completions) {
    RewardInput in;
    in.prompt = prompt_text;
    std::vector<uint32_t> text(c.begin(), c.end());
    if (!text.empty() && std::find(stop_ids_.begin(), stop_ids_.end(), text.back()) != stop_ids_.end()) text.pop_back();
    in.completion = tokenizer_->decode(text);
    for (const auto& s : opts_.stop)  // the text before the stop string
      if (const size_t at = in.completion.find(s); at != std::string::npos) in.completion.resize(at);
    in.completion_tokens = static_cast<int64_t>(c.size());
    in.record = &ds.record(split, row);
    in.where = ds.where(split, row);
    out.push_back(std::move(in));
  }
  return out;
}

nlohmann::json GrpoPart::reward_figures(const std::vector<std::vector<double>>& per, const std::vector<double>& total) const {
  auto mean_std = [](const std::vector<double>& v) {
    double s = 0, n = 0;
    for (double x : v)
      if (!std::isnan(x)) s += x, ++n;
    const double mean = n > 0 ? s / n : NAN;
    double q = 0;
    for (double x : v)
      if (!std::isnan(x)) q += (x - mean) * (x - mean);
    return std::make_pair(mean, n > 1 ? std::sqrt(q / (n - 1)) : 0.0);
  };
  nlohmann::json f;
  const auto [mean, sd] = mean_std(total);
  f["reward"] = mean;
  f["reward_std"] = sd;
  for (size_t k = 0; k < per.size(); ++k) f["reward/" + rewards_->rewards()[k].name] = mean_std(per[k]).first;
  return f;
}

torch::Tensor GrpoPart::logps_of(int64_t first, int64_t n, bool reference) {
  torch::NoGradGuard ng;
  CausalLM& model = trainer_.model();
  const Runtime& rt = trainer_.runtime();
  const int64_t W = rollouts_.width, micro = trainer_.micro_batch();
  auto out = torch::zeros({n, trainer_.block_size()}, torch::kFloat32);
  std::optional<AdaptersOff> off;
  if (reference) off.emplace(*model);
  for (int64_t r = 0; r < n; r += micro) {
    const int64_t m = std::min(micro, n - r);
    auto idx = rt.to_device(rollouts_.inputs.slice(0, first + r, first + r + m).slice(1, 0, W));
    auto tgt = rt.to_device(rollouts_.targets.slice(0, first + r, first + r + m).slice(1, 0, W));
    AutocastGuard autocast(rt);
    auto lp = token_logps(model->forward(idx), tgt, opts_.temperature);
    out.slice(0, r, r + m).slice(1, 0, W).copy_(lp.to(torch::kCPU, torch::kFloat32));
  }
  return out;
}

void GrpoPart::make_rollouts(int64_t first, int64_t count) {
  const double t0 = now_seconds();
  const int64_t G = opts_.num_generations, B = trainer_.batch_size(), T = trainer_.block_size();
  const int64_t step = trainer_.step();
  Distributed& dist = trainer_.dist();
  MixtureSampler& sampler = trainer_.data().sampler(trainer_.current_stage(), step);
  const Batch drawn = sampler.next_share(B / G, first / G, count / G);  // this rank's prompts
  Rollouts& ro = rollouts_;
  if (opts_.num_iterations == 1) {  // made fresh each step (the restorable ones were allocated once)
    ro.inputs = torch::zeros({B, T}, torch::kLong);
    ro.targets = torch::full({B, T}, -1, torch::kLong);
    ro.advantages = torch::zeros({B}, torch::kFloat64);
  } else {
    ro.inputs.zero_();
    ro.targets.fill_(-1);
  }
  RewardSet& rewards = reward_set();
  const size_t K = rewards.rewards().size();
  // [reward k, row] for k < K, then the total, then the completion's tokens, then the row's length: each
  // rank its rows, summed over the ranks so that every rank holds the global batch's.
  auto scores = torch::zeros({static_cast<int64_t>(K) + 3, B}, torch::kFloat64);
  CausalLM& model = trainer_.model();
  const bool training = model->is_training();
  model->eval();
  int64_t generated = 0;
  for (int64_t p = 0; p < count / G; ++p) {
    const Sampling& s = sampler.samplings()[static_cast<size_t>(drawn.source[static_cast<size_t>(p)])];
    const PromptsDataset& ds = prompts(s);
    const uint64_t row = drawn.index[static_cast<size_t>(p)];
    const std::vector<uint32_t> prompt = ds.prompt(Split::Train, row);
    const int64_t P = static_cast<int64_t>(prompt.size());
    if (P + opts_.max_completion_length > T)
      throw UserError(ds.where(Split::Train, row) + " is " + std::to_string(P) + " tokens, and with optimization/grpo/"
                      "max_completion_length (" + std::to_string(opts_.max_completion_length) + ") a rollout would pass "
                      "architecture/block_size (" + std::to_string(T) + "): lower max_completion_length to " +
                      std::to_string(std::max<int64_t>(0, T - static_cast<int64_t>(ds.longest_prompt()))) +
                      " or less, or tokenize shorter prompts");
    const int64_t global_prompt = first / G + p;
    const uint64_t seed = mix64(trainer_.options().seed ^ mix64((static_cast<uint64_t>(step) << 24) ^ static_cast<uint64_t>(global_prompt)));
    const auto completions = complete(prompt, G, /*greedy=*/false, seed);
    const auto inputs = reward_inputs(ds, Split::Train, row, prompt, completions);
    const auto per = rewards.score(inputs);
    const auto total = rewards.combine(per);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = first + p * G + g;
      const auto& c = completions[static_cast<size_t>(g)];
      std::vector<int64_t> seq(prompt.begin(), prompt.end());
      seq.insert(seq.end(), c.begin(), c.end());
      const int64_t L = static_cast<int64_t>(seq.size());
      auto in = ro.inputs[r];
      auto tg = ro.targets[r];
      in.fill_(static_cast<int64_t>(stop_ids_.front()));  // padding after the row: never a target
      in.slice(0, 0, L - 1).copy_(torch::tensor(std::vector<int64_t>(seq.begin(), seq.end() - 1), torch::kLong));
      if (L > P) tg.slice(0, P - 1, L - 1).copy_(torch::tensor(std::vector<int64_t>(seq.begin() + P, seq.end()), torch::kLong));
      for (size_t k = 0; k < K; ++k) scores[static_cast<int64_t>(k)][r] = per[k][static_cast<size_t>(g)];
      scores[static_cast<int64_t>(K)][r] = total[static_cast<size_t>(g)];
      scores[static_cast<int64_t>(K) + 1][r] = static_cast<double>(c.size());
      scores[static_cast<int64_t>(K) + 2][r] = static_cast<double>(L - 1);
      generated += static_cast<int64_t>(c.size());
    }
  }
  const double gen_seconds = now_seconds() - t0;
  share_rows(dist, scores, "the rewards of step " + std::to_string(step + 1));
  share_rows(dist, ro.inputs, "the rollouts of step " + std::to_string(step + 1));
  share_rows(dist, ro.targets, "the rollouts of step " + std::to_string(step + 1));
  if (dist.active()) ro.targets.add_(dist.world_size() - 1);  // each rank's -1s summed: -ranks off its rows
  ro.width = std::max<int64_t>(1, static_cast<int64_t>(scores[static_cast<int64_t>(K) + 2].max().item<double>()));
  ro.advantages.copy_(group_advantages(scores[static_cast<int64_t>(K)], G, opts_.scale_rewards));

  if (opts_.num_iterations > 1) {
    ro.old_logps.zero_();
    ro.old_logps.slice(0, first, first + count).copy_(logps_of(first, count, false));
    share_rows(dist, ro.old_logps, "the rollouts' log-probabilities of step " + std::to_string(step + 1));
  }
  if (opts_.beta > 0) {
    if (!ro.ref_logps.defined() || opts_.num_iterations == 1) ro.ref_logps = torch::zeros({B, T}, torch::kFloat32);
    else ro.ref_logps.zero_();
    ro.ref_logps.slice(0, first, first + count).copy_(logps_of(first, count, true));
    share_rows(dist, ro.ref_logps, "the reference's log-probabilities of step " + std::to_string(step + 1));
  }
  if (training) model->train();
  ro.step = step;
  // The figures of the batch: every rank has every row's.
  std::vector<std::vector<double>> per(K);
  for (size_t k = 0; k < K; ++k) {
    auto v = scores[static_cast<int64_t>(k)].contiguous();
    per[k].assign(v.data_ptr<double>(), v.data_ptr<double>() + B);
  }
  auto tv = scores[static_cast<int64_t>(K)].contiguous();
  rollout_figures_ = reward_figures(per, std::vector<double>(tv.data_ptr<double>(), tv.data_ptr<double>() + B));
  rollout_figures_["completion_tokens"] = scores[static_cast<int64_t>(K) + 1].mean().item<double>();
  rollout_figures_["rollout_tok_per_s"] = static_cast<double>(generated) * dist.world_size() / std::max(1e-9, gen_seconds);
}

Batch GrpoPart::RolloutSource::next_share(int64_t first, int64_t count) {
  GrpoPart& g = part_;
  const int64_t step = g.trainer_.step();
  const int64_t iteration = (step - g.trainer_.boundary_step()) % g.opts_.num_iterations;
  if (iteration == 0 || g.rollouts_.step < 0 || g.rollouts_.step > step) g.make_rollouts(first, count);
  Batch b;
  b.inputs = g.rollouts_.inputs.slice(0, first, first + count).slice(1, 0, g.rollouts_.width);
  b.targets = g.rollouts_.targets.slice(0, first, first + count).slice(1, 0, g.rollouts_.width);
  return b;
}

void GrpoPart::RolloutLoss::begin_step(const Batch&, int64_t step) {
  GrpoPart& g = part_;
  step_ = step;
  size_.rows = g.trainer_.batch_size();
  size_.tokens = static_cast<double>((g.rollouts_.targets >= 0).sum().item<int64_t>());  // the global batch's
  next_row_ = g.trainer_.dist().rank() * (g.trainer_.batch_size() / g.trainer_.dist().world_size());
  tokens_ = clipped_ = kl_ = 0;
}

torch::Tensor GrpoPart::RolloutLoss::forward_backward(const Batch& micro) {
  GrpoPart& g = part_;
  const Runtime& rt = g.trainer_.runtime();
  const int64_t n = micro.inputs.size(0), W = micro.inputs.size(1);
  auto rows = [&](const torch::Tensor& t) { return rt.to_device(t.slice(0, next_row_, next_row_ + n).slice(1, 0, W)); };
  GrpoBatch b;
  {
    AutocastGuard autocast(rt);
    b.logps = token_logps(g.trainer_.model()->forward(micro.inputs), micro.targets, g.opts_.temperature);
  }
  if (g.opts_.num_iterations > 1) b.old_logps = rows(g.rollouts_.old_logps);
  if (g.opts_.beta > 0) b.ref_logps = rows(g.rollouts_.ref_logps);
  b.advantages = rt.to_device(g.rollouts_.advantages.slice(0, next_row_, next_row_ + n));
  b.mask = (micro.targets >= 0).to(torch::kFloat32);

  GrpoTerms terms = grpo_loss(b, g.opts_, size_);
  terms.loss.backward();
  next_row_ += n;
  tokens_ += terms.tokens;
  clipped_ += terms.clipped_low + terms.clipped_high;
  kl_ += terms.kl;
  return terms.loss.detach();
}

void GrpoPart::RolloutLoss::end_step() {
  GrpoPart& g = part_;
  auto sums = torch::tensor({tokens_, clipped_, kl_}, torch::kFloat64);
  share_rows(g.trainer_.dist(), sums, "the GRPO figures of step " + std::to_string(step_));
  const double tokens = std::max(1.0, sums[0].item<double>());
  g.last_ = g.rollout_figures_;
  g.last_["clip_ratio"] = sums[1].item<double>() / tokens;
  if (g.opts_.beta > 0) g.last_["kl"] = sums[2].item<double>() / tokens;
  for (auto& [k, v] : g.last_.items()) {
    const double x = v.is_number() ? v.get<double>() : NAN;
    g.window_sums_[k] = g.window_sums_.value(k, 0.0) + (std::isnan(x) ? 0.0 : x);
  }
  ++g.window_steps_;
}

void GrpoPart::add_window_metrics(nlohmann::json& metrics) {
  if (window_steps_ == 0) return;  // lora/train's phase 1: no GRPO step since the last line
  for (auto& [k, v] : window_sums_.items()) metrics[k] = v.get<double>() / static_cast<double>(window_steps_);
  window_sums_ = nlohmann::json::object();
  window_steps_ = 0;
}

void GrpoPart::add_state(NamedTensors& tensors) {
  if (opts_.num_iterations == 1) return;  // each step's rollouts are made for it
  tensors.emplace_back(kRollouts + "inputs", rollouts_.inputs);
  tensors.emplace_back(kRollouts + "targets", rollouts_.targets);
  tensors.emplace_back(kRollouts + "old_logps", rollouts_.old_logps);
  tensors.emplace_back(kRollouts + "advantages", rollouts_.advantages);
  if (rollouts_.ref_logps.defined()) tensors.emplace_back(kRollouts + "ref_logps", rollouts_.ref_logps);
}

void GrpoPart::add_metadata(nlohmann::json& meta) const {
  nlohmann::json g = {{"loss_type", grpo_loss_type_names()[static_cast<size_t>(opts_.loss_type)]},
                      {"num_generations", opts_.num_generations},
                      {"num_iterations", opts_.num_iterations},
                      {"beta", opts_.beta},
                      {"rewards", opts_.rewards},
                      {"reference", "the base with the adapters off"}};
  if (opts_.num_iterations > 1) {
    g["rollouts_step"] = rollouts_.step;  // the step the saved rollouts were made for (-1: none)
    g["rollouts_width"] = rollouts_.width;
    g["rollout_figures"] = rollout_figures_;
  }
  meta["grpo"] = g;
}

void GrpoPart::restored(const CheckpointMeta& ck) {
  has_base_ = true;
  const nlohmann::json g = ck.raw.value("grpo", nlohmann::json());
  if (opts_.num_iterations == 1 || !g.is_object() || ck.weights_only || ck.kind != StateKind::Lora) {
    rollouts_.step = -1;  // a base, or a state saved between batches: the next step makes its own
    return;
  }
  rollouts_.step = g.value("rollouts_step", int64_t(-1));
  rollouts_.width = g.value("rollouts_width", int64_t(0));
  rollout_figures_ = g.value("rollout_figures", nlohmann::json::object());
  if (g.value("num_iterations", int64_t(1)) != opts_.num_iterations) rollouts_.step = -1;
}

std::vector<DatasetEval> GrpoPart::measure(const std::vector<Sampling>& datasets, int64_t rows) {
  torch::NoGradGuard ng;
  CausalLM& model = trainer_.model();
  Distributed& dist = trainer_.dist();
  const bool was_training = model->is_training();
  model->eval();
  RewardSet& rewards = reward_set();
  const int64_t D = static_cast<int64_t>(datasets.size()), K = static_cast<int64_t>(rewards.rewards().size());
  // [dataset, (each reward's sum) K, (its count) K, the total's sum, its count, prompts, completion tokens]
  auto sums = torch::zeros({D, 2 * K + 4}, torch::kFloat64);
  for (int64_t d = 0; d < D; ++d) {
    if (datasets[static_cast<size_t>(d)].style != DatasetStyle::PROMPTS) continue;
    const PromptsDataset& ds = prompts(datasets[static_cast<size_t>(d)]);
    const uint64_t n_rows = ds.rows(Split::Val);
    for_rank_micro_batches(rows, 1, dist, false, [&](int64_t first, int64_t, bool counted) {
      if (!counted) return;
      const uint64_t row = static_cast<uint64_t>(first) % n_rows;
      const auto prompt = ds.prompt(Split::Val, row);
      if (static_cast<int64_t>(prompt.size()) + opts_.max_completion_length > trainer_.block_size()) return;
      const auto completions = complete(prompt, 1, /*greedy=*/true, 0);
      const auto per = rewards.score(reward_inputs(ds, Split::Val, row, prompt, completions));
      const auto total = rewards.combine(per);
      auto s = sums[d];
      for (int64_t k = 0; k < K; ++k)
        if (!std::isnan(per[static_cast<size_t>(k)][0])) {
          s[k] += per[static_cast<size_t>(k)][0];
          s[K + k] += 1;
        }
      if (!std::isnan(total[0])) {
        s[2 * K] += total[0];
        s[2 * K + 1] += 1;
      }
      s[2 * K + 2] += 1;
      s[2 * K + 3] += static_cast<double>(completions[0].size());
    });
  }
  dist.all_reduce_sum({sums}, "the validation rewards");
  if (was_training) model->train();
  std::vector<DatasetEval> out;
  for (int64_t d = 0; d < D; ++d) {
    if (datasets[static_cast<size_t>(d)].style != DatasetStyle::PROMPTS) continue;
    auto s = sums[d];
    auto ratio = [](double a, double b) { return b > 0 ? a / b : NAN; };
    DatasetEval e;
    e.name = datasets[static_cast<size_t>(d)].name;
    e.style = DatasetStyle::PROMPTS;
    e.figures["reward"] = ratio(s[2 * K].item<double>(), s[2 * K + 1].item<double>());
    for (int64_t k = 0; k < K; ++k)
      e.figures["reward/" + rewards.rewards()[static_cast<size_t>(k)].name] =
          ratio(s[k].item<double>(), s[K + k].item<double>());
    e.figures["completion_tokens"] = ratio(s[2 * K + 3].item<double>(), s[2 * K + 2].item<double>());
    e.loss = -e.figures["reward"].get<double>();
    e.tokens = static_cast<int64_t>(s[2 * K + 2].item<double>());
    out.push_back(e);
  }
  return out;
}

ConfigSchema grpo_train_schema() {
  ConfigSchema s;
  add_job_options(s, "grpo/train");
  add_trainer_options(s);
  s.remove("training/dataset");  // declared again below with GRPO's own default and doc
  add_train_plan_options(s, json::array({{{"name", "prompts"}, {"rate", 1}, {"style", "prompts"}}}),
                         "mixture of prompts datasets (`tokenize --format prompts`) whose completions are rewarded");
  add_lora_options(s);
  add_grpo_options(s);
  return s;
}

std::unique_ptr<Trainer> make_grpo_train(JobSpec spec, Config cfg, std::string out_dir) {
  GrpoOptions grpo = GrpoOptions::from_config(cfg);
  TrainingPlan plan = TrainingPlan::from_train_config(cfg);
  plan.full_stages = 0;  // one phase: the adapters, from step 0
  auto t = std::make_unique<Trainer>(std::move(spec), cfg, std::move(out_dir), plan);
  check_no_modules_to_save(*t, "grpo/train");
  t->add_part(std::make_unique<GrpoPart>(*t, std::move(grpo), /*after_next_token_phase=*/false));
  return t;
}

}  // namespace lt
