// How much dynamic shared memory a block may take on the current device when `blocks` of them are to share an SM:
// the kernels that keep rows in shared memory (cross-entropy's row copy, the LayerNorm backward's ring) choose
// between that form and their register form by it, and set it as the kernel's cap. And how many SMs there are.
// CUDA-only header: include it from .cu files (the warp emulator stands in for the device attributes).
#pragma once
#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/check.h"

namespace fastgpt::cuda {

// The SM's shared memory (cudaDevAttrMaxSharedMemoryPerMultiprocessor: 228 KB on sm_90, 164 KB on sm_80, 100 KB on
// sm_86/89) split `blocks` ways, less the 1 KB the runtime reserves a block, within the opt-in limit a block
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), both less `slack` bytes for the kernel's static arrays.
inline int64_t smem_for_blocks(int blocks, int64_t slack) {
  int device = 0, per_sm = 0, per_block = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return std::min<int64_t>(per_sm / blocks - 1024, per_block) - slack;
}

// The current device's SMs (at least 1): the grid of the kernels whose blocks take their work in turn (the
// persistent flash attention kernels, the LayerNorm backward), the delta pass's cap.
inline int sm_count() {
  int device = 0, sms = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(sms, 1);
}

}  // namespace fastgpt::cuda
