#include "lora_trainer/core/checksum.hpp"

#include <zlib.h>

namespace lt {

uint32_t tensor_crc32(const torch::Tensor& t) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  if (t.numel() > 0)
    crc = crc32_z(crc, static_cast<const Bytef*>(t.data_ptr()), static_cast<z_size_t>(t.numel() * t.element_size()));
  return static_cast<uint32_t>(crc);
}

uint32_t bf16_crc32(const torch::Tensor& t) {
  return tensor_crc32(t.detach().to(torch::kCPU, torch::kBFloat16).contiguous());
}

}  // namespace lt
