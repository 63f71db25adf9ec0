#include "lora_trainer/core/runtime.hpp"

#include <dlfcn.h>
#include <malloc.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/options.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"
#include "lora_trainer/kernels/cross_entropy.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/util.hpp"

#ifdef LT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace lt {

// An enum key: its names in the enum's order, its check, and the setter of its field.
template <class E>
static auto enum_option(const std::string& key, std::vector<std::string> names, E RuntimeOptions::*field) {
  return [key, names, field](RuntimeOptions& o, const json& v) { o.*field = enum_named<E>(names, v.get<std::string>(), key); };
}

static const OptionGroup<RuntimeOptions>& runtime_options() {
  using O = RuntimeOptions;
  static const std::vector<std::string> devices = {"auto", "cpu", "cuda"}, precisions = {"auto", "bf16", "f32"},
                                        attentions = {"auto", "fused", "manual"}, losses = {"auto", "fused", "chunked", "libtorch"},
                                        matmuls = {"auto", "onednn", "libtorch"};
  static const auto g =
      OptionGroup<O>()
          .add("runtime/device", OptType::String, "auto", "cpu, cuda, or auto (cuda when available)",
               enum_option("runtime/device", devices, &O::device), check_one_of(devices))
          .add("runtime/precision", OptType::String, "auto",
               "bf16 (f32 weights, bf16 autocast), f32, or auto (bf16 where the device has fast bf16)",
               enum_option("runtime/precision", precisions, &O::precision), check_one_of(precisions))
          .add("runtime/attention", OptType::String, "auto",
               "fused (scaled_dot_product_attention: flash/efficient kernels on CUDA; LibTorch 2.0+), manual "
               "(masked softmax in f32), or auto (fused on CUDA where LibTorch has it, manual on the CPU, where the fused "
               "kernel measured slower)",
               enum_option("runtime/attention", attentions, &O::attention), check_one_of(attentions))
          .add("runtime/loss", OptType::String, "auto",
               "the loss's kernels: fused (this project's: reads the logits once, writes their gradient over them, no "
               "f32 copy; on the CPU, and on CUDA in a build with the CUDA kernels), chunked (fused, and a head that "
               "takes no gradient, as the LoRA phase's frozen head and every validation, computes its loss over blocks "
               "of 4,096 columns of the vocabulary: the logits never whole), libtorch (log_softmax + nll_loss over an "
               "f32 copy of the logits), or auto (chunked on the CPU; fused on CUDA in a build with the kernels, else "
               "libtorch)",
               enum_option("runtime/loss", losses, &O::loss), check_one_of(losses))
          .add("runtime/matmul", OptType::String, "auto",
               "the f32 products of linear layers on the CPU (forward and the input's gradient): onednn (oneDNN's "
               "sgemm, the bench model's steps 8% faster than with OpenBLAS's on an AVX-512 CPU; needs a build that found "
               "libdnnl-dev), "
               "libtorch (LibTorch's mm: OpenBLAS), or auto (onednn where this build has it and the CPU has AVX-512; "
               "libtorch on a CPU with AVX2 only, where oneDNN's ran a 1B Llama's products at 0.34-1.11x OpenBLAS's speed). "
               "bf16 products and CUDA are LibTorch's either way",
               enum_option("runtime/matmul", matmuls, &O::matmul), check_one_of(matmuls))
          .add("runtime/threads", OptType::Int, 0,
               "CPU threads for torch; 0 = every core (shared among the ranks of this machine)", &O::threads,
               check_range(0, 4096));
  return g;
}

void add_runtime_options(ConfigSchema& s) { runtime_options().declare(s); }

RuntimeOptions RuntimeOptions::from_config(const Config& cfg) { return runtime_options().read(cfg); }

// oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA before oneDNN 2.0: e.g. AVX2 or AVX512_CORE,
// to run the kernels of another CPU; docs/platforms.md), upper-case; "" without one.
static std::string onednn_isa_cap() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (!cap || !*cap) cap = std::getenv("DNNL_MAX_CPU_ISA");
  std::string isa(cap ? cap : "");
  for (char& c : isa) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return isa;
}

// Whether oneDNN, which runs LibTorch's bf16 products on the CPU, has been capped below its bf16 kernels:
// then bf16 products are as slow as on a CPU without them.
static bool onednn_capped_below_bf16() {
  const std::string isa = onednn_isa_cap();
  return !isa.empty() && isa != "ALL" && isa.find("BF16") == std::string::npos && isa.find("AMX") == std::string::npos &&
         isa.find("AVX10") == std::string::npos;
}

// Whether the cap is below oneDNN's first ISA with bf16 products (AVX512_CORE, which emulates them).
static bool onednn_capped_below_avx512() {
  const std::string isa = onednn_isa_cap();
  return (isa.rfind("SSE", 0) == 0 || isa.rfind("AVX", 0) == 0) && isa.rfind("AVX512", 0) != 0 && isa.rfind("AVX10", 0) != 0;
}

