// CRC-32 (zlib's) of a tensor's bytes: the per-tensor checksums of checkpoints (state_h5) and the
// digest of a frozen base (frozen_base.hpp), which is over bf16 values whatever the tensor's dtype.
#pragma once

#include <cstddef>
#include <cstdint>

#include <torch/torch.h>

namespace lt {

// Of `n` bytes: zlib's crc32, computed over the threads in 16 MiB pieces joined by crc32_combine
// (the same value as one pass).
uint32_t bytes_crc32(const void* data, size_t n);
// Of a contiguous CPU tensor's bytes as they are.
uint32_t tensor_crc32(const torch::Tensor& t);
// Of the tensor's values as bf16, in row-major order (any dtype and device: a CPU bf16 tensor as it is,
// any other copied to the CPU as bf16 a slice of 2^20 values at a time).
uint32_t bf16_crc32(const torch::Tensor& t);

}  // namespace lt
