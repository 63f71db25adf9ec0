// LoraPhase (lora_phase.hpp): the LoRA phase's selection, frozen-base policy, transition, metadata,
// restore checks and report lines. The trainer calls it at the boundary and at save/restore
// (trainer_lora.cpp).
#include "lora_trainer/training/lora_phase.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/adapter_source.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/peft/block_shard.hpp"

namespace fs = std::filesystem;

namespace lt {

LoraPhase::LoraPhase(const Config& cfg, CausalLM model, Distributed& dist, torch::Device device, ShardMode shard_params,
                     uint64_t seed, int64_t steps)
    : options_(LoraOptions::from_config(cfg)),
      model_(std::move(model)),
      dist_(dist),
      device_(device),
      shard_params_(shard_params),
      seed_(seed) {
  selection_ = select();  // now, not at the boundary hours later
  schedule_ = options_.schedule.make(steps);
}

LoraPhase::Selection LoraPhase::select() const {
  const NamedTensors params = base_params(*model_);
  Selection sel;
  with_lora_keys([&] {
    sel.targets = param_filter(params, expand_target_modules(*model_, options_.target_modules));
    check_lora_targets(*model_, params, sel.targets, options_.rank);
    sel.saved = modules_to_save_filter(params, options_.modules_to_save, sel.targets);
    if (options_.token_ids.empty() && options_.token_module.empty()) return;
    sel.token_embedding = resolve_trainable_tokens(*model_, params, options_.token_module, options_.token_ids);
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

void LoraPhase::add_metadata(json& out, int64_t boundary_step) const {
  LoraMetadata m;
  m.rank = options_.rank;
  m.alpha = options_.alpha;
  m.boundary_step = boundary_step;
  m.in_lora_phase = entered_;
  m.targets = adapters_.names;
  m.init = options_.init;
  m.rslora = options_.rslora;
  m.dora = options_.dora;
  m.lr_ratio = options_.lr_ratio;
  m.modules_to_save = saved_;
  m.modules_to_save_lr_ratio = options_.modules_to_save_lr_ratio;
  m.trainable_tokens = token_rows_of(token_rows_);
  m.adapters_from = adapters_from_;
  m.quantize_base = options_.quantize_base;
  for (const auto& [name, storage] : frozen_storages(*model_))
    if (frozen_storage(storage->format()).quantizes()) m.quantized[name] = storage->shape();
  m.base = base_;
  out["lora"] = m.to_json();
  if (refers_to_base()) out["frozen_base"] = frozen_base_->to_json();
}

void LoraPhase::restored(const CheckpointMeta& ck) {
  if (!ck.lora) return;
  base_ = ck.lora->base;
  adapters_from_ = ck.lora->adapters_from;
}

NamedTensors LoraPhase::frozen_tensors() const {
  NamedTensors out;
  if (!entered_) return out;
  for (auto& [name, p] : base_params(*model_))
    if (std::find(saved_.begin(), saved_.end(), name) == saved_.end()) out.emplace_back(name, p);
  return out;
}

std::map<std::string, uint32_t> LoraPhase::frozen_crcs() const {
  std::map<std::string, uint32_t> out;
  for (const auto& [name, storage] : frozen_storages(*model_))
    if (auto crc = storage->values_crc()) out[name] = *crc;
  return out;
}

std::set<std::string> LoraPhase::frozen_block_weights() const {
  std::set<std::string> out;
  const NamedTensors params = base_params(*model_);
  std::set<std::string> saved;
  for (size_t i = 0; i < params.size(); ++i)
    if (i < selection_.saved.size() && selection_.saved[i]) saved.insert(params[i].first);
  for (const auto& name : adaptable_weights(*model_))
    if (model_->in_blocks(name) && !saved.count(name)) out.insert(name);
  return out;
}

std::set<std::string> LoraPhase::quantized_weights() const {
  if (!frozen_storage(options_.quantize_base).quantizes()) return {};
  return frozen_block_weights();
}

bool LoraPhase::shards_base() const { return dist_.active() && shard_params_ != ShardMode::None; }

std::set<std::string> LoraPhase::sharded_weights() const { return shards_base() ? frozen_block_weights() : std::set<std::string>(); }

void LoraPhase::shard_base() {
  if (!shards_base() || !model_->block_shards().empty()) return;
  if (!quantized_weights().empty() && !shardable(options_.quantize_base))
    throw UserError("distributed/shard_params=" + shard_mode_name(shard_params_) + " keeps the frozen base 1/N a rank in bf16 "
                    "or nf4; optimization/lora/quantize_base=" + to_string(options_.quantize_base) + " cannot be sharded. Set "
                    "distributed/shard_params=none, or another quantize_base");
  std::vector<std::vector<std::string>> blocks(static_cast<size_t>(model_->options().n_layer));
  const std::set<std::string> sharded = sharded_weights();
  for (const auto& name : adaptable_weights(*model_))  // model order
    if (sharded.count(name)) blocks.at(static_cast<size_t>(model_->block_of(name))).push_back(name);
  model_->set_block_shards(shard_frozen_weights(*model_, blocks, dist_, device_));
}

void LoraPhase::refer_to_frozen_base(const std::string& source, const std::string& format, const std::string& job,
                                     const std::string& job_dir, bool main) {
  frozen_base_.reset();
  if (options_.save_frozen_base) return;
  // Rank 0 saved the boundary checkpoint; every rank sees the same file system (as for `latest`).
  const bool there = !source.empty() && (format == "hf" ? is_hf_model_dir(source) : is_checkpoint(source));
  if (!there && shards_base())
    throw UserError("job " + job + ": distributed/shard_params=" + shard_mode_name(shard_params_) +
                    " keeps 1/N of the frozen base on each rank, so its "
                    "checkpoints must refer to a file that holds the base, and there is none (" +
                    (source.empty() ? std::string("a random base") : source + " is gone") +
                    "). Give the job its base with --restore, or set distributed/shard_params=none");
  if (!there) {
    if (main)
      std::printf("note: the LoRA-phase checkpoints of job %s hold a copy of the frozen base: %s\n", job.c_str(),
                  base_ == "random" ? "it is randomly initialised (training/allow_random_base), so no file holds it"
                                          : "there is no checkpoint or model directory of it to refer to");
    return;
  }
  frozen_base_ = make_frozen_base_ref(source, format, frozen_tensors(), job_dir, frozen_crcs());
}

void LoraPhase::load_frozen_base(const CheckpointMeta& ck) {
  if (!ck.frozen_base) {  // a self-contained state: the load below reads the base, and so on
    frozen_base_.reset();
    return;
  }
  FrozenBaseRef ref = *ck.frozen_base;
  std::map<std::string, torch::Tensor> frozen;
  for (auto& [name, p] : frozen_tensors()) frozen[name] = p;
  const auto storages = frozen_storages(*model_);  // NF4 (quantized) weights: quantized again from the base's values
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
  const std::string where = read_frozen_base(ref, ck.dir, options_.frozen_base_path, model_->options().family,
                                             base_params(*model_),
                                             [&](const std::string& name, const torch::Tensor& t) -> std::optional<uint32_t> {
                                               auto storage = storages.find(name);
                                               if (storage == storages.end()) {
                                                 frozen.at(name).copy_(t);
                                                 return std::nullopt;
                                               }
                                               storage->second->assign(t.to(device_));
                                               return storage->second->values_crc();  // of the same bf16 values
                                             },
                                             Take::Copies);
  // Said when the job runs (run()): `eval` and `sample` print their results alone.
  char note[160];
  std::snprintf(note, sizeof note, " (%.2f GB in bf16, digest %s verified, %.1f s)", ref.bytes / 1e9, ref.digest.c_str(),
                now_seconds() - t0);
  base_note_ = "frozen base of " + ck.dir + ": " + where + note;
  if (options_.save_frozen_base) return;  // copies from here on
  ref.path = fs::absolute(where).lexically_normal().string();  // where it is now, for this job's next checkpoints
  frozen_base_ = ref;
}

void LoraPhase::drop_frozen_base(NamedTensors& tensors, bool referenced) const {
  if (!referenced) return;
  std::set<std::string> frozen;
  for (const auto& [name, p] : frozen_tensors()) frozen.insert(name);
  auto is_frozen = [&](const std::string& t) {
    if (t.rfind(kParamsPrefix, 0) == 0) return frozen.count(t.substr(kParamsPrefix.size())) > 0;
    for (FrozenFormat format : quantizing_frozen_formats()) {  // nf4/<weight>.<field>, <storage>/<weight>.<field>
      const std::string prefix = frozen_storage(format).state_prefix();
      if (t.rfind(prefix, 0) != 0) continue;
      const std::string rest = t.substr(prefix.size());
      return frozen.count(rest.substr(0, rest.rfind('.'))) > 0;
    }
    return false;
  };
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const auto& t) { return is_frozen(t.first); }), tensors.end());
}

void LoraPhase::load_initial_adapters() {
  AdapterSource src = read_adapter_source(options_.init_from, model_->options().family, adapters_.names, options_.rank,
                                          options_.alpha, options_.rslora, options_.dora, token_embeddings(*model_).front(),
                                          token_rows_.ids);
  torch::NoGradGuard ng;
  if (token_rows_.defined()) {
    if (src.tokens.values.sizes() != token_rows_.values.sizes())
      throw UserError("optimization/lora/init_from: " + src.path + ": the trainable token rows do not fit this model's " +
                      token_rows_.name + " (another model size?)");
    token_rows_.values.copy_(src.tokens.values);
  }
  for (size_t i = 0; i < adapters_.names.size(); ++i) {
    std::vector<std::string> misfits;  // each by the source's own name and shape, against what this model needs
    for (const auto& [key, theirs, ours] : {std::tuple<std::string, torch::Tensor, torch::Tensor>{src.keys[i].first, src.adapters.A[i], adapters_.A[i]},
                                            {src.keys[i].second, src.adapters.B[i], adapters_.B[i]}})
      if (theirs.sizes() != ours.sizes())
        misfits.push_back(key + " has shape " + shape_text(src.stored_shape(theirs)) + ", this model's needs " +
                          shape_text(src.stored_shape(ours)));
    if (!misfits.empty())
      throw UserError("optimization/lora/init_from: " + src.path + ": the adapter of " + adapters_.names[i] +
                      " does not fit this model's weight: " + join(misfits, "; ") + " (another model size?)");
    adapters_.A[i].copy_(src.adapters.A[i]);
    adapters_.B[i].copy_(src.adapters.B[i]);
    if (adapters_.dora()) {
      if (src.adapters.magnitude[i].sizes() != adapters_.magnitude[i].sizes())
        throw UserError("optimization/lora/init_from: " + src.path + ": the DoRA magnitude of " + adapters_.names[i] +
                        " has shape " + shape_text(src.adapters.magnitude[i].sizes().vec()) + ", not this weight's " +
                        shape_text(adapters_.magnitude[i].sizes().vec()) + " (another model size?)");
      adapters_.magnitude[i].copy_(src.adapters.magnitude[i]);
    }
  }
  adapters_from_ = src.path;
  std::printf("adapters of the %zu adapted weights%s start from %s (%s)%s\n", adapters_.names.size(),
              token_rows_.defined() ? " and the trainable token rows" : "", src.path.c_str(),
              src.format == AdapterSource::Format::Peft ? "a PEFT adapter" : "a LoRA checkpoint",
              src.modules_to_save.empty() ? ""
                                          : ("; its modules_to_save (" + join(src.modules_to_save) +
                                             ") are not loaded: they start from this job's base").c_str());
}

LoraPhase::BaseLoad LoraPhase::load_base(const std::function<torch::Tensor(const std::string&)>& read,
                                         const std::function<void(const std::string&)>& prefetch) {
  BaseLoad out;
  const NamedTensors params = base_params(*model_);
  const std::set<std::string> to_quantize = quantized_weights();
  const FrozenFormat quantize_as = options_.quantize_base;
  const std::map<std::string, LoraAdaptable*> layers = adaptable_layers(*model_);
  // A sharded base is sharded before it loads: its block weights frozen as stand-ins, in one BlockShard
  // a block, and each rank stores of each weight as it comes only what it keeps (quantized first).
  const std::set<std::string> to_shard = model_->block_shards().empty() ? sharded_weights() : std::set<std::string>();
  for (const auto& [name, p] : params) {
    if (!to_shard.count(name)) continue;
    p.set_data(frozen_stand_in(p.sizes(), device_));
    layers.at(name)->freeze_weight(to_quantize.count(name) ? quantize_as : FrozenFormat::Bf16);
  }
  shard_base();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].first;
    torch::Tensor p = params[i].second;
    const torch::Tensor t = read(name);  // cast once below (no copy when it is already the dtype it lives in), placed
    if (prefetch && i + 1 < params.size()) prefetch(params[i + 1].first);  // read while this one is stored
    if (to_shard.count(name)) {
      layers.at(name)->frozen()->assign(t.to(device_));  // which copies what it keeps
      (to_quantize.count(name) ? out.quantized : out.bf16) += 1;
      continue;
    }
    if (to_quantize.count(name) && layers.count(name)) {
      p.set_data(t.to(device_, torch::kBFloat16));
      layers.at(name)->freeze_weight(quantize_as);  // its bf16 values quantized, the parameter a stand-in
      ++out.quantized;
    } else {
      const bool bf16 = freezes(i, name) && t.scalar_type() == torch::kBFloat16;
      out.bf16 += bf16 ? 1 : 0;
      p.set_data(t.to(device_, bf16 ? torch::kBFloat16 : torch::kFloat32));
    }
    if (is_mapped_view(p)) p.set_data(p.detach().clone());  // kept as it came: not the file's pages
  }
  out.sharded = static_cast<int64_t>(to_shard.size());
  if (out.bf16 > 0) out.text += "; the weights the LoRA phase freezes are kept in bf16 from the start";
  if (out.quantized > 0)
    out.text += "; " + std::to_string(out.quantized) + " linear weights of the blocks quantized to " +
                frozen_storage(quantize_as).shown() + " as they came (optimization/lora/quantize_base)";
  if (out.sharded > 0)
    out.text += "; the blocks' " + std::to_string(out.sharded) + " linear weights sharded across the " +
                std::to_string(dist_.world_size()) + " ranks as they came (distributed/shard_params)";
  return out;
}

