#include "lora_trainer/training/step_loss.hpp"

#include <algorithm>
#include <string>

namespace lt {

void NextTokenLoss::begin_step(const Batch& rows, int64_t step) {
  counted_ = rows.targets.ge(0).sum().item<int64_t>();
  if (dist_.active()) {  // the loss is a mean over the targets of the whole global batch
    auto count = torch::tensor({counted_}, torch::kLong);
    dist_.all_reduce_sum({count}, "the target count of step " + std::to_string(step));
    counted_ = count.item<int64_t>();
  }
}

torch::Tensor NextTokenLoss::forward_backward(const Batch& micro) {
  AutocastGuard autocast(rt_);
  auto scaled = model_->loss_sum(micro.inputs, micro.targets, micro.segments) / static_cast<double>(std::max<int64_t>(1, counted_));
  scaled.backward();
  return scaled.detach();
}

}  // namespace lt
