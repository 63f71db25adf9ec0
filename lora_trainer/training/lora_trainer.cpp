#include "lora_trainer/training/lora_trainer.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "lora_trainer/core/options.hpp"
#include "lora_trainer/formats/adapter_source.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/report.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

static const char* kPreLoraCheckpoint = "pre_lora_checkpoint";

// lora.cpp knows its settings, not the config: its errors get their key (optimization/lora/...) here.
template <class F>
static auto with_lora_keys(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const LoraSettingError& e) {
    throw UserError("optimization/lora/" + e.setting() + ": " + e.what());
  }
}

// optimization/lora/* and training/allow_random_base, each bound to the LoraOptions field it sets.
// optimization/min_lr_ratio, phase 1's key, is read by from_config: both phases decay to it.
static void read_token_indices(LoraOptions& c, const json& tokens) {
  if (tokens.is_object() && tokens.size() > 1)
    throw UserError("optimization/lora/trainable_token_indices: " + tokens.dump() + " names " + std::to_string(tokens.size()) +
                    " modules; these models have one token embedding (a head tied to it follows it): name it once");
  if (tokens.is_object() && tokens.size() == 1) {
    c.token_module = tokens.begin().key();
    c.token_ids = tokens.begin().value().get<std::vector<int64_t>>();
  } else if (tokens.is_array()) {
    c.token_ids = tokens.get<std::vector<int64_t>>();
  }
}

static const OptionGroup<LoraOptions>& lora_options() {
  using O = LoraOptions;
  static const auto g =
      OptionGroup<O>()
          .add("training/allow_random_base", OptType::Bool, false,
               "with no pre-LoRA stages: let the adapters train on randomly initialised base weights (a study of LoRA "
               "alone). Otherwise such a job needs a pretrained base: `run ... --restore CHECKPOINT`",
               &O::allow_random_base)
          .add("optimization/lora/rank", OptType::Int, 16, "adapter rank r",
               &O::rank, check_positive())
          .add("optimization/lora/alpha", OptType::Float, 16.0, "adapter scale numerator: W + (alpha/r) A B",
               &O::alpha, check_positive())
          .add("optimization/lora/target_modules", OptType::StringList,
               json::array({kAllLinear}),
               "substrings of parameter names whose 2-D weights get adapters, or \"all-linear\" (PEFT's value, the default): "
               "every linear layer of the blocks (gpt2: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; llama: q/k/v/o_proj, "
               "gate/up/down_proj), not the output head",
               &O::target_modules)
          .add("optimization/lora/init", OptType::String, "gaussian",
               "how adapter A is drawn (B starts at zero): gaussian, normal(0, 1/r) as in the reference framework and PEFT's "
               "\"gaussian\"; or kaiming_uniform, uniform(+-1/sqrt(in)) as PEFT's default",
               [](O& o, const json& v) { o.init = with_lora_keys([&] { return parse_lora_init(v.get<std::string>()); }); },
               check_one_of({"gaussian", "kaiming_uniform"}))
          .add("optimization/lora/modules_to_save", OptType::StringList, json::array(),
               "base modules or parameters that train in full beside the adapters, as PEFT's modules_to_save (e.g. [\"wte\"]: "
               "the token embedding, tied to the output head; [\"ln_1\", \"ln_2\", \"ln_f\"]: every layer norm). Names or "
               "suffixes after a '.'; they stay f32 with their own AdamW moments. Default: none, the whole base frozen in bf16",
               &O::modules_to_save)
          .add("optimization/lora/modules_to_save_lr_ratio", OptType::Float, 1.0,
               "learning rate of the modules_to_save as a fraction of optimization/lora/lr (e.g. 0.1 for an embedding)",
               &O::modules_to_save_lr_ratio,
               check_positive())
          .add("optimization/lora/trainable_token_indices", OptType::TokenIndices, json::array(),
               "token ids whose rows of the token embedding train beside the adapters, as PEFT's trainable_token_indices: a "
               "list (e.g. [50256]) applies to the token embedding and a head tied to it; PEFT's dict form names the module "
               "({\"wte\": [50256]}). The rows keep f32 values that replace the frozen ones, with their own AdamW moments at "
               "optimization/lora/lr. Not with modules_to_save of the same embedding. Default []: none",
               read_token_indices)
          .add("optimization/lora/init_from", OptType::String, "",
               "start the adapters from an earlier run's instead of drawing them: one of our LoRA checkpoints or a PEFT adapter "
               "directory (adapter_config.json + adapter_model.safetensors) with the same targets, rank and scale. Applied at "
               "the transition; \"\" = drawn by optimization/lora/init",
               &O::init_from)
          .add("optimization/lora/rslora", OptType::Bool, false,
               "rank-stabilised LoRA: scale the adapters by alpha/sqrt(r) instead of alpha/r (PEFT's use_rslora)",
               &O::rslora)
          .add("optimization/lora/dora", OptType::Bool, false,
               "DoRA (PEFT's use_dora): each adapted weight also trains a magnitude per output feature, W' = m (W + s A B) / "
               "||W + s A B|| row by row; m starts at the base's row norms and trains at B's lr without weight decay",
               &O::dora)
          .add("optimization/lora/lr_ratio", OptType::Float, 1.0,
               "LoRA+: the learning rate of every B over that of A (the LoRA+ paper suggests 16); 1 trains both alike",
               &O::lr_ratio,
               check_positive())
          .add("optimization/lora/lr", OptType::Float, 1e-3, "peak learning rate of the LoRA phase",
               [](O& o, const json& v) { o.schedule.lr = v.get<double>(); }, check_positive())
          .add("optimization/lora/schedule", OptType::String, "wsd", "LoRA-phase schedule: constant, wsd or cosine",
               [](O& o, const json& v) { o.schedule.kind = parse_schedule_kind(v.get<std::string>()); },
               check_one_of({"constant", "wsd", "cosine"}))
          .add("optimization/lora/warmup_pct", OptType::Float, 0.05, "LoRA-phase warmup fraction",
               [](O& o, const json& v) { o.schedule.warmup_pct = v.get<double>(); }, check_range(0, 1))
          .add("optimization/lora/decay_pct", OptType::Float, 0.1, "LoRA-phase final decay fraction (wsd)",
               [](O& o, const json& v) { o.schedule.decay_pct = v.get<double>(); }, check_range(0, 1))
          .add("optimization/lora/weight_decay", OptType::Float, 0.0, "AdamW weight decay on the adapters",
               &O::weight_decay, check_nonnegative());
  return g;
}

