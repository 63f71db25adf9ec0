#include "lora_trainer/training/job_memory.hpp"

#include <algorithm>
#include <set>

#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/training/lora_phase.hpp"
#include "lora_trainer/training/training_options.hpp"

namespace lt {

int64_t runtime_memory() {
  // 68 MB on the CPU build here, a little above the 46-57 MB the runs' fit gives it (the threads'
  // caches included), so the plan errs up (docs/memory.md).
  return ProcessMemory::now().anonymous;
}

MemoryPlanInputs job_memory_inputs(CausalLM& model, const TrainingOptions& opts, const Runtime& rt, const LoraPhase* lora,
                                   bool phase_one, bool pairs, int ranks, int ranks_here, int64_t runtime) {
  MemoryPlanInputs in;
  in.model = model->options();
  in.phase_one = phase_one;
  in.lora_phase = lora != nullptr;
  in.ranks = std::max(1, ranks);
  in.ranks_here = std::max(1, std::min(ranks_here, in.ranks));
  in.rows = opts.rank_rows(in.ranks, true).micro_batch;
  in.rows_per_sample = pairs ? 2 : 1;
  in.bf16 = rt.bf16_autocast;
  in.fused_loss = in.model.fused_loss_on(rt.device);
  in.chunked_loss = in.model.chunked_loss_on(rt.device);
  in.fused_attention = in.model.fused_attention_on(rt.device);
  in.ema = opts.optimizer.ema_decay > 0;
  in.shard_optimizer = opts.shard_optimizer;
  in.shard_params = opts.shard_params;
  in.cuda = rt.device.is_cuda();
  in.runtime = runtime;
  in.blas = blas_packing(rt.threads);
  in.host_memory = machine_memory();
  in.device_memory = rt.device_memory();
  const NamedTensors params = base_params(*model);
  std::set<std::string> quantized, shardable;
  if (lora) {
    in.storage = lora->quantize_base();
    in.token_rows = static_cast<int64_t>(lora->options().token_ids.size());
    quantized = lora->quantized_weights();
    if (in.shard_params != ShardMode::None && in.ranks > 1) shardable = lora->frozen_block_weights();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    PlannedParam q;
    q.name = name;
    q.shape = p.sizes().vec();
    q.numel = p.numel();
    q.in_block = model->block_of(name) >= 0;
    q.linear = p.dim() == 2;
    if (lora) {
      const LoraPhase::Selection& sel = lora->selection();
      q.trains = sel.saved[i];
      q.quantized = quantized.count(name) > 0;
      q.sharded = shardable.count(name) > 0;
      if (sel.targets[i]) q.adapter = lora->options().rank * (q.shape[0] + q.shape[1]) + (lora->options().dora ? q.shape[0] : 0);
    }
    in.params.push_back(std::move(q));
  }
  return in;
}

MeasuredMemory measure_memory(const MemoryPlan& plan, const Runtime& rt) {
  const ProcessMemory now = ProcessMemory::now();
  MeasuredMemory m;
  m.peak_allocated = now.peak_allocated();
  m.peak_resident = now.peak;
  m.mapped_files = now.file;
  m.plan_host = plan.rank_host_peak();
  m.device_peak = rt.device_peak_bytes();
  m.plan_device = plan.device_peak();
  m.line = "memory: peak " + format_bytes(m.peak_allocated) + " allocated on the host (plan " + format_bytes(m.plan_host) + "), " +
           format_bytes(m.mapped_files) + " of mapped files";
  if (rt.device.is_cuda())
    m.line += "; " + format_bytes(m.device_peak) + " on the GPU (plan " + format_bytes(m.plan_device) + ")";
  return m;
}

nlohmann::json MeasuredMemory::event(int64_t step) const {
  return {{"event", "memory"},       {"step", step},          {"peak_allocated", peak_allocated},
          {"peak_resident", peak_resident}, {"mapped_files", mapped_files}, {"plan_host", plan_host},
          {"device_peak", device_peak}, {"plan_device", plan_device}};
}

}  // namespace lt
