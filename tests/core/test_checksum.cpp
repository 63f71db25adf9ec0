// The CRC-32 of checkpoints' tensors and of a frozen base's digest: computed over the threads in pieces
// joined by crc32_combine, it must be zlib's one-pass value for every length and thread count, or every
// checkpoint written before would read as damaged and every recorded base digest as another base.
#include <zlib.h>

#include <random>
#include <vector>

#include <ATen/Parallel.h>

#include "catch.hpp"
#include "lora_trainer/core/checksum.hpp"

TEST_CASE("checksum: the CRC-32 over the threads is zlib's one pass, for every length and thread count", "[checksum]") {
  constexpr size_t kPiece = size_t(16) << 20;
  std::vector<unsigned char> bytes(3 * kPiece + 12345);
  std::mt19937_64 rng(7);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  const int threads = at::get_num_threads();
  for (int t : {1, 2, 3}) {
    at::set_num_threads(t);
    for (size_t n : {size_t(0), size_t(1), size_t(1000), kPiece - 1, kPiece, kPiece + 1, 2 * kPiece + 7, bytes.size()}) {
      INFO(t << " threads, " << n << " bytes");
      const uint32_t zlib_value = static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0), bytes.data(), n));
      CHECK(lt::bytes_crc32(bytes.data(), n) == zlib_value);
    }
  }
  at::set_num_threads(threads);
  // A tensor's, and a float32 tensor's as bf16 (converted a slice at a time, the CRC continued).
  const torch::Tensor w = torch::randn({1 << 12, 1 << 11}, torch::kFloat32);
  const torch::Tensor b = w.to(torch::kBFloat16).contiguous();
  const uint32_t direct = static_cast<uint32_t>(crc32_z(0L, static_cast<const Bytef*>(b.data_ptr()), b.numel() * 2));
  CHECK(lt::tensor_crc32(b) == direct);
  CHECK(lt::bf16_crc32(w) == direct);
}
