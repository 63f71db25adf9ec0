// The execution environment of a job: device, thread count, precision (bf16 autocast or f32), and the
// random-generator state that a checkpoint must carry for an exact resume.
#pragma once

#include <string>

#include <torch/torch.h>

namespace lt {

class Config;
class ConfigSchema;

struct Runtime {
  torch::Device device = torch::kCPU;
  bool bf16_autocast = false;
  int threads = 1;
  // runtime/device: auto|cpu|cuda; runtime/precision: auto|bf16|f32; runtime/threads: 0 = all cores.
  static Runtime from_config(const Config& cfg);
  std::string describe() const;
  // A host tensor (a batch) on this device. To CUDA through pinned memory without waiting: a plain
  // copy from pageable memory would hold the host until the GPU had caught up.
  torch::Tensor to_device(const torch::Tensor& host) const;
  // Waits for the device's queued work (a no-op on the CPU); timings need it on CUDA.
  void synchronize() const;
};

void add_runtime_options(ConfigSchema& s);

// True when this CPU has native bf16 matrix instructions (AMX-BF16 or AVX512-BF16).
bool cpu_has_fast_bf16();

// Enables bf16 autocast for the scope (when the runtime asks for it) and, on leaving, clears the
// autocast weight-cast cache, which would otherwise hand out stale casts after an optimizer step.
class AutocastGuard {
 public:
  explicit AutocastGuard(const Runtime& rt);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false, cuda_ = false, prev_enabled_ = false;
};

// The default generators' states (CPU, and CUDA when used) as a uint8 tensor, and back. The device
// forms serve activation checkpointing, which replays a block's dropout on the device of its input.
torch::Tensor rng_state(const Runtime& rt);
void set_rng_state(const Runtime& rt, const torch::Tensor& state);
torch::Tensor rng_state(const torch::Device& device);
void set_rng_state(const torch::Device& device, const torch::Tensor& state);

}  // namespace lt
