#include "lora_trainer/core/distributed.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef LT_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/options.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

static const OptionGroup<DistributedOptions>& distributed_options() {
  using O = DistributedOptions;
  static const auto g =
      OptionGroup<O>()
          .add("distributed/timeout_s", OptType::Float, 300.0,
               "with several ranks: how long to wait for every rank at the rendezvous and in any one collective before "
               "exiting with an error (a rank that died or hangs)",
               &O::timeout_s, check_positive())
          .add("distributed/shard_optimizer", OptType::String, "lora",
               "with several ranks, which AdamW moments are split across ranks (ZeRO-1: each rank keeps and updates "
               "the moments of its share of the parameters): none, lora (the adapters' in the LoRA phase) or all "
               "(phase 1 too)",
               [](O& o, const json& v) { o.shard_optimizer = parse_shard_mode(v.get<std::string>()); },
               check_one_of(shard_mode_names()))
          .add("distributed/shard_params", OptType::String, "none",
               "with several ranks, which parameters are split across ranks instead of each rank holding them all: "
               "none; lora (the LoRA phase's frozen base: each rank keeps 1/N of every block's linear weights, "
               "gathered block by block around each forward and again in the backward, which recomputes the block); "
               "or all (phase 1's too: each rank keeps 1/N of every block's parameters, their gradients and moments, "
               "ZeRO-3; then the frozen base as with lora)",
               [](O& o, const json& v) { o.shard_params = parse_shard_mode(v.get<std::string>()); },
               check_one_of(shard_mode_names()));
  return g;
}

void add_distributed_options(ConfigSchema& s) { distributed_options().declare(s); }

DistributedOptions DistributedOptions::from_config(const Config& cfg) { return distributed_options().read(cfg); }

const std::vector<std::string>& shard_mode_names() {
  static const std::vector<std::string> names = {"none", "lora", "all"};  // in ShardMode's order
  return names;
}

ShardMode parse_shard_mode(const std::string& name) {
  if (auto mode = enum_from_name<ShardMode>(shard_mode_names(), name)) return *mode;
  throw std::invalid_argument("unknown shard mode \"" + name + "\" (known: " + join(shard_mode_names()) + ")");
}

std::string shard_mode_name(ShardMode mode) { return enum_name(shard_mode_names(), mode); }

// The backend; each collective blocks until it is done, at most `timeout`.
struct Distributed::Group {
  c10::Device device = c10::kCPU;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  bool gloo_flat = true;  // until Gloo refuses _allgather_base (LibTorch 1.13)
#ifdef LT_WITH_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  void allreduce(std::vector<at::Tensor>& t) {
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
#ifdef LT_WITH_NCCL
    if (nccl) return (void)nccl->allreduce(t, o)->wait(timeout);
#endif
    gloo->allreduce(t, o)->wait(timeout);
  }
  // Starts gathering every rank's `in` into `full` (`out`: its rank-sized views) and returns how to wait
  // for it. The flat form (_allgather_base: straight into `full`, no staging copy) where the backend has
  // it: NCCL in every LibTorch version, Gloo where its LibTorch implements it; LibTorch 1.13's Gloo refuses it before
  // sending anything (every rank alike), and then the list form, which writes each rank's part into its
  // view, serves from there on.
  std::function<void()> allgather(at::Tensor full, std::vector<at::Tensor> out, at::Tensor in) {
#ifdef LT_WITH_NCCL
    if (nccl) {
      auto work = nccl->_allgather_base(full, in, c10d::AllgatherOptions());
      return [work, full, in, t = timeout] { work->wait(t); };
    }
#endif
    if (gloo_flat) {
      try {
        auto work = gloo->_allgather_base(full, in, c10d::AllgatherOptions());
        return [work, full, in, t = timeout] { work->wait(t); };
      } catch (const c10::Error&) {
        gloo_flat = false;
      }
    }
    std::vector<std::vector<at::Tensor>> outs{std::move(out)};
    std::vector<at::Tensor> ins{std::move(in)};
    auto work = gloo->allgather(outs, ins, c10d::AllgatherOptions());
    return [work, outs, ins, t = timeout] { work->wait(t); };
  }
  void broadcast(std::vector<at::Tensor>& t) {
    c10d::BroadcastOptions o;
    o.rootRank = 0;
#ifdef LT_WITH_NCCL
    if (nccl) return (void)nccl->broadcast(t, o)->wait(timeout);
#endif
    gloo->broadcast(t, o)->wait(timeout);
  }
  void barrier() {
#ifdef LT_WITH_NCCL
    if (nccl) return (void)nccl->barrier(c10d::BarrierOptions())->wait(timeout);
#endif
    gloo->barrier(c10d::BarrierOptions())->wait(timeout);
  }
  bool uses_nccl() const {
#ifdef LT_WITH_NCCL
    return static_cast<bool>(nccl);
#else
    return false;
#endif
  }
  // Where the backend wants the bytes: NCCL on this rank's GPU, Gloo in host memory.
  c10::Device wire_device() const { return uses_nccl() ? device : c10::Device(c10::kCPU); }
};

