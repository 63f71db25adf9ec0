// The launch of NF4's CUDA dequantization kernel (nf4_cuda_kernels.cuh), for kernels/nf4.cpp. Built
// only in a CUDA build with a CUDA compiler (LT_WITH_CUDA_KERNELS); no LibTorch and no CUDA types
// here, so nf4.cpp, a plain C++ file, calls it with the tensors' pointers and stream.
#pragma once

#include <cstdint>

namespace lt::nf4_cuda {

// out[e] (bf16 bits) for e < n from a double-quantized NF4 storage (kernels/nf4.hpp's layout), every
// pointer on the device: the codes, the absmax codes and scales, the dynamic map (256) and the NF4
// values (16) as f32, the absmax offset (one f32). `stream` is a cudaStream_t. Returns nullptr, or
// the CUDA error's text.
const char* dequantize_bf16(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales,
                            const float* dynamic_map, const float* nf4_values, const float* absmax_offset, int64_t n,
                            uint16_t* out, void* stream);

}  // namespace lt::nf4_cuda
