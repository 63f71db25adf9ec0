// distributed/shard_params=all, phase 1 (ZeRO-3): the transformer blocks' trained parameters kept 1/N a
// rank. Each block's parameters (float32) are bound to one BlockShard (peft/block_shard.hpp): each rank
// stores only its bytes of them, the block's forward gathers them whole (and its backward again, to
// recompute), the backward sums the block's gradients over the ranks and keeps this rank's slice, and
// AdamW steps only this rank's pieces, with moments of the pieces' size. The embeddings, the final norm
// and the head stay whole on every rank, their gradients summed once a step as before.
//
// A checkpoint holds every tensor whole, as an unsharded run's does (so it restores at any number of
// ranks, sharded or not, and `export`/`eval` read it as ever): the trainer's save gathers block by block
// while rank 0 writes (gather_block), and its restore keeps of each tensor it reads the part this rank
// stores (local_part). At the LoRA transition unshard() makes the parameters whole again (those the
// LoRA phase freezes directly in bf16) before the base is frozen and, with several ranks, sharded as
// distributed/shard_params=lora shards it.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "lora_trainer/core/distributed.hpp"
#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/state_h5.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/block_shard.hpp"

namespace lt {

class ShardedParams {
 public:
  // Moves every parameter of the model's blocks into one BlockShard a block (their values as they are
  // now; the parameters become stand-ins) and hands the shards to the model, which gathers them.
  ShardedParams(CausalLM& model, Distributed& dist, const torch::Device& device);

  bool contains(const std::string& name) const { return where_.count(name) > 0; }
  // `params` (the model's, by name) with each sharded parameter replaced by this rank's piece of it: what
  // the optimizer steps. The names stay, so a checkpoint names the moments as an unsharded run does.
  NamedTensors pieces_of(const NamedTensors& params) const;
  const torch::Tensor& piece(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // The part of `full` (the whole value of the sharded parameter `name`, of one of its moments or of its
  // average) that this rank keeps: the elements its piece holds.
  torch::Tensor local_part(const std::string& name, const torch::Tensor& full) const;
  // The sharded parameters of the block holding `name`, whole, by name: `piece_of(p)` is this rank's
  // piece of what is gathered for parameter p (its value, a moment, its average). A collective: every
  // rank gathers the same blocks in the same order.
  std::map<std::string, torch::Tensor> gather_block(const std::string& name,
                                                    const std::function<torch::Tensor(const std::string&)>& piece_of,
                                                    const std::string& what);
  // Which block a sharded parameter is in.
  size_t block_of(const std::string& name) const { return where_.at(name).first; }
  // The end of phase 1: every sharded parameter whole again on every rank, as dtype_of(name) (a
  // collective); the model's shards are dropped.
  void unshard(const std::function<c10::ScalarType(const std::string&)>& dtype_of);
  // The bytes of parameters this rank stores (its shards, padding included).
  int64_t shard_bytes() const;
  // The run's line saying what is sharded over `ranks` ranks: this rank's bytes of the parameters beside
  // their whole float32 size.
  std::string describe(int ranks, ShardMode mode) const;

  // The state of a checkpoint (the trainer's state_tensors) holds every tensor whole, by the names an
  // unsharded run gives them: a sharded parameter's value ("params/"), moments ("optim/exp_avg/",
  // "optim/exp_avg_sq/") and average ("ema/"). These make that state from this rank's pieces.
  //
  // The sharded parameter a state tensor's name is of, or "".
  std::string param_of_state(const std::string& state_name) const;
  // `local` (this rank's state: the pieces under the whole tensors' names) with each piece replaced by a
  // stand-in of the whole tensor's shape and dtype, without storage: what a restore reads into (it keeps
  // its part: keep_local_part) and save() gathers.
  NamedTensors whole_stand_ins(NamedTensors local) const;
  // The whole state to write, made tensor by tensor in `whole`'s order from `local` (same names and
  // order): a sharded tensor's block gathered when first asked for (a collective: every rank must read
  // the stream through in the same order; rank 0 writes it, the others only gather).
  TensorStream gathered(const NamedTensors& whole, const NamedTensors& local, const std::string& what);
  // A restore's writer: a sharded tensor's value read whole, this rank's part copied into its piece in
  // `local` (true); other tensors are left to the load (false).
  TensorWriter keep_local_part(const NamedTensors& local) const;
  // Calls visit(name, value) for each of `params` (the model's, in order) with its whole value: the
  // sharded ones' blocks gathered in turn (a collective), the others as they are.
  void visit_whole(const NamedTensors& params, const std::function<void(const std::string&, const torch::Tensor&)>& visit);

 private:
  CausalLM& model_;
  std::vector<std::shared_ptr<BlockShard>> shards_;
  std::vector<std::vector<std::string>> names_;                // each block's, in bind order
  std::map<std::string, std::pair<size_t, size_t>> where_;     // name -> (block, index in it)
};

}  // namespace lt
