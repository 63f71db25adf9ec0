// An exponential moving average of the trainable parameters (optimization/ema/decay, seed 003):
// after every optimizer step, ema = decay * ema + (1 - decay) * p, starting from the parameters' values
// when the trainable set is built (the start of a run, the LoRA transition: then the adapters and the
// modules_to_save). Kept in f32 on the parameters' device, saved in checkpoints as `ema/<name>`.
// Validation, `eval` and `sample` use it with eval/use_ema, and `export --ema` writes it.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "lora_trainer/core/named_tensors.hpp"

namespace lt {

class Ema {
 public:
  Ema(const NamedTensors& params, double decay);
  void update();  // after an optimizer step
  // ema/<name> in parameter order: the tensors themselves (a checkpoint load copies into them).
  NamedTensors state() const;
  // Starts the average again from the parameters' current values (a checkpoint without one).
  void reset();
  const NamedTensors& params() const { return params_; }
  double decay() const { return decay_; }

  // For its lifetime the parameters hold the average; their own values come back after.
  class Swap {
   public:
    explicit Swap(Ema& ema);
    ~Swap();
    Swap(const Swap&) = delete;
    Swap& operator=(const Swap&) = delete;

   private:
    Ema& ema_;
    std::vector<torch::Tensor> saved_;
  };

 private:
  NamedTensors params_;
  std::vector<torch::Tensor> avg_;
  double decay_;
};

}  // namespace lt
