// The trainer's LoRA phase: its schema, what its settings select, the transition (transition_to_lora:
// freeze the base, inject the adapters, train only those), its block of the checkpoint metadata and its
// side of a restore. The trainer's loop is in trainer.cpp; the report of a LoRA job in trainer_report.cpp.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "lora_trainer/formats/adapter_source.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/lora_metadata.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

static const char* kPreLoraCheckpoint = "pre_lora_checkpoint";

ConfigSchema Trainer::lora_schema() {
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

Trainer::LoraSelection Trainer::select_lora_params() const {
  const NamedTensors params = base_params(*model_);
  LoraSelection sel;
  with_lora_keys([&] {
    sel.targets = param_filter(params, expand_target_modules(*model_, lora_->options.target_modules));
    check_lora_targets(*model_, params, sel.targets, lora_->options.rank);
    sel.saved = modules_to_save_filter(params, lora_->options.modules_to_save, sel.targets);
    if (lora_->options.token_ids.empty() && lora_->options.token_module.empty()) return;
    sel.token_embedding = resolve_trainable_tokens(*model_, params, lora_->options.token_module, lora_->options.token_ids);
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

// The trainable token rows as checkpoints and events record them: {"wte.weight": [ids]}, {} for none.
static std::map<std::string, std::vector<int64_t>> token_rows_of(const TrainableTokens& t) {
  if (!t.defined()) return {};
  return {{t.name, t.ids}};
}

json Trainer::lora_metadata() const {
  LoraMetadata m;
  m.rank = lora_->options.rank;
  m.alpha = lora_->options.alpha;
  m.boundary_step = boundary_step_;
  m.in_lora_phase = lora_->entered;
  m.targets = lora_->adapters.names;
  m.init = lora_->options.init;
  m.rslora = lora_->options.rslora;
  m.dora = lora_->options.dora;
  m.lr_ratio = lora_->options.lr_ratio;
  m.modules_to_save = lora_->saved;
  m.modules_to_save_lr_ratio = lora_->options.modules_to_save_lr_ratio;
  m.trainable_tokens = token_rows_of(lora_->token_rows);
  m.adapters_from = lora_->adapters_from;
  m.quantize_base = quantize_base_name(lora_->options.quantize_base);
  for (const auto& [name, storage] : frozen_storages(*model_))
    if (storage->format() == FrozenFormat::Nf4) m.quantized[name] = storage->shape();
  m.base = lora_->base;
  return m.to_json();
}

void Trainer::restore_lora_metadata(const CheckpointMeta& ck) {
  if (!ck.lora) return;
  lora_->base = ck.lora->base;
  lora_->adapters_from = ck.lora->adapters_from;
}

void Trainer::transition_to_lora() {
  // Rank 0 reads the file system for every rank: they must all take part in the save or none.
  if (boundary_step_ > 0 && step_ == boundary_step_ &&
      dist_.broadcast_flag(!is_checkpoint((fs::path(job_dir()) / kPreLoraCheckpoint).string()),
                           "deciding whether to save " + std::string(kPreLoraCheckpoint)))
    save(kPreLoraCheckpoint);
  freeze_base_and_inject();
  refer_to_frozen_base();
  if (!lora_->options.init_from.empty()) load_initial_adapters();
  log_transition();
}

NamedTensors Trainer::frozen_tensors() {
  NamedTensors out;
  if (!in_lora_phase()) return out;
  for (auto& [name, p] : base_params(*model_))
    if (std::find(lora_->saved.begin(), lora_->saved.end(), name) == lora_->saved.end()) out.emplace_back(name, p);
  return out;
}

std::map<std::string, uint32_t> Trainer::frozen_crcs() {
  std::map<std::string, uint32_t> out;
  for (const auto& [name, storage] : frozen_storages(*model_))
    if (auto crc = storage->values_crc()) out[name] = *crc;
  return out;
}

std::set<std::string> Trainer::frozen_block_weights() const {
  std::set<std::string> out;
  if (!lora_) return out;
  const NamedTensors params = base_params(*model_);
  std::set<std::string> saved;
  for (size_t i = 0; i < params.size(); ++i)
    if (i < lora_->selection.saved.size() && lora_->selection.saved[i]) saved.insert(params[i].first);
  for (const auto& name : adaptable_weights(*model_))
    if (model_->in_blocks(name) && !saved.count(name)) out.insert(name);
  return out;
}

std::set<std::string> Trainer::quantized_weights() const {
  if (!lora_ || lora_->options.quantize_base != FrozenFormat::Nf4) return {};
  return frozen_block_weights();
}

bool Trainer::shards_base() const { return lora_ && dist_.active() && opts_.shard_params != ShardMode::None; }

std::set<std::string> Trainer::sharded_weights() const { return shards_base() ? frozen_block_weights() : std::set<std::string>(); }

void Trainer::shard_base() {
  if (!shards_base() || !model_->block_shards().empty()) return;
  std::vector<std::vector<std::string>> blocks(static_cast<size_t>(model_->options().n_layer));
  const std::set<std::string> sharded = sharded_weights();
  for (const auto& name : adaptable_weights(*model_))  // model order
    if (sharded.count(name)) blocks.at(static_cast<size_t>(model_->block_of(name))).push_back(name);
  model_->set_block_shards(shard_frozen_weights(*model_, blocks, dist_, rt_.device));
}

void Trainer::refer_to_frozen_base() {
  lora_->frozen_base.reset();
  if (lora_->options.save_frozen_base) return;
  std::string source, format = "checkpoint";
  if (boundary_step_ > 0 && step_ == boundary_step_) {
    source = (fs::path(job_dir()) / kPreLoraCheckpoint).string();
  } else if (boundary_step_ == 0 && lora_->base.is_object()) {
    source = lora_->base.value("path", std::string());
    if (lora_->base.value("format", std::string()) == "hf") format = "hf";
  }
  // Rank 0 saved the boundary checkpoint; every rank sees the same file system (as for `latest`).
  const bool there = !source.empty() && (format == "hf" ? is_hf_model_dir(source) : is_checkpoint(source));
  if (!there && shards_base())
    throw UserError("job " + spec_.name + ": distributed/shard_params=" + shard_mode_name(opts_.shard_params) +
                    " keeps 1/N of the frozen base on each rank, so its "
                    "checkpoints must refer to a file that holds the base, and there is none (" +
                    (source.empty() ? std::string("a random base") : source + " is gone") +
                    "). Give the job its base with --restore, or set distributed/shard_params=none");
  if (!there) {
    if (is_main())
      std::printf("note: the LoRA-phase checkpoints of job %s hold a copy of the frozen base: %s\n", spec_.name.c_str(),
                  lora_->base == "random" ? "it is randomly initialised (training/allow_random_base), so no file holds it"
                                          : "there is no checkpoint or model directory of it to refer to");
    return;
  }
  lora_->frozen_base = make_frozen_base_ref(source, format, frozen_tensors(), job_dir(), frozen_crcs());
}

void Trainer::load_frozen_base(const CheckpointMeta& ck) {
  if (!ck.raw.contains("frozen_base")) {  // a self-contained state: the load below reads the base, and so on
    lora_->frozen_base.reset();
    return;
  }
  FrozenBaseRef ref = FrozenBaseRef::from_json(ck.raw["frozen_base"], ck.dir);
  std::map<std::string, torch::Tensor> frozen;
  for (auto& [name, p] : frozen_tensors()) frozen[name] = p;
  const auto storages = frozen_storages(*model_);  // NF4 weights: quantized again from the base's values
  std::vector<std::string> problems;
  for (const auto& [name, shape] : ref.tensors)
    if (!frozen.count(name)) problems.push_back(name);
  for (const auto& [name, p] : frozen)
    if (!ref.tensors.count(name)) problems.push_back(name);
  if (!problems.empty())
    throw UserError(ck.dir + "/metadata.json: its frozen base (frozen_base.tensors) is not this job's (" +
                    std::to_string(problems.size()) + " tensors differ, e.g. " + problems.front() +
                    "); is optimization/lora/modules_to_save as the job that saved it had it?");
  const double t0 = now_seconds();
  torch::NoGradGuard ng;
  const std::string where = read_frozen_base(ref, ck.dir, lora_->options.frozen_base_path, model_->options().family,
                                             base_params(*model_),
                                             [&](const std::string& name, const torch::Tensor& t) {
                                               auto storage = storages.find(name);
                                               if (storage != storages.end()) storage->second->assign(t.to(rt_.device));
                                               else frozen.at(name).copy_(t);
                                             });
  // Said when the job runs (run()): `eval` and `sample` print their results alone.
  char note[160];
  std::snprintf(note, sizeof note, " (%.2f GB in bf16, digest %s verified, %.1f s)", ref.bytes / 1e9, ref.digest.c_str(),
                now_seconds() - t0);
  lora_->base_note = "frozen base of " + ck.dir + ": " + where + note;
  if (lora_->options.save_frozen_base) return;  // copies from here on
  ref.path = fs::absolute(where).lexically_normal().string();  // where it is now, for this job's next checkpoints
  lora_->frozen_base = ref;
}

void Trainer::drop_frozen_base(NamedTensors& tensors, bool referenced) {
  if (!referenced) return;
  std::set<std::string> frozen;
  for (const auto& [name, p] : frozen_tensors()) frozen.insert(name);
  auto is_frozen = [&](const std::string& t) {
    if (t.rfind(kParamsPrefix, 0) == 0) return frozen.count(t.substr(kParamsPrefix.size())) > 0;
    if (t.rfind(kNf4Prefix, 0) != 0) return false;
    const std::string rest = t.substr(kNf4Prefix.size());  // <weight>.<field>
    return frozen.count(rest.substr(0, rest.rfind('.'))) > 0;
  };
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const auto& t) { return is_frozen(t.first); }), tensors.end());
}

void Trainer::load_initial_adapters() {
  AdapterSource src = read_adapter_source(lora_->options.init_from, model_->options().family, lora_->adapters.names, lora_->options.rank,
                                          lora_->options.alpha, lora_->options.rslora, lora_->options.dora, token_embeddings(*model_).front(),
                                          lora_->token_rows.ids);
  torch::NoGradGuard ng;
  if (lora_->token_rows.defined()) {
    if (src.tokens.values.sizes() != lora_->token_rows.values.sizes())
      throw UserError("optimization/lora/init_from: " + src.path + ": the trainable token rows do not fit this model's " +
                      lora_->token_rows.name + " (another model size?)");
    lora_->token_rows.values.copy_(src.tokens.values);
  }
  for (size_t i = 0; i < lora_->adapters.names.size(); ++i) {
    std::vector<std::string> misfits;  // each by the source's own name and shape, against what this model needs
    for (const auto& [key, theirs, ours] : {std::tuple<std::string, torch::Tensor, torch::Tensor>{src.keys[i].first, src.adapters.A[i], lora_->adapters.A[i]},
                                            {src.keys[i].second, src.adapters.B[i], lora_->adapters.B[i]}})
      if (theirs.sizes() != ours.sizes())
        misfits.push_back(key + " has shape " + shape_text(src.stored_shape(theirs)) + ", this model's needs " +
                          shape_text(src.stored_shape(ours)));
    if (!misfits.empty())
      throw UserError("optimization/lora/init_from: " + src.path + ": the adapter of " + lora_->adapters.names[i] +
                      " does not fit this model's weight: " + join(misfits, "; ") + " (another model size?)");
    lora_->adapters.A[i].copy_(src.adapters.A[i]);
    lora_->adapters.B[i].copy_(src.adapters.B[i]);
    if (lora_->adapters.dora()) {
      if (src.adapters.magnitude[i].sizes() != lora_->adapters.magnitude[i].sizes())
        throw UserError("optimization/lora/init_from: " + src.path + ": the DoRA magnitude of " + lora_->adapters.names[i] +
                        " has shape " + shape_text(src.adapters.magnitude[i].sizes().vec()) + ", not this weight's " +
                        shape_text(lora_->adapters.magnitude[i].sizes().vec()) + " (another model size?)");
      lora_->adapters.magnitude[i].copy_(src.adapters.magnitude[i]);
    }
  }
  lora_->adapters_from = src.path;
  std::printf("adapters of the %zu adapted weights%s start from %s (%s)%s\n", lora_->adapters.names.size(),
              lora_->token_rows.defined() ? " and the trainable token rows" : "", src.path.c_str(),
              src.format == AdapterSource::Format::Peft ? "a PEFT adapter" : "a LoRA checkpoint",
              src.modules_to_save.empty() ? ""
                                          : ("; its modules_to_save (" + join(src.modules_to_save) +
                                             ") are not loaded: they start from this job's base").c_str());
}

void Trainer::freeze_base_and_inject() {
  TORCH_CHECK(!lora_->entered, "transition_to_lora: already in the LoRA phase");
  settle_random_weights();  // a job stepped without a base: the family's init, as a random base gets
  if (sharded_params_) {
    // Phase 1's sharded parameters whole again, block by block: directly in bf16 those the LoRA phase
    // freezes (the rounding the freeze makes; NF4 quantizes bf16 values too), float32 the modules_to_save.
    optimizer_.reset();  // the pieces' moments go first
    std::set<std::string> saved;
    const NamedTensors all = base_params(*model_);
    for (size_t i = 0; i < all.size(); ++i)
      if (lora_->selection.saved[i]) saved.insert(all[i].first);
    sharded_params_->unshard([&](const std::string& name) { return saved.count(name) ? torch::kFloat32 : torch::kBFloat16; });
    sharded_params_.reset();
  }
  const NamedTensors params = base_params(*model_);
  const std::string& embedding = lora_->selection.token_embedding;
  lora_->token_rows = TrainableTokens();
  lora_->saved.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    if (lora_->selection.saved[i]) lora_->saved.push_back(params[i].first);
    if (params[i].first == embedding)  // the rows start from their f32 values, before the freeze
      lora_->token_rows = make_trainable_tokens(embedding, params[i].second, lora_->options.token_ids);
  }
  // The base: bf16 (the blocks' linear weights NF4 with quantize_base=nf4), no gradients, and (below) no
  // optimizer state; the modules_to_save stay f32 and train.
  const std::set<std::string> quantized = quantized_weights();
  freeze_base(*model_, lora_->saved, [&](const std::string& w) { return quantized.count(w) ? FrozenFormat::Nf4 : FrozenFormat::Bf16; });

  // The adapters become parameters of their layers; from here on they are found by name. DoRA's
  // magnitudes start at the row norms of the W the products use: an NF4 weight's dequantized values.
  NamedTensors weights = params;
  if (lora_->options.dora) {
    const auto storages = frozen_storages(*model_);
    for (auto& [name, W] : weights)
      if (storages.count(name)) W = storages.at(name)->for_matmul(W);
  }
  auto gen = at::detail::createCPUGenerator(mix64(opts_.seed ^ 0x4C6F5241ULL));  // "LoRA"
  LoraParams fresh = with_lora_keys([&] {
    return inject_lora_params(weights, lora_->selection.targets, lora_->options.rank, gen, lora_->options.init, lora_->options.dora);
  });
  for (auto& [name, t] : fresh.named()) t.requires_grad_(true);
  attach_lora(*model_, fresh, lora_->options.alpha, lora_->options.rank, lora_->options.rslora);
  if (lora_->token_rows.defined()) {
    lora_->token_rows.values.requires_grad_(true);
    attach_token_rows(*model_, lora_->token_rows);
  }
  lora_->adapters = lora_params_of(*model_);
  shard_base();  // with distributed/shard_params=lora or all (a job without phase one sharded its base as it loaded it)
  lora_->entered = true;  // before the optimizer: its sharding depends on the phase
  build_lora_optimizer();
}

