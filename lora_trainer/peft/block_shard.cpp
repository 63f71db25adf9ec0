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

// What a bound parameter is while its block is not gathered: its shape and dtype, no storage.
torch::Tensor stand_in(const torch::Tensor& like) {
  return torch::zeros({1}, like.options()).expand(like.sizes());
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
  for (Entry& e : entries_) {
    e.lo = std::max<int64_t>(e.offset, rank_ * shard_bytes_);
    e.hi = std::max(e.lo, std::min<int64_t>(e.offset + e.bytes, (rank_ + 1) * shard_bytes_));
  }
  if (bound_.empty()) return;
  torch::NoGradGuard ng;
  for (size_t k = 0; k < bound_.size(); ++k) {
    write(bound_index_[k], bound_[k].detach());
    bound_[k].set_data(stand_in(bound_[k]));
    pieces_.push_back(slice_of(shard_, entries_[static_cast<size_t>(bound_index_[k])]));
  }
}

int64_t BlockShard::bind(const torch::Tensor& param) {
  TORCH_CHECK(param.scalar_type() == torch::kFloat32, "BlockShard::bind: ", what_, ": trained parameters are float32, not ",
              param.scalar_type());
  const int64_t i = add(param.scalar_type(), param.sizes().vec());
  bound_.push_back(param);
  bound_index_.push_back(i);
  return i;
}

bool BlockShard::binds(const torch::Tensor& t) const {
  return std::any_of(bound_.begin(), bound_.end(), [&](const torch::Tensor& p) { return p.is_same(t); });
}

torch::Tensor BlockShard::slice_of(const torch::Tensor& shard_buffer, const Entry& e) const {
  return shard_buffer.narrow(0, e.hi > e.lo ? e.lo - rank_ * shard_bytes_ : 0, e.hi - e.lo).view(e.dtype);
}

torch::Tensor BlockShard::local_part(int64_t i, const torch::Tensor& full) const {
  const Entry& e = entries_.at(static_cast<size_t>(i));
  const int64_t size = static_cast<int64_t>(c10::elementSize(e.dtype));
  return full.contiguous().reshape({-1}).narrow(0, (e.lo - e.offset) / size * (e.hi > e.lo), (e.hi - e.lo) / size);
}

void BlockShard::reduce_gradients(const std::vector<torch::Tensor>& grads) {
  TORCH_CHECK(grads.size() == bound_.size(), "BlockShard::reduce_gradients: ", grads.size(), " gradients for ",
              bound_.size(), " parameters");
  torch::NoGradGuard ng;
  torch::Tensor full = torch::zeros({full_bytes()}, shard_.options());
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!grads[k].defined()) continue;
    const Entry& e = entries_[static_cast<size_t>(bound_index_[k])];
    full.narrow(0, e.offset, e.bytes).view(e.dtype).copy_(grads[k].reshape({-1}));
  }
  dist_.all_reduce_sum({full.view(torch::kFloat32)}, "summing the gradients of " + what_);
  if (!pieces_.empty() && !pieces_.front().grad().defined()) {  // the optimizer cleared them: a new step
    if (!grad_shard_.defined()) grad_shard_ = torch::empty_like(shard_);  // at the first backward
    grad_shard_.zero_();
    for (size_t k = 0; k < pieces_.size(); ++k)
      pieces_[k].mutable_grad() = slice_of(grad_shard_, entries_[static_cast<size_t>(bound_index_[k])]);
  }
  grad_shard_.view(torch::kFloat32).add_(full.narrow(0, rank_ * shard_bytes_, shard_bytes_).view(torch::kFloat32));
}

std::vector<torch::Tensor> BlockShard::gather_pieces(const std::vector<torch::Tensor>& pieces, const std::string& what) {
  TORCH_CHECK(pieces.size() == bound_.size(), "BlockShard::gather_pieces: ", pieces.size(), " pieces for ", bound_.size(),
              " parameters");
  torch::NoGradGuard ng;
  torch::Tensor mine = torch::zeros_like(shard_);
  for (size_t k = 0; k < pieces.size(); ++k)
    slice_of(mine, entries_[static_cast<size_t>(bound_index_[k])]).copy_(pieces[k]);
  torch::Tensor full = torch::empty({full_bytes()}, shard_.options());
  dist_.all_gather_async(mine, full, what)->wait();
  std::vector<torch::Tensor> out;
  for (int64_t i : bound_index_) {
    const Entry& e = entries_[static_cast<size_t>(i)];
    out.push_back(full.narrow(0, e.offset, e.bytes).view(e.dtype).view(e.shape));
  }
  return out;
}

void BlockShard::unbind(const std::function<c10::ScalarType(size_t)>& dtype_of) {
  torch::NoGradGuard ng;
  acquire();
  std::vector<torch::Tensor> params = std::move(bound_);
  bound_.clear();  // release() leaves them as they are now
  for (size_t k = 0; k < params.size(); ++k)
    params[k].set_data(tensor(bound_index_[k]).to(dtype_of(k), /*non_blocking=*/false, /*copy=*/true));
  release();
  bound_index_.clear();
  pieces_.clear();
  grad_shard_ = torch::Tensor();
  shard_ = torch::zeros({0}, shard_.options());
}

void BlockShard::write(int64_t i, const torch::Tensor& value) {
  const Entry& e = entries_.at(static_cast<size_t>(i));
  TORCH_CHECK(shard_.defined(), "BlockShard::write before seal");
  TORCH_CHECK(value.scalar_type() == e.dtype && value.sizes().vec() == e.shape, "BlockShard::write: ", what_,
              ": tensor ", i, " is ", e.dtype, " ", c10::IntArrayRef(e.shape), ", not ", value.scalar_type(), " ",
              value.sizes());
  torch::NoGradGuard ng;
  if (e.hi <= e.lo) return;  // none of the tensor's bytes are this rank's
  const torch::Tensor bytes = bytes_of(value);
  shard_.narrow(0, e.lo - rank_ * shard_bytes_, e.hi - e.lo).copy_(bytes.narrow(0, e.lo - e.offset, e.hi - e.lo));
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
  pending_ = dist_.all_gather_async(shard_, pending_full_, (bound_.empty() ? "gathering the frozen weights of " : "gathering the parameters of ") + what_);
}

void BlockShard::acquire() {
  if (users_++ > 0) return;
  prefetch();  // unless one is under way
  auto pending = std::move(pending_);
  pending->wait();
  full_ = std::move(pending_full_);
  bind_views();
}

void BlockShard::bind_views() {
  for (size_t k = 0; k < bound_.size(); ++k) bound_[k].set_data(tensor(bound_index_[k]));
}

void BlockShard::release() {
  TORCH_CHECK(users_ > 0, "BlockShard::release without acquire");
  if (--users_ > 0) return;
  for (auto& p : bound_) p.set_data(stand_in(p));
  full_ = torch::Tensor();
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