LoraPhase::Trained LoraPhase::enter() {
  TORCH_CHECK(!entered_, "transition_to_lora: already in the LoRA phase");
  const NamedTensors params = base_params(*model_);
  const std::string& embedding = selection_.token_embedding;
  token_rows_ = TrainableTokens();
  saved_.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    if (selection_.saved[i]) saved_.push_back(params[i].first);
    if (params[i].first == embedding)  // the rows start from their f32 values, before the freeze
      token_rows_ = make_trainable_tokens(embedding, params[i].second, options_.token_ids);
  }
  // The base: bf16 (the blocks' linear weights NF4 with quantize_base=nf4), no gradients, and (below) no
  // optimizer state; the modules_to_save stay f32 and train.
  const std::set<std::string> quantized = quantized_weights();
  freeze_base(*model_, saved_, [&](const std::string& w) { return quantized.count(w) ? options_.quantize_base : FrozenFormat::Bf16; });

  // The adapters become parameters of their layers; from here on they are found by name. DoRA's
  // magnitudes start at the row norms of the W the products use: an NF4 weight's dequantized values.
  NamedTensors weights = params;
  if (options_.dora) {
    const auto storages = frozen_storages(*model_);
    for (auto& [name, W] : weights)
      if (storages.count(name)) W = storages.at(name)->for_matmul(W);
  }
  auto gen = at::detail::createCPUGenerator(mix64(seed_ ^ 0x4C6F5241ULL));  // "LoRA"
  LoraParams fresh = with_lora_keys([&] {
    return inject_lora_params(weights, selection_.targets, options_.rank, gen, options_.init, options_.dora);
  });
  for (auto& [name, t] : fresh.named()) t.requires_grad_(true);
  attach_lora(*model_, fresh, options_.alpha, options_.rank, options_.rslora);
  if (token_rows_.defined()) {
    token_rows_.values.requires_grad_(true);
    attach_token_rows(*model_, token_rows_);
  }
  adapters_ = lora_params_of(*model_);
  shard_base();  // with distributed/shard_params=lora or all (a job without phase one sharded its base as it loaded it)
  entered_ = true;

  // What trains, by name: the adapters (A, B and DoRA's magnitude of each layer in turn; B and the
  // magnitude at LoRA+'s lr_ratio, the magnitude being 1-D without weight decay by AdamW's rule), then
  // the modules_to_save at their own ratio, then the token rows at the adapters' lr, as PEFT trains
  // them. Identical on every rank (the same seed); their moments may be sharded.
  Trained trained;
  trained.weight_decay = options_.weight_decay;
  for (const auto& [name, p] : named_params(*model_))
    if (is_lora_param(name)) {
      trained.params.emplace_back(name, p);
      trained.lr_scale.push_back(lora_plus_lr_scale(name, options_.lr_ratio));
    }
  for (const auto& [name, p] : named_params(*model_))
    if (std::find(saved_.begin(), saved_.end(), name) != saved_.end()) {
      trained.params.emplace_back(name, p);
      trained.lr_scale.push_back(options_.modules_to_save_lr_ratio);
    }
  if (token_rows_.defined()) {
    trained.params.emplace_back(TrainableTokens::values_name(token_rows_.name), token_rows_.values);
    trained.lr_scale.push_back(1.0);
  }
  return trained;
}

