// Trainer's state as a checkpoint: what a checkpoint of it holds (state_tensors,
// checkpoint_metadata), saving it, and restoring it (a full state, or weights only). The format itself
// is checkpoint.hpp's; the loop that decides when to save is in trainer.cpp.
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/safetensors.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

NamedTensors Trainer::state_tensors() {
  // With phase 1's parameters sharded, stand-ins of the whole tensors: save() gathers them, a restore keeps its part.
  return sharded_params_ ? sharded_params_->whole_stand_ins(local_state_tensors()) : local_state_tensors();
}

NamedTensors Trainer::local_state_tensors() {
  NamedTensors out;
  // Every parameter of the model, the adapters' included (the LoRA phase's "<layer>.lora_A", ...); a
  // weight stored as NF4 by its codes and scales (nf4/<name>.<field>; another storage's state() as
  // <storage>/<name>.<field>) instead of its stand-in.
  const auto storages = frozen_storages(*model_);
  for (auto& [name, t] : named_params(*model_)) {
    auto storage = storages.find(name);
    if (storage == storages.end()) {
      out.emplace_back(kParamsPrefix + name, sharded_params_ && sharded_params_->contains(name) ? sharded_params_->piece(name) : t);
      continue;
    }
    const std::string prefix = frozen_storage(storage->second->format()).state_prefix();  // nf4/
    for (auto& [field, v] : storage->second->state()) out.emplace_back(prefix + name + "." + field, v);
  }
  for (auto& kv : optimizer_->state()) out.push_back(kv);
  if (ema_)
    for (auto& kv : ema_->state()) out.push_back(kv);
  out.emplace_back("rng/generators", rng_state(rt_));
  for (const auto& part : parts_) part->add_state(out);
  return out;
}

json Trainer::checkpoint_metadata() const {
  json cursors = json::object();
  uint64_t drawn = 0;
  for (const auto& [stage, cursor] : data_->cursors()) {
    cursors[std::to_string(stage)] = cursor;
    drawn += cursor;
  }
  // per_step: when the counters follow from the step count (every step took training/batch_size rows of
  // tokens_per_step() tokens, and the cursors sum to no more than those rows), a restore checks them
  // exactly (check_counters). A resume that changed the batch or block size breaks that: null then.
  const bool uniform = tokens_ == step_ * tokens_per_step() && drawn <= static_cast<uint64_t>(step_ * batch_size_);
  json m = {{"kind", state_kind_name(state_kind())},
            {"step", step_},
            {"tokens", tokens_},
            {"total_steps", total_steps_},
            {"finished", step_ >= total_steps_},
            {"best_score", best_score_ ? json(*best_score_) : json(nullptr)},
            {"best_stage", best_stage_},
            {"trainable_params", optimizer_->param_names()},
            {"distributed", {{"ranks", dist_.world_size()}, {"optimizer_sharded", optimizer_->sharded()}}},
            {"data", {{"stage", current_stage()}, {"cursors", cursors}}},
            {"per_step", uniform ? json{{"rows", batch_size_}, {"tokens", tokens_per_step()}} : json(nullptr)},
            {"job", spec_.to_json()},
            {"config", cfg_.to_json()}};
  provenance_->add_metadata(m);
  if (ema_) m["ema"] = {{"decay", ema_->decay()}, {"params", names_of(ema_->params())}};
  if (lora_) lora_->add_metadata(m, boundary_step_);
  for (const auto& part : parts_) part->add_metadata(m);
  return m;
}

void Trainer::visit_whole_params(const std::function<void(const std::string&, const torch::Tensor&)>& visit) {
  if (sharded_params_) sharded_params_->visit_whole(named_params(*model_), visit);
  else
    for (const auto& [name, p] : named_params(*model_)) visit(name, p);
}

void Trainer::save(const std::string& suffix, bool update_latest) {
  std::string dir = (fs::path(job_dir()) / suffix).string();
  if (sharded_params_) {
    save_sharded(dir, suffix);
    if (update_latest && is_main()) write_latest(job_dir(), suffix);
    dist_.barrier("saving checkpoint " + suffix);
    return;
  }
  NamedTensors tensors = state_tensors();
  if (lora_) lora_->drop_frozen_base(tensors, lora_->refers_to_base());  // referred to, not copied
  if (optimizer_->sharded()) {  // the whole state: each rank contributes its share of the moments, zeros elsewhere
    std::vector<torch::Tensor> moments;
    for (auto& [n, t] : tensors)
      if (n.rfind("optim/exp_avg", 0) == 0) moments.push_back(t);
    dist_.all_reduce_sum(moments, "gathering the sharded optimizer state for " + suffix);
  }
  check_finite(tensors, step_, spec_.name, "checkpoint " + suffix);  // every rank holds the whole state, so all decide alike
  if (is_main()) {
    save_checkpoint(dir, tensors, checkpoint_metadata());
    if (update_latest) write_latest(job_dir(), suffix);
  }
  dist_.barrier("saving checkpoint " + suffix);  // the others go on once it is complete
}

