#include "lora_trainer/training/sharded_params.hpp"

#include <cstdio>

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

std::string ShardedParams::describe(int ranks, ShardMode mode) const {
  int64_t whole = 0;
  for (const auto& [name, where] : where_) {
    int64_t n = 1;
    for (int64_t d : shape(name)) n *= d;
    whole += n * static_cast<int64_t>(sizeof(float));
  }
  char line[320];
  std::snprintf(line, sizeof line, "phase 1's block parameters sharded across %d ranks (distributed/shard_params=%s): %.1f MB "
                "of their %.1f MB on each, and as much again of gradients and twice of moments; gathered a block at a time",
                ranks, shard_mode_name(mode).c_str(), shard_bytes() / 1e6, whole / 1e6);
  return line;
}

int64_t ShardedParams::shard_bytes() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s->shard_bytes();
  return n;
}

std::string ShardedParams::param_of_state(const std::string& state_name) const {
  for (const std::string& prefix : {kParamsPrefix, std::string("optim/exp_avg/"), std::string("optim/exp_avg_sq/"), kEmaPrefix})
    if (state_name.rfind(prefix, 0) == 0 && contains(state_name.substr(prefix.size()))) return state_name.substr(prefix.size());
  return "";
}

NamedTensors ShardedParams::whole_stand_ins(NamedTensors local) const {
  for (auto& [name, t] : local) {
    const std::string param = param_of_state(name);
    if (!param.empty()) t = torch::zeros({1}, t.options()).expand(shape(param));
  }
  return local;
}

TensorStream ShardedParams::gathered(const NamedTensors& whole, const NamedTensors& local, const std::string& what) {
  // One block's sharded tensors of one kind (its parameters, or one of their moments, or their average)
  // gathered at a time, in the order of the names, which keeps each block's tensors of a kind together.
  struct Gathered {
    std::map<std::string, torch::Tensor> by_name;
    std::string key;
    std::map<std::string, torch::Tensor> tensors;
  };
  auto g = std::make_shared<Gathered>();
  g->by_name.insert(local.begin(), local.end());
  TensorStream stream;
  for (const auto& [name, t] : whole) {
    stream.names.push_back(name);
    stream.bytes += static_cast<uint64_t>(t.numel()) * t.element_size();
  }
  stream.get = [this, g, whole, local, what](size_t i) -> torch::Tensor {
    const std::string& name = whole[i].first;
    const std::string param = param_of_state(name);
    if (param.empty()) return local[i].second;
    const std::string prefix = name.substr(0, name.size() - param.size());
    const std::string key = prefix + std::to_string(block_of(param));
    if (key != g->key) {
      g->tensors.clear();  // the last block's buffers go before the next block's come
      g->tensors = gather_block(param, [&](const std::string& p) { return g->by_name.at(prefix + p); },
                                "gathering " + prefix + " of block " + std::to_string(block_of(param)) + " for " + what);
      g->key = key;
    }
    return g->tensors.at(param);
  };
  return stream;
}

TensorWriter ShardedParams::keep_local_part(const NamedTensors& local) const {
  auto by_name = std::make_shared<std::map<std::string, torch::Tensor>>(local.begin(), local.end());
  return [this, by_name](const std::string& name, const torch::Tensor& value) {
    const std::string param = param_of_state(name);
    if (param.empty()) return false;
    torch::NoGradGuard ng;
    by_name->at(name).copy_(local_part(param, value));
    return true;
  };
}

void ShardedParams::visit_whole(const NamedTensors& params,
                                const std::function<void(const std::string&, const torch::Tensor&)>& visit) {
  size_t block = SIZE_MAX;
  std::map<std::string, torch::Tensor> whole;  // the gathered block's
  for (const auto& [name, p] : params) {
    if (!contains(name)) {
      visit(name, p);
      continue;
    }
    if (block_of(name) != block) {
      block = block_of(name);
      whole.clear();
      whole = gather_block(name, [&](const std::string& n) { return piece(n); },
                           "gathering the parameters of block " + std::to_string(block));
    }
    visit(name, whole.at(name));
  }
}

}  // namespace lt
