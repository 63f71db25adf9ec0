#include "lora_trainer/kernels/adamw.hpp"

#include <cmath>

#include "lora_trainer/kernels/vector_math.hpp"

namespace lt {

namespace {

// Plain loops the compiler vectorises (vector_math.hpp; this file is also built with -fno-math-errno,
// so the square root is a vector instruction).
LT_VECTOR_KERNEL void adamw_chunk(float* __restrict p, const float* __restrict g, float* __restrict m,
                                  float* __restrict v, int64_t n, const AdamWScalars& s) {
  const float decay = s.decay, b1 = s.beta1, b2 = s.beta2, c1 = s.one_minus_beta1, c2 = s.one_minus_beta2;
  const float inv = s.inv_sqrt_bc2, eps = s.eps, step = s.step_size;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i] * b1 + c1 * gi;
    const float vi = v[i] * b2 + c2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step * (mi / (std::sqrt(vi) * inv + eps));
  }
}

LT_VECTOR_KERNEL double squares_sum(const float* __restrict x, int64_t n) {
  // f32 lanes over blocks of 1024 values (short enough that f32 loses nothing that matters), the
  // blocks summed in double, in order.
  double total = 0.0;
  for (int64_t b = 0; b < n; b += 1024) {
    const int64_t e = b + 1024 < n ? b + 1024 : n;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b; i < e; ++i) s += x[i] * x[i];
    total += s;
  }
  return total;
}

LT_VECTOR_DISPATCH(adamw_chunk)
LT_VECTOR_DISPATCH(squares_sum)

}  // namespace

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
  adamw_chunk_dispatch(p, g, m, v, n, s);
}

double sum_of_squares(const float* x, int64_t n) { return squares_sum_dispatch(x, n); }

}  // namespace lt