void Trainer::build_lora_optimizer() {
  // What trains, by name: the adapters (A, B and DoRA's magnitude of each layer in turn; B and the
  // magnitude at LoRA+'s lr_ratio, the magnitude being 1-D without weight decay by AdamW's rule), then
  // the modules_to_save at their own ratio, then the token rows at the adapters' lr, as PEFT trains
  // them. Identical on every rank (the same seed); their moments may be sharded.
  NamedTensors trained;
  std::vector<double> lr_scale;
  for (const auto& [name, p] : named_params(*model_))
    if (is_lora_param(name)) {
      trained.emplace_back(name, p);
      lr_scale.push_back(lora_plus_lr_scale(name, lora_->options.lr_ratio));
    }
  for (const auto& [name, p] : named_params(*model_))
    if (std::find(lora_->saved.begin(), lora_->saved.end(), name) != lora_->saved.end()) {
      trained.emplace_back(name, p);
      lr_scale.push_back(lora_->options.modules_to_save_lr_ratio);
    }
  if (lora_->token_rows.defined()) {
    trained.emplace_back(TrainableTokens::values_name(lora_->token_rows.name), lora_->token_rows.values);
    lr_scale.push_back(1.0);
  }
  build_optimizer(std::move(trained), lora_->options.weight_decay, std::move(lr_scale));
}

