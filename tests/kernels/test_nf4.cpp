// NF4 storage (kernels/nf4.hpp) against bitsandbytes: its 16 values and midpoint rule, its packing order,
// its dynamic map for double quantization, and its own test's error figures on N(0, 1) matrices.
#include "catch.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "lora_trainer/kernels/nf4.hpp"

using namespace lt;

namespace {

struct Errors {
  double mean_abs, mean_rel;
};

// bitsandbytes' test_4bit_quant measures: mean |A - dequant(quant(A))| and mean of that over |A| + 1e-8.
Errors errors(const torch::Tensor& A, const torch::Tensor& B) {
  auto err = (A - B).abs().to(torch::kFloat32);
  return {err.mean().item<double>(), (err / (A.abs().to(torch::kFloat32) + 1e-8)).mean().item<double>()};
}

}  // namespace

TEST_CASE("NF4: bitsandbytes' 16 values, each value its nearest code, a midpoint to the lower one", "[nf4][numerics]") {
  const auto& v = nf4_values();
  CHECK(v[0] == -1.0f);
  CHECK(v[7] == 0.0f);
  CHECK(v[15] == 1.0f);
  CHECK(v[8] == 0.07958029955625534f);
  CHECK(v[1] == -0.6961928009986877f);
  for (int i = 0; i < 16; ++i) CHECK(nf4_code(v[i]) == i);
  // bitsandbytes' thresholds, from its dQuantizeNF4 (csrc/kernels.cu): the midpoints of the values
  // (within f32 rounding); x above threshold i has a code above i, x on it code i.
  const float thresholds[15] = {-0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f,
                                -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                                -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                                0.2035212516784668f,   0.2920137718319893f,  0.3893125355243683f,
                                0.5016634166240692f,   0.6427869200706482f,  0.8614784181118011f};
  for (int i = 0; i < 15; ++i) {
    INFO("between codes " << i << " and " << i + 1);
    CHECK(thresholds[i] == Approx((v[i] + v[i + 1]) / 2.0).margin(1e-6));
    CHECK(nf4_code(thresholds[i]) == i);
    CHECK(nf4_code(std::nextafter(thresholds[i], 2.0f)) == i + 1);
  }
  // Everywhere else the nearest value.
  int farther = 0;
  for (int k = -10000; k <= 10000; ++k) {
    const float x = static_cast<float>(k) / 10000.0f;
    const int c = nf4_code(x);
    for (int j = 0; j < 16; ++j) farther += std::fabs(x - v[c]) > std::fabs(x - v[j]) + 1e-7f;
  }
  CHECK(farther == 0);
  CHECK(nf4_code(std::nanf("")) == 0);
}

TEST_CASE("NF4: two codes a byte, the first in the high nibble, a partial last block and an all-zero block", "[nf4][numerics]") {
  // 2 x 67 = 134 elements: blocks of 64, 64 and 6.
  auto W = torch::zeros({2, 67}, torch::kFloat32);
  auto w = W.view({-1});
  w[0] = -3.0f;  // block 0's absmax 3: code 0 (-1)
  w[1] = 3.0f;   // code 15 (1)
  w[2] = 0.0f;   // code 7
  w[3] = 1.2f;   // 0.4 of the absmax: code 12 (0.4407)
  // block 1 (elements 64..127) all zero
  w[128] = 0.5f;  // block 2 (partial): its own absmax 0.5
  w[133] = -0.25f;
  const Nf4Tensor q = quantize_nf4(W, /*double_quant=*/false);
  REQUIRE(q.blocks() == 3);
  REQUIRE(q.codes.numel() == 67);
  const uint8_t* c = q.codes.data_ptr<uint8_t>();
  CHECK(c[0] == 0x0F);
  CHECK(c[1] == 0x7C);
  CHECK(q.absmax[0].item<float>() == 3.0f);
  CHECK(q.absmax[1].item<float>() == 0.0f);
  CHECK(q.absmax[2].item<float>() == 0.5f);
  CHECK(c[64] == 0xF7);       // elements 128 (1.0 of 0.5: code 15), 129 (0: code 7)
  CHECK((c[66] & 0x0F) == 2);  // element 133 (odd: the low nibble): -0.5 of the absmax, nearest -0.5251 (code 2)
  const auto back = dequantize_nf4(q, torch::kFloat32);
  CHECK(back.sizes() == W.sizes());
  CHECK(back.view({-1}).slice(0, 64, 128).abs().max().item<float>() == 0.0f);  // the all-zero block comes back zero
  CHECK(back.view({-1})[3].item<float>() == 0.44070982933044434f * 3.0f);
  // An odd count leaves the last low nibble 0.
  const Nf4Tensor odd = quantize_nf4(torch::tensor({1.0f, -1.0f, 1.0f}), false);
  REQUIRE(odd.codes.numel() == 2);
  CHECK(odd.codes[1].item<uint8_t>() == 0xF0);
}

