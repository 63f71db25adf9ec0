// One transformer block's frozen weights sharded across the ranks (distributed/shard_params=lora, the
// storage FrozenWeight's seam takes for "a shard per rank"): the tensors that keep them (a bf16 W, or
// NF4's codes and scales) are laid out one after another as bytes, each from an offset aligned to 64
// bytes, the whole padded so that it divides into world_size equal shards; rank r keeps bytes
// [r S, (r + 1) S) and nothing else. Around each forward of the block (and its recompute in the
// backward) the shards are all-gathered into one buffer that holds every tensor whole, and the buffer
// is dropped when the last user lets it go:
//
//   acquire()   gathers (or waits for the gather prefetch() started) unless already gathered; counted,
//               so nested users (a layer's on-demand gather inside its block's) share one buffer
//   release()   the last one drops the buffer; views still held keep their bytes alive, nothing more
//   prefetch()  starts the gather on the backend's threads without waiting: the model starts the next
//               block's while this one computes (forward), the previous block's in the backward
//
// Every rank must acquire and prefetch the same blocks in the same order (they are collectives): the
// model's loop over its blocks does, as long as every rank runs the same forwards (the evaluation gives
// ranks without a batch left one to run).
//
// Trained parameters (distributed/shard_params=all, phase 1: ZeRO-3) are bound to the block instead:
// bind() lays out a parameter, seal() moves its values into the shards and leaves the parameter a
// stand-in of its shape (no storage). While the block is gathered each bound parameter's data is its
// view of the buffer, so the block's forward reads its parameters as ever; on release they are stand-ins
// again. What the optimizer steps is this rank's piece of each bound parameter (piece(): a 1-D view of
// the shard, the elements of the parameter that fall in it), whose gradient is the matching view of a
// gradient shard: reduce_gradients() takes a backward's full gradients of the bound parameters, sums
// them over the ranks and adds this rank's slice to the pieces' gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "lora_trainer/core/distributed.hpp"

namespace lt {

class BlockShard {
 public:
  // `what` names the block in errors ("block 3"); the shard lives on `device`.
  BlockShard(Distributed& dist, torch::Device device, std::string what);
  BlockShard(const BlockShard&) = delete;
  BlockShard& operator=(const BlockShard&) = delete;

  // The layout, declared before seal(): a tensor of `dtype` and `shape`; returns its index.
  int64_t add(c10::ScalarType dtype, std::vector<int64_t> shape);
  // Fixes the layout and allocates this rank's shard, zeros.
  void seal();

  // Stores `value` (the dtype and shape of tensor `i`, any device) as tensor i: this rank keeps the
  // bytes of it that fall in its shard. No collective: every rank stores what it keeps.
  void write(int64_t i, const torch::Tensor& value);
  // Tensor i, whole: a view of the gathered buffer (acquired only).
  torch::Tensor tensor(int64_t i) const;

  // Trained parameters (see above). bind() before seal(); returns the parameter's index.
  int64_t bind(const torch::Tensor& param);
  const std::vector<torch::Tensor>& bound() const { return bound_; }  // the parameters, in bind order
  bool binds(const torch::Tensor& t) const;
  // Bound parameter k's piece on this rank (1-D, maybe empty), the same tensor every call; its .grad()
  // is set by reduce_gradients.
  const torch::Tensor& piece(size_t k) const { return pieces_.at(k); }
  // The elements of tensor i's value `full` that this rank keeps (1-D, piece-sized).
  torch::Tensor local_part(int64_t i, const torch::Tensor& full) const;
  // Sums the bound parameters' gradients `grads` (full shapes, bind order; undefined: zeros) over the
  // ranks (a collective) and adds this rank's slice to each piece's gradient (zeroed first when the
  // optimizer has cleared it).
  void reduce_gradients(const std::vector<torch::Tensor>& grads);
  // Every rank's `pieces` (piece-sized, bind order: a piece's moments or average) assembled into the
  // whole tensors, on every rank (a collective).
  std::vector<torch::Tensor> gather_pieces(const std::vector<torch::Tensor>& pieces, const std::string& what);
  // Gathers the block and leaves each bound parameter its whole value (cast to dtype_of(k): a copy), no
  // longer bound: the end of phase 1. The shard is empty after it.
  void unbind(const std::function<c10::ScalarType(size_t)>& dtype_of);

  void acquire();
  void release();
  void prefetch();
  bool gathered() const { return full_.defined(); }

  // The neighbours in the model's order, for prefetching (null at the ends).
  BlockShard* next = nullptr;
  BlockShard* previous = nullptr;

  int64_t shard_bytes() const { return shard_bytes_; }  // this rank's, as every rank's
  int64_t full_bytes() const { return shard_bytes_ * world_; }  // the gathered buffer, padding included
  int64_t tensor_bytes(int64_t i) const { return entries_.at(static_cast<size_t>(i)).bytes; }
  const std::string& what() const { return what_; }

 private:
  struct Entry {
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t offset = 0, bytes = 0;
    // The bytes [lo, hi) of the buffer that are both this entry's and this rank's (lo == hi: none).
    int64_t lo = 0, hi = 0;
  };
  torch::Tensor slice_of(const torch::Tensor& shard_buffer, const Entry& e) const;  // as the entry's dtype
  void bind_views();  // bound parameters: their views of the gathered buffer
  std::vector<torch::Tensor> bound_;
  std::vector<int64_t> bound_index_;  // entry of each
  std::vector<torch::Tensor> pieces_;
  torch::Tensor grad_shard_;  // uint8 (shard_bytes_), the pieces' gradients
  Distributed& dist_;
  torch::Device device_;
  std::string what_;
  int rank_ = 0, world_ = 1;
  std::vector<Entry> entries_;
  int64_t used_bytes_ = 0, shard_bytes_ = 0;
  torch::Tensor shard_;  // uint8 (shard_bytes_)
  torch::Tensor full_;   // uint8 (full_bytes()) while gathered
  torch::Tensor pending_full_;
  std::unique_ptr<Distributed::Gather> pending_;  // destroyed first: it waits for a gather under way
  int users_ = 0;
};

// Scoped acquire/release of a block (nothing when null), prefetching a neighbour once acquired.
class BlockGathered {
 public:
  enum class Direction { Forward, Backward, None };
  BlockGathered(BlockShard* block, Direction prefetch);
  ~BlockGathered();
  BlockGathered(const BlockGathered&) = delete;
  BlockGathered& operator=(const BlockGathered&) = delete;

 private:
  BlockShard* block_;
};

}  // namespace lt