json LoraPhase::log_transition(int64_t step, int64_t tokens) {
  int64_t frozen = 0, saved_numel = 0;
  for (const auto& [name, p] : base_params(*model_))
    (std::find(saved_.begin(), saved_.end(), name) != saved_.end() ? saved_numel : frozen) += p.numel();
  const int64_t token_numel = token_rows_.defined() ? token_rows_.values.numel() : 0;
  const int64_t adapters = count_lora_params(adapters_), trainable = adapters + saved_numel + token_numel;
  std::string saved_text;
  if (!saved_.empty()) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%g", options_.modules_to_save_lr_ratio);
    saved_text = " + " + std::to_string(saved_numel) + " in the modules_to_save (" + join(saved_) + ", f32, lr x" + ratio + ")";
  }
  if (token_rows_.defined())
    saved_text += " + " + std::to_string(token_numel) + " in " + std::to_string(token_rows_.ids.size()) +
                  " trainable token rows of " + token_rows_.name + " (f32)";
  std::string recipe;  // what differs from plain LoRA
  if (options_.rslora) recipe += ", rsLoRA (scale alpha/sqrt(r))";
  if (options_.lr_ratio != 1.0) {
    char ratio[48];
    std::snprintf(ratio, sizeof ratio, ", LoRA+ (B's lr x%g)", options_.lr_ratio);
    recipe += ratio;
  }
  if (adapters_.dora()) {
    int64_t m = 0;
    for (const auto& t : adapters_.magnitude) m += t.numel();
    char text[160];
    std::snprintf(text, sizeof text, ", DoRA (%lld magnitudes, one per output feature, at B's lr x%g, no weight decay)",
                  (long long)m, options_.lr_ratio);
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
    if (frozen_storage(storage->second->format()).quantizes()) quantized += p.numel();
    if (storage->second->sharded()) sharded += p.numel();
  }
  char base_text[160];
  if (quantized > 0)
    std::snprintf(base_text, sizeof base_text, "%lld of them %s: %.3f GB, %.3f bytes a parameter", (long long)quantized,
                  frozen_storage(options_.quantize_base).shown().c_str(), base_bytes / 1e9,
                  static_cast<double>(base_bytes) / std::max<int64_t>(1, frozen));
  else
    std::snprintf(base_text, sizeof base_text, "bf16: %.3f GB", base_bytes / 1e9);
  const std::string base_where = sharded == 0 ? "" : " on each of " + std::to_string(dist_.world_size()) + " ranks: " +
                                                       std::to_string(sharded) + " of them, the blocks' linear weights, sharded "
                                                       "(distributed/shard_params)";
  std::printf("transition to LoRA at step %lld (%lld tokens): %zu adapted weights, rank %lld, alpha %g, init %s%s; "
              "trainable %lld (%.2f%%: %lld in adapters%s), frozen %lld (%s%s)\n",
              (long long)step, (long long)tokens, adapters_.names.size(), (long long)options_.rank, options_.alpha,
              to_string(options_.init), recipe.c_str(), (long long)trainable,
              100.0 * trainable / std::max<int64_t>(1, frozen + trainable), (long long)adapters, saved_text.c_str(),
              (long long)frozen, base_text, base_where.c_str());
  std::fflush(stdout);
  json event = {{"event", "transition"}, {"step", step}, {"tokens", tokens}, {"trainable_params", trainable},
             {"adapter_params", adapters}, {"saved_params", saved_numel}, {"token_params", token_numel},
             {"frozen_params", frozen}, {"frozen_bytes", base_bytes}, {"quantized_params", quantized},
             {"adapted", adapters_.names}, {"modules_to_save", saved_},
             {"trainable_tokens", json(token_rows_of(token_rows_))}};
  if (quantized > 0) event["quantized_as"] = frozen_storage(options_.quantize_base).shown();  // the report's "of them NF4"
  return event;
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
  if (theirs.quantize_base != ours.quantize_base)
    throw UserError(ck.dir + " trained its adapters on a base stored as " + frozen_storage(theirs.quantize_base).shown() +
                    " (lora.quantize_base \"" + to_string(theirs.quantize_base) + "\"); this job has optimization/lora/quantize_base=" +
                    to_string(ours.quantize_base) + ". Set it as the job that saved the checkpoint had it (to go on from its adapters on the other "
                    "base, start a new job with optimization/lora/init_from=" + ck.dir + ")");
  if (theirs.dora != ours.dora)
    throw UserError(ck.dir + (theirs.dora ? " trained DoRA adapters (a magnitude per output feature)" : " trained plain LoRA "
                    "adapters, without DoRA's magnitudes") + "; this job has optimization/lora/dora=" +
                    (ours.dora ? "true" : "false") + ". Set it as the job that saved the checkpoint had it");
}

