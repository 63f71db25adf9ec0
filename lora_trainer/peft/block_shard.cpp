#include "lora_trainer/peft/block_shard.hpp"

#include <algorithm>

#include <c10/util/accumulate.h>

namespace lt {

namespace {

constexpr int64_t kAlign = 64;  // bytes: every tensor's offset, and the shard size

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// A tensor's bytes as a flat uint8 view (contiguous).
torch::Tensor bytes_of(const torch::Tensor& t) {
  const torch::Tensor flat = t.contiguous().reshape({-1});
  return flat.numel() == 0 ? torch::empty({0}, flat.options().dtype(torch::kUInt8)) : flat.view(torch::kUInt8);
}

}  // namespace

BlockShard::BlockShard(Distributed& dist, torch::Device device, std::string what)
    : dist_(dist), device_(device), what_(std::move(what)), rank_(dist.rank()), world_(dist.world_size()) {}

int64_t BlockShard::add(c10::ScalarType dtype, std::vector<int64_t> shape) {
  TORCH_CHECK(!shard_.defined(), "BlockShard::add after seal");
  Entry e;
  e.dtype = dtype;
  const int64_t numel = c10::multiply_integers(shape);
  e.shape = std::move(shape);
  e.offset = round_up(used_bytes_, kAlign);
  e.bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  used_bytes_ = e.offset + e.bytes;
  entries_.push_back(std::move(e));
  return static_cast<int64_t>(entries_.size()) - 1;
}

void BlockShard::seal() {
  TORCH_CHECK(!shard_.defined(), "BlockShard::seal twice");
  shard_bytes_ = round_up(std::max<int64_t>(1, (used_bytes_ + world_ - 1) / world_), kAlign);
  shard_ = torch::zeros({shard_bytes_}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
}

void BlockShard::write(int64_t i, const torch::Tensor& value) {
  const Entry& e = entries_.at(static_cast<size_t>(i));
  TORCH_CHECK(shard_.defined(), "BlockShard::write before seal");
  TORCH_CHECK(value.scalar_type() == e.dtype && value.sizes().vec() == e.shape, "BlockShard::write: ", what_,
              ": tensor ", i, " is ", e.dtype, " ", c10::IntArrayRef(e.shape), ", not ", value.scalar_type(), " ",
              value.sizes());
  torch::NoGradGuard ng;
  // This rank's bytes [lo, hi) of the buffer meet the tensor's [offset, offset + bytes).
  const int64_t lo = std::max<int64_t>(e.offset, rank_ * shard_bytes_);
  const int64_t hi = std::min<int64_t>(e.offset + e.bytes, (rank_ + 1) * shard_bytes_);
  if (hi <= lo) return;
  const torch::Tensor bytes = bytes_of(value);
  shard_.narrow(0, lo - rank_ * shard_bytes_, hi - lo).copy_(bytes.narrow(0, lo - e.offset, hi - lo));
}

torch::Tensor BlockShard::tensor(int64_t i) const {
  TORCH_CHECK(full_.defined(), "BlockShard::tensor: ", what_, " is not gathered");
  const Entry& e = entries_.at(static_cast<size_t>(i));
  if (e.bytes == 0) return torch::empty(e.shape, full_.options().dtype(e.dtype));
  return full_.narrow(0, e.offset, e.bytes).view(e.dtype).view(e.shape);
}

void BlockShard::prefetch() {
  if (full_.defined() || pending_) return;
  pending_full_ = torch::empty({full_bytes()}, shard_.options());
  pending_ = dist_.all_gather_async(shard_, pending_full_, "gathering the frozen weights of " + what_);
}

void BlockShard::acquire() {
  if (users_++ > 0) return;
  prefetch();  // unless one is under way
  auto pending = std::move(pending_);
  pending->wait();
  full_ = std::move(pending_full_);
}

void BlockShard::release() {
  TORCH_CHECK(users_ > 0, "BlockShard::release without acquire");
  if (--users_ == 0) full_ = torch::Tensor();
}

BlockGathered::BlockGathered(BlockShard* block, Direction prefetch) : block_(block) {
  if (!block_) return;
  block_->acquire();
  BlockShard* neighbour = prefetch == Direction::Forward ? block_->next : prefetch == Direction::Backward ? block_->previous : nullptr;
  if (neighbour) neighbour->prefetch();
}

BlockGathered::~BlockGathered() {
  if (block_) block_->release();
}

}  // namespace lt
