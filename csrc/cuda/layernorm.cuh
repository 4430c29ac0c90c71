// One row of LayerNorm by one warp (eps 1e-5, biased variance, two passes in float), shared by layernorm.cu and
// residual_layernorm.cu: with one body for both, the fused residual + LayerNorm gives the unfused path's bits.
// CUDA-only header: include it from .cu files.
#pragma once
#include "cpu/dtype.h"
#include "cuda/warp.cuh"

namespace fastgpt::cuda {

constexpr float kLayerNormEps = 1e-5f;

// Lane `lane` owns columns lane, lane + 32, ...; s is its partial sum of x over those columns, in that order (the
// caller forms it while it loads or makes the row). x may be memory this lane just wrote: only its own columns are
// read back. All 32 lanes must call.
template <typename S>
__device__ __forceinline__ void layernorm_row(S* o, float* mean, float* rstd, const S* x, const S* weight,
                                              const S* bias, int C, int lane, float s) {
  const float m = warp_sum(s) / C;
  float v = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float d = to_float(x[c]) - m;
    v += d * d;
  }
  const float r = 1.f / sqrtf(warp_sum(v) / C + kLayerNormEps);  // IEEE sqrt and divide: closer to the CPU than rsqrtf
  for (int c = lane; c < C; c += 32)
    o[c] = from_float<S>((to_float(x[c]) - m) * r * to_float(weight[c]) + to_float(bias[c]));
  if (lane == 0) {
    *mean = m;
    *rstd = r;
  }
}

}  // namespace fastgpt::cuda