void LoraPhase::check_selection(const CheckpointMeta& ck) const {
  const LoraMetadata& theirs = *ck.lora;
  const std::vector<std::string>& saved = saved_;
  const auto token_rows = token_rows_of(token_rows_);
  if (theirs.modules_to_save != saved)
    throw UserError(ck.dir + " trained the modules_to_save " + json(theirs.modules_to_save).dump() + " beside its adapters; "
                    "this job's optimization/lora/modules_to_save selects " + json(saved).dump() +
                    ". Set it as the job that saved the checkpoint had it");
  if (theirs.trainable_tokens != token_rows)
    throw UserError(ck.dir + " trained the token rows " + json(theirs.trainable_tokens).dump() + " beside its adapters; "
                    "this job's optimization/lora/trainable_token_indices selects " + json(token_rows).dump() +
                    ". Set it as the job that saved the checkpoint had it");
}

void LoraPhase::check_restorable(const CheckpointMeta& ck, int64_t boundary_step) const {
  if (ck.step < boundary_step)
    throw UserError(ck.dir + " is a LoRA state at step " + std::to_string(ck.step) + ", before this job's LoRA boundary (step " +
                    std::to_string(boundary_step) + "): it belongs to a job with other training/pre_lora_tokens");
  if (!ck.lora)
    throw UserError(ck.dir + "/metadata.json: a LoRA state without its \"lora\" block (rank, alpha, targets): the "
                    "checkpoint is damaged or hand-edited; " + use_another_checkpoint(ck.job_name));
  check_same_recipe(ck, options_);
  if (shards_base() && !ck.frozen_base)
    throw UserError(ck.dir + " holds its own copy of the frozen base (it was saved with logging/save_frozen_base=true, or "
                    "its base had no file to refer to); a job with distributed/shard_params=" + shard_mode_name(shard_params_) +
                    " reads its base from the file its checkpoints refer to, one tensor at a time. Continue it with "
                    "distributed/shard_params=none");
}