void Trainer::log_transition() {
  int64_t frozen = 0, saved_numel = 0;
  for (const auto& [name, p] : base_params(*model_))
    (std::find(lora_->saved.begin(), lora_->saved.end(), name) != lora_->saved.end() ? saved_numel : frozen) += p.numel();
  const int64_t token_numel = lora_->token_rows.defined() ? lora_->token_rows.values.numel() : 0;
  const int64_t adapters = count_lora_params(lora_->adapters), trainable = adapters + saved_numel + token_numel;
  std::string saved_text;
  if (!lora_->saved.empty()) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%g", lora_->options.modules_to_save_lr_ratio);
    saved_text = " + " + std::to_string(saved_numel) + " in the modules_to_save (" + join(lora_->saved) + ", f32, lr x" + ratio + ")";
  }
  if (lora_->token_rows.defined())
    saved_text += " + " + std::to_string(token_numel) + " in " + std::to_string(lora_->token_rows.ids.size()) +
                  " trainable token rows of " + lora_->token_rows.name + " (f32)";
  std::string recipe;  // what differs from plain LoRA
  if (lora_->options.rslora) recipe += ", rsLoRA (scale alpha/sqrt(r))";
  if (lora_->options.lr_ratio != 1.0) {
    char ratio[48];
    std::snprintf(ratio, sizeof ratio, ", LoRA+ (B's lr x%g)", lora_->options.lr_ratio);
    recipe += ratio;
  }
  if (lora_->adapters.dora()) {
    int64_t m = 0;
    for (const auto& t : lora_->adapters.magnitude) m += t.numel();
    char text[160];
    std::snprintf(text, sizeof text, ", DoRA (%lld magnitudes, one per output feature, at B's lr x%g, no weight decay)",
                  (long long)m, lora_->options.lr_ratio);
    recipe += text;
  }
  // The frozen base's bytes as this rank stores them: 2 a parameter in bf16, NF4's codes and scales, of
  // a sharded weight this rank's share.
  const auto storages = frozen_storages(*model_);
  int64_t base_bytes = 0, quantized = 0, sharded = 0;
  for (const auto& [name, p] : frozen_tensors()) {
    auto storage = storages.find(name);
    base_bytes += storage != storages.end() ? storage->second->bytes() : p.numel() * 2;
    if (storage == storages.end()) continue;
    if (storage->second->format() == FrozenFormat::Nf4) quantized += p.numel();
    if (storage->second->sharded()) sharded += p.numel();
  }
  char base_text[160];
  if (quantized > 0)
    std::snprintf(base_text, sizeof base_text, "%lld of them NF4: %.3f GB, %.3f bytes a parameter", (long long)quantized,
                  base_bytes / 1e9, static_cast<double>(base_bytes) / std::max<int64_t>(1, frozen));
  else
    std::snprintf(base_text, sizeof base_text, "bf16: %.3f GB", base_bytes / 1e9);
  const std::string base_where = sharded == 0 ? "" : " on each of " + std::to_string(dist_.world_size()) + " ranks: " +
                                                       std::to_string(sharded) + " of them, the blocks' linear weights, sharded "
                                                       "(distributed/shard_params)";
  std::printf("transition to LoRA at step %lld (%lld tokens): %zu adapted weights, rank %lld, alpha %g, init %s%s; "
              "trainable %lld (%.2f%%: %lld in adapters%s), frozen %lld (%s%s)\n",
              (long long)step_, (long long)tokens_, lora_->adapters.names.size(), (long long)lora_->options.rank, lora_->options.alpha,
              to_string(lora_->options.init), recipe.c_str(), (long long)trainable,
              100.0 * trainable / std::max<int64_t>(1, frozen + trainable), (long long)adapters, saved_text.c_str(),
              (long long)frozen, base_text, base_where.c_str());
  std::fflush(stdout);
  log_event({{"event", "transition"}, {"step", step_}, {"tokens", tokens_}, {"trainable_params", trainable},
             {"adapter_params", adapters}, {"saved_params", saved_numel}, {"token_params", token_numel},
             {"frozen_params", frozen}, {"frozen_bytes", base_bytes}, {"quantized_params", quantized},
             {"adapted", lora_->adapters.names}, {"modules_to_save", lora_->saved},
             {"trainable_tokens", json(token_rows_of(lora_->token_rows))}});
}