TEST_CASE("NF4 on a seeded 1024 x 1024 N(0, 1) matrix: bitsandbytes' error figures, with and without double quantization", "[nf4][numerics]") {
  auto gen = at::detail::createCPUGenerator(1234);
  const auto A = torch::randn({1024, 1024}, gen, torch::kFloat32);
  const Nf4Tensor plain = quantize_nf4(A, false);
  const Errors e = errors(A, dequantize_nf4(plain, torch::kFloat32));
  INFO("mean abs " << e.mean_abs << ", mean rel " << e.mean_rel);
  WARN("NF4 on N(0, 1), blocks of 64: mean abs error " << e.mean_abs << ", mean relative " << e.mean_rel);
  // bitsandbytes' test_4bit_quant: blocksize 64, err < 0.072792 + 1e-3, relerr < 0.203299 + 1e-3 (its
  // averages over 1,000 samples); we hold to the same figures from both sides.
  CHECK(std::fabs(e.mean_abs - 0.072792) < 1e-3);
  CHECK(std::fabs(e.mean_rel - 0.203299) < 1e-3);

  const Nf4Tensor dq = quantize_nf4(A, true);
  const Errors d = errors(A, dequantize_nf4(dq, torch::kFloat32));
  INFO("double quantization: mean abs " << d.mean_abs << ", mean rel " << d.mean_rel);
  CHECK(d.mean_abs < 0.11);  // bitsandbytes' test_4bit_compressed_stats
  CHECK(d.mean_rel < 0.28);
  CHECK(d.mean_abs < e.mean_abs * 1.01);  // the 8-bit absmax costs under 1% more error
  // The codes are the same NF4 codes; only the absmax is stored smaller.
  CHECK(torch::equal(plain.codes, dq.codes));
  const auto rel = ((nf4_absmax(dq) - plain.absmax).abs() / plain.absmax).mean().item<double>();
  CHECK(rel < 0.01);
  // 0.5 bytes a value for the codes, 1 byte per 64 for the absmax, 4 per 16,384 for the scales, 4 for the offset.
  CHECK(dq.bytes() == 1024 * 1024 / 2 + 1024 * 1024 / 64 + 4 * (1024 * 1024 / 64 / 256) + 4);
  CHECK(plain.bytes() == 1024 * 1024 / 2 + 4 * 1024 * 1024 / 64);
  // bf16 in, the same codes as its f32 values; bf16 out, rounded once from the f32 result.
  const auto Ab = A.to(torch::kBFloat16);
  CHECK(torch::equal(quantize_nf4(Ab, true).codes, quantize_nf4(Ab.to(torch::kFloat32), true).codes));
  CHECK(torch::equal(dequantize_nf4(dq, torch::kBFloat16), dequantize_nf4(dq, torch::kFloat32).to(torch::kBFloat16)));
}

TEST_CASE("NF4 double quantization: bitsandbytes' signed dynamic map, each entry its own code", "[nf4][numerics]") {
  const auto& m = dynamic_map_values();
  CHECK(std::is_sorted(m.begin(), m.end()));
  CHECK(m[127] == 0.0f);
  CHECK(m[255] == 1.0f);
  CHECK(m[128] == Approx(5.5e-7).epsilon(1e-6));         // 10^-6 x the midpoint of linspace(0.1, 1, 2)
  CHECK(m[254] == Approx(0.99296875).epsilon(1e-6));     // the last midpoint of linspace(0.1, 1, 65)
  CHECK(m[0] == -m[254]);
  int other = 0;
  for (int k = 0; k < 256; ++k) other += dynamic_map_code(m[k]) != k;
  CHECK(other == 0);
  CHECK(dynamic_map_code(1.0f) == 255);
  CHECK(dynamic_map_code(-1.0f) == 0);
  // Halfway between two entries goes to the searched pivot's side as bitsandbytes' dQuantize does: the
  // code is one of the two neighbours.
  for (int k = 0; k < 254; ++k) {
    const float mid = (m[k] + m[k + 1]) * 0.5f;
    const int c = dynamic_map_code(mid);
    CHECK((c == k || c == k + 1));
  }
}

