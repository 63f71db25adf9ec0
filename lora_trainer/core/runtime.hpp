// The execution environment of a job: device, thread count, precision (bf16 autocast or f32), and the
// random-generator state that a checkpoint must carry for an exact resume.
#pragma once

#include <string>

#include <torch/torch.h>

namespace lt {

class Config;
class ConfigSchema;

// The runtime's keys (runtime/*), each declared once bound to its field (runtime.cpp's OptionGroup):
// add_runtime_options adds them to a schema, from_config reads them. The model reads its two
// (attention, loss) through ModelOptions.
struct RuntimeOptions {
  enum class Device { Auto, Cpu, Cuda } device = Device::Auto;           // runtime/device
  enum class Precision { Auto, Bf16, F32 } precision = Precision::Auto;  // runtime/precision
  enum class Attention { Auto, Fused, Manual } attention = Attention::Auto;  // runtime/attention
  enum class Loss { Auto, Fused, Chunked, LibTorch } loss = Loss::Auto;  // runtime/loss
  enum class Matmul { Auto, OneDnn, LibTorch } matmul = Matmul::Auto;     // runtime/matmul
  int64_t threads = 0;  // runtime/threads: 0 = every core (shared among this machine's ranks)
  static RuntimeOptions from_config(const Config& cfg);
};

struct Runtime {
  torch::Device device = torch::kCPU;
  bool bf16_autocast = false;
  int threads = 1;
  // The device, precision and threads runtime/* chooses (RuntimeOptions), and the process's
  // allocator and BLAS threads set for training.
  static Runtime from_config(const Config& cfg);
  std::string describe() const;
  // A host tensor (a batch) on this device. To CUDA through pinned memory without waiting: a plain
  // copy from pageable memory would hold the host until the GPU had caught up.
  torch::Tensor to_device(const torch::Tensor& host) const;
  // Waits for the device's queued work (a no-op on the CPU); timings need it on CUDA.
  void synchronize() const;
  // The most device memory LibTorch's caching allocator has handed out since the process began or
  // the last reset_device_peak (0 on the CPU): the tensors' bytes, not the allocator's reserve.
  int64_t device_peak_bytes() const;
  // The device's memory in all (a GPU's; 0 on the CPU).
  int64_t device_memory() const;
  void reset_device_peak() const;
};

void add_runtime_options(ConfigSchema& s);

// For a command that streams a model tensor by tensor (import-hf, export): allocations of 1 MiB and
// more come from mmap and go back to the system when freed. glibc's default raises its mmap threshold
// as large blocks are freed, after which freed tensors stay in a fragmented heap: an import of a 2.2 GB
// model peaked at 1.95 GB instead of about its largest tensor. Training keeps freed memory instead
// (Runtime::from_config; docs/performance.md, "The allocator").
void return_freed_tensors();
// Hands the freed pages inside the heap back to the system (malloc_trim): after a large structure was
// freed for good (a model's whole parameters once they are sharded), so the peak resident memory is the
// state's, not the state's plus what it was built from.
void release_freed_memory();
// For a scope that allocates and frees large buffers among other allocations (a sharded save gathers a
// block at a time while HDF5 allocates its own): glibc maps and unmaps each large allocation there
// instead of keeping freed ones in a heap that the others fragment; the step's setting comes back after.
class MappedLargeAllocations {
 public:
  MappedLargeAllocations();
  ~MappedLargeAllocations();
  MappedLargeAllocations(const MappedLargeAllocations&) = delete;
  MappedLargeAllocations& operator=(const MappedLargeAllocations&) = delete;
};

// What the BLAS under LibTorch's f32 products on the CPU keeps of them (OpenBLAS: the one Debian's LibTorch
// links). Its multi-threaded sgemm packs a block of up to `depth` values of the inner dimension by the
// output's columns, each thread its share of the columns into its own buffer of `buffer` bytes, which the
// library keeps for the life of the process: a weight gradient g^T x (the inner dimension the tokens)
// leaves 4 x min(tokens, depth) x the weight's rows, at most `buffer` a thread. depth by OpenBLAS's kernel
// (openblas_get_corename, measured with 0.3.21): 320 (Haswell, Zen, Cooperlake), 384 (Sandybridge),
// 448 (SkylakeX), else 512; 512 where the BLAS is not OpenBLAS (its own buffers are not known: the plan
// errs up). `threads`: the threads its products run on, the process's (`threads`, runtime/threads) unless
// the library was started with one (OPENBLAS_NUM_THREADS=1 or OMP_NUM_THREADS=1; its pthreads build here).
struct BlasPacking {
  int64_t depth = 512;
  int64_t buffer = int64_t{128} << 20;
  int threads = 1;
};
BlasPacking blas_packing(int threads);

// LibTorch sends bf16 products on the CPU to oneDNN by its own look at the CPU (AVX-512), also where
// ONEDNN_MAX_CPU_ISA caps oneDNN below every bf16 kernel (AVX2, SSE41: to run another CPU's kernels,
// docs/platforms.md), and oneDNN then refuses them ("could not create a primitive descriptor
// iterator"). Under such a cap this leaves them to LibTorch's own kernels, as on a CPU without AVX-512.
// Runtime::from_config calls it; so does the test binary, before any test.
void follow_onednn_isa_cap();

// True when this CPU has native bf16 matrix instructions (AMX-BF16 or AVX512-BF16) and oneDNN is not
// capped below them (ONEDNN_MAX_CPU_ISA=AVX2, say, runs the products as a CPU without them would).
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
