#include "lora_trainer/training/memory_plan.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <set>
#include <stdexcept>

#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/kernels/head_loss.hpp"
#include "lora_trainer/peft/frozen_weight.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/training/lora_phase.hpp"
#include "lora_trainer/training/training_options.hpp"

namespace lt {

namespace {

// What a block's forward keeps for its backward, in bytes, as measured on the CPU: the bytes a token
// keeps per unit of d_model and of d_ff, and those of attention's weights per (row, head, query, key)
// where attention is not fused (none where it is). LibTorch's autograd decides what is kept, so each
// generation has its rows: 2.x saves no operand whose partner needs no gradient (1.13 saves both), which
// matters most where the weights are frozen (the LoRA phase). Each row is fitted by least squares on
// 2-step runs over d_model, d_ff, block_size and the layers by scripts/fit_activations.py (docs/
// memory.md, "How the plan was measured").
struct BlockActivations {
  double per_c = 0, per_ff = 0, attention = 0;
};

struct ActivationRow {
  ModelFamily family;
  bool bf16, frozen;
  BlockActivations bytes;
};

// Rows: family, bf16 autocast (else f32), frozen (the LoRA phase), {per d_model, per d_ff, attention}.
#if LT_TORCH_AT_LEAST(2, 0)
// LibTorch 2.6 (Debian 13), 2026-11-29: the plan within -5% to +6% of every fitted run.
constexpr ActivationRow kActivationRows[] = {
    {ModelFamily::Llama, true, false, {34.5, 7.3, 2.94}},  {ModelFamily::Llama, true, true, {26.4, 10.3, 1.71}},
    {ModelFamily::Llama, false, false, {48.8, 13.9, 5.56}}, {ModelFamily::Llama, false, true, {57.3, 15.5, 3.66}},
    {ModelFamily::Gpt2, true, false, {15.6, 3.4, 2.89}},   {ModelFamily::Gpt2, true, true, {21.3, 6.4, 1.95}},
    {ModelFamily::Gpt2, false, false, {28.6, 6.5, 5.59}},  {ModelFamily::Gpt2, false, true, {39.6, 8.2, 3.82}}};
// A checkpointed full-parameter f32 backward keeps what the rows predict (AVX2 Zen 1, 2026-11-29: the plan
// about 9% over the measured peak); so does the LoRA phase's.
constexpr double kCheckpointedF32Extra = 0.0;
constexpr double kCheckpointedF32LoraExtra = 0.0;
#else
// A checkpointed f32 backward keeps more than the rows predict: full-parameter, about half a block (AVX2
// Zen 1: 2026-11-29 the run peaked at 399 MB, 2026-11-30 at 352-371 MB, where the rows alone say 357 MB
// and one block more 411 MB); the LoRA phase about one block (2026-11-30, 18% under without it with one
// thread (OMP_NUM_THREADS=1, as ctest runs it), 13% under with two); bf16's need none.
constexpr double kCheckpointedF32Extra = 0.5;
constexpr double kCheckpointedF32LoraExtra = 1.0;
// LibTorch 1.13 (Debian 12), 2026-11-29: the plan within -6% to +6% of every fitted run.
constexpr ActivationRow kActivationRows[] = {
    {ModelFamily::Llama, true, false, {47.0, 7.7, 2.93}},  {ModelFamily::Llama, true, true, {54.4, 9.9, 0.76}},
    {ModelFamily::Llama, false, false, {65.4, 13.4, 5.61}}, {ModelFamily::Llama, false, true, {74.2, 14.2, 4.13}},
    {ModelFamily::Gpt2, true, false, {17.7, 2.8, 3.76}},   {ModelFamily::Gpt2, true, true, {36.6, 4.2, 1.97}},
    {ModelFamily::Gpt2, false, false, {33.9, 7.3, 5.43}},  {ModelFamily::Gpt2, false, true, {42.0, 7.7, 4.78}}};
#endif

// `frozen`: the blocks' weights need no gradient (the LoRA phase: only the adapters' do).
BlockActivations block_activations(ModelFamily family, bool bf16, bool frozen) {
  for (const auto& row : kActivationRows)
    if (row.family == family && row.bf16 == bf16 && row.frozen == frozen) return row.bytes;
  throw std::logic_error("memory plan: no activation row for this family");
}

int64_t sum(const std::vector<PlannedParam>& params, bool (*take)(const PlannedParam&)) {
  int64_t n = 0;
  for (const auto& p : params)
    if (take(p)) n += p.numel;
  return n;
}

struct Shape {
  int64_t N = 0;  // tokens of a micro-batch on one rank
  int64_t B = 0, T = 0, C = 0, F = 0, H = 0, V = 0, L = 0;
  int act = 4;    // bytes of an activation value
};

Shape shape_of(const MemoryPlanInputs& in) {
  Shape s;
  const ModelOptions& m = in.model;
  s.B = in.rows * in.rows_per_sample;
  s.T = m.block_size;
  s.N = s.B * s.T;
  s.C = m.d_model;
  s.F = m.ff();
  s.H = m.n_head;
  s.V = m.vocab_size;
  s.L = m.n_layer;
  s.act = in.bf16 ? 2 : 4;
  return s;
}

// The activations of a micro-batch: every block's (or, checkpointed, every block's input and one
// block's whole), the embeddings' output, and the gradient of one block's in the backward. A block
// whose weights are sharded is always checkpointed (its gathered weights are dropped after the forward).
int64_t activations(const MemoryPlanInputs& in, const Shape& s, bool checkpointed, bool frozen) {
  const BlockActivations k = block_activations(in.model.family, in.bf16, frozen);
  double block = (k.per_c * s.C + k.per_ff * s.F) * static_cast<double>(s.N);
  if (!in.fused_attention) block += k.attention * static_cast<double>(s.B) * s.H * s.T * s.T;
  const double stream = 4.0 * s.N * s.C;  // the residual stream between blocks (f32)
  // Checkpointed, the backward of a block holds its recomputed activations and their gradients; with
  // LibTorch 1.13, in f32, about one block more (kCheckpointedF32Extra; in the LoRA phase
  // kCheckpointedF32LoraExtra, with activation checkpointing: a sharded block's own recompute needs none).
  // The LoRA phase's extra block came with oneDNN's products (runtime/matmul); with LibTorch's the rows
  // alone hold (the Zen 1, 2026-11-30: one block more put the plan 33% over).
  const double extra = in.bf16                                ? 0.0
                       : !frozen                              ? kCheckpointedF32Extra
                       : in.model.activation_checkpointing && cpu_matmul() == CpuMatmul::OneDnn ? kCheckpointedF32LoraExtra
                                                              : 0.0;
  const double kept = checkpointed ? s.L * stream + (1.0 + extra) * block : s.L * block;
  return static_cast<int64_t>(kept + 2 * stream + block);  // + embeddings' output, final norm; one block's gradients
}

// The head's output and the loss's arrays: the fused loss keeps the logits and writes their gradient
// into them; LibTorch's makes an f32 copy, its log-softmax and the gradient.
// GRPO's loss reads log-probabilities (token_logps: an f32 copy over the temperature, its log-sum-exp, the
// gradients), never the fused loss.
int64_t logits(const MemoryPlanInputs& in, const Shape& s) {
  const double nv = static_cast<double>(s.N) * s.V;
  return static_cast<int64_t>(in.fused_loss && in.rollout_rows == 0 ? nv * s.act : nv * s.act + 3 * nv * 4);
}

// The chunked head + loss (kernels/head_loss.hpp) of a head that takes no gradient: one block of logits
// (N x 4,096; N x 1,024 in f32 for d_model 4,096), W's block cast where the head is stored in another dtype (a bf16 head in an f32 step), x's
// gradient (N x C, f32) kept from the forward, the block's product p W_b in bf16; LibTorch's f32
// operations on a block where there are no row kernels (CUDA).
int64_t chunked_columns(const MemoryPlanInputs& in, const Shape& s) { return head_loss_columns(s.V, s.C, /*cast=*/!in.bf16); }

int64_t chunked_logits(const MemoryPlanInputs& in, const Shape& s) {
  const int64_t columns = chunked_columns(in, s);
  int64_t bytes = s.N * columns * s.act + 4 * s.N * s.C;
  if (!in.bf16) bytes += columns * s.C * 4;
  else bytes += 2 * s.N * s.C;
  if (in.cuda) bytes += 2 * 4 * s.N * columns;
  return bytes;
}

// OpenBLAS's packing of the f32 weight gradients g^T x on the CPU (BlasPacking): 4 x min(tokens, depth)
// x the product's output columns, each thread its share in its own buffer; the library keeps the pages
// until the process ends, so a LoRA phase after phase 1 still holds phase 1's, and the widest product
// counts. A weight's gradient (out x in) is made in blocks of kWeightGradRows of its rows (cpu_linear):
// columns min(out, 8,192), in rows; an adapter's A (in x rank, LibTorch's autograd) in columns by rank
// rows (its B's, rank by out, packs rank columns). One thread keeps a block whole only where it has more
// rows than depth (else it packs a few columns at a time), at most its one buffer.
int64_t kept_packing(const MemoryPlanInputs& in, int64_t tokens, bool phase_one) {
  if (in.cuda || in.bf16) return 0;
  const int64_t depth = std::min(tokens, in.blas.depth);
  int64_t most = 0;
  for (const auto& p : in.params) {
    if (p.shape.size() != 2) continue;
    const bool whole = phase_one || p.trains;
    if (!whole && p.adapter == 0) continue;
    const int64_t columns = whole ? std::min(p.shape[0], kWeightGradRows) : p.shape[1];
    const int64_t rows = whole ? p.shape[1] : 0;  // an adapter's A: its rank, never more than depth
    const int64_t packed = 4 * depth * columns;
    most = std::max(most, in.blas.threads > 1   ? std::min(packed, in.blas.threads * in.blas.buffer)
                          : rows > in.blas.depth ? std::min(packed, in.blas.buffer)
                                                 : 0);
  }
  return most;
}

// Whether the LoRA phase's head takes no gradient, so that its loss is chunked where the runtime chunks
// it: no adapter on it and it does not train (modules_to_save; trainable token rows of a tied head).
bool head_frozen(const MemoryPlanInputs& in) {
  const PlannedParam* head = nullptr;
  for (const auto& p : in.params) {
    const bool vocabulary = p.shape.size() == 2 && p.shape[0] == in.model.vocab_size;
    if (vocabulary && (!head || p.name.find("lm_head") != std::string::npos)) head = &p;
  }
  if (!head) return false;
  const bool tied = head->name.find("lm_head") == std::string::npos;
  return !head->trains && head->adapter == 0 && !(tied && in.token_rows > 0);
}

// GRPO's rollouts: the KV cache of rollout_rows completions of up to block_size positions (keys and
// values of every layer, in the activations' dtype), held while they are generated, before the step's
// activations and logits exist; what it needs beyond them.
int64_t rollout_cache(const MemoryPlanInputs& in, const Shape& s, int64_t step) {
  if (in.rollout_rows <= 0) return 0;
  const int64_t cache = 2 * s.L * in.rollout_rows * in.model.kv_heads() * in.model.head_dim() * s.T * s.act;
  return std::max<int64_t>(0, cache - step);
}

struct Builder {
  const MemoryPlanInputs& in;
  PhaseMemory phase;
  // `bytes` of the training state: on the device on a GPU, else on the host.
  void state(const std::string& what, int64_t bytes) {
    if (bytes <= 0) return;
    phase.items.push_back(in.cuda ? MemoryItem{what, 0, bytes} : MemoryItem{what, bytes, 0});
  }
  void host(const std::string& what, int64_t bytes) {
    if (bytes > 0) phase.items.push_back({what, bytes, 0});
  }
};

PhaseMemory full_phase(const MemoryPlanInputs& in) {
  const Shape s = shape_of(in);
  Builder b{in, {"phase 1 (full parameters)", {}}};
  const int64_t all = sum(in.params, [](const PlannedParam&) { return true; });
  const int64_t blocks = sum(in.params, [](const PlannedParam& p) { return p.in_block; });
  const int64_t linear = sum(in.params, [](const PlannedParam& p) { return p.linear; });
  const bool sharded = in.shard_params == ShardMode::All && in.ranks > 1;
  const int64_t per_block = s.L > 0 ? blocks / s.L : 0;
  const int64_t held = sharded ? all - blocks + (blocks + in.ranks - 1) / in.ranks : all;  // this rank's values
  const bool zero1 = !sharded && in.shard_optimizer == ShardMode::All && in.ranks > 1;
  const std::string of_ranks = " (1/" + std::to_string(in.ranks) + " of the blocks')";
  b.state("weights (f32)" + std::string(sharded ? of_ranks : ""), 4 * held);
  b.state("gradients (f32)" + std::string(sharded ? of_ranks : ""), 4 * held);
  b.state(zero1 ? "AdamW moments (2 x f32, 1/" + std::to_string(in.ranks) + ": distributed/shard_optimizer)"
                : "AdamW moments (2 x f32)",
          8 * (zero1 ? (held + in.ranks - 1) / in.ranks : held));
  if (in.ema) b.state("EMA (f32)", 4 * held);
  if (in.reference_copy) b.state("DPO's reference (a frozen bf16 copy of the starting weights)", 2 * all);
  if (sharded) b.state("blocks gathered (this one and the next, with a gradient)", 3 * 4 * per_block);
  b.state("activations (" + std::to_string(s.B) + " x " + std::to_string(s.T) + " tokens a micro-batch" +
              (in.model.activation_checkpointing || sharded ? ", checkpointed)" : ")"),
          activations(in, s, in.model.activation_checkpointing || sharded, /*frozen=*/false));
  b.state("logits and loss", logits(in, s));
  if (in.bf16) {  // autocast's bf16 copies of the weights: kept for the micro-batch, or one at a time checkpointed
    int64_t largest = 0;
    for (const auto& p : in.params)
      if (p.linear) largest = std::max(largest, p.numel);
    b.state(in.model.activation_checkpointing || sharded ? "bf16 casts of the weights (one at a time)"
                                                         : "bf16 casts of the weights (kept for the micro-batch)",
            2 * (in.model.activation_checkpointing || sharded ? largest : linear));
  }
  if (zero1) b.host("checkpoint save (the other ranks' moments, gathered)", 8 * held - 8 * ((held + in.ranks - 1) / in.ranks));
  b.host("BLAS packing, kept (widest f32 weight gradient)", kept_packing(in, s.N, /*phase_one=*/true));
  b.host("runtime (LibTorch, threads)", in.runtime);
  return b.phase;
}

PhaseMemory lora_phase(const MemoryPlanInputs& in) {
  Shape s = shape_of(in);
  // GRPO trains rows as long as the step's longest prompt and completion, and caches as many positions.
  if (in.rollout_rows > 0 && in.rollout_width > 0 && in.rollout_width < s.T) {
    s.T = in.rollout_width;
    s.N = s.B * s.T;
  }
  Builder b{in, {"phase 2 (LoRA)", {}}};
  const FrozenStorage& storage = frozen_storage(in.storage);
  int64_t bf16 = 0, quantized = 0, sharded = 0, trained = 0, largest_quantized = 0, n_quantized = 0, adapters = 0;
  int64_t sharded_block = 0;
  for (const auto& p : in.params) {
    adapters += p.adapter;
    if (p.trains) {
      trained += p.numel;
      continue;
    }
    const int64_t bytes = p.quantized ? storage.bytes_of(p.shape) : 2 * p.numel;
    if (p.sharded) {
      sharded += bytes;
      sharded_block = std::max<int64_t>(sharded_block, bytes);
    } else if (p.quantized) {
      quantized += bytes;
    } else {
      bf16 += bytes;
    }
    if (p.quantized) largest_quantized = std::max(largest_quantized, p.numel), ++n_quantized;
  }
  const int64_t trains = adapters + trained + in.token_rows * s.C;
  const bool zero1 = in.shard_optimizer != ShardMode::None && in.ranks > 1;
  if (quantized > 0)
    b.state("frozen base: " + std::to_string(n_quantized) + " linear weights in " + storage.shown(), quantized);
  b.state("frozen base: bf16", bf16);
  if (sharded > 0) {
    const int64_t per_block = s.L > 0 ? sharded / s.L : 0;
    b.state("frozen base: the blocks' weights, 1/" + std::to_string(in.ranks) + " a rank", (sharded + in.ranks - 1) / in.ranks);
    b.state("frozen blocks gathered (this one and the next)", 2 * per_block);
  }
  b.state("adapters" + std::string(trained > 0 ? " and modules_to_save" : "") + " (f32)", 4 * trains);
  b.state("gradients (f32)", 4 * trains);
  b.state(zero1 ? "AdamW moments (2 x f32, 1/" + std::to_string(in.ranks) + ")" : "AdamW moments (2 x f32)",
          8 * (zero1 ? (trains + in.ranks - 1) / in.ranks : trains));
  if (in.ema) b.state("EMA (f32)", 4 * trains);
  const bool checkpointed = in.model.activation_checkpointing || sharded > 0;
  const bool chunked = in.chunked_loss && in.rollout_rows == 0 && in.rows_per_sample == 1 && head_frozen(in);
  const int64_t acts = activations(in, s, checkpointed, /*frozen=*/true), outs = chunked ? chunked_logits(in, s) : logits(in, s);
  b.state("activations (" + std::to_string(s.B) + " x " + std::to_string(s.T) + " tokens a micro-batch" +
              (checkpointed ? ", checkpointed)" : ")"),
          acts);
  b.state(in.rollout_rows > 0 ? "logits and log-probabilities (unfused)"
          : chunked          ? "logits and loss (chunked: " + std::to_string(chunked_columns(in, s)) + " columns at a time, x's gradient)"
                             : "logits and loss",
          outs);
  b.state("rollouts' KV cache (" + std::to_string(in.rollout_rows) + " completions x " + std::to_string(s.T) +
              " positions), beyond the step's activations and logits",
          rollout_cache(in, s, acts + outs));
  if (largest_quantized > 0)  // each product makes its weight whole in bf16, in the forward and the backward
    b.state(storage.shown() + " weights made whole for their products (two at a time)", 2 * 2 * largest_quantized);
  if (!in.bf16) {  // each product casts its frozen weight into one buffer, in blocks of rows of 64 MiB at most
    int64_t largest_frozen = 0;
    for (const auto& p : in.params)  // a chunked head casts its own blocks (chunked_logits); the embedding's is a lookup
      if (!p.trains && !p.quantized && p.shape.size() == 2 && !(chunked && p.shape[0] == s.V))
        largest_frozen = std::max(largest_frozen, p.numel);
    b.state("f32 cast of a frozen weight (one buffer, 64 MiB at most)", std::min(kFrozenCastBlockBytes, 4 * largest_frozen));
  }
  if (in.loads_base) {
    // The load maps allocations of 1 MiB and more and returns them when freed; a smaller tensor read and
    // then dropped (quantized, sharded, or read wider than the bf16 it is kept as) stays in the heap.
    int64_t left = 0;
    for (const auto& p : in.params) {
      const int64_t read = p.numel * in.source_bytes;
      if (!p.trains && read < (int64_t{1} << 20) && (p.quantized || p.sharded || in.source_bytes > 2)) left += read;
    }
    b.host("what the load left in the heap (tensors under 1 MiB read and dropped)", left);
  }
  const int64_t packed = std::max(kept_packing(in, s.N, /*phase_one=*/false), in.phase_one ? kept_packing(in, shape_of(in).N, true) : 0);
  b.host("BLAS packing, kept (widest f32 weight gradient)", packed);
  b.host("runtime (LibTorch, threads)", in.runtime);
  return b.phase;
}

// A job that starts in its LoRA phase, loading its base: what the phase keeps of the base, plus the
// tensor being read (in the source's dtype) and converted.
PhaseMemory load_phase(const MemoryPlanInputs& in, const PhaseMemory& lora) {
  PhaseMemory p{"load of the base", {}};
  int64_t in_flight = 0, kept_wider = 0;
  for (const auto& q : in.params) {
    // What reading one tensor holds besides what the phase keeps of it: a quantized (or sharded) weight
    // read, made bf16 and worked on in f32; a weight that trains read and made f32; a frozen one read
    // in bf16 is kept as read (nothing more), one read wider stays so until the transition.
    int64_t extra = 0;
    if (q.quantized || q.sharded) extra = q.numel * (in.source_bytes + (in.source_bytes > 2 ? 2 : 0) + (q.quantized ? 4 : 0));
    else if (q.trains) extra = q.numel * in.source_bytes;
    else if (in.source_bytes > 2) kept_wider += (4 - 2) * q.numel;
    in_flight = std::max(in_flight, extra);
  }
  for (const auto& item : lora.items)
    if (item.what.rfind("frozen base", 0) == 0 || item.what.rfind("adapters", 0) == 0 || item.what.rfind("runtime", 0) == 0)
      p.items.push_back(item);
  // Weights the phase freezes stay f32 until the transition when the source stores f32.
  if (kept_wider > 0) p.items.push_back(in.cuda ? MemoryItem{"frozen base kept f32 until the transition", 0, kept_wider}
                                                : MemoryItem{"frozen base kept f32 until the transition", kept_wider, 0});
  p.items.push_back({"the tensor being read and converted", in_flight, 0});
  return p;
}

std::string padded(const std::string& s, size_t width) { return s.size() >= width ? s : s + std::string(width - s.size(), ' '); }

}  // namespace

int64_t PhaseMemory::host() const {
  int64_t n = 0;
  for (const auto& i : items) n += i.host;
  return n;
}

int64_t PhaseMemory::device() const {
  int64_t n = 0;
  for (const auto& i : items) n += i.device;
  return n;
}

MemoryPlan plan_memory(const MemoryPlanInputs& inputs) {
  MemoryPlan plan;
  plan.inputs = inputs;
  if (inputs.phase_one) plan.phases.push_back(full_phase(inputs));
  if (inputs.lora_phase) {
    PhaseMemory lora = lora_phase(inputs);
    if (inputs.loads_base) plan.phases.push_back(load_phase(inputs, lora));
    plan.phases.push_back(std::move(lora));
  }
  return plan;
}

int64_t MemoryPlan::rank_host_peak() const {
  int64_t n = 0;
  for (const auto& p : phases) n = std::max(n, p.host());
  return n;
}

int64_t MemoryPlan::host_peak() const { return rank_host_peak() * std::max(1, inputs.ranks_here); }

int64_t MemoryPlan::device_peak() const {
  int64_t n = 0;
  for (const auto& p : phases) n = std::max(n, p.device());
  return n;
}

bool MemoryPlan::fits() const {
  if (inputs.host_memory > 0 && host_peak() > inputs.host_memory) return false;
  if (inputs.cuda && inputs.device_memory > 0 && device_peak() > inputs.device_memory) return false;
  return true;
}

std::string MemoryPlan::text() const {
  std::string out;
  const bool device = inputs.cuda;
  // A row: its name, then the host's bytes (and the device's) right-aligned in columns of 10.
  auto row = [&](const std::string& what, int64_t host, int64_t dev) {
    char cells[64];
    std::snprintf(cells, sizeof cells, device ? "%10s%10s" : "%10s", format_bytes(host).c_str(), format_bytes(dev).c_str());
    out += "    " + padded(what, 56) + cells + "\n";
  };
  for (const auto& p : phases) {
    out += "  " + padded(p.name, 58) + (device ? "      host    device\n" : "      host\n");
    for (const auto& i : p.items) row(i.what, i.host, i.device);
    row("total, per rank", p.host(), p.device());
  }
  out += "  peak: " + format_bytes(host_peak()) + " of host memory" +
         (inputs.ranks_here > 1 ? " (" + std::to_string(inputs.ranks_here) + " ranks on this machine)" : std::string()) +
         (inputs.host_memory > 0 ? ", of the machine's " + format_bytes(inputs.host_memory) : std::string());
  if (device) out += "; " + format_bytes(device_peak()) + " of each GPU's " + format_bytes(inputs.device_memory);
  out += fits() ? ": fits\n" : ": does not fit\n";
  return out;
}

std::string MemoryPlan::summary() const {
  std::string peak_phase;
  int64_t peak = -1;
  for (const auto& p : phases)
    if ((inputs.cuda ? p.device() : p.host()) > peak) peak = inputs.cuda ? p.device() : p.host(), peak_phase = p.name;
  std::string out = "memory plan: " + format_bytes(rank_host_peak()) + " of host memory a rank";
  if (inputs.cuda) out += ", " + format_bytes(device_peak()) + " of the GPU's " + format_bytes(inputs.device_memory);
  else if (inputs.host_memory > 0) out += " (this machine has " + format_bytes(inputs.host_memory) + ")";
  return out + ", at its peak in " + peak_phase + "; `lora_trainer plan` itemizes it";
}

nlohmann::json MemoryPlan::to_json() const {
  nlohmann::json phases_json = nlohmann::json::array();
  for (const auto& p : phases) {
    nlohmann::json items = nlohmann::json::array();
    for (const auto& i : p.items) items.push_back({{"what", i.what}, {"host", i.host}, {"device", i.device}});
    phases_json.push_back({{"phase", p.name}, {"items", items}, {"host", p.host()}, {"device", p.device()}});
  }
  nlohmann::json changes = nlohmann::json::array();
  if (!fits())
    for (const auto& c : fit_changes()) changes.push_back({{"setting", c.setting}, {"host", c.host}, {"device", c.device}});
  return {{"phases", phases_json},
          {"ranks", inputs.ranks},
          {"ranks_here", inputs.ranks_here},
          {"host_peak_per_rank", rank_host_peak()},
          {"host_peak", host_peak()},
          {"device_peak", device_peak()},
          {"host_memory", inputs.host_memory},
          {"device_memory", inputs.device_memory},
          {"fits", fits()},
          {"fit_changes", changes}};
}

std::vector<FitChange> MemoryPlan::fit_changes() const {
  struct Change {
    std::string setting;
    bool applies;
    std::function<void(MemoryPlanInputs&)> apply;
  };
  const MemoryPlanInputs& in = inputs;
  const bool checkpointed = in.model.activation_checkpointing;
  std::vector<Change> changes = {
      {"training/per_device_batch_size=1", in.rows > 1, [](MemoryPlanInputs& i) { i.rows = 1; }},
      {"training/activation_checkpointing=true", !checkpointed, [](MemoryPlanInputs& i) { i.model.activation_checkpointing = true; }},
      {"optimization/lora/quantize_base=nf4", in.lora_phase && in.storage == FrozenFormat::Bf16,
       [](MemoryPlanInputs& i) {
         i.storage = FrozenFormat::Nf4;
         for (auto& p : i.params) p.quantized = p.in_block && p.linear && !p.trains;
       }},
      {"distributed/shard_params=" + std::string(in.phase_one ? "all" : "lora") +
           " on 2 machines (a rank each)",
       in.shard_params == ShardMode::None && in.ranks == 1,
       [phase_one = in.phase_one](MemoryPlanInputs& i) {
         i.ranks = 2;
         i.ranks_here = 1;
         i.shard_params = phase_one ? ShardMode::All : ShardMode::Lora;
         for (auto& p : i.params) p.sharded = p.in_block && p.linear && !p.trains;
       }},
  };
  std::vector<FitChange> out;
  for (const auto& c : changes) {
    if (!c.applies) continue;
    MemoryPlanInputs changed = in;
    c.apply(changed);
    const MemoryPlan p = plan_memory(changed);
    if (p.fits()) out.push_back({c.setting, p.host_peak(), p.device_peak()});
  }
  if (!out.empty()) return out;
  // None alone: all of them together, when that is enough.
  MemoryPlanInputs changed = in;
  std::string settings;
  for (const auto& c : changes) {
    if (!c.applies) continue;
    c.apply(changed);
    settings += (settings.empty() ? "" : " and ") + c.setting;
    const MemoryPlan p = plan_memory(changed);
    if (p.fits()) return {{settings, p.host_peak(), p.device_peak()}};
  }
  return out;
}

std::string MemoryPlan::refusal() const {
  const bool device = inputs.cuda && inputs.device_memory > 0 && device_peak() > inputs.device_memory;
  const PhaseMemory* peak = nullptr;
  for (const auto& p : phases)
    if (!peak || (device ? p.device() > peak->device() : p.host() > peak->host())) peak = &p;
  std::string out = "this job does not fit in memory: its plan needs " +
                    (device ? format_bytes(device_peak()) + " on each GPU, which has " + format_bytes(inputs.device_memory)
                            : format_bytes(host_peak()) + " of host memory" +
                                  (inputs.ranks_here > 1 ? " (" + std::to_string(inputs.ranks_here) + " ranks on this machine)" : "") +
                                  ", and this machine has " + format_bytes(inputs.host_memory)) +
                    ".";
  if (peak) {
    std::vector<MemoryItem> items = peak->items;
    std::sort(items.begin(), items.end(), [&](const MemoryItem& a, const MemoryItem& b) {
      return (device ? a.device : a.host) > (device ? b.device : b.host);
    });
    out += " Its largest items, in " + peak->name + ":";
    for (size_t i = 0; i < items.size() && i < 3; ++i)
      out += std::string(i ? "," : "") + " " + items[i].what + " " + format_bytes(device ? items[i].device : items[i].host);
    out += ".";
  }
  const std::vector<FitChange> changes = fit_changes();
  if (changes.empty()) {
    out += " None of per_device_batch_size=1, activation checkpointing, an NF4 base or sharding over two machines "
           "makes it fit: it needs a machine with more memory.";
  } else {
    out += " It fits with";
    for (size_t i = 0; i < changes.size(); ++i)
      out += std::string(i ? "; or" : "") + " " + changes[i].setting + " (" +
             format_bytes(device ? changes[i].device : changes[i].host) + ")";
    out += ".";
  }
  return out + " `lora_trainer plan` itemizes the plan (docs/memory.md).";
}

}  // namespace lt