Distributed::Distributed() = default;
Distributed::~Distributed() = default;

bool Distributed::requested_by_env() { return env_int("WORLD_SIZE", 1) > 1; }

// c10 appends its C++ backtrace to what(); a user needs the first lines.
static std::string without_backtrace(const std::exception& e) {
  std::string msg = e.what();
  auto nl = msg.find("\nException raised from");
  if (nl != std::string::npos) msg.resize(nl);
  return msg;
}

static std::string require_env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    throw UserError(std::string("WORLD_SIZE asks for several ranks but ") + name +
                    " is not set; start the ranks with `lora_trainer run --nproc N ...` on one machine, or set "
                    "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does (docs/distributed.md)");
  return v;
}

static bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// A TCPStore with `so`; without libuv where LibTorch asked for it but was built without it (the classic
// backend: every rank does the same, so they still agree).
static c10::intrusive_ptr<c10d::TCPStore> make_tcp_store(const std::string& addr, c10d::TCPStoreOptions so) {
  try {
    return c10::make_intrusive<c10d::TCPStore>(addr, so);
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("libuv") == std::string::npos || !compat::store_without_libuv(so, 0)) throw;
    return c10::make_intrusive<c10d::TCPStore>(addr, so);
  }
}

struct StoreServer::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

StoreServer::StoreServer(int port, double timeout_s) : impl_(std::make_unique<Impl>()) {
  if (port < 0 || port > 65535)
    throw UserError("MASTER_PORT=" + std::to_string(port) + " is not a TCP port: give one from 1 to 65535, or leave "
                    "MASTER_PORT unset to let the system pick a free one");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = true;
  so.waitWorkers = false;  // the ranks count themselves in (their Gloo rendezvous waits for all)
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  try {
    impl_->store = make_tcp_store("127.0.0.1", so);
  } catch (const std::exception& e) {
    throw UserError("cannot serve the ranks' store on port " + std::to_string(port) + " (MASTER_PORT): " +
                    without_backtrace(e) + "\nLeave MASTER_PORT unset to let the system pick a free port, or give a "
                    "port nothing else listens on");
  }
}

StoreServer::~StoreServer() = default;

int StoreServer::port() const { return static_cast<int>(impl_->store->getPort()); }

namespace {

// Ends the process with kExitLostRank and `message` unless it is destroyed within `seconds`: a rank
// whose store address leads to a program that accepts the connection but never answers as a store
// waits in c10d without any timeout of its own.
class RendezvousWatchdog {
 public:
  RendezvousWatchdog(double seconds, std::string message)
      : thread_([this, seconds, message = std::move(message)] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (done_cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) return;
          std::fprintf(stderr, "error: %s\n", message.c_str());
          std::fflush(stdout);
          std::fflush(stderr);
          std::_Exit(kExitLostRank);
        }) {}
  ~RendezvousWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

}  // namespace

