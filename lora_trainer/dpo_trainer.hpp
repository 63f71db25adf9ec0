// The dpo/train job: DPO (dpo.hpp) on a CONTRASTIVE dataset of preference pairs, from a pretrained
// base (`run ... --restore CHECKPOINT`), in one of two forms chosen by optimization/dpo/lora:
//
//   DpoTrainer<LoRATrainer>  (true, the default) the LoRA trainer with no pre-LoRA stage: at step 0
//                            the base is frozen as bf16 and adapters train (optimization/lora/*). The
//                            reference is the same model with the adapters switched off
//                            (AdaptersOff): no second copy of the weights.
//   DpoTrainer<BaseTrainer>  (false) every parameter trains (optimization/lr, training/schedule);
//                            the reference is a frozen bf16 copy of the starting weights, taken when
//                            the base is loaded and saved in every checkpoint as ref/<name>.
//
// training/tokens and training/dataset are the one stage, as in `train`; a sample is a pair, so
// training/batch_size (and per_device_batch_size) count pairs, each two rows of block_size tokens,
// and a step's tokens are counted as batch_size x block_size. Validation measures the DPO loss,
// reward margin and accuracy on the first training/validation_steps pairs of each dataset; the step
// line adds the margin, accuracy and both rewards, averaged over the steps since the last line.
// Everything a step depends on is in the checkpoint, so resume is bit-identical in both forms.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "lora_trainer/dpo.hpp"
#include "lora_trainer/lora_trainer.hpp"
#include "lora_trainer/trainer.hpp"

namespace lt {

template <class Base>
class DpoTrainer : public Base {
 public:
  static ConfigSchema schema();
  DpoTrainer(JobSpec spec, Config cfg, std::string out_dir);

  // Refuses to start without a base (a --restore) unless training/allow_random_base.
  void run() override;
  // A DPO state of this form continues (full-parameter: its ref/* included); any other plain state or
  // export becomes the base (and, full-parameter, the reference) with the counters at zero.
  void restore_from_checkpoint(const CheckpointMeta& ck) override;
  NamedTensors state_tensors() override;
  // Contrastive datasets: DPO's loss, margin and accuracy; others: the held-out cross-entropy.
  std::vector<DatasetEval> evaluate(const std::vector<Sampling>& datasets, int64_t rows) override;

  const DpoOptions& dpo_options() const { return dpo_; }
  // The last step's sums over its pairs (all ranks).
  const DpoStats& last_step() const { return last_; }

 protected:
  double forward_backward(const Batch& batch) override;
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

  DpoOptions dpo_;
  CausalLM reference_;  // full-parameter only
  DpoStats last_, window_;
  bool has_base_ = false;
};

template <> DpoTrainer<BaseTrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir);
template <> DpoTrainer<LoRATrainer>::DpoTrainer(JobSpec spec, Config cfg, std::string out_dir);
extern template class DpoTrainer<BaseTrainer>;
extern template class DpoTrainer<LoRATrainer>;

}  // namespace lt
