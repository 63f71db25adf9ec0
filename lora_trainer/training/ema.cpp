#include "lora_trainer/training/ema.hpp"

#include "lora_trainer/formats/checkpoint.hpp"

namespace lt {

Ema::Ema(const NamedTensors& params, double decay) : params_(params), decay_(decay) {
  torch::NoGradGuard ng;
  for (const auto& [n, p] : params_) avg_.push_back(p.detach().to(torch::kFloat32).clone());
}

void Ema::update() {
  torch::NoGradGuard ng;
  for (size_t i = 0; i < avg_.size(); ++i)
    avg_[i].mul_(decay_).add_(params_[i].second.detach().to(torch::kFloat32), 1.0 - decay_);
}

void Ema::reset() {
  torch::NoGradGuard ng;
  for (size_t i = 0; i < avg_.size(); ++i) avg_[i].copy_(params_[i].second.detach());
}

NamedTensors Ema::state() const {
  NamedTensors out;
  for (size_t i = 0; i < avg_.size(); ++i) out.emplace_back(kEmaPrefix + params_[i].first, avg_[i]);
  return out;
}

Ema::Swap::Swap(Ema& ema) : ema_(ema) {
  torch::NoGradGuard ng;
  for (size_t i = 0; i < ema_.avg_.size(); ++i) {
    auto& p = ema_.params_[i].second;
    saved_.push_back(p.detach().clone());
    p.detach().copy_(ema_.avg_[i]);
  }
}

Ema::Swap::~Swap() {
  torch::NoGradGuard ng;
  for (size_t i = 0; i < saved_.size(); ++i) ema_.params_[i].second.detach().copy_(saved_[i]);
}

}  // namespace lt
