#include "lora_trainer/kernels/nf4.hpp"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>

#include "lora_trainer/kernels/parallel.hpp"
#include "lora_trainer/kernels/vector_math.hpp"

#ifdef LT_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "lora_trainer/kernels/nf4_cuda.hpp"
#endif

namespace lt {

const std::array<float, 16>& nf4_values() {
  static const std::array<float, 16> values = {
      -1.0f,
      -0.6961928009986877f,
      -0.5250730514526367f,
      -0.39491748809814453f,
      -0.28444138169288635f,
      -0.18477343022823334f,
      -0.09105003625154495f,
      0.0f,
      0.07958029955625534f,
      0.16093020141124725f,
      0.24611230194568634f,
      0.33791524171829224f,
      0.44070982933044434f,
      0.5626170039176941f,
      0.7229568362236023f,
      1.0f};
  return values;
}

namespace {

// bitsandbytes' thresholds between consecutive NF4 values (its dQuantizeNF4 decision tree, flattened):
// a normalised x above threshold i has a code above i.
constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f,  -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f, -0.23460740596055984f,
    -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,  0.2035212516784668f,
    0.2920137718319893f,   0.3893125355243683f,   0.5016634166240692f,  0.6427869200706482f,  0.8614784181118011f};

constexpr int64_t kChunkElements = int64_t(1) << 20;  // quantize this many elements at a time

}  // namespace

uint8_t nf4_code(float x) {
  uint8_t code = 0;
  for (float t : kNf4Thresholds) code += x > t ? 1 : 0;  // NaN: no comparison holds, code 0
  return code;
}

const std::array<float, 256>& dynamic_map_values() {
  static const std::array<float, 256> values = [] {
    // Signed, 7 exponent bits, 8 bits: for exponent i = 0..6, the 2^i midpoints of linspace(0.1, 1, 2^i + 1)
    // (f32, as torch computes it) times 10^(i - 6), and their negatives; then 0 and 1.
    std::vector<float> data;
    for (int i = 0; i < 7; ++i) {
      auto bounds = torch::linspace(0.1, 1.0, (int64_t(1) << i) + 1, torch::kFloat32);
      auto means = (bounds.slice(0, 0, -1) + bounds.slice(0, 1)) / 2.0;
      auto scaled = (means * std::pow(10.0, -6 + i)).contiguous();
      const float* p = scaled.data_ptr<float>();
      for (int64_t k = 0; k < scaled.numel(); ++k) data.push_back(p[k]);
      for (int64_t k = 0; k < scaled.numel(); ++k) data.push_back(-p[k]);
    }
    data.push_back(0.0f);
    data.push_back(1.0f);
    std::sort(data.begin(), data.end());
    std::array<float, 256> out{};
    std::copy(data.begin(), data.end(), out.begin());
    return out;
  }();
  return values;
}

uint8_t dynamic_map_code(float x) {
  // A binary search from the middle entry down to a pivot, then the nearer of the pivot and the entry
  // on x's side of it, the pivot on a tie: bitsandbytes' dQuantize (not stochastic).
  const auto& map = dynamic_map_values();
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f, val = map[127];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += step;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= step;
    }
    val = map[pivot];
  }
  if (upper_pivot == 255) upper = map[255];
  if (lower_pivot == 0) lower = map[0];
  if (x > val) return static_cast<uint8_t>(x > (upper + val) * 0.5f ? upper_pivot : pivot);
  return static_cast<uint8_t>(x < (lower + val) * 0.5f ? lower_pivot : pivot);
}

namespace {

// dynamic_map_code(x[i] * scale) for i < n, written for the vectoriser: the same search with each branch
// a selection (the map's entries gathered), so every value gets the scalar search's code.
LT_VECTOR_KERNEL void dynamic_map_code_range(const float* __restrict map, const float* __restrict x, float scale, int64_t n,
                                             uint8_t* __restrict codes) {
  const float first = map[0], middle = map[127], last = map[255];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * scale;
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = -1.0f, upper = 1.0f, val = middle;
    // The search's seven steps written out: GCC's vectoriser takes no loop inside the loop, and a loop
    // over the steps is not unrolled before it runs.
#define LT_SEARCH_STEP(step)                                \
  {                                                         \
    const bool above = v > val;                             \
    lower_pivot = above ? pivot : lower_pivot;              \
    lower = above ? val : lower;                            \
    upper_pivot = above ? upper_pivot : pivot;              \
    upper = above ? upper : val;                            \
    pivot += above ? (step) : -(step);                      \
    val = map[pivot];                                       \
  }
    LT_SEARCH_STEP(64) LT_SEARCH_STEP(32) LT_SEARCH_STEP(16) LT_SEARCH_STEP(8) LT_SEARCH_STEP(4) LT_SEARCH_STEP(2)
    LT_SEARCH_STEP(1)
#undef LT_SEARCH_STEP
    upper = upper_pivot == 255 ? last : upper;
    lower = lower_pivot == 0 ? first : lower;
    const int code = v > val ? (v > (upper + val) * 0.5f ? upper_pivot : pivot) : (v < (lower + val) * 0.5f ? lower_pivot : pivot);
    codes[i] = static_cast<uint8_t>(code);
  }
}
LT_VECTOR_DISPATCH_GATHERS(dynamic_map_code_range)

}  // namespace