std::unique_ptr<Distributed> Distributed::from_env(double timeout_s, c10::Device device) {
  auto d = std::make_unique<Distributed>();
  d->world_ = env_int("WORLD_SIZE", 1);
  d->timeout_s_ = timeout_s;
  if (d->world_ <= 1) return d;
  require_env("RANK");
  d->rank_ = env_int("RANK", 0);
  const std::string addr = require_env("MASTER_ADDR");
  require_env("MASTER_PORT");
  const int port = env_int("MASTER_PORT", 0);
  if (d->rank_ < 0 || d->rank_ >= d->world_)
    throw UserError("RANK=" + std::to_string(d->rank_) + " is outside [0, WORLD_SIZE=" + std::to_string(d->world_) +
                    "): give the ranks the numbers 0 to WORLD_SIZE - 1, one each");
  if (port <= 0 || port > 65535)
    throw UserError("MASTER_PORT=" + std::to_string(port) + " is not a TCP port: give the same port, 1 to 65535, to every rank");
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  // torchrun's static rendezvous and `run --nproc` serve the store themselves and say so; every rank
  // is then a client (torch.distributed's _create_c10d_store reads the same two variables).
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent && std::string(agent) == "True";
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string attempt = restarts && *restarts ? restarts : "0";
  const std::string where = "rank " + std::to_string(d->rank_) + " of " + std::to_string(d->world_) + ": rendezvous at " +
                            addr + ":" + std::to_string(port);
  const std::string check = "Check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, that " +
                            std::string(agent_store ? "the process that started them serves the store there"
                                                    : "rank 0 can listen on that port") +
                            ", and distributed/timeout_s (" + std::to_string(static_cast<int>(timeout_s)) + " s).";
  const double watchdog_s = 2 * timeout_s + 10;
  RendezvousWatchdog watchdog(watchdog_s, where + " did not finish within " + std::to_string(static_cast<int>(watchdog_s)) +
                                              " s (2 x distributed/timeout_s + 10 s): something there accepts connections "
                                              "but does not answer as a c10d store, or the ranks cannot reach each other.\n" +
                                              check);
  const double started = now_seconds();
  try {
    d->group_ = std::make_unique<Group>();
    d->group_->device = device;
    d->group_->timeout = timeout;
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = d->rank_ == 0 && !agent_store;
    so.numWorkers = static_cast<size_t>(d->world_);
    so.waitWorkers = true;
    so.timeout = timeout;
    auto tcp = make_tcp_store(addr, so);
    // Under a starter's store, keys live where torch.distributed's ranks keep theirs.
    if (agent_store) d->group_->store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + attempt, tcp);
    else d->group_->store = tcp;
#ifdef LT_WITH_NCCL
    // NCCL needs a GPU of its own for each rank of a machine; ranks sharing one (more ranks than
    // GPUs) reduce over Gloo through host memory instead.
    // Without LOCAL_WORLD_SIZE (torchrun always sets it) all ranks are taken to share this machine.
    if (device.is_cuda() && env_int("LOCAL_WORLD_SIZE", d->world_) <= static_cast<int>(torch::cuda::device_count())) {
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      d->group_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(d->group_->store, d->rank_, d->world_, o);
    }
#endif
    if (!d->group_->uses_nccl()) {
      auto o = c10d::ProcessGroupGloo::Options::create(timeout);
      // As in PyTorch: GLOO_SOCKET_IFNAME picks the interface; a loopback master means one machine.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname && *ifname) o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      else if (is_loopback(addr)) o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      else o->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      o->threads = 2;
      d->group_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(d->group_->store, d->rank_, d->world_, o);
    }
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    throw DistributedError(where + " failed after " + std::to_string(static_cast<int>(now_seconds() - started)) +
                           " s: " + without_backtrace(e) + "\n" + check);
  }
  return d;
}

void Distributed::fail(const std::string& what, const std::exception& e, double started) const {
  const std::string msg = without_backtrace(e);
  char took[32];
  std::snprintf(took, sizeof took, "%.1f", now_seconds() - started);
  throw DistributedError("rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ": " + what +
                         " failed after " + took + " s: " + msg +
                         "\nAnother rank has probably exited or stopped responding; see its output. (The limit on one "
                         "collective is distributed/timeout_s = " + std::to_string(static_cast<int>(timeout_s_)) + " s.)");
}

