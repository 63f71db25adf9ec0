// The keys and values of the positions a model has already read, kept per layer while it generates
// (models/generate.hpp): each new token runs through the blocks alone and attends to the cache, where
// recomputing the context would run every earlier position again for every token.
//
// A forward that takes a cache (CausalLMImpl::forward_cached) reads its t new tokens at positions
// length() .. length() + t - 1; each attention layer, in order, appends its t new keys and values with
// append() and attends to everything the layer holds; advance() then counts the t positions in. The
// rows of a batch share their positions (the rows of one prompt's completions, or prompts of one length).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace lt {

class KvCache {
 public:
  // Room for `capacity` positions in each of `layers` layers; allocated at the first append, in the
  // keys' dtype and device: 2 x layers x rows x kv_heads x capacity x head_dim values.
  KvCache(int64_t layers, int64_t capacity);
  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  // Whether t more positions fit.
  bool fits(int64_t t) const { return length_ + t <= capacity_; }
  // The next layer's t new keys and values (B, KV, t, D), written after its length() cached ones;
  // returns the layer's keys and values of positions 0 .. length() + t - 1 (views of the cache).
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& k, const torch::Tensor& v);
  // After every layer appended its t positions: they count from now on, and the next append is layer 0's.
  void advance(int64_t t);
  // Each row's keys and values copied to `n` rows each (row r to rows r n .. r n + n - 1): one prompt read
  // once, then continued n ways.
  void repeat_rows(int64_t n);
  // The bytes it holds.
  int64_t bytes() const;

 private:
  int64_t layers_, capacity_, length_ = 0;
  size_t next_layer_ = 0;
  int64_t appended_ = -1;  // the t of this forward's appends (each layer's the same)
  std::vector<torch::Tensor> k_, v_;  // per layer (B, KV, capacity, D)
};

}  // namespace lt
