// The NF4 dequantization kernel (lora_trainer/kernels/nf4_cuda_kernels.cuh) run from its own source on
// the CPU under cuda_on_cpu.hpp: each value against a plain per-element computation of the layout (high
// nibble first, 64 values an absmax, 256 absmax values a scale), for counts that end mid-byte, mid-block
// and mid-scale. No LibTorch here: the values tests/kernels/test_nf4.cpp checks against bitsandbytes are
// the inputs' meaning, not this test's.
#include "catch.hpp"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda_on_cpu/cuda_on_cpu.hpp"
#include "lora_trainer/kernels/nf4_cuda_kernels.cuh"
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__

namespace {

// bitsandbytes' NF4 values (as lora_trainer/kernels/nf4.cpp holds them).
const float kNf4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
                        -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
                        0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                        0.7229568362236023f, 1.0f};

}  // namespace

TEST_CASE("NF4 dequantization kernel on the CPU: every value where the layout puts it, rounded once to bf16", "[kernels][nf4]") {
  std::mt19937 rng(5);
  std::vector<float> map(256);
  for (int k = 0; k < 256; ++k) map[k] = -1.0f + 2.0f * static_cast<float>(k) / 255.0f;  // any map: the kernel reads it
  for (int64_t n : {int64_t(1), int64_t(2), int64_t(63), int64_t(64), int64_t(65), int64_t(129), int64_t(64 * 256 + 3),
                    int64_t(64 * 300 + 64)}) {
    INFO(n << " values");
    const int64_t bytes = (n + 1) / 2, blocks = (n + 63) / 64, scales = (blocks + 255) / 256;
    std::vector<uint8_t> codes(static_cast<size_t>(bytes)), absmax_codes(static_cast<size_t>(blocks));
    std::vector<float> absmax_scales(static_cast<size_t>(scales));
    for (auto& c : codes) c = static_cast<uint8_t>(rng() & 0xFF);
    for (auto& c : absmax_codes) c = static_cast<uint8_t>(rng() & 0xFF);
    for (auto& s : absmax_scales) s = 0.01f + static_cast<float>(rng() % 1000) / 997.0f;
    const float offset = 0.0371f;
    std::vector<__nv_bfloat16> out(static_cast<size_t>(n) + 1, __nv_bfloat16{0xABCD});  // one past the end stays
    const unsigned grid = static_cast<unsigned>((bytes + lt::nf4_cuda::kThreads - 1) / lt::nf4_cuda::kThreads);
    cuda_on_cpu::launch(grid, lt::nf4_cuda::kThreads, lt::nf4_cuda::dequantize_bf16_kernel, codes.data(), absmax_codes.data(),
                        absmax_scales.data(), map.data(), kNf4, &offset, n, out.data());
    int wrong = 0;
    for (int64_t e = 0; e < n; ++e) {
      const uint8_t byte = codes[static_cast<size_t>(e / 2)];
      const int code = e % 2 == 0 ? byte >> 4 : byte & 15;
      const int64_t block = e / 64;
      volatile float scaled = map[absmax_codes[static_cast<size_t>(block)]] * absmax_scales[static_cast<size_t>(block / 256)];
      const float absmax = scaled + offset;
      wrong += out[static_cast<size_t>(e)].bits != __float2bfloat16_rn(kNf4[code] * absmax).bits;
    }
    CHECK(wrong == 0);
    CHECK(out[static_cast<size_t>(n)].bits == 0xABCD);
  }
}
