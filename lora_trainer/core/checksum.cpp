#include "lora_trainer/core/checksum.hpp"

#include <zlib.h>

#include <algorithm>

namespace lt {

uint32_t tensor_crc32(const torch::Tensor& t) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  if (t.numel() > 0)
    crc = crc32_z(crc, static_cast<const Bytef*>(t.data_ptr()), static_cast<z_size_t>(t.numel() * t.element_size()));
  return static_cast<uint32_t>(crc);
}

uint32_t bf16_crc32(const torch::Tensor& t) {
  const torch::Tensor flat = t.detach().reshape({-1});
  if (flat.is_cpu() && flat.scalar_type() == torch::kBFloat16 && flat.is_contiguous()) return tensor_crc32(flat);
  // Another dtype or device: copied as bf16 a slice at a time (the CRC continues over them), never whole.
  constexpr int64_t kSlice = int64_t(1) << 20;
  uLong crc = crc32_z(0L, Z_NULL, 0);
  for (int64_t first = 0; first < flat.numel(); first += kSlice) {
    const torch::Tensor part = flat.slice(0, first, std::min(flat.numel(), first + kSlice)).to(torch::kCPU, torch::kBFloat16).contiguous();
    crc = crc32_z(crc, static_cast<const Bytef*>(part.data_ptr()), static_cast<z_size_t>(part.numel() * 2));
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace lt
