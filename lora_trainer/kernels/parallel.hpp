// at::parallel_for for the library's CPU kernels (the fused loss, the causal softmax, the fused AdamW,
// NF4, attention's batched products), and the check that it can run on more than one thread.
//
// at::parallel_for is a template: its parallel branch is compiled in the file that calls it. With
// LibTorch's OpenMP backend (Debian's LibTorch, PyTorch's wheels: AT_PARALLEL_OPENMP) that branch is a
// `#pragma omp parallel`, which a file built without OpenMP drops: the loop then runs on the calling
// thread alone, whatever runtime/threads says, and nothing tells. CMakeLists.txt builds the library
// with OpenMP (the libgomp LibTorch and OpenBLAS already use, so one pool of threads); a file that
// includes this header without it does not compile.
#pragma once

#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "at::parallel_for would run on one thread: build this file with OpenMP (OpenMP::OpenMP_CXX, CMakeLists.txt)"
#endif