void follow_onednn_isa_cap() {
  if (onednn_capped_below_avx512()) at::globalContext().setUserEnabledMkldnn(false);
}

bool cpu_has_fast_bf16() {
  if (onednn_capped_below_bf16()) return false;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0)
      return line.find(" amx_bf16") != std::string::npos || line.find(" avx512_bf16") != std::string::npos;
  }
  return false;
}

// OpenBLAS's threading: 0 sequential, 1 its own pthreads, 2 OpenMP (openblas_get_parallel); -1 when
// the BLAS is not OpenBLAS.
static int openblas_threading() {
  using GetParallel = int (*)();
  auto fn = reinterpret_cast<GetParallel>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  return fn ? fn() : -1;
}

BlasPacking blas_packing(int threads) {
  BlasPacking b;
  b.threads = std::max(1, threads);
  using CoreName = char* (*)();
  using NumThreads = int (*)();
  auto fn = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* core = fn ? fn() : nullptr;
  if (!core) return b;
  // OpenBLAS's OpenMP build follows OpenMP's thread count at each call, unless it started with one.
  if (auto n = reinterpret_cast<NumThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads")); n && n() == 1) b.threads = 1;
  const std::string name = core;
  if (name == "Haswell" || name == "Zen" || name == "Cooperlake") b.depth = 320;
  else if (name == "Sandybridge") b.depth = 384;
  else if (name == "SkylakeX") b.depth = 448;
  return b;
}

// The f32 matmuls (phase 1 and the LoRA phase on a CPU without fast bf16) are OpenBLAS's. Its OpenMP
// build (libopenblas0-openmp, which scripts/setup.sh selects) runs on LibTorch's own OpenMP threads:
// nothing to do. Its pthreads build keeps a pool of its own beside them; the two pools spin while the
// other works, and with one thread per core each the step collapsed, so that build gets one thread, and
// the f32 products then use one core (measured: the OpenMP build's f32 step is 1.5-1.9x faster on 2 cores,
// docs/performance.md). Runtime::describe() says so.
static void limit_blas_threads() {
  if (openblas_threading() == 2) return;
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(1);
}

// glibc serves allocations above 32 MiB with mmap and returns them with munmap, and trims the heap
// top after every large free. A step allocates and frees logits of B*T*V values (tens of MiB) many
// times, so each step faulted in fresh zeroed pages: measured here, over half the wall time went to
// the kernel. Keeping freed memory in the heap removes that (see docs/performance.md).
static void keep_freed_memory() {
  static bool done = false;
  if (done) return;
  done = true;
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

void return_freed_tensors() { mallopt(M_MMAP_THRESHOLD, 1 << 20); }

void release_freed_memory() { malloc_trim(0); }

MappedLargeAllocations::MappedLargeAllocations() { mallopt(M_MMAP_THRESHOLD, 1 << 20); }

MappedLargeAllocations::~MappedLargeAllocations() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);  // keep_freed_memory's
  malloc_trim(0);
}

Runtime Runtime::from_config(const Config& cfg) {
  keep_freed_memory();
  follow_onednn_isa_cap();
  Runtime rt;
  const RuntimeOptions o = RuntimeOptions::from_config(cfg);
  using Device = RuntimeOptions::Device;
  bool cuda = torch::cuda::is_available();
  if (o.device == Device::Cuda && !cuda)
    throw UserError("runtime/device=cuda, but no CUDA device is available to this build; use runtime/device=cpu");
  // A rank started by `run --nproc` or torchrun uses the GPU of its LOCAL_RANK.
  const int local_rank = env_int("LOCAL_RANK", 0);
  const int local_ranks = std::max(1, env_int("LOCAL_WORLD_SIZE", 1));
  rt.device = (o.device == Device::Cuda || (o.device == Device::Auto && cuda))
                  ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % std::max<int64_t>(1, torch::cuda::device_count())))
                  : torch::Device(torch::kCPU);
  if (rt.device.is_cuda() && o.loss == RuntimeOptions::Loss::Fused && !cuda_loss_kernels_built())
    throw UserError("runtime/loss=fused on CUDA needs the CUDA kernels, which this build does not have (CMake found no "
                    "CUDA compiler, nvcc, when it was configured); use runtime/loss=auto or libtorch, or rebuild with "
                    "nvcc on PATH (docs/performance.md)");
  if (o.precision == RuntimeOptions::Precision::Auto) rt.bf16_autocast = rt.device.is_cuda() || cpu_has_fast_bf16();
  else rt.bf16_autocast = o.precision == RuntimeOptions::Precision::Bf16;
  const int64_t threads = o.threads;
  // 0: the cores are shared among the ranks on this machine.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  rt.threads = threads > 0 ? static_cast<int>(threads) : std::max(1, cores / local_ranks);
  at::set_num_threads(rt.threads);
  limit_blas_threads();
  if (o.matmul == RuntimeOptions::Matmul::OneDnn && !onednn_available())
    throw UserError("runtime/matmul=onednn, but this build has no oneDNN (CMake found no libdnnl-dev when it was "
                    "configured); use runtime/matmul=auto or libtorch, or install libdnnl-dev and build again");
  // The f32 CPU products of linear layers (kernels/cpu_gemm.hpp): oneDNN's where chosen, or under auto where
  // this build has it and the CPU has AVX-512. On the AVX2-only Zen 1 (docs/performance.md, "oneDNN's sgemm")
  // oneDNN's sgemm ran a 1B Llama's products at 256 rows at 0.34-1.11x OpenBLAS's speed (x's gradient
  // through down_proj 292 ms against 100), its LoRA step 7.3 s against 5.8.
  const bool onednn = o.matmul == RuntimeOptions::Matmul::OneDnn ||
                      (o.matmul == RuntimeOptions::Matmul::Auto && onednn_available() && __builtin_cpu_supports("avx512f"));
  // Attention's many small products (cpu_sgemm) under auto: oneDNN's wherever the build has it. On the Zen 1
  // the GPT bench layer's causal attention (build/attention_bench) took 18.2 ms with them against 27.5.
  const bool onednn_small = o.matmul == RuntimeOptions::Matmul::OneDnn || (o.matmul == RuntimeOptions::Matmul::Auto && onednn_available());
  set_cpu_matmul(onednn ? CpuMatmul::OneDnn : CpuMatmul::LibTorch, onednn_small ? CpuMatmul::OneDnn : CpuMatmul::LibTorch);
  return rt;
}