TEST_CASE("NF4 double quantization's vectorised search gives the scalar search's code for every value", "[nf4][numerics]") {
  const auto& m = dynamic_map_values();
  std::vector<float> x;
  for (int k = 0; k < 256; ++k) {  // every entry, the midpoints, and a value either side of each
    x.push_back(m[k]);
    x.push_back(std::nextafter(m[k], -2.0f));
    x.push_back(std::nextafter(m[k], 2.0f));
    if (k < 255) x.push_back((m[k] + m[k + 1]) * 0.5f);
  }
  for (float v : {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f, std::numeric_limits<float>::quiet_NaN()}) x.push_back(v);
  auto gen = at::detail::createCPUGenerator(11);
  const auto u = torch::rand({100003}, gen, torch::kFloat32).mul_(2.0).sub_(1.0).contiguous();
  x.insert(x.end(), u.data_ptr<float>(), u.data_ptr<float>() + u.numel());
  const auto tiny = torch::randn({4099}, gen, torch::kFloat32).mul_(1e-5).contiguous();  // the smallest exponents
  x.insert(x.end(), tiny.data_ptr<float>(), tiny.data_ptr<float>() + tiny.numel());
  for (float scale : {1.0f, 0.5f, 1.0f / 3.0f}) {
    std::vector<uint8_t> codes(x.size());
    dynamic_map_codes(x.data(), scale, static_cast<int64_t>(x.size()), codes.data());
    size_t other = 0;
    for (size_t i = 0; i < x.size(); ++i) other += codes[i] != dynamic_map_code(x[i] * scale);
    INFO("scale " << scale << ", " << x.size() << " values");
    CHECK(other == 0);
  }
}

TEST_CASE("NF4 quantizes in chunks: a weight larger than a chunk gets the codes of its block-aligned parts", "[nf4][numerics]") {
  auto gen = at::detail::createCPUGenerator(7);
  const auto A = torch::randn({1536, 1024}, gen, torch::kFloat32);  // 1.5 chunks of 2^20 values
  const Nf4Tensor whole = quantize_nf4(A, false);
  const Nf4Tensor top = quantize_nf4(A.slice(0, 0, 768), false), bottom = quantize_nf4(A.slice(0, 768), false);
  CHECK(torch::equal(whole.codes, torch::cat({top.codes, bottom.codes})));
  CHECK(torch::equal(whole.absmax, torch::cat({top.absmax, bottom.absmax})));
  CHECK(torch::equal(dequantize_nf4(whole, torch::kFloat32),
                     torch::cat({dequantize_nf4(top, torch::kFloat32), dequantize_nf4(bottom, torch::kFloat32)})));
}

TEST_CASE("NF4 quantization in tensor operations (on a GPU) gives the CPU kernel's codes and scales, whatever the vector width and dtype", "[nf4][numerics]") {
  // The CPU kernel reads f32 and bf16 in place (and converts f16 a chunk at a time), a vector of values at
  // a time; the tensor operations are the scalar definition. Run under each CPU's kernels ([numerics]).
  auto gen = at::detail::createCPUGenerator(9);
  for (int64_t n : {int64_t(1), int64_t(2), int64_t(63), int64_t(65), int64_t(64 * 256 + 3), int64_t(64 * 600)}) {
    for (auto [dq, dtype] : {std::pair{false, torch::kBFloat16}, std::pair{true, torch::kBFloat16},
                             std::pair{false, torch::kFloat32}, std::pair{true, torch::kFloat32}, std::pair{false, torch::kFloat16}}) {
      INFO(n << " values of " << c10::toString(dtype) << ", double quantization " << dq);
      auto W = torch::randn({n}, gen, torch::kFloat32).to(dtype);
      if (n > 128) W.narrow(0, 64, 64).zero_();  // an all-zero block
      // An infinite value (without double quantization, whose mean it would make NaN): its block's absmax
      // is inf and every code that of x * 0.
      if (n > 256 && !dq) W[200] = std::numeric_limits<float>::infinity();
      const Nf4Tensor loop = quantize_nf4(W, dq), ops = quantize_nf4_ops(W, dq);
      CHECK(torch::equal(loop.codes, ops.codes));
      if (dq) {
        CHECK(torch::equal(loop.absmax_codes, ops.absmax_codes));
        CHECK(torch::equal(loop.absmax_scales, ops.absmax_scales));
        CHECK(torch::equal(loop.absmax_offset, ops.absmax_offset));
      } else {
        CHECK(torch::equal(loop.absmax, ops.absmax));
      }
    }
  }
}

TEST_CASE("NF4 dequantization in tensor operations (where no kernel runs) gives the loop's bits", "[nf4][numerics]") {
  auto gen = at::detail::createCPUGenerator(8);
  for (int64_t n : {int64_t(1), int64_t(63), int64_t(65), int64_t(64 * 256 + 3), int64_t(64 * 600)}) {
    for (bool dq : {false, true}) {
      INFO(n << " values, double quantization " << dq);
      const auto W = torch::randn({n}, gen, torch::kFloat32).to(torch::kBFloat16);
      const Nf4Tensor q = quantize_nf4(W, dq);
      for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
        const auto loop = dequantize_nf4(q, dtype), ops = dequantize_nf4_ops(q, dtype);
        CHECK(ops.sizes() == W.sizes());
        CHECK(torch::equal(loop, ops));
      }
    }
  }
}
