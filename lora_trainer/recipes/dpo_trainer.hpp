// DPO (dpo.hpp) on CONTRASTIVE datasets of preference pairs, as the trainer of two jobs:
//
// dpo/train, from a pretrained base (`run ... --restore CHECKPOINT`), in one of two forms chosen by
// optimization/dpo/lora:
//
//   DpoTrainer<LoRATrainer>  (true, the default) the LoRA trainer with no pre-LoRA stage: at step 0
//                            the base is frozen as bf16 and adapters train (optimization/lora/*). The
//                            reference is the same model with the adapters switched off
//                            (AdaptersOff): no second copy of the weights.
//   DpoTrainer<BaseTrainer>  (false) every parameter trains (optimization/lr, training/schedule);
//                            the reference is a frozen bf16 copy of the starting weights, taken when
//                            the base is loaded and saved in every checkpoint as ref/<name>.
//
// lora/train whose post-LoRA datasets are contrastive (make_lora_train): DpoTrainer<LoRATrainer> over
// both phases' stages. Phase 1 is next-token training on the pre-LoRA datasets as in any lora/train
// job; at the boundary transition_to_lora puts on the adapters (B = 0), and phase 2 trains them with
// DPO's loss, the reference being the base with the adapters off, as in dpo/train's LoRA form.
//
// training/tokens and training/dataset are dpo/train's one stage, as in `train`; a sample is a pair, so
// training/batch_size (and per_device_batch_size) count pairs, each two rows of block_size tokens,
// and a step's tokens are counted as batch_size x block_size. Validation measures the DPO loss,
// reward margin and accuracy on the first training/validation_steps pairs of each contrastive dataset
// (the held-out cross-entropy of any other); the DPO step line adds the margin, accuracy and both
// rewards, averaged over the steps since the last line. Everything a step depends on is in the
// checkpoint, so resume is bit-identical in every form.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "lora_trainer/recipes/dpo.hpp"
#include "lora_trainer/training/lora_trainer.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace lt {

template <class Base>
class DpoTrainer : public Base {
 public:
  static ConfigSchema schema();  // dpo/train's
  DpoTrainer(JobSpec spec, Config cfg, std::string out_dir);  // dpo/train
  // The LoRA form only: lora/train's stages (lora_stage_plan), the first `pre_lora_stages` next-token
  // training and the rest, all contrastive (lora_phase_is_dpo), DPO on the adapters.
  DpoTrainer(JobSpec spec, Config cfg, std::string out_dir, const StagePlan& plan, size_t pre_lora_stages);

  // dpo/train: refuses to start without a base (a --restore) unless training/allow_random_base.
  void run() override;
  // A DPO state of this form continues (full-parameter: its ref/* included); any other plain state or
  // export becomes the base (and, full-parameter, the reference) with the counters at zero.
  void restore_from_checkpoint(const CheckpointMeta& ck) override;
  NamedTensors state_tensors() override;
  // Contrastive datasets: DPO's loss, margin and accuracy; others: the held-out cross-entropy.
  std::vector<DatasetEval> evaluate(const std::vector<Sampling>& datasets, int64_t rows) override;

  // The base's phases, the last trained on preference pairs with DPO's loss: dpo/train's (its only one,
  // or the LoRA one after an empty pre-LoRA phase) and lora/train's LoRA phase.
  std::vector<Phase> phases() override;
  const DpoOptions& dpo_options() const { return dpo_; }
  // The last DPO step's sums over its pairs (all ranks).
  const DpoStats& last_step() const { return last_; }

 protected:
  nlohmann::json window_metrics() override;
  void check_dataset_styles(const std::vector<Sampling>& datasets) const override;
  nlohmann::json extra_metadata() const override;

 private:
  static constexpr bool kLora = std::is_base_of_v<LoRATrainer, Base>;
  void init();
  // The reference's summed log-probabilities of rows (2P, T) -> (2P), without gradients.
  torch::Tensor reference_logps(const torch::Tensor& idx, const torch::Tensor& targets);
  // The DPO terms of pairs (P, 2T) on the device (the loss differentiable).
  DpoTerms pair_terms(const torch::Tensor& inputs, const torch::Tensor& targets);
  void copy_reference();  // full-parameter: the model's weights into the reference (bf16)
  // DPO's StepLoss: each micro-batch's pairs' losses over the global batch's pairs (training/batch_size);
  // the step's figures summed over its micro-batches and the ranks into last_step() and the step line's window.
  class PairLoss : public StepLoss {
   public:
    explicit PairLoss(DpoTrainer& trainer) : t_(trainer) {}
    void begin_step(const Batch& rows, int64_t step) override;
    torch::Tensor forward_backward(const torch::Tensor& inputs, const torch::Tensor& targets) override;
    void end_step() override;

   private:
    DpoTrainer& t_;
    DpoStats stats_;  // this rank's, over the step's micro-batches
    int64_t step_ = 0;
  };

  DpoOptions dpo_;
  bool lora_train_ = false;  // the lora/train form: a next-token phase 1 before the DPO phase
  CausalLM reference_;  // full-parameter only
  DpoStats last_, window_;
  PairLoss pair_loss_{*this};
  bool has_base_ = false;
};

template <> DpoTrainer<BaseTrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir);
template <> DpoTrainer<LoRATrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir);
template <>
DpoTrainer<LoRATrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir, const StagePlan& plan,
                                    size_t pre_lora_stages);
extern template class DpoTrainer<BaseTrainer>;
extern template class DpoTrainer<LoRATrainer>;

// Whether lora/train's LoRA phase trains with DPO: true when every post-LoRA dataset of `plan` (the
// stages after the first `pre_lora_stages`) is contrastive, false when none is. A UserError naming the
// datasets and their styles for a mix, and for preference pairs among the pre-LoRA datasets (phase 1
// is next-token training).
bool lora_phase_is_dpo(const StagePlan& plan, size_t pre_lora_stages);
// lora/train's schema: LoRATrainer's and optimization/dpo/{beta, label_smoothing} for a DPO phase 2.
ConfigSchema lora_train_schema();
// The lora/train job: a LoRATrainer, or a DpoTrainer<LoRATrainer> when lora_phase_is_dpo.
std::unique_ptr<RestorableJob> make_lora_train(JobSpec spec, Config cfg, std::string out_dir);

}  // namespace lt
