// Warp-wide reductions over all 32 lanes (full mask: callers keep every lane in the call). Butterfly shuffles, so
// every lane ends with the same result, summed in the same fixed order on every run.
#pragma once

namespace fastgpt::cuda {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace fastgpt::cuda
