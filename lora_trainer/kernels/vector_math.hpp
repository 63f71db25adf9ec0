// What the CPU kernels (cross_entropy.cpp, adamw.cpp, causal_softmax.cpp) share: a loop built for
// several vector widths and the choice among them, bf16 <-> f32 conversions, a tensor's elements as the
// kernels' element types, and e^x for x <= 0, written so that the compiler vectorises the loops that
// call them (those files are built with -O3, -fopenmp-simd and -fno-trapping-math: CMakeLists.txt).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

// Each kernel is written once, as an LT_VECTOR_KERNEL body (always inlined), and LT_VECTOR_DISPATCH(name)
// compiles it three times: for AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and the baseline, callable as
// name_dispatch(...). Which runs is chosen once per process (vec::isa()): the widest this CPU has, or a
// narrower one named by the environment variable LT_CPU_KERNELS (baseline, avx2, avx512), as
// ATEN_CPU_CAPABILITY does for LibTorch's kernels: the sums of a wider vector run in another order, so a
// test run under LT_CPU_KERNELS=avx2 or baseline sees the bits of a CPU it does not have.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LT_VECTOR_ISAS 1
#define LT_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define LT_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
// GCC's generic tuning never gathers; a kernel that looks values up in a table (an index per lane) is
// vectorised with gathers for AVX-512 tuned as for a CPU whose gathers are fast (AVX-512 CPUs' are).
#define LT_TARGET_AVX512_GATHERS __attribute__((target("arch=x86-64-v4,tune=skylake-avx512")))
#else
#define LT_VECTOR_ISAS 0
#define LT_TARGET_AVX512
#define LT_TARGET_AVX2
#define LT_TARGET_AVX512_GATHERS
#endif
#define LT_VECTOR_KERNEL __attribute__((always_inline)) inline

#define LT_VECTOR_DISPATCH(name) LT_VECTOR_DISPATCH_AS(name, LT_TARGET_AVX512)
// The same, its AVX-512 build gathering (LT_TARGET_AVX512_GATHERS).
#define LT_VECTOR_DISPATCH_GATHERS(name) LT_VECTOR_DISPATCH_AS(name, LT_TARGET_AVX512_GATHERS)
#define LT_VECTOR_DISPATCH_AS(name, avx512_target)                                                  \
  template <typename... Args>                                                                      \
  avx512_target auto name##_avx512(Args... args) {                                                 \
    return name(args...);                                                                          \
  }                                                                                                \
  template <typename... Args>                                                                      \
  LT_TARGET_AVX2 auto name##_avx2(Args... args) {                                                  \
    return name(args...);                                                                          \
  }                                                                                                \
  template <typename... Args>                                                                      \
  auto name##_baseline(Args... args) {                                                             \
    return name(args...);                                                                          \
  }                                                                                                \
  template <typename... Args>                                                                      \
  auto name##_dispatch(Args... args) {                                                             \
    switch (::lt::vec::isa()) {                                                                    \
      case ::lt::vec::Isa::Avx512: return name##_avx512(args...);                                  \
      case ::lt::vec::Isa::Avx2: return name##_avx2(args...);                                      \
      default: return name##_baseline(args...);                                                    \
    }                                                                                              \
  }

namespace lt::vec {

// The vector widths the kernels are built for, narrowest first.
enum class Isa { Baseline, Avx2, Avx512 };

// The width the kernels run at in this process (see above); a LT_CPU_KERNELS this CPU cannot run, or
// that names no width, is said once on stderr and the CPU's own width is used.
Isa isa();
const char* isa_name(Isa isa);

inline float bf16_to_f32(uint16_t b) { return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16); }

// Round to nearest even, as LibTorch's float -> bfloat16 conversion does (the values here are finite).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// e^x for x <= 0 (a little above 0 is fine), relative error ~1e-7: Cephes' expf (range reduction by
// ln 2 in two parts, a degree-6 polynomial, the power of two built in the exponent bits). Below
// -87 it returns e^-87 (~1.6e-38), which adds nothing next to a row's maximum term, e^0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// A value as f32, and an f32 value in a kernel's element type (bf16 as its bits, uint16_t).
inline float to_f32(uint16_t b) { return bf16_to_f32(b); }
inline float to_f32(float f) { return f; }
template <typename T>
inline T from_f32(float f);
template <>
inline uint16_t from_f32<uint16_t>(float f) { return f32_to_bf16(f); }
template <>
inline float from_f32<float>(float f) { return f; }

// The elements of an f32 or bf16 CPU tensor as a kernel's element type: float, or bf16's bits as uint16_t.
template <typename T>
T* elements(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else return reinterpret_cast<T*>(t.data_ptr<at::BFloat16>());
}

}  // namespace lt::vec