void LoraPhase::allocate_base_for_load() {
  const NamedTensors params = base_params(*model_);
  const std::set<std::string> quantized = quantized_weights(), sharded = sharded_weights();
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor p = params[i].second;
    if (quantized.count(params[i].first) || sharded.count(params[i].first))
      p.set_data(frozen_stand_in(p.sizes(), device_));
    else
      p.set_data(torch::empty(p.sizes(), p.options().device(device_).dtype(freezes(i, params[i].first) ? torch::kBFloat16 : torch::kFloat32)));
  }
  model_->to(device_);  // the buffers
}

bool LoraPhase::freezes(size_t i, const std::string& name) const {
  if (name == selection_.token_embedding) return false;  // its rows train: they start from its f32 values
  return i < selection_.saved.size() && !selection_.saved[i];
}

std::string LoraPhase::skipped_phase_one_text() const {
  if (base_.is_object() && base_.value("format", std::string()) == "hf")
    return "phase 1: skipped; the frozen base is the Hugging Face model " + base_.value("path", std::string("?")) + "\n";
  if (base_.is_object())
    return "phase 1: skipped; the frozen base is " + base_.value("path", std::string("?")) + " (job " +
           base_.value("job", std::string("?")) + ", step " + std::to_string(base_.value("step", int64_t(0))) + ")\n";
  return "phase 1: skipped; the base is randomly initialised (training/allow_random_base)\n";
}

