// The trainer's side of its LoRA phase (lora_phase.hpp): the boundary (transition_to_lora), the
// phase-one state handed over to it, and a restore's choice between a base, a LoRA state and a plain
// state. The trainer's loop is in trainer.cpp.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/training/lora_report.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace fs = std::filesystem;

namespace lt {

static const char* kPreLoraCheckpoint = "pre_lora_checkpoint";

ConfigSchema Trainer::lora_schema() {
  ConfigSchema s;
  add_job_options(s, "lora/train");
  add_trainer_options(s);
  s.remove("training/tokens").remove("training/dataset");  // the phases below replace them
  add_lora_plan_options(s);
  add_lora_options(s);
  return s;
}

void Trainer::transition_to_lora() {
  const bool at_boundary = boundary_step_ > 0 && step_ == boundary_step_;
  const std::string boundary_checkpoint = (fs::path(job_dir()) / kPreLoraCheckpoint).string();
  // Rank 0 reads the file system for every rank: they must all take part in the save or none.
  if (at_boundary && dist_.broadcast_flag(!is_checkpoint(boundary_checkpoint), "deciding whether to save " + std::string(kPreLoraCheckpoint)))
    save(kPreLoraCheckpoint);
  enter_lora_phase();
  // The base this job's checkpoints refer to instead of copying it: its own boundary checkpoint, or
  // the base it loaded (none for a random base, or a test's transition at another step).
  const json& base = lora_->base();
  std::string source, format = "checkpoint";
  if (at_boundary) {
    source = boundary_checkpoint;
  } else if (boundary_step_ == 0 && base.is_object()) {
    source = base.value("path", std::string());
    if (base.value("format", std::string()) == "hf") format = "hf";
  }
  lora_->refer_to_frozen_base(source, format, spec_.name, job_dir(), is_main());
  if (!lora_->options().init_from.empty()) lora_->load_initial_adapters();
  log_event(lora_->log_transition(step_, tokens_));
}

void Trainer::enter_lora_phase() {
  settle_random_weights();  // a job stepped without a base: the family's init, as a random base gets
  if (sharded_params_) {
    // Phase 1's sharded parameters whole again, block by block: directly in bf16 those the LoRA phase
    // freezes (the rounding the freeze makes; NF4 quantizes bf16 values too), float32 the modules_to_save.
    optimizer_.reset();  // the pieces' moments go first
    std::set<std::string> saved;
    const NamedTensors all = base_params(*model_);
    for (size_t i = 0; i < all.size(); ++i)
      if (lora_->selection().saved[i]) saved.insert(all[i].first);
    sharded_params_->unshard([&](const std::string& name) { return saved.count(name) ? torch::kFloat32 : torch::kBFloat16; });
    sharded_params_.reset();
  }
  LoraPhase::Trained trained = lora_->enter();
  // Identical on every rank (the same seed); their moments may be sharded (the phase is entered now).
  build_optimizer(std::move(trained.params), trained.weight_decay, std::move(trained.lr_scale));
}

bool Trainer::restore_lora_template(const CheckpointMeta& ck) {
  if (ck.weights_only || (ck.kind == StateKind::Plain && boundary_step_ == 0)) {
    // Skip phase one: another job's weights become this job's base; our counters stay at zero.
    if (in_lora_phase() || step_ != 0)
      throw UserError("a pretrained base can only be loaded before training starts; " + ck.dir + " came too late");
    load_weights_from(ck);
    lora_->set_base({{"path", ck.dir}, {"job", ck.job_name}, {"step", ck.step}});
    return true;
  }
  if (ck.kind == StateKind::Lora) {
    lora_->check_restorable(ck, boundary_step_);
    // As load_weights_from: each base tensor read (and its quantization) is mapped, so that its memory
    // goes back to the system when it is dropped instead of staying in the heap.
    MappedLargeAllocations mapped;
    if (weights_pending_) lora_->allocate_base_for_load();  // not drawn: the load overwrites every tensor
    weights_pending_ = false;
    if (!in_lora_phase()) enter_lora_phase();  // the LoRA template; the load overwrites it
    lora_->check_selection(ck);
    lora_->load_frozen_base(ck);
  } else {
    if (ck.step > boundary_step_)
      throw UserError(ck.dir + " is a plain state at step " + std::to_string(ck.step) + ", past this job's LoRA boundary (step " +
                      std::to_string(boundary_step_) +
                      "). To use it as a pretrained base, set training/pre_lora_tokens and training/pre_lora_dataset to []");
    if (in_lora_phase()) throw UserError("cannot restore the plain state " + ck.dir + " into a job already in its LoRA phase");
  }
  return false;
}

std::string Trainer::report() {
  if (!lora_) return "";  // the report compares the phases of a LoRA job
  LoraReportFacts f{spec_.name, spec_.kind, run_dir(), job_dir(), boundary_step_, total_steps_, tokens_per_step(),
                    lora_->skipped_phase_one_text(), {}};
  for (const auto& smp : data_->datasets())
    if (smp.style == DatasetStyle::PMD)
      f.unigram_perplexity.emplace_back(
          smp.name, std::exp(unigram_val_loss(dynamic_cast<const PmdDataset&>(data_->open(smp)), model_->options().vocab_size)));
  return write_lora_report(f);
}

// Without a LoRA phase there are no adapters, saved modules nor token rows: the empty ones.
const LoraParams& Trainer::lora_params() const {
  static const LoraParams none;
  return lora_ ? lora_->adapters() : none;
}

const std::vector<std::string>& Trainer::saved_modules() const {
  static const std::vector<std::string> none;
  return lora_ ? lora_->saved() : none;
}

const TrainableTokens& Trainer::trainable_tokens() const {
  static const TrainableTokens none;
  return lora_ ? lora_->token_rows() : none;
}

const LoraOptions& Trainer::lora_config() const {
  if (!lora_) throw std::logic_error("lora_config: job " + spec_.name + " has no LoRA phase");
  return lora_->options();
}

}  // namespace lt