void Distributed::all_reduce_sum(const std::vector<at::Tensor>& tensors, const std::string& what) {
  if (!active() || tensors.empty()) return;
  // One flat buffer per dtype, in first-seen order (the same on every rank).
  std::vector<at::ScalarType> order;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& t : tensors) {
    auto st = t.scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kLong,
                "all_reduce_sum: Gloo sums f32, f64 or int64, not ", st);
    if (!by_type.count(st)) order.push_back(st);
    by_type[st].push_back(t);
  }
  const double started = now_seconds();
  try {
    torch::NoGradGuard ng;
    for (auto st : order) {
      auto& ts = by_type[st];
      // A single contiguous tensor is reduced in place; several are packed and unpacked.
      const bool in_place = ts.size() == 1 && ts[0].is_contiguous();
      at::Tensor flat;
      if (in_place) {
        flat = ts[0].view({-1});
      } else {
        std::vector<at::Tensor> parts;
        for (auto& t : ts) parts.push_back(t.reshape({-1}));
        flat = torch::cat(parts);
      }
      at::Tensor wire = flat.device() == group_->wire_device() ? flat : flat.to(group_->wire_device());
      std::vector<at::Tensor> v{wire};
      group_->allreduce(v);
      if (!wire.is_same(flat)) flat.copy_(wire);
      if (in_place) continue;
      int64_t off = 0;
      for (auto& t : ts) {
        t.copy_(flat.slice(0, off, off + t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    fail(what, e, started);
  }
}

bool Distributed::broadcast_flag(bool flag, const std::string& what) {
  if (!active()) return flag;
  const double started = now_seconds();
  try {
    std::vector<at::Tensor> v{torch::tensor({flag ? int64_t(1) : int64_t(0)}, torch::kLong).to(group_->wire_device())};
    group_->broadcast(v);
    return v[0].item<int64_t>() != 0;
  } catch (const std::exception& e) {
    fail(what, e, started);
  }
}

bool Distributed::same_on_every_rank(int64_t value, const std::string& what, int64_t* rank0) {
  // The sums of the values and of their squares equal W times rank 0's only when every value equals it.
  auto s = torch::tensor({value, value * value, is_main() ? value : int64_t(0)}, torch::kLong);
  all_reduce_sum({s}, what);
  const int64_t w = world_size(), first = s[2].item<int64_t>();
  if (rank0) *rank0 = first;
  return s[0].item<int64_t>() == w * first && s[1].item<int64_t>() == w * first * first;
}

void Distributed::barrier(const std::string& what) {
  if (!active()) return;
  const double started = now_seconds();
  try {
    group_->barrier();
  } catch (const std::exception& e) {
    fail(what, e, started);
  }
}

namespace {

class PendingGather : public Distributed::Gather {
 public:
  PendingGather(std::function<void()> wait, at::Tensor wire, at::Tensor full, std::function<void(const std::exception&)> fail)
      : wait_(std::move(wait)), wire_(std::move(wire)), full_(std::move(full)), fail_(std::move(fail)) {}
  ~PendingGather() override {
    if (!wait_) return;
    try {  // a gather abandoned (an exception elsewhere) is still waited for: its buffers are in use
      wait_();
    } catch (...) {
    }
  }
  void wait() override {
    if (!wait_) return;
    auto wait = std::move(wait_);
    wait_ = nullptr;
    try {
      wait();
      if (!wire_.is_same(full_)) full_.copy_(wire_);
    } catch (const std::exception& e) {
      fail_(e);
    }
  }

 private:
  std::function<void()> wait_;
  at::Tensor wire_, full_;
  std::function<void(const std::exception&)> fail_;
};

class DoneGather : public Distributed::Gather {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<Distributed::Gather> Distributed::all_gather_async(const at::Tensor& shard, const at::Tensor& full,
                                                                   const std::string& what) {
  TORCH_CHECK(shard.scalar_type() == at::kByte && full.scalar_type() == at::kByte && shard.is_contiguous() &&
                  full.is_contiguous() && full.numel() == shard.numel() * world_,
              "all_gather_async: ", what, ": uint8 shards of one size and a buffer of world_size() of them");
  torch::NoGradGuard ng;
  if (!active()) {
    full.copy_(shard);
    return std::make_unique<DoneGather>();
  }
  const double started = now_seconds();
  try {
    const c10::Device wire_device = group_->wire_device();
    at::Tensor in = shard.device() == wire_device ? shard : shard.to(wire_device);
    at::Tensor wire = full.device() == wire_device ? full : torch::empty_like(full, full.options().device(wire_device));
    const int64_t n = shard.numel();
    std::vector<at::Tensor> out;
    for (int r = 0; r < world_; ++r) out.push_back(wire.narrow(0, r * n, n));
    auto wait = group_->allgather(wire, std::move(out), in);
    return std::make_unique<PendingGather>(std::move(wait), wire, full,
                                           [this, what, started](const std::exception& e) { fail(what, e, started); });
  } catch (const std::exception& e) {
    fail(what, e, started);
  }
}

static std::unique_ptr<Distributed>& current() {
  static std::unique_ptr<Distributed> d = std::make_unique<Distributed>();
  return d;
}

Distributed& distributed() { return *current(); }

void set_distributed(std::unique_ptr<Distributed> d) { current() = std::move(d); }

}  // namespace lt