void LoraPhase::check_can_start(const std::string& job, int64_t boundary_step, int64_t step) {
  if (boundary_step == 0 && step == 0 && base_.is_null()) {
    // No phase one and no base given: adapters on random weights teach nothing about LoRA on a model.
    if (!options_.allow_random_base)
      throw UserError("job " + job + " has no pre-LoRA stages (training/pre_lora_tokens is []), so its base must "
                      "come from a pretrained checkpoint: add `--restore CHECKPOINT` (a plain checkpoint, an `export`, "
                      "or an `import-hf` output). To train adapters on randomly initialised weights on purpose, set "
                      "training/allow_random_base=true");
    base_ = "random";
  }
  if (shards_base() && options_.save_frozen_base)
    throw UserError("logging/save_frozen_base=true and distributed/shard_params=" + shard_mode_name(shard_params_) +
                    " do not go together: each rank keeps "
                    "1/N of the frozen base, and its checkpoints refer to the file that holds it. Set one of them back "
                    "(logging/save_frozen_base=false, or distributed/shard_params=none)");
  if (shards_base() && base_ == "random" && !entered_)
    throw UserError("job " + job + ": distributed/shard_params=" + shard_mode_name(shard_params_) +
                    " needs a base in a file (its checkpoints refer to "
                    "it, each rank keeping 1/N of it), and this job's is randomly initialised (training/allow_random_base). "
                    "Give it one with --restore, or set distributed/shard_params=none");
  if (!entered_ && !options_.init_from.empty()) {
    // The adapters' source is read at the transition, maybe hours from now: check it fits before training.
    read_adapter_source(options_.init_from, model_->options().family, selection_.target_names, options_.rank,
                        options_.alpha, options_.rslora, options_.dora, token_embeddings(*model_).front(),
                        selection_.token_embedding.empty() ? std::vector<int64_t>() : options_.token_ids);
  }
}

}  // namespace lt