// A LoRA state's rank and DoRA against this job's, before its template is built. The adapters'
// shapes are checked against this job's rank by the load; a rank in the metadata that differs from both
// would be silently replaced by the job's in the next checkpoint.
static void check_same_recipe(const CheckpointMeta& ck, const LoraOptions& ours) {
  const LoraMetadata& theirs = *ck.lora;
  if (theirs.rank != ours.rank)
    throw UserError(ck.dir + "/metadata.json gives lora.rank " + std::to_string(theirs.rank) + "; this job has "
                    "optimization/lora/rank=" + std::to_string(ours.rank) + ". Set it as the job that saved the "
                    "checkpoint had it; if its adapters are not of rank " + std::to_string(theirs.rank) + ", its metadata "
                    "is damaged: " + use_another_checkpoint(ck.job_name));
  const std::string quantize = quantize_base_name(ours.quantize_base);
  if (theirs.quantize_base != quantize)
    throw UserError(ck.dir + " trained its adapters on a " + (theirs.quantize_base == "nf4" ? "4-bit NF4" : "bf16") +
                    " base (lora.quantize_base \"" + theirs.quantize_base + "\"); this job has optimization/lora/quantize_base=" +
                    quantize + ". Set it as the job that saved the checkpoint had it (to go on from its adapters on the other "
                    "base, start a new job with optimization/lora/init_from=" + ck.dir + ")");
  if (theirs.dora != ours.dora)
    throw UserError(ck.dir + (theirs.dora ? " trained DoRA adapters (a magnitude per output feature)" : " trained plain LoRA "
                    "adapters, without DoRA's magnitudes") + "; this job has optimization/lora/dora=" +
                    (ours.dora ? "true" : "false") + ". Set it as the job that saved the checkpoint had it");
}