void dynamic_map_codes(const float* x, float scale, int64_t n, uint8_t* codes) {
  dynamic_map_code_range_dispatch(dynamic_map_values().data(), x, scale, n, codes);
}

int64_t Nf4Tensor::bytes() const {
  auto size = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; };
  return size(codes) + size(absmax) + size(absmax_codes) + size(absmax_scales) + size(absmax_offset);
}

int64_t nf4_bytes(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t blocks = (n + kNf4BlockSize - 1) / kNf4BlockSize;
  return (n + 1) / 2 + blocks + (blocks + kNf4AbsmaxBlockSize - 1) / kNf4AbsmaxBlockSize * 4 + 4;
}

Nf4Tensor Nf4Tensor::zeros(const std::vector<int64_t>& shape, const torch::Device& device) {
  Nf4Tensor q;
  q.shape = shape;
  q.numel = 1;
  for (int64_t d : shape) q.numel *= d;
  const auto bytes = torch::TensorOptions().dtype(torch::kUInt8).device(device), f32 = bytes.dtype(torch::kFloat32);
  q.codes = torch::zeros({(q.numel + 1) / 2}, bytes);
  q.absmax_codes = torch::zeros({q.blocks()}, bytes);
  q.absmax_scales = torch::zeros({(q.blocks() + kNf4AbsmaxBlockSize - 1) / kNf4AbsmaxBlockSize}, f32);
  q.absmax_offset = torch::zeros({1}, f32);
  return q;
}

std::vector<std::pair<const char*, torch::Tensor*>> Nf4Tensor::fields() {
  return {{"codes", &codes}, {"absmax_codes", &absmax_codes}, {"absmax_scales", &absmax_scales}, {"absmax_offset", &absmax_offset}};
}

void Nf4Tensor::fill_from(Nf4Tensor q) {
  bool in_place = codes.defined() && double_quantized() && q.double_quantized() && device() == q.device();
  auto mine = fields(), made = q.fields();
  for (size_t i = 0; in_place && i < mine.size(); ++i)
    in_place = mine[i].second->sizes() == made[i].second->sizes() && mine[i].second->dtype() == made[i].second->dtype();
  if (!in_place) {
    *this = std::move(q);
    return;
  }
  for (size_t i = 0; i < mine.size(); ++i) mine[i].second->copy_(*made[i].second);
}

Nf4Tensor Nf4Tensor::to(const torch::Device& device) const {
  Nf4Tensor q = *this;
  for (torch::Tensor* t : {&q.codes, &q.absmax, &q.absmax_codes, &q.absmax_scales, &q.absmax_offset})
    if (t->defined()) *t = t->to(device);
  return q;
}

