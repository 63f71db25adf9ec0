// A job's memory from its parts: the plan's inputs from its model, options, runtime and LoRA phase
// (memory_plan.hpp makes the plan of them), and at its end the peaks the run measured beside the plan's.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "lora_trainer/training/memory_plan.hpp"

namespace lt {

// A run's measured peaks beside its plan's, at its end: the host's (the peak resident set less mapped
// files' pages) and, on a GPU, LibTorch's allocator's.
struct MeasuredMemory {
  int64_t peak_allocated = 0, peak_resident = 0, mapped_files = 0, plan_host = 0, device_peak = 0, plan_device = 0;
  std::string line;  // "memory: peak 1.02 GB allocated on the host (plan 1.05 GB), 120 MB of mapped files"
  nlohmann::json event(int64_t step) const;  // the `memory` event of metrics.jsonl
};
MeasuredMemory measure_memory(const MemoryPlan& plan, const Runtime& rt);

class LoraPhase;
struct TrainingOptions;

// A job's inputs, from its parts: the model's parameters (their shapes: no value is read), the trainer's
// options and runtime, its LoRA phase's selection (null without one), whether it has a full-parameter
// phase and trains on preference pairs, over `ranks` ranks of which `ranks_here` share this machine;
// `runtime`: the process's own memory (runtime_memory() before the model was made).
MemoryPlanInputs job_memory_inputs(CausalLM& model, const TrainingOptions& opts, const Runtime& rt, const LoraPhase* lora,
                                   bool phase_one, bool pairs, int ranks, int ranks_here, int64_t runtime);
// What the process holds of its own before a job's first tensor: its anonymous memory now (LibTorch's
// libraries loaded, the config read).
int64_t runtime_memory();

}  // namespace lt