// What else a LoRA state trained beside its adapters (modules_to_save, token rows) against what this
// job's settings select (known once the template is built).
static void check_same_selection(const CheckpointMeta& ck, const std::vector<std::string>& saved,
                                 const std::map<std::string, std::vector<int64_t>>& token_rows) {
  const LoraMetadata& theirs = *ck.lora;
  if (theirs.modules_to_save != saved)
    throw UserError(ck.dir + " trained the modules_to_save " + json(theirs.modules_to_save).dump() + " beside its adapters; "
                    "this job's optimization/lora/modules_to_save selects " + json(saved).dump() +
                    ". Set it as the job that saved the checkpoint had it");
  if (theirs.trainable_tokens != token_rows)
    throw UserError(ck.dir + " trained the token rows " + json(theirs.trainable_tokens).dump() + " beside its adapters; "
                    "this job's optimization/lora/trainable_token_indices selects " + json(token_rows).dump() +
                    ". Set it as the job that saved the checkpoint had it");
}

bool Trainer::restore_lora_template(const CheckpointMeta& ck) {
  const std::string& dir = ck.dir;
  const StateKind kind = ck.kind;
  const int64_t step = ck.step;
  if (ck.weights_only || (kind == StateKind::Plain && boundary_step_ == 0)) {
    // Skip phase one: another job's weights become this job's base; our counters stay at zero.
    if (lora_->entered || step_ != 0)
      throw UserError("a pretrained base can only be loaded before training starts; " + dir + " came too late");
    load_weights_from(ck);
    lora_->base = {{"path", dir}, {"job", ck.job_name}, {"step", step}};
    return true;
  }
  if (kind == StateKind::Lora) {
    if (step < boundary_step_)
      throw UserError(dir + " is a LoRA state at step " + std::to_string(step) + ", before this job's LoRA boundary (step " +
                      std::to_string(boundary_step_) + "): it belongs to a job with other training/pre_lora_tokens");
    if (!ck.lora)
      throw UserError(dir + "/metadata.json: a LoRA state without its \"lora\" block (rank, alpha, targets): the "
                      "checkpoint is damaged or hand-edited; " + use_another_checkpoint(ck.job_name));
    check_same_recipe(ck, lora_->options);
    if (shards_base() && !ck.raw.contains("frozen_base"))
      throw UserError(dir + " holds its own copy of the frozen base (it was saved with logging/save_frozen_base=true, or "
                      "its base had no file to refer to); a job with distributed/shard_params=" + shard_mode_name(opts_.shard_params) +
                      " reads its base from the file its checkpoints refer to, one tensor at a time. Continue it with "
                      "distributed/shard_params=none");
    settle_weights_for_load();  // not drawn: the load overwrites every tensor
    if (!lora_->entered) freeze_base_and_inject();  // the LoRA template; the load overwrites it
    check_same_selection(ck, lora_->saved, token_rows_of(lora_->token_rows));
    load_frozen_base(ck);
  } else {
    if (step > boundary_step_)
      throw UserError(dir + " is a plain state at step " + std::to_string(step) + ", past this job's LoRA boundary (step " +
                      std::to_string(boundary_step_) +
                      "). To use it as a pretrained base, set training/pre_lora_tokens and training/pre_lora_dataset to []");
    if (lora_->entered) throw UserError("cannot restore the plain state " + dir + " into a job already in its LoRA phase");
  }
  return false;
}