namespace {

// The tables on a device, copied there once.
const torch::Tensor& table_on(const float* values, int64_t n, const torch::Device& device) {
  static std::mutex mutex;
  static std::map<std::pair<const float*, std::string>, torch::Tensor> tables;
  std::lock_guard<std::mutex> lock(mutex);
  torch::Tensor& t = tables[{values, device.str()}];
  if (!t.defined()) t = torch::from_blob(const_cast<float*>(values), {n}, torch::kFloat32).to(device);
  return t;
}

// Blocks [first, end) of x (numel values, f32 or bf16's bits): each block's absmax into absmax[block]
// and its codes into codes, two a byte, high nibble first (a block starts at an even element, so it
// owns whole bytes; an odd count's last low nibble is 0). Written for the vectoriser: the absmax as
// std::max takes it (NaN ignored: `m < a` is false), the code as the number of thresholds below
// x * (1 / absmax), NaN none of them (code 0), so every value gets the bits of a scalar loop.
template <typename T>
LT_VECTOR_KERNEL void quantize_block_range(const T* __restrict x, int64_t numel, int64_t first, int64_t end,
                                           float* __restrict absmax, uint8_t* __restrict codes) {
  for (int64_t blk = first; blk < end; ++blk) {
    const int64_t b0 = blk * kNf4BlockSize, n = std::min(kNf4BlockSize, numel - b0);
    const T* xb = x + b0;
    float m = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(vec::to_f32(xb[i]));
      m = m < a ? a : m;
    }
    absmax[blk] = m;
    const float r = 1.0f / m;  // bitsandbytes multiplies by the reciprocal
    uint8_t c[kNf4BlockSize];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float v = vec::to_f32(xb[i]) * r;
      int k = 0;
      for (int t = 0; t < 15; ++t) k += v > kNf4Thresholds[t] ? 1 : 0;
      c[i] = static_cast<uint8_t>(k);
    }
    uint8_t* out = codes + b0 / 2;
    for (int64_t j = 0; j < n / 2; ++j) out[j] = static_cast<uint8_t>(c[2 * j] << 4 | c[2 * j + 1]);
    if (n % 2) out[n / 2] = static_cast<uint8_t>(c[n - 1] << 4);
  }
}
LT_VECTOR_DISPATCH(quantize_block_range)

// W's codes (q.codes) and each block's absmax (returned, f32) by the kernel above, on the CPU over the
// threads: read in place when W is f32 or bf16, else converted to f32 a chunk at a time.
torch::Tensor codes_by_loop(const torch::Tensor& flat, Nf4Tensor& q) {
  q.codes = torch::empty({(q.numel + 1) / 2}, torch::kUInt8);
  auto absmax = torch::empty({q.blocks()}, torch::kFloat32);
  uint8_t* codes = q.codes.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  auto run = [&](const auto* x, int64_t numel, int64_t first_block, uint8_t* out, float* out_am) {
    at::parallel_for(0, (numel + kNf4BlockSize - 1) / kNf4BlockSize, 256, [&](int64_t b, int64_t e) {
      quantize_block_range_dispatch(x, numel, b, e, out_am + first_block, out + first_block * kNf4BlockSize / 2);
    });
  };
  if (flat.scalar_type() == torch::kFloat32 || flat.scalar_type() == torch::kBFloat16) {
    const auto in = flat.to(torch::kCPU).contiguous();
    if (in.scalar_type() == torch::kFloat32) run(vec::elements<float>(in), q.numel, 0, codes, am);
    else run(vec::elements<uint16_t>(in), q.numel, 0, codes, am);
    return absmax;
  }
  for (int64_t first = 0; first < q.numel; first += kChunkElements) {  // a multiple of the block size and of 2
    const int64_t n = std::min(kChunkElements, q.numel - first);
    const auto chunk = flat.slice(0, first, first + n).to(torch::kCPU, torch::kFloat32).contiguous();
    run(chunk.data_ptr<float>(), n, first / kNf4BlockSize, codes, am);
  }
  return absmax;
}

// The same in tensor operations on flat's device: the absmax, the reciprocal's product and the
// comparisons with the thresholds are exact IEEE operations on every device, so the codes are the loop's.
torch::Tensor codes_by_ops(const torch::Tensor& flat, Nf4Tensor& q) {
  const auto device = flat.device();
  q.codes = torch::empty({(q.numel + 1) / 2}, flat.options().dtype(torch::kUInt8));
  auto absmax = torch::empty({q.blocks()}, flat.options().dtype(torch::kFloat32));
  const auto thresholds = table_on(kNf4Thresholds.data(), static_cast<int64_t>(kNf4Thresholds.size()), device);
  constexpr int64_t kOpsChunk = int64_t(1) << 24;  // elements a step: a 64 MiB f32 copy at most
  for (int64_t first = 0; first < q.numel; first += kOpsChunk) {
    const int64_t n = std::min(kOpsChunk, q.numel - first), blocks = (n + kNf4BlockSize - 1) / kNf4BlockSize;
    auto x = flat.slice(0, first, first + n).to(torch::kFloat32);
    if (blocks * kNf4BlockSize > n) x = torch::cat({x, x.new_zeros({blocks * kNf4BlockSize - n})});
    x = x.view({blocks, kNf4BlockSize});
    const auto m = x.abs().amax(1);
    absmax.narrow(0, first / kNf4BlockSize, blocks).copy_(m);
    const auto scaled = x.mul(torch::reciprocal(m).unsqueeze(1)).view({-1});
    // The number of thresholds below each value; NaN (an all-zero block: 0 * inf) gets code 0.
    auto c = torch::bucketize(scaled, thresholds, /*out_int32=*/true, /*right=*/false);
    c.masked_fill_(scaled.isnan(), 0);
    c.narrow(0, n, blocks * kNf4BlockSize - n).zero_();  // past the end: the low nibble of an odd count is 0
    const auto pairs = c.view({-1, 2});
    const auto packed = pairs.select(1, 0).bitwise_left_shift(4).bitwise_or(pairs.select(1, 1)).to(torch::kUInt8);
    q.codes.narrow(0, first / 2, (n + 1) / 2).copy_(packed.narrow(0, 0, (n + 1) / 2));
  }
  return absmax;
}

