// The fused loss's CUDA kernels (lora_trainer/kernels/cross_entropy_cuda_kernels.cuh), run from their own
// source on the CPU under cuda_on_cpu.hpp, against a float64 reference: the checks that
// tests/kernels/test_cross_entropy.cpp's [cuda] cases make on a GPU, made on every machine.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_on_cpu/cuda_on_cpu.hpp"
#include "lora_trainer/kernels/cross_entropy_cuda_kernels.cuh"
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__

namespace {

using lt::cuda_kernels::backward_kernel;
using lt::cuda_kernels::forward_kernel;
using lt::cuda_kernels::kThreads;

constexpr double kInf = std::numeric_limits<double>::infinity();

float bf16_value(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
uint16_t bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }

// N rows of V bf16 logits, `stride` apart (16-byte aligned storage), and their targets.
struct Rows {
  int64_t N, V, stride;
  std::vector<uint4> storage;  // uint4: the alignment the vector kernels need
  std::vector<int64_t> targets;

  Rows(int64_t n, int64_t v, int64_t s) : N(n), V(v), stride(s), storage(static_cast<size_t>((n * s + 7) / 8 + 1)), targets(static_cast<size_t>(n), -1) {}
  uint16_t* data() { return reinterpret_cast<uint16_t*>(storage.data()); }
  uint16_t& at(int64_t i, int64_t j) { return data()[i * stride + j]; }
  float value(int64_t i, int64_t j) { return bf16_value(at(i, j)); }
};

// Normal logits times `scale`; every fifth row's target -1 (a row that does not count).
Rows random_rows(int64_t N, int64_t V, int64_t stride, double scale, uint64_t seed) {
  Rows r(N, V, stride);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < V; ++j) r.at(i, j) = bf16_bits(normal(rng));
    r.targets[static_cast<size_t>(i)] = i % 5 == 3 ? -1 : pick(rng);
  }
  return r;
}

struct Result {
  std::vector<float> lse, loss;
  std::vector<uint16_t> grad;  // N x V
};

// The backward kernel's gradient (N x V) from the rows' lse, launched as cross_entropy_cuda.cu
// launches it (one block of kThreads a row), the vector or the one-at-a-time variant.
std::vector<uint16_t> backward(Rows& r, const std::vector<float>& lse, bool vectors, float g) {
  std::vector<uint16_t> grad(static_cast<size_t>(r.N * r.V), 0xABCD);  // garbage: every element must be written
  if (vectors) REQUIRE(lt::cuda_kernels::vectors_fit(r.V, r.stride, r.data(), grad.data()));
  cuda_on_cpu::launch(static_cast<unsigned>(r.N), kThreads, vectors ? backward_kernel<true> : backward_kernel<false>, r.data(), r.V,
                      r.stride, r.targets.data(), lse.data(), &g, grad.data());
  return grad;
}

// Both kernels, launched the same way.
Result run(Rows& r, bool vectors, float g) {
  Result out;
  out.lse.assign(static_cast<size_t>(r.N), -1.0f);
  out.loss.assign(static_cast<size_t>(r.N), -1.0f);
  cuda_on_cpu::launch(static_cast<unsigned>(r.N), kThreads, vectors ? forward_kernel<true> : forward_kernel<false>, r.data(), r.V,
                      r.stride, r.targets.data(), out.lse.data(), out.loss.data());
  out.grad = backward(r, out.lse, vectors, g);
  return out;
}

// float64: log sum_j exp(x_ij) over the row (-inf entries add nothing).
double reference_lse(Rows& r, int64_t i) {
  double m = -kInf, s = 0;
  for (int64_t j = 0; j < r.V; ++j) m = std::max(m, static_cast<double>(r.value(i, j)));
  for (int64_t j = 0; j < r.V; ++j) s += std::exp(static_cast<double>(r.value(i, j)) - m);
  return m + std::log(s);
}