void Trainer::save_sharded(const std::string& dir, const std::string& suffix) {
  const NamedTensors local = local_state_tensors();
  // Every rank checks what it holds; all decide alike on the sum of their findings.
  std::exception_ptr found;
  try {
    check_finite(local, step_, spec_.name, "checkpoint " + suffix);
  } catch (const TrainingDiverged&) {
    found = std::current_exception();
  }
  auto flags = torch::tensor({found ? int64_t(1) : int64_t(0)}, torch::kLong);
  dist_.all_reduce_sum({flags}, "checking the sharded state for checkpoint " + suffix);
  if (found) std::rethrow_exception(found);
  if (flags.item<int64_t>() > 0)
    throw TrainingDiverged("training diverged: after step " + std::to_string(step_) + " of job " + spec_.name + ", another rank's "
                           "part of the parameters holds NaN or infinite values (that rank names the tensor), so checkpoint " +
                           suffix + " was not saved. " + divergence_advice());
  TensorStream stream = sharded_params_->gathered(state_tensors(), local, "checkpoint " + suffix);
  MappedLargeAllocations mapped;  // each gathered block's memory returned when the next comes
  if (is_main()) {
    save_checkpoint(dir, stream, checkpoint_metadata());
  } else {
    for (size_t i = 0; i < stream.names.size(); ++i) stream.get(i);  // the same gathers, in rank 0's order
  }
}

void Trainer::restore_from_checkpoint(const CheckpointMeta& ck) {
  bool restored = false;
  for (const auto& part : parts_)
    if (!restored) restored = part->restore(ck);
  if (!restored) restore_state(ck);
  for (const auto& part : parts_) part->restored(ck);
}

void Trainer::restore_state(const CheckpointMeta& ck) {
  if (lora_ && restore_lora_template(ck)) return;  // a base for a job without phase 1
  const std::string& dir = ck.dir;
  if (ck.weights_only) {
    load_weights_from(ck);
    return;
  }
  if (ck.kind != state_kind())
    throw UserError(dir + " holds a \"" + state_kind_name(ck.kind) + "\" state; job kind " + spec_.kind +
                    " expects \"" + state_kind_name(state_kind()) + "\"");
  if (ck.step > total_steps_)
    throw UserError(dir + " is at step " + std::to_string(ck.step) + " (" + std::to_string(ck.tokens) + " tokens), past the end "
                    "of this job's schedule (" + std::to_string(total_steps_) + " steps of " + std::to_string(tokens_per_step()) +
                    " tokens): this job would call it finished without having trained to its end. To continue it, raise "
                    "the token budget (training/tokens, or training/post_lora_tokens) to " + std::to_string(ck.step) +
                    " steps or more, or " + use_another_checkpoint(ck.job_name));
  check_same_computation(cfg_, ck.config.value("architecture", json::object()), ck.dir);
  const std::vector<std::string>& names = ck.trainable_params;
  if (names != optimizer_->param_names())
    throw UserError(dir + ": its trainable parameters (" + std::to_string(names.size()) +
                    ") differ from this job's (" + std::to_string(optimizer_->param_names().size()) +
                    "); is it a checkpoint of this model (architecture/*)?");
  // Parameters and moments are loaded in place; the step count and RNG state come back as the fresh
  // scalars that state_tensors() made for them, and are applied here.
  NamedTensors into = state_tensors();
  if (lora_) lora_->drop_frozen_base(into, in_lora_phase() && ck.frozen_base.has_value());  // loaded by load_frozen_base
  // The EMA is loaded where both have one; a checkpoint without it (saved with optimization/ema/decay 0)
  // starts this job's average at its weights, and one with it loads into a job without one as weights only.
  const bool ema_saved = ck.ema.has_value();
  if (ema_ && !ema_saved)
    into.erase(std::remove_if(into.begin(), into.end(), [](const auto& p) { return p.first.rfind(kEmaPrefix, 0) == 0; }),
               into.end());
  std::set<std::string> prefixes;  // without an EMA here: every kind of tensor but the saved average
  if (!ema_ && ema_saved)
    for (const auto& [n, t] : into) prefixes.insert(n.substr(0, n.find('/') + 1));
  // With phase 1's parameters sharded, this rank keeps its part of each of their tensors.
  const TensorWriter keep_part = sharded_params_ ? sharded_params_->keep_local_part(local_state_tensors()) : nullptr;
  load_checkpoint_into(ck, into, std::vector<std::string>(prefixes.begin(), prefixes.end()), keep_part);
  if (ema_ && !ema_saved) {
    ema_->reset();
    std::fprintf(stderr, "note: %s has no EMA (its run had optimization/ema/decay 0); the average starts here\n", dir.c_str());
  }
  for (auto& [n, t] : into) {
    if (n == "rng/generators") set_rng_state(rt_, t);
    if (n == "optim/step") optimizer_->set_steps_taken(t.item<int64_t>());
  }
  step_ = ck.step;
  tokens_ = ck.tokens;
  best_score_ = ck.best_score;
  best_stage_ = ck.best_stage;
  provenance_->restored(ck);
  if (lora_) lora_->restored(ck);
  const std::string& from_job = ck.job_name;
  if (from_job != spec_.name)  // another job's state: say what was loaded and that its counters go on
    std::fprintf(stderr,
                 "loaded the %s state of job %s at step %lld (%lld tokens) from %s; job %s continues from there: its "
                 "step, tokens, learning-rate schedule, optimizer moments and data position are that state's\n",
                 state_kind_name(state_kind()).c_str(), from_job.c_str(), (long long)step_, (long long)tokens_, dir.c_str(),
                 spec_.name.c_str());
  // Samplers are rebuilt when next used (a checkpoint read for eval needs no training data).
  data_->restore(ck.cursors);
}

