// Data parallelism over LibTorch's c10d: the process group a job runs in, and its collectives.
//
// A job is one process (rank 0 of 1, every collective a no-op) unless it was started by torchrun's
// environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), by `run --nproc N`
// (which sets them for N local ranks), or by anything else that sets them. The ranks meet through a
// c10d::TCPStore, served by rank 0 or, where the environment says TORCHELASTIC_USE_AGENT_STORE=True
// (torchrun's static rendezvous, `run --nproc`), by the process that started them (StoreServer); they
// talk over Gloo (NCCL for CUDA tensors in a CUDA build with NCCL). Gloo refuses bf16 and AVG, so every
// reduction is a SUM in f32 or f64.
//
// A collective that fails (a rank exited, or hung past distributed/timeout_s) throws DistributedError
// naming the collective, this rank and the timeout; the launcher prints it and exits non-zero.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

namespace lt {

class ConfigSchema;
class Config;

class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The exit status of a rank that could not meet the others, or whose collective failed because another
// rank exited or hung (a DistributedError).
constexpr int kExitLostRank = 3;

// The store ranks meet at, served by the process that starts them, as torchrun's agent serves it:
// `run --nproc N` makes one before starting its ranks and keeps it until they end, and gives them
// MASTER_PORT = port() and TORCHELASTIC_USE_AGENT_STORE=True (every rank a client). It listens on
// `port`, or with 0 on a port the system picks while listening, so that no other program can take the
// port between its choice and its use. UserError when `port` cannot be listened on.
class StoreServer {
 public:
  StoreServer(int port, double timeout_s);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// distributed/shard_optimizer: which AdamW moments ZeRO-1 splits across the ranks; its name in configs
// is "none", "lora" (the adapters') or "all" (phase 1's too).
enum class ShardMode { None, Lora, All };
ShardMode parse_shard_mode(const std::string& name);  // std::invalid_argument naming the known ones
std::string shard_mode_name(ShardMode mode);
const std::vector<std::string>& shard_mode_names();  // in ShardMode's order: every name, for a config check

// distributed/*, each declared once bound to its field (distributed.cpp's OptionGroup):
// add_distributed_options adds them to a schema, from_config reads them.
struct DistributedOptions {
  double timeout_s = 300.0;                   // distributed/timeout_s
  ShardMode shard_optimizer = ShardMode::Lora;  // distributed/shard_optimizer
  // distributed/shard_params: none; lora (the LoRA phase's frozen base: the blocks' linear weights
  // kept 1/N a rank and gathered block by block around each forward; peft/block_shard.hpp); or all
  // (phase 1's block parameters too, with their gradients and moments: training/sharded_params.hpp).
  ShardMode shard_params = ShardMode::None;
  static DistributedOptions from_config(const Config& cfg);
};
void add_distributed_options(ConfigSchema& s);

class Distributed {
 public:
  // This process alone.
  Distributed();
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  // True when WORLD_SIZE in the environment asks for more than one rank.
  static bool requested_by_env();
  // Joins the group described by the environment: rendezvous at MASTER_ADDR:MASTER_PORT (rank 0
  // serves the store unless TORCHELASTIC_USE_AGENT_STORE=True says its starter does), waiting at most
  // `timeout_s` for every rank, which is also the limit on any one collective. `device` picks the
  // backend (Gloo for CPU tensors). UserError for missing or inconsistent variables; DistributedError
  // when the rendezvous fails. A rendezvous still unfinished after 2 x timeout_s + 10 s (something at
  // MASTER_PORT accepts connections but does not answer as a store) ends the process with
  // kExitLostRank and a message naming the address.
  static std::unique_ptr<Distributed> from_env(double timeout_s, c10::Device device);

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool active() const { return world_ > 1; }
  bool is_main() const { return rank_ == 0; }

  // Sums each tensor over the ranks, in place. Tensors are packed into one buffer per dtype (f32,
  // f64 or int64; any device), so a list costs one collective per dtype. `what` names it in errors.
  void all_reduce_sum(const std::vector<at::Tensor>& tensors, const std::string& what);
  // Rank 0's value of `flag`, on every rank (for decisions that read files rank 0 writes).
  bool broadcast_flag(bool flag, const std::string& what);
  // Whether every rank holds the same `value` (one sum of the values, their squares and rank 0's);
  // `rank0`, when given, gets rank 0's.
  bool same_on_every_rank(int64_t value, const std::string& what, int64_t* rank0 = nullptr);
  void barrier(const std::string& what);

  // A gather under way (all_gather_async): wait() returns once its output holds every rank's bytes,
  // or throws DistributedError as the other collectives do.
  class Gather {
   public:
    virtual ~Gather() = default;
    virtual void wait() = 0;
  };
  // Starts concatenating every rank's `shard` (uint8, contiguous, the same size on every rank) in rank
  // order into `full` (uint8, world_size() times that size, on shard's device) and returns at once:
  // the backend's threads move the bytes while this one computes. Every rank must start the same
  // gathers in the same order. One process: a copy.
  std::unique_ptr<Gather> all_gather_async(const at::Tensor& shard, const at::Tensor& full, const std::string& what);

 private:
  struct Group;
  std::unique_ptr<Group> group_;
  int rank_ = 0, world_ = 1;
  double timeout_s_ = 0;
  [[noreturn]] void fail(const std::string& what, const std::exception& e, double started) const;
};

// The process-wide group: a single process until set_distributed() installs one from the environment.
Distributed& distributed();
void set_distributed(std::unique_ptr<Distributed> d);

}  // namespace lt