// Loss and lse within 1e-5 (relative, at least 1) of float64. Each gradient element within half a bf16
// step of g * (softmax - onehot) in float64 (2^-8 relative: what rounding to nearest allows) plus
// float's own error: 2^-14 relative, and an absolute floor of a few float steps of lse times g (p is
// exp(x - lse) with lse in float, so p - 1 for a row's dominant target is off by that much).
// Rows that do not count: 0 and a zero row.
void check_against_reference(Rows& r, const Result& got, float g) {
  for (int64_t i = 0; i < r.N; ++i) {
    const int64_t t = r.targets[static_cast<size_t>(i)];
    INFO("row " << i << " of " << r.N << ", V " << r.V << ", target " << t);
    if (t < 0) {
      CHECK(got.lse[static_cast<size_t>(i)] == 0.0f);
      CHECK(got.loss[static_cast<size_t>(i)] == 0.0f);
      for (int64_t j = 0; j < r.V; ++j) REQUIRE(got.grad[static_cast<size_t>(i * r.V + j)] == 0);
      continue;
    }
    const double lse = reference_lse(r, i), loss = lse - r.value(i, t);
    CHECK(std::abs(got.lse[static_cast<size_t>(i)] - lse) <= 1e-5 * std::max(1.0, std::abs(lse)));
    CHECK(std::abs(got.loss[static_cast<size_t>(i)] - loss) <= 1e-5 * std::max(1.0, std::abs(loss)));
    int64_t off = 0;
    std::string first;
    for (int64_t j = 0; j < r.V; ++j) {
      const double want = g * (std::exp(r.value(i, j) - lse) - (j == t ? 1.0 : 0.0));
      const double have = bf16_value(got.grad[static_cast<size_t>(i * r.V + j)]);
      const double floor = std::abs(g) * std::ldexp(std::max(1.0, std::abs(lse)), -21);
      if (!(std::abs(have - want) <= std::abs(want) * (std::ldexp(1.0, -8) + std::ldexp(1.0, -14)) + floor) && off++ == 0)
        first = "column " + std::to_string(j) + ": " + std::to_string(have) + " where float64 gives " + std::to_string(want);
    }
    INFO("gradient elements off: " << off << "; the first at " << first);
    CHECK(off == 0);
  }
}

}  // namespace

TEST_CASE("CUDA loss kernels on the CPU: 16-byte vector variant against float64", "[kernels]") {
  // 4,104 = 8 x 513: one vector more than threads, so thread 0 takes two.
  const float g = 0.37f;
  SECTION("contiguous rows") {
    Rows r = random_rows(11, 4104, 4104, 3.0, 1);
    check_against_reference(r, run(r, true, g), g);
  }
  SECTION("rows further apart than their length (the forward reads a strided view)") {
    Rows r = random_rows(7, 4104, 4104 + 24, 3.0, 2);
    check_against_reference(r, run(r, true, g), g);
  }
  SECTION("large logits (up to about +-250): no overflow in the running sum") {
    Rows r = random_rows(6, 1024, 1024, 80.0, 3);
    check_against_reference(r, run(r, true, g), g);
  }
}

TEST_CASE("CUDA loss kernels on the CPU: one-value-at-a-time variant against float64", "[kernels]") {
  const float g = 1.0f;
  SECTION("an odd row length") {
    Rows r = random_rows(11, 4101, 4101, 3.0, 4);
    REQUIRE_FALSE(lt::cuda_kernels::vectors_fit(r.V, r.stride, r.data()));
    check_against_reference(r, run(r, false, g), g);
  }
  SECTION("rows an odd number of elements apart") {
    Rows r = random_rows(7, 700, 703, 2.0, 5);
    check_against_reference(r, run(r, false, g), g);
  }
  SECTION("rows shorter than a block") {
    Rows r = random_rows(6, 100, 100, 2.0, 6);
    check_against_reference(r, run(r, false, g), g);
  }
}

TEST_CASE("CUDA loss kernels on the CPU: the padded head's -inf columns count nothing", "[kernels]") {
  // layers.cpp pads GPT-2's 50,257 columns to a multiple of 64 with -inf logits; here 1,984 + 64.
  for (bool vectors : {true, false}) {
    INFO((vectors ? "vectors" : "one at a time"));
    const int64_t real = 1984, padded = 2048;
    Rows r = random_rows(6, padded, padded, 3.0, 7);
    Rows unpadded(r.N, real, real);
    for (int64_t i = 0; i < r.N; ++i) {
      for (int64_t j = real; j < padded; ++j) r.at(i, j) = bf16_bits(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < real; ++j) unpadded.at(i, j) = r.at(i, j);
      auto& t = r.targets[static_cast<size_t>(i)];
      if (t >= real) t %= real;
      unpadded.targets[static_cast<size_t>(i)] = t;
    }
    const Result a = run(r, vectors, 1.0f), b = run(unpadded, vectors, 1.0f);
    check_against_reference(r, a, 1.0f);
    for (int64_t i = 0; i < r.N; ++i) {
      CHECK(std::abs(a.loss[static_cast<size_t>(i)] - b.loss[static_cast<size_t>(i)]) <= 1e-5f * std::max(1.0f, b.loss[static_cast<size_t>(i)]));
      for (int64_t j = real; j < padded; ++j) REQUIRE(a.grad[static_cast<size_t>(i * padded + j)] == 0);
    }
  }
}

