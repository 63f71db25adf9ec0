#include "lora_trainer/models/activation_checkpointing.hpp"

#include <algorithm>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/core/torch_compat.hpp"

namespace lt {

namespace {

using torch::autograd::variable_list;

// One device type's autocast settings, as the forward saw them.
struct AutocastState {
  c10::DeviceType device;
  bool enabled;
  at::ScalarType dtype;

  static AutocastState current(c10::DeviceType device) {
    return {device, compat::autocast_enabled(device), compat::autocast_dtype(device)};
  }
  void apply() const {
    compat::set_autocast_enabled(device, enabled);
    compat::set_autocast_dtype(device, dtype);
  }
};

// Turns the autocast weight-cast cache off for a scope (see the header).
class NoAutocastCache {
 public:
  NoAutocastCache() : prev_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(prev_); }
  NoAutocastCache(const NoAutocastCache&) = delete;
  NoAutocastCache& operator=(const NoAutocastCache&) = delete;

 private:
  bool prev_;
};

// For the scope of a recompute: the generators and autocast as they were at the forward, gradients
// on, no weight-cast cache; on leaving, the backward's own generator and autocast state come back, so
// the recompute draws nothing from the sequence the rest of training sees.
class ReplayForward {
 public:
  ReplayForward(const torch::Device& device, const torch::Tensor& rng, const AutocastState& autocast)
      : device_(device), rng_(rng_state(device)), autocast_(AutocastState::current(autocast.device)) {
    set_rng_state(device_, rng);
    autocast.apply();
  }
  ~ReplayForward() {
    autocast_.apply();
    set_rng_state(device_, rng_);
  }
  ReplayForward(const ReplayForward&) = delete;
  ReplayForward& operator=(const ReplayForward&) = delete;

 private:
  torch::Device device_;
  torch::Tensor rng_;
  AutocastState autocast_;
  at::AutoGradMode grad_{true};
  NoAutocastCache no_cache_;
};

// The backward of a checkpointed block. Inputs (next edges): 0 = the block's input x, 1.. = the
// block's tensors that require a gradient.
class CheckpointBackward : public torch::autograd::Node {
 public:
  CheckpointBackward(BlockForward forward, const torch::Tensor& x, std::vector<torch::Tensor> tensors, torch::Tensor rng,
                     AutocastState autocast, BlockShard* shard, bool trains_shard)
      : forward_(std::move(forward)),
        shard_(shard),
        trains_shard_(trains_shard),
        x_(x.detach()),  // shares x's version counter: an in-place change before the backward is caught
        x_version_(x._version()),
        x_requires_grad_(x.requires_grad()),
        tensors_(std::move(tensors)),
        rng_(std::move(rng)),
        autocast_(autocast) {}

  std::string name() const override { return "lt::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(forward_, "activation checkpointing: a block's backward ran twice (retain_graph is not supported)");
    TORCH_CHECK(x_._version() == x_version_,
                "activation checkpointing: a block's input was modified in place between its forward and backward");
    variable_list out(1 + tensors_.size());
    if (!grads[0].defined()) return out;
    torch::Tensor x = x_.detach().requires_grad_(x_requires_grad_);
    BlockGathered gathered(shard_, BlockGathered::Direction::Backward);  // for the recompute and its gradients
    torch::Tensor y;
    {
      ReplayForward replay(x.device(), rng_, autocast_);
      y = forward_(x);
    }
    // The gradients are taken back in the backward's own state, as the plain path takes them.
    variable_list wrt;
    if (x_requires_grad_) wrt.push_back(x);
    wrt.insert(wrt.end(), tensors_.begin(), tensors_.end());
    if (trains_shard_) wrt.insert(wrt.end(), shard_->bound().begin(), shard_->bound().end());
    variable_list g = torch::autograd::grad({y}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                            /*allow_unused=*/true);
    size_t next = 0;
    if (x_requires_grad_) out[0] = g[next++];
    for (size_t i = 0; i < tensors_.size(); ++i) out[1 + i] = g[next++];
    // The sharded parameters' gradients are summed over the ranks now, and each rank keeps its slice.
    if (trains_shard_) shard_->reduce_gradients(variable_list(g.begin() + static_cast<std::ptrdiff_t>(next), g.end()));
    return out;
  }

  void release_variables() override {
    forward_ = nullptr;
    x_.reset();
    tensors_.clear();
    rng_.reset();
  }

 private:
  BlockForward forward_;
  BlockShard* shard_;  // the model's, which outlives the step's graph
  bool trains_shard_;  // its bound (trained) parameters take their gradients here, not through edges
  torch::Tensor x_;
  int64_t x_version_;
  bool x_requires_grad_;
  std::vector<torch::Tensor> tensors_;
  torch::Tensor rng_;
  AutocastState autocast_;
};

}  // namespace

std::vector<torch::Tensor> grad_tensors(torch::nn::Module& block) {
  std::vector<torch::Tensor> out;
  // The adapters are parameters of their layers: parameters() lists them with the rest.
  for (const auto& p : block.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

torch::Tensor checkpointed(bool enabled, torch::nn::Module& block, const BlockForward& forward, const torch::Tensor& x,
                           BlockShard* shard) {
  auto plain = [&] {
    BlockGathered gathered(shard, BlockGathered::Direction::Forward);
    return forward(x);
  };
  if (!(enabled || shard) || !torch::GradMode::is_enabled()) return plain();
  std::vector<torch::Tensor> tensors = grad_tensors(block);
  // Parameters bound to the shard (trained, sharded: phase 1's ZeRO-3) are stand-ins outside the
  // gather: the node takes their gradients itself and hands them to the shard, no edge to them.
  const bool trains_shard = shard && !shard->bound().empty() && shard->bound().front().requires_grad();
  if (trains_shard)
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const torch::Tensor& t) { return shard->binds(t); }),
                  tensors.end());
  if (!x.requires_grad() && tensors.empty() && !trains_shard) return plain();  // nothing to differentiate
  torch::Tensor rng = rng_state(x.device());
  const AutocastState autocast = AutocastState::current(x.device().type());
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    NoAutocastCache no_cache;
    BlockGathered gathered(shard, BlockGathered::Direction::Forward);
    y = forward(x);
  }
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(forward, x, tensors, std::move(rng), autocast, shard, trains_shard),
                                                  torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x, tensors));
  torch::autograd::set_history(y, node);
  return y;
}

}  // namespace lt
