#include "lora_trainer/core/checksum.hpp"

#include <zlib.h>

#include <algorithm>
#include <vector>

#include <ATen/Parallel.h>

namespace lt {

uint32_t bytes_crc32(const void* data, size_t n) {
  const auto* bytes = static_cast<const Bytef*>(data);
  constexpr int64_t kPiece = int64_t(16) << 20;  // bytes a thread takes at a time
  const int64_t pieces = (static_cast<int64_t>(n) + kPiece - 1) / kPiece;
  if (pieces <= 1) return static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0), bytes, n));
  // Each piece's CRC over the threads, then joined in order (crc32_combine): zlib's value for the whole.
  std::vector<uLong> crcs(static_cast<size_t>(pieces));
  at::parallel_for(0, pieces, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const size_t first = static_cast<size_t>(i * kPiece), len = std::min(n - first, static_cast<size_t>(kPiece));
      crcs[static_cast<size_t>(i)] = crc32_z(crc32_z(0L, Z_NULL, 0), bytes + first, len);
    }
  });
  uLong crc = crcs[0];
  for (int64_t i = 1; i < pieces; ++i) {
    const size_t first = static_cast<size_t>(i * kPiece), len = std::min(n - first, static_cast<size_t>(kPiece));
    crc = crc32_combine(crc, crcs[static_cast<size_t>(i)], static_cast<z_off_t>(len));
  }
  return static_cast<uint32_t>(crc);
}

uint32_t tensor_crc32(const torch::Tensor& t) {
  return t.numel() > 0 ? bytes_crc32(t.data_ptr(), static_cast<size_t>(t.numel() * t.element_size())) : 0;
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
