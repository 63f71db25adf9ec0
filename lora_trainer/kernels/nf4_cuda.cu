// The launch of NF4's dequantization kernel (nf4_cuda.hpp says what it computes; the kernel is in
// nf4_cuda_kernels.cuh, which tests/kernels/ also runs on the CPU).
#include "lora_trainer/kernels/nf4_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "lora_trainer/kernels/nf4_cuda_kernels.cuh"

namespace lt::nf4_cuda {

const char* dequantize_bf16(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales,
                            const float* dynamic_map, const float* nf4_values, const float* absmax_offset, int64_t n,
                            uint16_t* out, void* stream) {
  if (n == 0) return nullptr;
  const int64_t bytes = (n + 1) / 2, grid = (bytes + kThreads - 1) / kThreads;
  if (grid > 0x7fffffff) return "more values than one kernel launch takes";
  dequantize_bf16_kernel<<<static_cast<unsigned>(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      codes, absmax_codes, absmax_scales, dynamic_map, nf4_values, absmax_offset, n, reinterpret_cast<__nv_bfloat16*>(out));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lt::nf4_cuda
