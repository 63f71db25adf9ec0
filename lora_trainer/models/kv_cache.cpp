#include "lora_trainer/models/kv_cache.hpp"

#include <stdexcept>
#include <string>

namespace lt {

KvCache::KvCache(int64_t layers, int64_t capacity) : layers_(layers), capacity_(capacity) {
  if (layers <= 0 || capacity <= 0) throw std::invalid_argument("KvCache: layers and capacity must be positive");
}

std::pair<torch::Tensor, torch::Tensor> KvCache::append(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "KvCache::append: keys and values must be (B, KV, t, D) alike, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(next_layer_ < static_cast<size_t>(layers_), "KvCache::append: more layers than the cache's ", layers_,
              " before advance()");
  const int64_t t = k.size(2);
  TORCH_CHECK(appended_ < 0 || appended_ == t, "KvCache::append: layer ", next_layer_, " appends ", t,
              " positions, the layers before it ", appended_);
  TORCH_CHECK(fits(t), "KvCache::append: ", length_, " + ", t, " positions exceed its capacity of ", capacity_);
  if (k_.empty()) {
    for (int64_t i = 0; i < layers_; ++i) {
      k_.push_back(torch::empty({k.size(0), k.size(1), capacity_, k.size(3)}, k.options()));
      v_.push_back(torch::empty({v.size(0), v.size(1), capacity_, v.size(3)}, v.options()));
    }
  }
  auto& K = k_[next_layer_];
  auto& V = v_[next_layer_];
  TORCH_CHECK(K.size(0) == k.size(0) && K.size(1) == k.size(1) && K.size(3) == k.size(3),
              "KvCache::append: layer ", next_layer_, " holds ", K.sizes(), ", given ", k.sizes());
  K.narrow(2, length_, t).copy_(k);
  V.narrow(2, length_, t).copy_(v);
  ++next_layer_;
  appended_ = t;
  return {K.narrow(2, 0, length_ + t), V.narrow(2, 0, length_ + t)};
}

void KvCache::advance(int64_t t) {
  TORCH_CHECK(next_layer_ == static_cast<size_t>(layers_) && appended_ == t, "KvCache::advance(", t, "): ", next_layer_,
              " of ", layers_, " layers appended ", appended_, " positions");
  length_ += t;
  next_layer_ = 0;
  appended_ = -1;
}

void KvCache::repeat_rows(int64_t n) {
  TORCH_CHECK(n >= 1 && next_layer_ == 0, "KvCache::repeat_rows(", n, ") between forwards only");
  for (auto* tensors : {&k_, &v_})
    for (auto& t : *tensors) t = t.repeat_interleave(n, /*dim=*/0);
}

int64_t KvCache::bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < k_.size(); ++i) n += k_[i].nbytes() + v_[i].nbytes();
  return n;
}

}  // namespace lt