void Trainer::load_weights_from(const CheckpointMeta& ck) {
  if (ck.kind != StateKind::Plain)
    throw UserError(ck.dir + " holds a \"" + state_kind_name(ck.kind) +
                    "\" state; only a plain checkpoint (or one made by `export`) can initialise weights");
  check_same_computation(cfg_, ck.config.value("architecture", json::object()), ck.dir);
  load_weights_from(*BaseWeights::open_checkpoint(ck, base_params(*model_)));
  provenance_->restored(ck);
  std::fprintf(stderr, "initialised weights from %s (step %lld of job %s); this job starts at step %lld\n", ck.dir.c_str(),
               (long long)ck.step, ck.job_name.c_str(), (long long)step_);
}

void Trainer::load_weights_from(const BaseWeights& src) {
  torch::NoGradGuard ng;
  const double t0 = now_seconds();
  // Each tensor read (and its conversions) is freed before the next: mapped, so that its memory goes
  // back to the system instead of staying in a heap the kept tensors (NF4 codes, bf16 weights) fragment.
  MappedLargeAllocations mapped;
  LoraPhase::BaseLoad loaded;
  if (lora_ && boundary_step_ == 0) {  // the LoRA phase's base, stored as the phase keeps it as it comes
    check_memory(dist_.world_size(), memory_plan_.inputs.ranks_here, src.dtype() == "bfloat16" ? 2 : 4);
    loaded = lora_->load_base([&](const std::string& name) { return src.peek(name); },
                              [&](const std::string& name) { src.prefetch(name); });
  } else {
    // Read in the source's dtype, cast once to float32 (no copy when it is already), placed; phase 1's
    // sharded parameters keep this rank's part.
    const NamedTensors params = base_params(*model_);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      const torch::Tensor t = src.peek(name);  // perhaps the file's own pages: converted or copied, never kept
      if (i + 1 < params.size()) src.prefetch(params[i + 1].first);  // read while this one is placed
      if (sharded_params_ && sharded_params_->contains(name))
        sharded_params_->piece(name).copy_(sharded_params_->local_part(name, t.to(torch::kFloat32)));
      else
        p.set_data(t.to(rt_.device, torch::kFloat32));
      if (is_mapped_view(p)) p.set_data(p.detach().clone());
    }
  }
  if (weights_pending_) model_->to(rt_.device);  // the buffers
  weights_pending_ = false;
  provenance_->loaded(src.base_model());
  if (is_main())  // stderr, as every line of a restore: `eval --json` prints its JSON alone on stdout
    std::fprintf(stderr, "loaded %s: %.2f GB of %s weights in %.1f s%s\n", src.path().c_str(), src.bytes() / 1e9,
                 src.dtype().c_str(), now_seconds() - t0, loaded.text.c_str());
}

void Trainer::restore_from_model_dir(const std::string& dir) {
  if (step_ != 0 || in_lora_phase())
    throw UserError("a pretrained model can only be loaded before training starts; " + dir + " came too late");
  auto src = BaseWeights::open_hf(dir, model_->options().family, base_params(*model_));
  // Every architecture setting the model's config.json gives must be this job's (block_size is the
  // rows' length the job trains on, for a rotary model its own choice; a learned table's shape is
  // checked by the load).
  std::vector<std::string> differ;
  for (const auto& [setting, ours] : differing_architecture(cfg_, src->architecture())) differ.push_back(setting);
  if (!differ.empty())
    throw UserError(dir + "/config.json describes another model than this job's architecture: set " + join(differ, " ") +
                    " (`lora_trainer run` takes them from the directory by itself when the config leaves them at their "
                    "defaults; the settings above were given otherwise)");
  load_weights_from(*src);
  if (lora_) lora_->set_base({{"path", src->base_model()["hf_dir"]}, {"format", "hf"}, {"step", 0}});
  std::fprintf(stderr, "initialised weights from the Hugging Face model %s; this job starts at step %lld\n", dir.c_str(),
               (long long)step_);
}

}  // namespace lt
