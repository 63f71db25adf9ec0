// The NF4 dequantization kernel for a CUDA build (kernels/nf4.hpp's layout), nothing but CUDA C++, so
// that tests/kernels/cuda_on_cpu/ runs it on the CPU as well. Launched by nf4_cuda.cu for every product
// of a layer whose frozen base is NF4 on the GPU (peft/frozen_weight.hpp).
#pragma once

#include <stdint.h>

namespace lt::nf4_cuda {

inline constexpr unsigned kThreads = 256;  // threads a block; each writes the two values of one byte

// out[e] = bf16(NF4[code of e] * absmax of e's block) for e < n, computed in f32 as dequantize_nf4
// computes it: the absmax of block b (64 values) is dynamic_map[absmax_codes[b]] * absmax_scales[b / 256]
// + *absmax_offset (read on the device: no copy to the host), each product and sum rounded on its own (__fmul_rn, __fadd_rn: no fused multiply-add),
// so the bits are the CPU's. Codes: two a byte, element 2i in the high nibble of byte i.
// Grid: ceil(ceil(n / 2) / kThreads) blocks of kThreads.
__global__ void __launch_bounds__(kThreads)
    dequantize_bf16_kernel(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales, const float* dynamic_map,
                           const float* nf4_values, const float* absmax_offset, int64_t n, __nv_bfloat16* out) {
  const int64_t byte = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t e = 2 * byte;
  if (e >= n) return;
  const int64_t block = e / 64;
  const float absmax = __fadd_rn(__fmul_rn(dynamic_map[absmax_codes[block]], absmax_scales[block / 256]), *absmax_offset);
  const unsigned c = codes[byte];
  out[e] = __float2bfloat16_rn(__fmul_rn(nf4_values[c >> 4], absmax));
  if (e + 1 < n) out[e + 1] = __float2bfloat16_rn(__fmul_rn(nf4_values[c & 15u], absmax));
}

}  // namespace lt::nf4_cuda