std::string Runtime::describe() const {
  std::string s = std::string(device.is_cuda() ? "cuda" : "cpu") + ", " + std::to_string(threads) + " threads, " +
                  (bf16_autocast ? "bf16 autocast" : "f32");
  if (!device.is_cuda() && !bf16_autocast) {
    s += cpu_matmul() == CpuMatmul::OneDnn ? ", oneDNN products" : ", LibTorch products";
    if (cpu_small_matmul() != cpu_matmul()) s += cpu_small_matmul() == CpuMatmul::OneDnn ? " (attention's oneDNN)" : " (attention's LibTorch)";
  }
  if (!device.is_cuda() && !bf16_autocast && threads > 1 && openblas_threading() == 1)
    s += " (OpenBLAS's pthreads build: its f32 products on one core; scripts/setup.sh selects its OpenMP build, "
         "libopenblas0-openmp, which uses them all)";
  return s;
}

torch::Tensor Runtime::to_device(const torch::Tensor& host) const {
  if (!device.is_cuda()) return host.to(device);
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

void Runtime::synchronize() const {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

int64_t Runtime::device_memory() const {
#ifdef LT_WITH_CUDA
  if (!device.is_cuda()) return 0;
  return static_cast<int64_t>(at::cuda::getDeviceProperties(device.index() < 0 ? c10::DeviceIndex(0) : device.index())->totalGlobalMem);
#else
  return 0;
#endif
}

int64_t Runtime::device_peak_bytes() const {
#ifdef LT_WITH_CUDA
  if (!device.is_cuda()) return 0;
  const auto index = device.index() < 0 ? c10::DeviceIndex(0) : device.index();
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak;
#else
  return 0;
#endif
}

void Runtime::reset_device_peak() const {
#ifdef LT_WITH_CUDA
  if (!device.is_cuda()) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? c10::DeviceIndex(0) : device.index());
#endif
}

AutocastGuard::AutocastGuard(const Runtime& rt) : active_(rt.bf16_autocast), cuda_(rt.device.is_cuda()) {
  if (!active_) return;
  const auto type = cuda_ ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  prev_enabled_ = compat::autocast_enabled(type);
  compat::set_autocast_enabled(type, true);
  compat::set_autocast_dtype(type, at::kBFloat16);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(cuda_ ? c10::DeviceType::CUDA : c10::DeviceType::CPU, prev_enabled_);
}

torch::Tensor rng_state(const Runtime& rt) { return rng_state(rt.device); }

void set_rng_state(const Runtime& rt, const torch::Tensor& state) { set_rng_state(rt.device, state); }

torch::Tensor rng_state(const torch::Device& device) {
  auto cpu = at::detail::getDefaultCPUGenerator().get_state();
  if (!device.is_cuda()) return cpu;
#ifdef LT_WITH_CUDA
  auto gpu = at::cuda::detail::getDefaultCUDAGenerator(device.index()).get_state();
  return torch::cat({cpu, gpu});
#else
  return cpu;
#endif
}

void set_rng_state(const torch::Device& device, const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  int64_t cpu_size = gen.get_state().numel();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state.slice(0, 0, cpu_size).contiguous());
#ifdef LT_WITH_CUDA
  if (device.is_cuda() && state.numel() > cpu_size) {
    auto cuda_gen = at::cuda::detail::getDefaultCUDAGenerator(device.index());  // a handle; the generator is shared
    std::lock_guard<std::mutex> cuda_lock(cuda_gen.mutex());
    cuda_gen.set_state(state.slice(0, cpu_size).contiguous());
  }
#endif
}

}  // namespace lt
