// DPO (dpo.hpp) on CONTRASTIVE datasets of preference pairs, as a part of a trainer (DpoPart, a
// TrainerPart: training/trainer_part.hpp) in two jobs:
//
// dpo/train, from a pretrained base (`run ... --restore CHECKPOINT`), in one of two forms chosen by
// optimization/dpo/lora (make_dpo_train):
//
//   LoRA (true, the default)  a trainer whose one phase trains adapters: at step 0 the base is frozen as bf16
//                             and adapters train (optimization/lora/*). The reference is the same model
//                             with the adapters switched off (AdaptersOff): no second copy of the weights.
//   full (false)              a Trainer: every parameter trains (optimization/lr, training/schedule);
//                             the reference is a frozen bf16 copy of the starting weights, taken when the
//                             base is loaded and saved in every checkpoint as ref/<name>.
//
// lora/train whose post-LoRA datasets are contrastive (make_lora_train, lora_train.hpp): a trainer over both phases'
// stages with DPO on its LoRA phase. Phase 1 is next-token training on the pre-LoRA datasets as in any
// lora/train job; at the boundary transition_to_lora puts on the adapters (B = 0), and phase 2 trains
// them with DPO's loss, the reference being the base with the adapters off, as in dpo/train's LoRA form.
//
// training/tokens and training/dataset are dpo/train's one stage, as in `train`; a sample is a pair, so
// training/batch_size (and per_device_batch_size) count pairs, each two rows of block_size tokens,
// and a step's tokens are counted as batch_size x block_size. Validation measures the DPO loss,
// reward margin and accuracy on the first training/validation_steps pairs of each contrastive dataset
// (the trainer measures the held-out cross-entropy of any other); the DPO step line adds the margin,
// accuracy and both rewards, averaged over the steps since the last line. Everything a step depends on is
// in the checkpoint, so resume is bit-identical in every form.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/recipes/dpo.hpp"
#include "lora_trainer/training/step_loss.hpp"
#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/training/trainer_part.hpp"

namespace lt {

class DpoPart : public TrainerPart {
 public:
  // The part of `trainer`, which must outlive it: the last phase of its plan trains with DPO's loss.
  // `lora`: the reference is the trainer's model with its adapters off (a LoRA phase), else a frozen
  // bf16 copy of its weights, made now. `after_next_token_phase`: lora/train's form, whose phase 1 trains
  // on text (its datasets were checked by lora_phase_objective), else dpo/train's.
  DpoPart(Trainer& trainer, DpoOptions options, bool after_next_token_phase);

  void plan(std::vector<Phase>& phases) override;
  // dpo/train: refuses to start without a base (a --restore) unless training/allow_random_base.
  void before_run() override;
  void add_state(NamedTensors& tensors) override;  // full-parameter: the reference, ref/<name>
  void add_metadata(nlohmann::json& meta) const override;
  // Full-parameter: a DPO state of this form is the trainer's to restore (its ref/* included); any other
  // plain state or export becomes the base and the reference, with the counters at zero.
  bool restore(const CheckpointMeta& ck) override;
  void restored(const CheckpointMeta& ck) override;
  void add_window_metrics(nlohmann::json& metrics) override;
  bool measures(DatasetStyle style) const override { return style == DatasetStyle::CONTRASTIVE; }
  // DPO's loss, reward margin and accuracy of each contrastive dataset's first `rows` pairs (the others
  // are the trainer's; their rows of the sums reduced over the ranks stay zero).
  std::vector<DatasetEval> measure(const std::vector<Sampling>& datasets, int64_t rows) override;
  // dpo/train trains on pairs only.
  void check_training_datasets(const std::vector<Sampling>& datasets) const override;

  const DpoOptions& dpo_options() const { return dpo_; }
  // The last DPO step's sums over its pairs (all ranks).
  const DpoStats& last_step() const { return last_; }

 private:
  // The reference's summed log-probabilities of rows (2P, T) -> (2P), without gradients.
  torch::Tensor reference_logps(const torch::Tensor& idx, const torch::Tensor& targets);
  // The DPO terms of pairs (P, 2T) on the device (the loss differentiable).
  DpoTerms pair_terms(const torch::Tensor& inputs, const torch::Tensor& targets);
  void copy_reference();  // full-parameter: the model's weights into the reference (bf16)
  // DPO's StepLoss: each micro-batch's pairs' losses over the global batch's pairs (training/batch_size);
  // the step's figures summed over its micro-batches and the ranks into last_step() and the step line's window.
  class PairLoss : public StepLoss {
   public:
    explicit PairLoss(DpoPart& part) : part_(part) {}
    void begin_step(const Batch& rows, int64_t step) override;
    torch::Tensor forward_backward(const Batch& micro) override;
    void end_step() override;

   private:
    DpoPart& part_;
    DpoStats stats_;  // this rank's, over the step's micro-batches
    int64_t step_ = 0;
  };

  Trainer& trainer_;
  DpoOptions dpo_;
  bool lora_train_;     // lora/train's form: a next-token phase 1 before the DPO phase
  CausalLM reference_;  // full-parameter only
  DpoStats last_, window_;
  PairLoss pair_loss_{*this};
  bool has_base_ = false;
};

// dpo/train's schema, and its job: a trainer of adapters with a DpoPart (optimization/dpo/lora=true) or a
// Trainer with one (false).
ConfigSchema dpo_train_schema();
std::unique_ptr<Trainer> make_dpo_train(JobSpec spec, Config cfg, std::string out_dir);

// A UserError naming `job` when `t` trains modules_to_save: DPO's reference is the model with its
// adapters off, and modules trained beside them would leak into it.
void check_no_modules_to_save(const Trainer& t, const char* job);

}  // namespace lt
