// The launches of the fused loss's CUDA kernels (cross_entropy_cuda.hpp says what they compute; the
// kernels are in cross_entropy_cuda_kernels.cuh, which tests/kernels/ also runs on the CPU).
#include "lora_trainer/kernels/cross_entropy_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>

#include "lora_trainer/kernels/cross_entropy_cuda_kernels.cuh"

namespace lt::cuda_kernels {

namespace {

const char* launched() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

const char* cross_entropy_forward(const uint16_t* logits, int64_t N, int64_t V, int64_t row_stride,
                                  const int64_t* targets, float* lse, float* row_loss, void* stream) {
  if (N == 0) return nullptr;
  if (N > INT_MAX) return "more rows than one kernel launch takes (2^31 - 1)";
  auto s = static_cast<cudaStream_t>(stream);
  if (vectors_fit(V, row_stride, logits))
    forward_kernel<true><<<static_cast<unsigned>(N), kThreads, 0, s>>>(logits, V, row_stride, targets, lse, row_loss);
  else
    forward_kernel<false><<<static_cast<unsigned>(N), kThreads, 0, s>>>(logits, V, row_stride, targets, lse, row_loss);
  return launched();
}

const char* cross_entropy_backward(const uint16_t* logits, int64_t N, int64_t V, int64_t row_stride,
                                   const int64_t* targets, const float* lse, const float* g, uint16_t* grad,
                                   void* stream) {
  if (N == 0) return nullptr;
  if (N > INT_MAX) return "more rows than one kernel launch takes (2^31 - 1)";
  if (static_cast<const void*>(grad) == static_cast<const void*>(logits) && row_stride != V)
    return "the gradient written over logits whose rows are not contiguous";
  auto s = static_cast<cudaStream_t>(stream);
  if (vectors_fit(V, row_stride, logits, grad))
    backward_kernel<true><<<static_cast<unsigned>(N), kThreads, 0, s>>>(logits, V, row_stride, targets, lse, g, grad);
  else
    backward_kernel<false><<<static_cast<unsigned>(N), kThreads, 0, s>>>(logits, V, row_stride, targets, lse, g, grad);
  return launched();
}

}  // namespace lt::cuda_kernels