void add_lora_options(ConfigSchema& s) { lora_options().declare(s); }

LoraOptions LoraOptions::from_config(const Config& cfg) {
  LoraOptions c = lora_options().read(cfg);
  c.schedule.min_lr_ratio = cfg.get_double("optimization/min_lr_ratio");  // shared with phase 1
  return c;
}

ConfigSchema LoRATrainer::schema() {
  ConfigSchema s;
  add_job_options(s, "lora/train");
  add_trainer_options(s);
  s.remove("training/tokens").remove("training/dataset");  // the phases below replace them
  auto stage = [](const char* name) { return json::array({json::array({{{"name", name}, {"rate", 1}, {"style", "pmd"}}})}); };
  s.add("training/pre_lora_tokens", OptType::IntList, json::array({2097152}),
        "token budget of each pre-LoRA (full-parameter) stage; [] starts in the LoRA phase", check_positive_list());
  s.add("training/pre_lora_dataset", OptType::SamplingStages, stage("english"),
        "dataset mixture of each pre-LoRA stage (one list of samplings per budget)");
  s.add("training/post_lora_tokens", OptType::IntList, json::array({524288}),
        "token budget of each post-LoRA (adapter) stage", check_positive_list());
  s.add("training/post_lora_dataset", OptType::SamplingStages, stage("code"),
        "dataset mixture of each post-LoRA stage (one list of samplings per budget)");
  add_lora_options(s);
  return s;
}

StagePlan lora_stage_plan(const Config& cfg) {
  StagePlan pre = StagePlan::from_config(cfg, "training/pre_lora_tokens", "training/pre_lora_dataset",
                                         " (both [] to skip phase one)");
  StagePlan post = StagePlan::from_config(cfg, "training/post_lora_tokens", "training/post_lora_dataset");
  if (post.tokens.empty())
    throw UserError("training/post_lora_tokens is empty: a LoRA job needs at least one post-LoRA stage "
                    "(for full-parameter training alone use the `train` job)");
  return pre.append(post);
}

LoRATrainer::LoRATrainer(JobSpec spec, Config cfg, std::string out_dir)
    : LoRATrainer(std::move(spec), cfg, std::move(out_dir), lora_stage_plan(cfg),
                  cfg.get("training/pre_lora_tokens").size()) {}