void Trainer::check_lora_can_start() {
  if (boundary_step_ == 0 && step_ == 0 && lora_->base.is_null()) {
    // No phase one and no base given: adapters on random weights teach nothing about LoRA on a model.
    if (!lora_->options.allow_random_base)
      throw UserError("job " + spec_.name + " has no pre-LoRA stages (training/pre_lora_tokens is []), so its base must "
                      "come from a pretrained checkpoint: add `--restore CHECKPOINT` (a plain checkpoint, an `export`, "
                      "or an `import-hf` output). To train adapters on randomly initialised weights on purpose, set "
                      "training/allow_random_base=true");
    lora_->base = "random";
  }
  if (shards_base() && lora_->options.save_frozen_base)
    throw UserError("logging/save_frozen_base=true and distributed/shard_params=" + shard_mode_name(opts_.shard_params) +
                    " do not go together: each rank keeps "
                    "1/N of the frozen base, and its checkpoints refer to the file that holds it. Set one of them back "
                    "(logging/save_frozen_base=false, or distributed/shard_params=none)");
  if (shards_base() && lora_->base == "random" && !lora_->entered)
    throw UserError("job " + spec_.name + ": distributed/shard_params=" + shard_mode_name(opts_.shard_params) +
                    " needs a base in a file (its checkpoints refer to "
                    "it, each rank keeping 1/N of it), and this job's is randomly initialised (training/allow_random_base). "
                    "Give it one with --restore, or set distributed/shard_params=none");
  if (!lora_->entered && !lora_->options.init_from.empty()) {
    // The adapters' source is read at the transition, maybe hours from now: check it fits before training.
    read_adapter_source(lora_->options.init_from, model_->options().family, lora_->selection.target_names, lora_->options.rank,
                        lora_->options.alpha, lora_->options.rslora, lora_->options.dora, token_embeddings(*model_).front(),
                        lora_->selection.token_embedding.empty() ? std::vector<int64_t>() : lora_->options.token_ids);
  }
}


// Without a LoRA phase there are no adapters, saved modules nor token rows: the empty ones.
const LoraParams& Trainer::lora_params() const {
  static const LoraParams none;
  return lora_ ? lora_->adapters : none;
}

const std::vector<std::string>& Trainer::saved_modules() const {
  static const std::vector<std::string> none;
  return lora_ ? lora_->saved : none;
}

const TrainableTokens& Trainer::trainable_tokens() const {
  static const TrainableTokens none;
  return lora_ ? lora_->token_rows : none;
}

const LoraOptions& Trainer::lora_config() const {
  if (!lora_) throw std::logic_error("lora_config: job " + spec_.name + " has no LoRA phase");
  return lora_->options;
}

}  // namespace lt