// QLoRA's double quantization of `absmax` (f32, on the CPU) into q, on the CPU.
void double_quantize(Nf4Tensor& q, const torch::Tensor& absmax) {
  const float* am = absmax.data_ptr<float>();
  // The mean in a fixed order (a double sum, rounded once): the same offset whatever the thread count or
  // device, so a base quantized again on restore, on another machine, gets the same bits.
  double sum = 0.0;
  for (int64_t b = 0; b < q.blocks(); ++b) sum += am[b];
  q.absmax_offset = torch::full({1}, static_cast<float>(sum / static_cast<double>(q.blocks())), torch::kFloat32);
  const auto centred = (absmax - q.absmax_offset).contiguous();
  const float* a = centred.data_ptr<float>();
  const int64_t blocks = q.blocks(), scales = (blocks + kNf4AbsmaxBlockSize - 1) / kNf4AbsmaxBlockSize;
  q.absmax_codes = torch::empty({blocks}, torch::kUInt8);
  q.absmax_scales = torch::empty({scales}, torch::kFloat32);
  uint8_t* ac = q.absmax_codes.data_ptr<uint8_t>();
  float* as = q.absmax_scales.data_ptr<float>();
  // Each group of kNf4AbsmaxBlockSize values apart, over the threads: the same bits in any split.
  at::parallel_for(0, scales, 64, [&](int64_t first, int64_t end) {
    for (int64_t s = first; s < end; ++s) {
      const int64_t b0 = s * kNf4AbsmaxBlockSize, b1 = std::min(blocks, b0 + kNf4AbsmaxBlockSize);
      float m = 0.0f;
      for (int64_t i = b0; i < b1; ++i) m = std::max(m, std::fabs(a[i]));
      as[s] = m;
      dynamic_map_codes(a + b0, 1.0f / m, b1 - b0, ac + b0);
    }
  });
}

Nf4Tensor quantize(const torch::Tensor& W, bool double_quant, bool by_ops) {
  TORCH_CHECK(W.is_floating_point(), "quantize_nf4: the weight must be floating point, got ", W.scalar_type());
  Nf4Tensor q;
  q.shape = W.sizes().vec();
  q.numel = W.numel();
  const auto flat = W.contiguous().view({-1});
  const torch::Tensor absmax = by_ops ? codes_by_ops(flat, q) : codes_by_loop(flat, q);
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  double_quantize(q, absmax.to(torch::kCPU).contiguous());  // ceil(numel / 64) values: small beside W
  return q.to(W.device());
}

}  // namespace

Nf4Tensor quantize_nf4(const torch::Tensor& W, bool double_quant) { return quantize(W, double_quant, !W.device().is_cpu()); }

Nf4Tensor quantize_nf4_ops(const torch::Tensor& W, bool double_quant) { return quantize(W, double_quant, true); }

namespace {

// map[code] * scale + offset, each rounded on its own (as the loop and the kernel), in tensor operations.
torch::Tensor absmax_ops(const Nf4Tensor& q) {
  const auto map = table_on(dynamic_map_values().data(), 256, q.device());
  const auto scales = q.absmax_scales.repeat_interleave(kNf4AbsmaxBlockSize).narrow(0, 0, q.blocks());
  return map.index_select(0, q.absmax_codes.to(torch::kLong)).mul(scales).add(q.absmax_offset);
}

}  // namespace