LoRATrainer::LoRATrainer(JobSpec spec, Config cfg, std::string out_dir, const StagePlan& plan, size_t pre_lora_stages)
    : BaseTrainer(std::move(spec), cfg, std::move(out_dir), plan) {
  lora_cfg_ = LoraOptions::from_config(cfg_);
  const size_t n_pre = pre_lora_stages;  // the plan's first stages
  boundary_step_ = n_pre > 0 ? stages_[n_pre - 1].end_step : 0;
  selection_ = select_lora_params();  // now, not at the boundary hours later
  schedule_ = full_schedule(boundary_step_);  // phase 1's schedule ends at the boundary
  lora_schedule_ = lora_cfg_.schedule.make(total_steps_ - boundary_step_);
}

LoRATrainer::Selection LoRATrainer::select_lora_params() const {
  const NamedTensors params = base_params(*model_);
  Selection sel;
  with_lora_keys([&] {
    sel.targets = param_filter(params, expand_target_modules(*model_, lora_cfg_.target_modules));
    check_lora_targets(*model_, params, sel.targets, lora_cfg_.rank);
    sel.saved = modules_to_save_filter(params, lora_cfg_.modules_to_save, sel.targets);
    if (lora_cfg_.token_ids.empty() && lora_cfg_.token_module.empty()) return;
    sel.token_embedding = resolve_trainable_tokens(*model_, params, lora_cfg_.token_module, lora_cfg_.token_ids);
    for (size_t i = 0; i < params.size(); ++i)
      if (sel.saved[i] && params[i].first == sel.token_embedding)
        throw LoraSettingError("trainable_token_indices", "selects rows of " + sel.token_embedding +
                               ", which optimization/lora/modules_to_save already trains in full; give the "
                               "embedding to one of the two, not both");
  });
  for (size_t i = 0; i < params.size(); ++i)
    if (sel.targets[i]) sel.target_names.push_back(params[i].first);
  return sel;
}

std::vector<Phase> LoRATrainer::own_phases() {
  return {{boundary_step_, nullptr, &next_token_loss_},  // pre-LoRA: every parameter (none when the job
                                                         // starts with adapters)
          {total_steps_,
           [this] {  // LoRA: the adapters
             if (!in_lora_) transition_to_lora();  // a restored LoRA state is in it already
           },
           &next_token_loss_}};
}

bool LoRATrainer::shard_optimizer_state() const {
  const ShardMode mode = opts_.shard_optimizer;
  return in_lora_ ? mode != ShardMode::None : mode == ShardMode::All;
}

double LoRATrainer::current_lr() const {
  return in_lora_ ? lora_schedule_.at(step_ - boundary_step_) : schedule_.at(step_);
}

// The trainable token rows as checkpoints and events record them: {"wte.weight": [ids]}, {} for none.
static std::map<std::string, std::vector<int64_t>> token_rows_of(const TrainableTokens& t) {
  if (!t.defined()) return {};
  return {{t.name, t.ids}};
}

static json tokens_json(const TrainableTokens& t) {
  json out = json::object();
  for (const auto& [name, ids] : token_rows_of(t)) out[name] = ids;
  return out;
}

json LoRATrainer::extra_metadata() const {
  LoraMetadata m;
  m.rank = lora_cfg_.rank;
  m.alpha = lora_cfg_.alpha;
  m.boundary_step = boundary_step_;
  m.in_lora_phase = in_lora_;
  m.targets = lora_.names;
  m.init = lora_cfg_.init;
  m.rslora = lora_cfg_.rslora;
  m.dora = lora_cfg_.dora;
  m.lr_ratio = lora_cfg_.lr_ratio;
  m.modules_to_save = saved_;
  m.modules_to_save_lr_ratio = lora_cfg_.modules_to_save_lr_ratio;
  m.trainable_tokens = token_rows_of(token_rows_);
  m.adapters_from = adapters_from_;
  m.base = base_;
  return {{"lora", m.to_json()}};
}

void LoRATrainer::restore_extra(const CheckpointMeta& ck) {
  if (!ck.lora) return;
  base_ = ck.lora->base;
  adapters_from_ = ck.lora->adapters_from;
}

