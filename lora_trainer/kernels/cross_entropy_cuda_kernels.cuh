// The fused loss's CUDA kernels themselves (device code, and the launch's choice of variant),
// included by cross_entropy_cuda.cu, which launches them, and by tests/kernels/, which runs the same
// source on the CPU under an emulation of CUDA's threads (tests/kernels/cuda_on_cpu/cuda_on_cpu.hpp). So this file uses only what both
// provide: CUDA C++'s qualifiers, threadIdx/blockIdx, __syncthreads, __shfl_xor_sync, uint4 and the
// bf16 and float intrinsics named here; the includer supplies them (cuda_runtime.h and cuda_bf16.h,
// or the emulation).
//
// One thread block a row: the row's values are read as 16-byte vectors of eight bf16 where the row
// starts aligned and its length is a multiple of eight (the padded head of layers.cpp makes it so),
// else one at a time.
#pragma once

#include <cmath>
#include <cstdint>

namespace lt::cuda_kernels {

// Internal linkage: the CPU tests' instantiations and nvcc's host stubs share these names.
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;  // bf16 values in one 16-byte load

__device__ __forceinline__ float bf16_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ uint32_t float_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// The eight bf16 of a 16-byte vector (little-endian: the lower half of each word comes first).
__device__ __forceinline__ void unpack(const uint4& u, float* v) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = bf16_to_float(w[k] & 0xFFFFu);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 pack(const float* v) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = float_to_bf16(v[2 * k]) | (float_to_bf16(v[2 * k + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A running log-sum-exp: the largest value m seen and s = sum exp(x - m) (s = 0 while m = -inf, i.e.
// while every value seen was -inf, as the padded head's extra columns are). `bad` records NaN or
// +inf, which make the row's result NaN.
struct LogSumExp {
  float m = -INFINITY;
  float s = 0.0f;
  bool bad = false;

  template <int n>
  __device__ __forceinline__ void add(const float* v) {
    float top = m;
#pragma unroll
    for (int k = 0; k < n; ++k) {
      bad |= isnan(v[k]) || v[k] == INFINITY;
      top = fmaxf(top, v[k]);
    }
    if (top == -INFINITY) return;
    s = m == -INFINITY ? 0.0f : s * expf(m - top);
    m = top;
#pragma unroll
    for (int k = 0; k < n; ++k) s += expf(v[k] - m);
  }

  __device__ __forceinline__ void merge(float m2, float s2, bool bad2) {
    bad |= bad2;
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return;
    s = (m == -INFINITY ? 0.0f : s * expf(m - top)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - top));
    m = top;
  }

  __device__ __forceinline__ void merge_warp() {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, offset);
      const float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, offset);
      const int bad2 = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(bad), offset);
      merge(m2, s2, bad2 != 0);
    }
  }

  // The whole block's, in thread 0.
  __device__ void merge_block() {
    __shared__ float ms[kWarps], ss[kWarps];
    __shared__ int bads[kWarps];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    merge_warp();
    if (lane == 0) {
      ms[warp] = m;
      ss[warp] = s;
      bads[warp] = bad;
    }
    __syncthreads();
    if (warp == 0) {
      m = lane < kWarps ? ms[lane] : -INFINITY;
      s = lane < kWarps ? ss[lane] : 0.0f;
      bad = lane < kWarps ? bads[lane] != 0 : false;
      merge_warp();
    }
  }

  __device__ float value() const { return bad ? NAN : m + logf(s); }
};

template <bool kVectors>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const uint16_t* __restrict__ logits, int64_t V, int64_t row_stride, const int64_t* __restrict__ targets,
                   float* __restrict__ lse, float* __restrict__ row_loss) {
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  if (t < 0) {  // a row that does not count: not read at all
    if (threadIdx.x == 0) lse[row] = row_loss[row] = 0.0f;
    return;
  }
  const uint16_t* x = logits + row * row_stride;
  LogSumExp acc;
  if (kVectors) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int64_t i = threadIdx.x; i < V / kVec; i += kThreads) {
      float v[kVec];
      unpack(xv[i], v);
      acc.add<kVec>(v);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      const float v = bf16_to_float(x[j]);
      acc.add<1>(&v);
    }
  }
  acc.merge_block();
  if (threadIdx.x == 0) {
    const float l = acc.value();
    lse[row] = l;
    row_loss[row] = t < V ? l - bf16_to_float(x[t]) : NAN;
  }
}

// `grad` may be `logits` itself (then row_stride == V): each thread reads the elements it writes, and
// nothing else of the row, before writing them, so the pointers to the two are not __restrict__.
template <bool kVectors>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const uint16_t* logits, int64_t V, int64_t row_stride, const int64_t* __restrict__ targets,
                    const float* __restrict__ lse, const float* __restrict__ g_ptr, uint16_t* grad) {
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  uint16_t* out = grad + row * V;
  if (t < 0) {
    if (kVectors) {
      for (int64_t i = threadIdx.x; i < V / kVec; i += kThreads) reinterpret_cast<uint4*>(out)[i] = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t j = threadIdx.x; j < V; j += kThreads) out[j] = 0;
    }
    return;
  }
  const uint16_t* x = logits + row * row_stride;
  const float g = *g_ptr, l = lse[row];
  if (kVectors) {
    for (int64_t i = threadIdx.x; i < V / kVec; i += kThreads) {
      float v[kVec];
      unpack(reinterpret_cast<const uint4*>(x)[i], v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float p = expf(v[k] - l);
        v[k] = g * (i * kVec + k == t ? p - 1.0f : p);
      }
      reinterpret_cast<uint4*>(out)[i] = pack(v);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      const float p = expf(bf16_to_float(x[j]) - l);
      out[j] = static_cast<uint16_t>(float_to_bf16(g * (j == t ? p - 1.0f : p)));
    }
  }
}

// Whether a launch may use the 16-byte vector kernels: the length and the stride a multiple of eight
// bf16 and the rows' start aligned to 16 bytes (for the backward, the gradient's too).
inline bool vectors_fit(int64_t V, int64_t row_stride, const void* logits, const void* grad = nullptr) {
  auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return V % kVec == 0 && row_stride % kVec == 0 && aligned16(logits) && (grad == nullptr || aligned16(grad));
}

}  // namespace

}  // namespace lt::cuda_kernels
