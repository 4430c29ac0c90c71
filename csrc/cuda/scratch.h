// Stream-ordered fp32 scratch for the CUDA ops (cudaMallocAsync on the op's stream), returned to the pool on every
// exit path, exceptions included: one definition for flash attention, the engine's attention and the GEMM fallback.
// Include it after cuda/check.h (and, in flash files, after flash_attention.cuh, which the warp emulator swaps).
#pragma once
#include <cstddef>

#include "cuda/check.h"

namespace fastgpt::cuda {

struct Scratch {
  float* ptr = nullptr;
  cudaStream_t stream;
  Scratch(size_t n, cudaStream_t s) : stream(s) {
    if (n) FASTGPT_CUDA_CHECK(cudaMallocAsync((void**)&ptr, n * sizeof(float), stream));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr) cudaFreeAsync(ptr, stream);  // no throw from a destructor
  }
};

}  // namespace fastgpt::cuda
