// Tolerances that follow from the computation, for tests that compare two float32 evaluations of the
// same products summed in different orders (another BLAS or oneDNN kernel, another CPU's vector width,
// the product cut in blocks). A fixed 1e-6 passes on the CPU a test was written on and fails on
// another (an AVX2-only EPYC summed a blocked product's gradient in another order): the bound here is
// Higham's for a dot product of length k, |fl(x.w) - x.w| <= gamma_k |x|.|w| with gamma_k ~ k u,
// taken for each of the two evaluations compared.
#pragma once

#include <sstream>
#include <string>

#include <torch/torch.h>

namespace lt::test {

// float32's unit roundoff, 2^-24.
inline constexpr double kF32UnitRoundoff = 5.9604644775390625e-08;

// The bound, per element, on the difference of two float32 evaluations of x w^T (+ b): x (..., k),
// w (n, k), b (n) or undefined. 2 (k + 1) u (|x| |w|^T + |b|), computed in float64.
inline torch::Tensor linear_rounding_bound(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {}) {
  const auto ax = x.detach().to(torch::kFloat64).abs(), aw = w.detach().to(torch::kFloat64).abs();
  auto magnitude = torch::matmul(ax, aw.t());
  if (b.defined()) magnitude = magnitude + b.detach().to(torch::kFloat64).abs();
  return magnitude * (2.0 * static_cast<double>(x.size(-1) + 1) * kF32UnitRoundoff);
}

// "" when |got - want| <= bound everywhere; otherwise where the worst excess is, for the test's message.
inline std::string outside_bound(const torch::Tensor& got, const torch::Tensor& want, const torch::Tensor& bound) {
  const auto diff = (got.detach().to(torch::kFloat64) - want.detach().to(torch::kFloat64)).abs();
  const auto excess = (diff - bound).reshape({-1});
  const int64_t worst = excess.argmax().item<int64_t>();
  if (excess[worst].item<double>() <= 0.0) return "";
  std::ostringstream s;
  s.precision(9);
  s << "element " << worst << ": difference " << diff.reshape({-1})[worst].item<double>() << " over its bound "
    << bound.reshape({-1})[worst].item<double>();
  return s.str();
}

}  // namespace lt::test
