// Stream-ordered fp32 scratch for the CUDA ops (cudaMallocAsync on the op's stream), returned to the pool on every
// exit path, exceptions included: one definition for flash attention, the engine's attention and the GEMM fallback.
// Include it after cuda/check.h (and, in flash files, after flash_attention.cuh, which the warp emulator swaps).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cuda/check.h"

namespace fastgpt::cuda {

// Stream-ordered bytes from the current device's default pool. The first call on a device sets that pool's release
// threshold to "never": with the default (0) the pool unmaps freed memory at every synchronize, and every training
// step would map its scratch again. (The pool is ours alone: torch and CuPy keep their own caching allocators.)
inline void* pool_malloc(size_t bytes, cudaStream_t stream) {
  static std::atomic<uint64_t> configured{0};  // bit d: device d's pool is set up
  int dev = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !((configured.load() >> dev) & 1)) {
    cudaMemPool_t pool;
    FASTGPT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    FASTGPT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    if (dev < 64) configured.fetch_or(uint64_t(1) << dev);
  }
  void* p = nullptr;
  FASTGPT_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
  return p;
}

struct Scratch {
  float* ptr = nullptr;
  cudaStream_t stream;
  Scratch(size_t n, cudaStream_t s) : stream(s) {
    if (n) ptr = static_cast<float*>(pool_malloc(n * sizeof(float), stream));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr) cudaFreeAsync(ptr, stream);  // no throw from a destructor
  }
};

}  // namespace fastgpt::cuda