void LoRATrainer::transition_to_lora() {
  // Rank 0 reads the file system for every rank: they must all take part in the save or none.
  if (boundary_step_ > 0 && step_ == boundary_step_ &&
      dist_.broadcast_flag(!is_checkpoint((fs::path(job_dir()) / kPreLoraCheckpoint).string()),
                           "deciding whether to save " + std::string(kPreLoraCheckpoint)))
    save(kPreLoraCheckpoint);
  freeze_base_and_inject();
  if (!lora_cfg_.init_from.empty()) load_initial_adapters();
  log_transition();
}

void LoRATrainer::load_initial_adapters() {
  AdapterSource src = read_adapter_source(lora_cfg_.init_from, model_->options().family, lora_.names, lora_cfg_.rank,
                                          lora_cfg_.alpha, lora_cfg_.rslora, lora_cfg_.dora, token_embeddings(*model_).front(),
                                          token_rows_.ids);
  torch::NoGradGuard ng;
  if (token_rows_.defined()) {
    if (src.tokens.values.sizes() != token_rows_.values.sizes())
      throw UserError("optimization/lora/init_from: " + src.path + ": the trainable token rows do not fit this model's " +
                      token_rows_.name + " (another model size?)");
    token_rows_.values.copy_(src.tokens.values);
  }
  for (size_t i = 0; i < lora_.names.size(); ++i) {
    if (src.adapters.A[i].sizes() != lora_.A[i].sizes() || src.adapters.B[i].sizes() != lora_.B[i].sizes())
      throw UserError("optimization/lora/init_from: " + src.path + ": the adapter of " + lora_.names[i] +
                      " does not fit this model's weight (another model size?)");
    lora_.A[i].copy_(src.adapters.A[i]);
    lora_.B[i].copy_(src.adapters.B[i]);
    if (lora_.dora()) {
      if (src.adapters.magnitude[i].sizes() != lora_.magnitude[i].sizes())
        throw UserError("optimization/lora/init_from: " + src.path + ": the DoRA magnitude of " + lora_.names[i] +
                        " has shape " + shape_text(src.adapters.magnitude[i].sizes().vec()) + ", not this weight's " +
                        shape_text(lora_.magnitude[i].sizes().vec()) + " (another model size?)");
      lora_.magnitude[i].copy_(src.adapters.magnitude[i]);
    }
  }
  adapters_from_ = src.path;
  std::printf("adapters of the %zu adapted weights%s start from %s (%s)%s\n", lora_.names.size(),
              token_rows_.defined() ? " and the trainable token rows" : "", src.path.c_str(),
              src.format == AdapterSource::Format::Peft ? "a PEFT adapter" : "a LoRA checkpoint",
              src.modules_to_save.empty() ? ""
                                          : ("; its modules_to_save (" + join(src.modules_to_save) +
                                             ") are not loaded: they start from this job's base").c_str());
}

void LoRATrainer::freeze_base_and_inject() {
  TORCH_CHECK(!in_lora_, "transition_to_lora: already in the LoRA phase");
  const NamedTensors params = base_params(*model_);
  const std::string& embedding = selection_.token_embedding;
  token_rows_ = TrainableTokens();
  saved_.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    if (selection_.saved[i]) saved_.push_back(params[i].first);
    if (params[i].first == embedding)  // the rows start from their f32 values, before the freeze
      token_rows_ = make_trainable_tokens(embedding, params[i].second, lora_cfg_.token_ids);
  }
  // The base: bf16, no gradients, and (below) no optimizer state; the modules_to_save stay f32 and train.
  freeze_base(*model_, saved_, FrozenFormat::Bf16);

  // The adapters become parameters of their layers; from here on they are found by name.
  auto gen = at::detail::createCPUGenerator(mix64(opts_.seed ^ 0x4C6F5241ULL));  // "LoRA"
  LoraParams fresh = with_lora_keys([&] {
    return inject_lora_params(params, selection_.targets, lora_cfg_.rank, gen, lora_cfg_.init, lora_cfg_.dora);
  });
  for (auto& [name, t] : fresh.named()) t.requires_grad_(true);
  attach_lora(*model_, fresh, lora_cfg_.alpha, lora_cfg_.rank, lora_cfg_.rslora);
  if (token_rows_.defined()) {
    token_rows_.values.requires_grad_(true);
    attach_token_rows(*model_, token_rows_);
  }
  lora_ = lora_params_of(*model_);
  in_lora_ = true;  // before the optimizer: its sharding depends on the phase
  // What trains, by name: the adapters (A, B and DoRA's magnitude of each layer in turn; B and the
  // magnitude at LoRA+'s lr_ratio, the magnitude being 1-D without weight decay by AdamW's rule), then
  // the modules_to_save at their own ratio, then the token rows at the adapters' lr, as PEFT trains
  // them. Identical on every rank (the same seed); their moments may be sharded.
  NamedTensors trained;
  std::vector<double> lr_scale;
  for (const auto& [name, p] : named_params(*model_))
    if (is_lora_param(name)) {
      trained.emplace_back(name, p);
      lr_scale.push_back(lora_plus_lr_scale(name, lora_cfg_.lr_ratio));
    }
  for (const auto& [name, p] : named_params(*model_))
    if (std::find(saved_.begin(), saved_.end(), name) != saved_.end()) {
      trained.emplace_back(name, p);
      lr_scale.push_back(lora_cfg_.modules_to_save_lr_ratio);
    }
  if (token_rows_.defined()) {
    trained.emplace_back(TrainableTokens::values_name(token_rows_.name), token_rows_.values);
    lr_scale.push_back(1.0);
  }
  build_optimizer(std::move(trained), lora_cfg_.weight_decay, std::move(lr_scale));
}

