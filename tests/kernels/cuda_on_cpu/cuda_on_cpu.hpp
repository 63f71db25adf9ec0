// CUDA's thread model on the CPU, enough to run lora_trainer's own kernels (*.cuh under lora_trainer/)
// from their source where there is no GPU: what the device tests cannot check on a machine without
// one (their indexing, reductions, -inf/NaN handling and bf16 rounding) these tests check everywhere.
//
// A launch starts blockDim real threads (std::thread) that run its blocks one after another, so
// __syncthreads and the warp shuffles are real barriers between real threads and a block's
// __shared__ arrays (function-local statics here) are shared by exactly that block. Not emulated,
// and so not checked here: timing, the memory model between blocks, occupancy, and anything a kernel
// does that these kernels do not (atomics, dynamic shared memory, 2-D/3-D grids).
//
// Include it last (it defines CUDA's qualifiers as macros), then the kernel header, then
// #undef the five macros it defines.
#pragma once

#include <math.h>  // expf, logf, fmaxf, isnan, INFINITY and NAN at global scope, as device code has them

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct CudaOnCpuIndex {
  unsigned x = 0;
};
inline thread_local CudaOnCpuIndex threadIdx, blockIdx;

struct alignas(16) uint4 {  // CUDA's is 16-byte aligned too
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct __nv_bfloat16 {
  uint16_t bits;
};

// Round to nearest, ties to even, as cvt.rn.bf16.f32 does; NaN becomes 0x7FFF, as in cuda_bf16.h.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return {0x7FFF};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }

// A product or sum rounded on its own, never fused with the next operation (the volatile store keeps
// the compiler from contracting a * b + c into a multiply-add, as nvcc's __fmul_rn / __fadd_rn do).
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}

namespace cuda_on_cpu {

// A reusable barrier for a fixed number of threads (std::barrier is C++20).
class Barrier {
 public:
  explicit Barrier(unsigned n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const unsigned n_;
  unsigned arrived_ = 0;
  uint64_t generation_ = 0;
};

// The running launch's block: its barrier, and each warp's barrier and exchange slots.
struct Block {
  explicit Block(unsigned threads) : all(threads) {
    for (unsigned w = 0; w < threads / 32; ++w) warps.emplace_back(new Warp);
  }
  struct Warp {
    Barrier barrier{32};
    uint32_t slots[32] = {};
  };
  Barrier all;
  std::vector<std::unique_ptr<Warp>> warps;
};

inline Block*& current_block() {
  static Block* block = nullptr;
  return block;
}

// kernel<<<blocks, threads>>>(args...), synchronous. threads: a multiple of 32 (whole warps).
template <class Kernel, class... Args>
void launch(unsigned blocks, unsigned threads, Kernel kernel, Args... args) {
  if (threads == 0 || threads % 32 != 0 || threads > 1024)
    throw std::invalid_argument("cuda_on_cpu::launch: threads must be whole warps, at most 1024");
  Block block(threads);
  current_block() = &block;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx.x = t;
      for (unsigned b = 0; b < blocks; ++b) {
        blockIdx.x = b;
        kernel(args...);
        block.all.wait();  // the block ends for all its threads before the next one reuses __shared__
      }
    });
  for (auto& th : pool) th.join();
  current_block() = nullptr;
}

}  // namespace cuda_on_cpu

inline void __syncthreads() { cuda_on_cpu::current_block()->all.wait(); }

// Every lane of the warp must take part (the only use these kernels make of it).
template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) == 4, "__shfl_xor_sync: 32-bit values");
  if (mask != 0xFFFFFFFFu) throw std::logic_error("__shfl_xor_sync: only full-warp masks are emulated");
  auto& warp = *cuda_on_cpu::current_block()->warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  std::memcpy(&warp.slots[lane], &value, 4);
  warp.barrier.wait();  // every lane has written
  T out;
  std::memcpy(&out, &warp.slots[lane ^ static_cast<unsigned>(lane_mask)], 4);
  warp.barrier.wait();  // every lane has read before any writes again
  return out;
}
