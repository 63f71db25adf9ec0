// The speed benchmark (`lora_trainer bench`), not to be confused with continual.* (the continual-
// learning trainers): for one model size it times phase-1 (full) and phase-2 (LoRA) training steps of
// the real trainer of a lora/train job on synthetic tokens and reports, per phase, tokens/s, step time (median and
// spread), peak memory (the process's RSS, the CPU allocator's peak above the state held before the timed
// steps, the GPU allocator's peak), bytes of persistent state and model FLOPs utilisation against a bf16
// (or f32) matmul peak measured in the same run. Results print as a table and are written as JSON.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <c10/util/ThreadLocalDebugInfo.h>

#include <nlohmann/json.hpp>

namespace lt {

struct BenchOptions {
  std::string config_path;             // a lora/train config: its architecture, batch and runtime keys
  std::vector<std::string> overrides;  // key=value over it
  int64_t warmup_steps = 3, steps = 10;
  std::string out_json = "bench.json";
  std::string weights_out;             // when set: the initial weights and first batch, for the reference
  std::string profile;                 // when set: PROFILE-full.trace.json and PROFILE-lora.trace.json, Chrome
                                       // traces of each phase's timed steps (LibTorch's autograd profiler)
  std::string cuda_profile;            // "full" or "lora": that phase's timed steps between cuProfilerStart and
                                       // cuProfilerStop, for a CUDA profiler started with --profile-from-start off
                                       // (scripts/profile_kernels.sh)
};

nlohmann::json run_bench(const BenchOptions& opts);

// The most bytes LibTorch's CPU allocator held at once during this object's life, counting what was
// allocated in it: what a training step adds on top of the weights and state that existed before
// (activations, gradients, temporaries). It listens where the autograd profiler's memory view does
// (c10's memory-reporting hook, on this thread and the threads that inherit its state, the autograd
// engine's included), so it reads 0 while a profiler is recording (`--profile`), which takes the hook.
// While it listens, LibTorch 1.13 logs a warning ("Memory block of unknown size was allocated before the
// profiling started") for the first of every 1,000 frees of memory allocated before it: harmless.
class CpuAllocatorPeak {
 public:
  CpuAllocatorPeak();
  ~CpuAllocatorPeak();
  CpuAllocatorPeak(const CpuAllocatorPeak&) = delete;
  CpuAllocatorPeak& operator=(const CpuAllocatorPeak&) = delete;
  int64_t peak_bytes() const;

 private:
  struct Listener;
  std::shared_ptr<Listener> listener_;
  std::unique_ptr<c10::DebugInfoGuard> guard_;
};

struct Runtime;

// Sustained matmul rate (FLOP/s) of an n x n x n product in bf16 (else f32) on the runtime's device
// (the CPU with the current thread count, or the GPU): the best of a few timed repetitions.
double measure_matmul_peak(int64_t n, bool bf16, const Runtime& rt);

}  // namespace lt
