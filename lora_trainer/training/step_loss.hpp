// What a phase's steps minimise. Trainer::forward_backward is the one micro-batch loop of every job
// (this rank's rows cut into micro-batches of training/per_device_batch_size, each moved to the device,
// the step's loss summed in f64 on the device and read once); for each micro-batch it asks the phase's
// StepLoss to run the forward and backward pass of that micro-batch's part of the step's mean loss.
// The next-token loss (NextTokenLoss) is the trainers' own; DPO's (recipes/dpo_part) trains on
// preference pairs. A Phase (plan.hpp) names its loss.
#pragma once

#include <torch/torch.h>

#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/data/data.hpp"
#include "lora_trainer/models/model.hpp"

namespace lt {

class StepLoss {
 public:
  virtual ~StepLoss() = default;
  // Before the micro-batches of step `step` (1-based): `rows` are this rank's rows of the global batch.
  virtual void begin_step(const Batch& rows, int64_t step) {}
  // Forward and backward of one micro-batch (its tensors on the device) for its part of the step's mean
  // loss (gradients accumulate); returns that part, detached.
  virtual torch::Tensor forward_backward(const Batch& micro) = 0;
  // After the step's micro-batches.
  virtual void end_step() {}
};

// The mean cross-entropy of the next token over the counted targets (>= 0) of the whole global batch:
// each micro-batch's summed loss over that count (summed over the ranks at begin_step), so that the
// micro-batches' gradients add up to the gradient of the global batch's mean.
class NextTokenLoss : public StepLoss {
 public:
  NextTokenLoss(CausalLM& model, const Runtime& rt, Distributed& dist) : model_(model), rt_(rt), dist_(dist) {}
  void begin_step(const Batch& rows, int64_t step) override;
  torch::Tensor forward_backward(const Batch& micro) override;

 private:
  CausalLM& model_;
  const Runtime& rt_;
  Distributed& dist_;
  int64_t counted_ = 0;  // the global batch's counted targets
};

}  // namespace lt