void LoRATrainer::log_transition() {
  int64_t frozen = 0, saved_numel = 0;
  for (const auto& [name, p] : base_params(*model_))
    (std::find(saved_.begin(), saved_.end(), name) != saved_.end() ? saved_numel : frozen) += p.numel();
  const int64_t token_numel = token_rows_.defined() ? token_rows_.values.numel() : 0;
  const int64_t adapters = count_lora_params(lora_), trainable = adapters + saved_numel + token_numel;
  std::string saved_text;
  if (!saved_.empty()) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%g", lora_cfg_.modules_to_save_lr_ratio);
    saved_text = " + " + std::to_string(saved_numel) + " in the modules_to_save (" + join(saved_) + ", f32, lr x" + ratio + ")";
  }
  if (token_rows_.defined())
    saved_text += " + " + std::to_string(token_numel) + " in " + std::to_string(token_rows_.ids.size()) +
                  " trainable token rows of " + token_rows_.name + " (f32)";
  std::string recipe;  // what differs from plain LoRA
  if (lora_cfg_.rslora) recipe += ", rsLoRA (scale alpha/sqrt(r))";
  if (lora_cfg_.lr_ratio != 1.0) {
    char ratio[48];
    std::snprintf(ratio, sizeof ratio, ", LoRA+ (B's lr x%g)", lora_cfg_.lr_ratio);
    recipe += ratio;
  }
  if (lora_.dora()) {
    int64_t m = 0;
    for (const auto& t : lora_.magnitude) m += t.numel();
    char text[160];
    std::snprintf(text, sizeof text, ", DoRA (%lld magnitudes, one per output feature, at B's lr x%g, no weight decay)",
                  (long long)m, lora_cfg_.lr_ratio);
    recipe += text;
  }
  std::printf("transition to LoRA at step %lld (%lld tokens): %zu adapted weights, rank %lld, alpha %g, init %s%s; "
              "trainable %lld (%.2f%%: %lld in adapters%s), frozen %lld (bf16)\n",
              (long long)step_, (long long)tokens_, lora_.names.size(), (long long)lora_cfg_.rank, lora_cfg_.alpha,
              to_string(lora_cfg_.init), recipe.c_str(), (long long)trainable,
              100.0 * trainable / std::max<int64_t>(1, frozen + trainable), (long long)adapters, saved_text.c_str(),
              (long long)frozen);
  std::fflush(stdout);
  log_event({{"event", "transition"}, {"step", step_}, {"tokens", tokens_}, {"trainable_params", trainable},
             {"adapter_params", adapters}, {"saved_params", saved_numel}, {"token_params", token_numel},
             {"frozen_params", frozen}, {"adapted", lora_.names}, {"modules_to_save", saved_},
             {"trainable_tokens", tokens_json(token_rows_)}});
}