TEST_CASE("CUDA loss kernels on the CPU: NaN, +inf and an out-of-range target make the row's loss NaN", "[kernels]") {
  for (bool vectors : {true, false}) {
    INFO((vectors ? "vectors" : "one at a time"));
    Rows r = random_rows(5, 512, 512, 1.0, 8);
    for (int64_t i = 0; i < r.N; ++i) r.targets[static_cast<size_t>(i)] = 7;
    r.at(0, 300) = bf16_bits(std::numeric_limits<float>::quiet_NaN());
    r.at(1, 511) = bf16_bits(std::numeric_limits<float>::infinity());
    r.targets[2] = r.V;   // one past the row
    r.targets[3] = -1;    // not counted
    const Result got = run(r, vectors, 1.0f);
    CHECK(std::isnan(got.loss[0]));
    CHECK(std::isnan(got.lse[0]));
    CHECK(std::isnan(got.loss[1]));
    CHECK(std::isnan(got.lse[1]));
    CHECK(std::isnan(got.loss[2]));
    CHECK(got.loss[3] == 0.0f);
    CHECK(std::isfinite(got.loss[4]));
    CHECK(std::abs(got.loss[4] - (reference_lse(r, 4) - r.value(4, 7))) <= 1e-5);
  }
}

TEST_CASE("CUDA loss kernels on the CPU: both variants write the same gradient bits from the same lse", "[kernels]") {
  Rows r = random_rows(9, 1032, 1032, 4.0, 9);
  const Result vec = run(r, true, 0.25f);
  CHECK(backward(r, vec.lse, false, 0.25f) == vec.grad);
}

TEST_CASE("CUDA loss kernels on the CPU: the backward written over the logits themselves gives the same bits", "[kernels]") {
  // What CudaCrossEntropySum does with overwrite_logits: grad == logits. Each counted row's target is its
  // largest logit, whose probability is large enough to show in bf16, so a kernel that read the
  // target's logit after overwriting it would write other bits.
  for (bool vectors : {true, false}) {
    INFO((vectors ? "vector variant" : "one value at a time"));
    Rows r = random_rows(11, 1032, 1032, 6.0, 21);
    for (int64_t i = 0; i < r.N; ++i) {
      if (r.targets[static_cast<size_t>(i)] < 0) continue;
      int64_t top = 0;
      for (int64_t j = 1; j < r.V; ++j) top = r.value(i, j) > r.value(i, top) ? j : top;
      r.targets[static_cast<size_t>(i)] = top;
    }
    const Result separate = run(r, vectors, 0.125f);
    cuda_on_cpu::launch(static_cast<unsigned>(r.N), kThreads, vectors ? backward_kernel<true> : backward_kernel<false>, r.data(),
                        r.V, r.stride, r.targets.data(), separate.lse.data(), std::vector<float>{0.125f}.data(), r.data());
    const std::vector<uint16_t> in_place(r.data(), r.data() + r.N * r.V);
    CHECK(in_place == separate.grad);
  }
}

TEST_CASE("CUDA loss kernels: the vector variant only where length, stride and alignment allow it", "[kernels]") {
  using lt::cuda_kernels::vectors_fit;
  alignas(16) uint16_t buf[64] = {};
  CHECK(vectors_fit(1024, 1024, buf, buf + 16));
  CHECK_FALSE(vectors_fit(1020, 1024, buf));      // length not a multiple of 8
  CHECK_FALSE(vectors_fit(1024, 1028, buf));      // stride not a multiple of 8
  CHECK_FALSE(vectors_fit(1024, 1024, buf + 1));  // logits not 16-byte aligned
  CHECK_FALSE(vectors_fit(1024, 1024, buf, buf + 4));  // gradient not 16-byte aligned
}

TEST_CASE("CUDA on the CPU: float to bf16 rounds to nearest, ties to even, as the GPU does", "[kernels]") {
  CHECK(bf16_bits(1.0f) == 0x3F80);
  CHECK(bf16_bits(__uint_as_float(0x3F808000u)) == 0x3F80);  // a tie: down to the even 0x3F80
  CHECK(bf16_bits(__uint_as_float(0x3F818000u)) == 0x3F82);  // a tie: up to the even 0x3F82
  CHECK(bf16_bits(__uint_as_float(0x3F808001u)) == 0x3F81);  // above the tie
  CHECK(bf16_bits(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(bf16_bits(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(bf16_bits(std::numeric_limits<float>::max()) == 0x7F80);  // rounds up to +inf
  CHECK(bf16_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(bf16_bits(__uint_as_float(0x7F800001u)) == 0x7FFF);  // a NaN that plain rounding would make +inf
}
