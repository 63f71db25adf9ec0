#include "lora_trainer/peft/frozen_weight.hpp"

#include "lora_trainer/core/torch_compat.hpp"

namespace lt {

torch::Tensor weight_for(const torch::Tensor& W, const torch::Tensor& x) {
  if (!W.defined() || W.scalar_type() == x.scalar_type()) return W;
  const bool autocast = compat::autocast_enabled(x.device().type());
  return autocast ? W : W.to(x.scalar_type());
}

namespace {

// The parameter itself, in bf16: produced for a matmul as weight_for does for any parameter.
class Bf16Weight : public FrozenWeight {
 public:
  explicit Bf16Weight(torch::Tensor weight) : weight_(std::move(weight)) {}
  torch::Tensor for_matmul(const torch::Tensor& x) const override { return weight_for(weight_, x); }

 private:
  torch::Tensor weight_;
};

}  // namespace

std::shared_ptr<FrozenWeight> freeze_weight(torch::Tensor weight, FrozenFormat format) {
  switch (format) {
    case FrozenFormat::Bf16:
      weight.set_data(weight.detach().to(torch::kBFloat16));  // as Module::to casts a parameter
      weight.requires_grad_(false);
      return std::make_shared<Bf16Weight>(std::move(weight));
  }
  throw std::logic_error("freeze_weight: unknown format");
}

}  // namespace lt