void LoRATrainer::restore_state(const CheckpointMeta& ck) {
  const std::string& dir = ck.dir;
  const StateKind kind = ck.kind;
  const int64_t step = ck.step;
  if (ck.weights_only || (kind == StateKind::Plain && boundary_step_ == 0)) {
    // Skip phase one: another job's weights become this job's base; our counters stay at zero.
    if (in_lora_ || step_ != 0)
      throw UserError("a pretrained base can only be loaded before training starts; " + dir + " came too late");
    load_weights_from(ck);
    base_ = {{"path", dir}, {"job", ck.job_name}, {"step", step}};
    return;
  }
  if (kind == StateKind::Lora) {
    if (step < boundary_step_)
      throw UserError(dir + " is a LoRA state at step " + std::to_string(step) + ", before this job's LoRA boundary (step " +
                      std::to_string(boundary_step_) + "): it belongs to a job with other training/pre_lora_tokens");
    if (!ck.lora)
      throw UserError(dir + "/metadata.json: a LoRA state without its \"lora\" block (rank, alpha, targets): the "
                      "checkpoint is damaged or hand-edited; " + use_another_checkpoint(ck.job_name));
    const LoraMetadata& theirs = *ck.lora;
    // The adapters' shapes are checked against this job's rank by the load; a rank in the metadata that
    // differs from both would be silently replaced by the job's in the next checkpoint.
    if (theirs.rank != lora_cfg_.rank)
      throw UserError(dir + "/metadata.json gives lora.rank " + std::to_string(theirs.rank) + "; this job has "
                      "optimization/lora/rank=" + std::to_string(lora_cfg_.rank) + ". Set it as the job that saved the "
                      "checkpoint had it; if its adapters are not of rank " + std::to_string(theirs.rank) + ", its metadata "
                      "is damaged: " + use_another_checkpoint(ck.job_name));
    if (theirs.dora != lora_cfg_.dora)
      throw UserError(dir + (theirs.dora ? " trained DoRA adapters (a magnitude per output feature)" : " trained plain LoRA "
                      "adapters, without DoRA's magnitudes") + "; this job has optimization/lora/dora=" +
                      (lora_cfg_.dora ? "true" : "false") + ". Set it as the job that saved the checkpoint had it");
    if (!in_lora_) freeze_base_and_inject();  // the LoRA template; the load overwrites it
    if (theirs.modules_to_save != saved_)
      throw UserError(dir + " trained the modules_to_save " + json(theirs.modules_to_save).dump() + " beside its adapters; "
                      "this job's optimization/lora/modules_to_save selects " + json(saved_).dump() +
                      ". Set it as the job that saved the checkpoint had it");
    if (theirs.trainable_tokens != token_rows_of(token_rows_)) {
      json their_tokens = json::object();
      for (const auto& [name, ids] : theirs.trainable_tokens) their_tokens[name] = ids;
      throw UserError(dir + " trained the token rows " + their_tokens.dump() + " beside its adapters; this job's " +
                      "optimization/lora/trainable_token_indices selects " + tokens_json(token_rows_).dump() +
                      ". Set it as the job that saved the checkpoint had it");
    }
  } else {
    if (step > boundary_step_)
      throw UserError(dir + " is a plain state at step " + std::to_string(step) + ", past this job's LoRA boundary (step " +
                      std::to_string(boundary_step_) +
                      "). To use it as a pretrained base, set training/pre_lora_tokens and training/pre_lora_dataset to []");
    if (in_lora_) throw UserError("cannot restore the plain state " + dir + " into a job already in its LoRA phase");
  }
  BaseTrainer::restore_state(ck);
}

void LoRATrainer::check_can_start() {
  if (boundary_step_ == 0 && step_ == 0 && base_.is_null()) {
    // No phase one and no base given: adapters on random weights teach nothing about LoRA on a model.
    if (!lora_cfg_.allow_random_base)
      throw UserError("job " + spec_.name + " has no pre-LoRA stages (training/pre_lora_tokens is []), so its base must "
                      "come from a pretrained checkpoint: add `--restore CHECKPOINT` (a plain checkpoint, an `export`, "
                      "or an `import-hf` output). To train adapters on randomly initialised weights on purpose, set "
                      "training/allow_random_base=true");
    base_ = "random";
  }
  if (!in_lora_ && !lora_cfg_.init_from.empty()) {
    // The adapters' source is read at the transition, maybe hours from now: check it fits before training.
    read_adapter_source(lora_cfg_.init_from, model_->options().family, selection_.target_names, lora_cfg_.rank,
                        lora_cfg_.alpha, lora_cfg_.rslora, lora_cfg_.dora, token_embeddings(*model_).front(),
                        selection_.token_embedding.empty() ? std::vector<int64_t>() : lora_cfg_.token_ids);
  }
}

}  // namespace lt
