// NF4: the 4-bit NormalFloat storage of a frozen weight that QLoRA introduced, as bitsandbytes stores
// it (quantize_4bit / dequantize_4bit with quant_type="nf4"), so that a base kept this way holds the
// same codes and scales that PEFT + bitsandbytes would hold for it.
//
//   blocks     the weight's elements in row-major order, in blocks of 64 (the last block may be partial);
//              each block's absmax = max |x| over it.
//   codes      x * (1 / absmax) (a multiplication by the reciprocal, as bitsandbytes' kernel does),
//              mapped to the nearest of the 16 NF4 values by the midpoints between them, a value on a
//              midpoint going to the lower code (bitsandbytes' decision tree); an all-zero block
//              (absmax 0: 0 * inf is NaN) gets code 0, which dequantizes to -0.0 * 0 = zero.
//              Two codes a byte, element 2i in the high nibble of byte i (an odd count leaves the last
//              low nibble 0).
//   double quantization (QLoRA's, bitsandbytes' compress_statistics): the absmax values minus their
//              mean (offset, f32; summed in double in a fixed order, so it does not depend on threads)
//              are quantized in blocks of 256 with bitsandbytes' signed dynamic 8-bit map: per block the absmax of (absmax - offset), and each value times its
//              reciprocal mapped to the nearest map entry (binary search, ties to the searched pivot
//              as bitsandbytes' dQuantize). About 0.127 bits an element instead of 0.5.
//   dequantize NF4[code] * absmax in f32 (absmax = map[absmax code] * block scale + offset with double
//              quantization), rounded once to the output dtype: on the CPU a loop over the codes, on CUDA
//              (a build with the project's kernels) nf4_cuda.cu's kernel, elsewhere the same arithmetic
//              in tensor operations (dequantize_nf4_ops); the three give the same bits.
//
// The quantization runs over the weight in chunks of rows, so a 128256 x 4096 matrix never needs an f32
// copy of itself.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace lt {

inline constexpr int64_t kNf4BlockSize = 64;        // elements per absmax
inline constexpr int64_t kNf4AbsmaxBlockSize = 256;  // absmax values per scale (double quantization)

// bitsandbytes' 16 NF4 values (create_normal_map with offset 0.9677083), ascending; code i is entry i.
const std::array<float, 16>& nf4_values();
// The code of a normalised value x (in [-1, 1]): the nearest NF4 value, a midpoint going to the lower.
uint8_t nf4_code(float x);
// bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): 256 values, sorted.
const std::array<float, 256>& dynamic_map_values();
// The index of the nearest entry of dynamic_map_values() to x (in [-1, 1]), as bitsandbytes' dQuantize.
uint8_t dynamic_map_code(float x);
// codes[i] = dynamic_map_code(x[i] * scale) for i < n, vectorised (the double quantization's loop).
void dynamic_map_codes(const float* x, float scale, int64_t n, uint8_t* codes);

// A weight stored as NF4.
// The bytes a double-quantized NF4 storage of `shape` holds (Nf4Tensor::bytes() of one): its codes, the
// absmax codes, their scales and offset.
int64_t nf4_bytes(const std::vector<int64_t>& shape);

struct Nf4Tensor {
  std::vector<int64_t> shape;
  int64_t numel = 0;
  torch::Tensor codes;          // uint8 (ceil(numel / 2))
  torch::Tensor absmax;         // f32 (blocks), without double quantization; undefined with it
  torch::Tensor absmax_codes;   // uint8 (blocks), with double quantization
  torch::Tensor absmax_scales;  // f32 (ceil(blocks / 256)), with double quantization
  torch::Tensor absmax_offset;  // f32 (1), with double quantization: the mean of the absmax values
  bool double_quantized() const { return absmax_codes.defined(); }
  int64_t blocks() const { return (numel + kNf4BlockSize - 1) / kNf4BlockSize; }
  // Bytes held: codes and scales.
  int64_t bytes() const;
  // The same storage on `device` (codes and scales copied; the shape kept).
  Nf4Tensor to(const torch::Device& device) const;
  // A double-quantized storage of `shape` on `device`, every code and scale zero: the layout (each
  // tensor's size and dtype) a weight of that shape has.
  static Nf4Tensor zeros(const std::vector<int64_t>& shape, const torch::Device& device);
  // A double-quantized storage's tensors by field name: "codes", "absmax_codes", "absmax_scales",
  // "absmax_offset" (what a checkpoint stores as nf4/<weight>.<field>).
  std::vector<std::pair<const char*, torch::Tensor*>> fields();
  torch::Device device() const { return codes.device(); }
  // Becomes `q`: its values copied into this storage's own tensors where both are double-quantized with
  // the same layout on one device (nothing allocated stays beside them), else its tensors taken.
  void fill_from(Nf4Tensor q);
};

// W (any float dtype, on any device) as NF4, on W's device: a loop over chunks on the CPU, tensor
// operations elsewhere (quantize_nf4_ops); the double quantization of the absmax values on the CPU.
Nf4Tensor quantize_nf4(const torch::Tensor& W, bool double_quant = true);
// The same in tensor operations on any device: what quantize_nf4 runs on a GPU; the same bits.
Nf4Tensor quantize_nf4_ops(const torch::Tensor& W, bool double_quant = true);
// The per-block absmax, f32 (blocks), on the storage's device.
torch::Tensor nf4_absmax(const Nf4Tensor& q);
// The weight back, computed in f32 and rounded once to `dtype`, on the storage's device.
torch::Tensor dequantize_nf4(const Nf4Tensor& q, torch::ScalarType dtype = torch::kBFloat16);
// The same in tensor operations (any device): what dequantize_nf4 runs where it has no kernel.
torch::Tensor dequantize_nf4_ops(const Nf4Tensor& q, torch::ScalarType dtype = torch::kBFloat16);

}  // namespace lt