torch::Tensor nf4_absmax(const Nf4Tensor& q) {
  if (!q.double_quantized()) return q.absmax;
  if (!q.device().is_cpu()) return absmax_ops(q);
  const float offset = q.absmax_offset.item<float>();
  auto out = torch::empty({q.blocks()}, torch::kFloat32);
  const auto& map = dynamic_map_values();
  const uint8_t* ac = q.absmax_codes.data_ptr<uint8_t>();
  const float* as = q.absmax_scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < q.blocks(); ++b) {
    // Rounded after the product and after the sum, never fused (the CUDA kernel's __fmul_rn, __fadd_rn).
    volatile float scaled = map[ac[b]] * as[b / kNf4AbsmaxBlockSize];
    o[b] = scaled + offset;
  }
  return out;
}

namespace {

// The loop on the CPU: per block of 64 values its 16 possible values NF4[k] * absmax (f32, each product
// rounded once to T), then two table lookups a byte. The same products, so the same bits, as computing
// each value on its own; blocks over the threads.
template <class T>
torch::Tensor dequantize_blocks(const Nf4Tensor& q) {
  const auto absmax = nf4_absmax(q).contiguous();
  const float* am = absmax.data_ptr<float>();
  const uint8_t* codes = q.codes.data_ptr<uint8_t>();
  const auto& nf4 = nf4_values();
  auto out = torch::empty({q.numel}, torch::CppTypeToScalarType<T>::value);
  T* o = out.template data_ptr<T>();
  at::parallel_for(0, q.blocks(), 1024, [&](int64_t first_block, int64_t end_block) {
    T lut[16];
    for (int64_t blk = first_block; blk < end_block; ++blk) {
      const float m = am[blk];
      for (int k = 0; k < 16; ++k) lut[k] = static_cast<T>(nf4[k] * m);
      const int64_t e0 = blk * kNf4BlockSize, e1 = std::min(q.numel, e0 + kNf4BlockSize);
      const int64_t pairs = (e1 - e0) / 2;  // whole bytes; blocks start at even elements
      const uint8_t* c = codes + e0 / 2;
      T* dst = o + e0;
      for (int64_t j = 0; j < pairs; ++j) {
        dst[2 * j] = lut[c[j] >> 4];
        dst[2 * j + 1] = lut[c[j] & 15];
      }
      if ((e1 - e0) % 2) dst[2 * pairs] = lut[c[pairs] >> 4];  // an odd count's last value
    }
  });
  return out.view(q.shape);
}

}  // namespace

torch::Tensor dequantize_nf4_ops(const Nf4Tensor& q, torch::ScalarType dtype) {
  const auto nf4 = table_on(nf4_values().data(), 16, q.device());
  const auto codes = q.codes.to(torch::kLong);
  // Element 2i is byte i's high nibble, 2i + 1 its low one.
  const auto pairs = torch::stack({codes.bitwise_right_shift(4), codes.bitwise_and(15)}, 1).view({-1});
  const int64_t padded = q.blocks() * kNf4BlockSize;
  auto values = nf4.index_select(0, pairs);
  values = values.numel() < padded ? torch::cat({values, values.new_zeros({padded - values.numel()})}) : values.narrow(0, 0, padded);
  const auto absmax = nf4_absmax(q).view({-1, 1});
  return values.view({-1, kNf4BlockSize}).mul(absmax).view({-1}).narrow(0, 0, q.numel).to(dtype).view(q.shape);
}

torch::Tensor dequantize_nf4(const Nf4Tensor& q, torch::ScalarType dtype) {
#ifdef LT_WITH_CUDA_KERNELS
  if (q.device().is_cuda() && q.double_quantized() && dtype == torch::kBFloat16) {
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty(q.shape, q.codes.options().dtype(torch::kBFloat16));
    const char* error = nf4_cuda::dequantize_bf16(
        q.codes.data_ptr<uint8_t>(), q.absmax_codes.data_ptr<uint8_t>(), q.absmax_scales.data_ptr<float>(),
        table_on(dynamic_map_values().data(), 256, q.device()).data_ptr<float>(),
        table_on(nf4_values().data(), 16, q.device()).data_ptr<float>(), q.absmax_offset.data_ptr<float>(), q.numel,
        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == nullptr, "dequantize_nf4: the CUDA kernel failed: ", error);
    return out;
  }
#endif
  if (!q.device().is_cpu()) return dequantize_nf4_ops(q, dtype);
  if (dtype == torch::kBFloat16) return dequantize_blocks<c10::BFloat16>(q);
  if (dtype == torch::kFloat32) return dequantize_blocks<float>(q);
  return dequantize_blocks<float>(q).to(dtype);  // rounded once, from f32
}

}  // namespace lt

