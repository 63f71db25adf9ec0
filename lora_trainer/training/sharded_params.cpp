#include "lora_trainer/training/sharded_params.hpp"

#include "lora_trainer/core/runtime.hpp"

namespace lt {

ShardedParams::ShardedParams(CausalLM& model, Distributed& dist, const torch::Device& device) : model_(model) {
  const int64_t blocks = model->options().n_layer;
  for (int64_t b = 0; b < blocks; ++b)
    shards_.push_back(std::make_shared<BlockShard>(dist, device, "block " + std::to_string(b)));
  names_.resize(shards_.size());
  for (const auto& [name, p] : named_params(*model)) {
    const int64_t b = model->block_of(name);
    if (b < 0) continue;  // embeddings, final norm, head: whole on every rank
    const size_t block = static_cast<size_t>(b);
    where_[name] = {block, names_[block].size()};
    names_[block].push_back(name);
    shards_[block]->bind(p);
  }
  for (auto& shard : shards_) shard->seal();  // the values move into the shards
  model->set_block_shards(shards_);
  release_freed_memory();  // the whole parameters the shards were made from
}

NamedTensors ShardedParams::pieces_of(const NamedTensors& params) const {
  NamedTensors out;
  for (const auto& [name, p] : params) out.emplace_back(name, contains(name) ? piece(name) : p);
  return out;
}

const torch::Tensor& ShardedParams::piece(const std::string& name) const {
  const auto& [b, k] = where_.at(name);
  return shards_[b]->piece(k);
}

std::vector<int64_t> ShardedParams::shape(const std::string& name) const {
  const auto& [b, k] = where_.at(name);
  return shards_[b]->bound()[k].sizes().vec();
}

torch::Tensor ShardedParams::local_part(const std::string& name, const torch::Tensor& full) const {
  const auto& [b, k] = where_.at(name);
  return shards_[b]->local_part(static_cast<int64_t>(k), full);  // every entry of a block is bound: index k
}

std::map<std::string, torch::Tensor> ShardedParams::gather_block(
    const std::string& name, const std::function<torch::Tensor(const std::string&)>& piece_of, const std::string& what) {
  const size_t b = where_.at(name).first;
  std::vector<torch::Tensor> pieces;
  for (const auto& n : names_[b]) pieces.push_back(piece_of(n));
  const std::vector<torch::Tensor> whole = shards_[b]->gather_pieces(pieces, what);
  std::map<std::string, torch::Tensor> out;
  for (size_t k = 0; k < whole.size(); ++k) out[names_[b][k]] = whole[k];
  return out;
}

void ShardedParams::unshard(const std::function<c10::ScalarType(const std::string&)>& dtype_of) {
  for (size_t b = 0; b < shards_.size(); ++b)
    shards_[b]->unbind([&](size_t k) { return dtype_of(names_[b][k]); });
  model_->set_block_shards({});
  shards_.clear();
  names_.clear();
  where_.clear();
}

int64_t ShardedParams::shard_bytes() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s->shard_bytes();
  return n;
}

}  // namespace lt
