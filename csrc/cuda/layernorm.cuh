// One row of LayerNorm by one warp (eps 1e-5, biased variance, two passes in float), shared by layernorm.cu and
// residual_layernorm.cu: with one body for both, the fused residual + LayerNorm gives the unfused path's bits.
// Two forms of the row. layernorm_row takes any width and reads the row from memory for each of its passes (lane l
// owns columns l, l + 32, ...). layernorm_row_packs keeps the row in registers from its load to its output, so the
// row is read once: lane l owns the 16-byte packs l, l + 32, ... (columns (32 k + l) P .. + P - 1), which needs C a
// multiple of P and at most kLayerNormMaxPackedCols (layernorm_row_fits). The two sum in different orders, so the
// callers pick one by C alone (and the process-wide layernorm_one_pass switch), never by alignment: an unaligned
// view takes the packed order through single-element loads (RowPack::vec), so fused and unfused calls on the same
// row agree bit for bit whatever their views' alignment.
// CUDA-only header: include it from .cu files.
#pragma once
#include "cpu/dtype.h"
#include "cuda/storage.cuh"
#include "cuda/warp.cuh"

namespace fastgpt::cuda {

constexpr float kLayerNormEps = 1e-5f;
// The widest row the packed forms keep in registers: 32 columns per lane (the backward also keeps 64 sums).
constexpr int kLayerNormMaxPackedCols = 1024;

template <typename S>
constexpr bool layernorm_row_fits(int C) {
  return C > 0 && C % Pack<S>::N == 0 && C <= kLayerNormMaxPackedCols;
}

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

// Packs of a row in the packed order, through PackIO (16-byte accesses where every view is aligned, else single
// elements into the same registers).
template <typename S>
struct RowPack : PackIO<S> {
  static constexpr int P = Pack<S>::N;
  static constexpr int K = kLayerNormMaxPackedCols / (32 * P);  // packs per lane at most: 4 (16-bit), 8 (float)
};

// The packed row. make(c) gives the pack at column c, one of lane `lane`'s ((32 k + lane) P < C), in order: the
// caller loads it, or forms it and writes it where it belongs. Each is summed as it comes and kept in registers for
// the variance and the output, so every caller sums a row in the same order. Same arithmetic as layernorm_row,
// values taken from registers. All 32 lanes must call.
template <typename S, typename Make>
__device__ __forceinline__ void layernorm_row_packs(S* o, float* mean, float* rstd, const S* weight, const S* bias,
                                                    int C, int lane, RowPack<S> io, Make make) {
  constexpr int P = RowPack<S>::P, K = RowPack<S>::K;
  Pack<S> x[K];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int c = (32 * k + lane) * P;
    if (c < C) {
      x[k] = make(c);
#pragma unroll
      for (int e = 0; e < P; e++) s += to_float(x[k].v[e]);
    }
  }
  const float m = warp_sum(s) / C;
  float v = 0.f;
#pragma unroll
  for (int k = 0; k < K; k++)
    if ((32 * k + lane) * P < C) {
#pragma unroll
      for (int e = 0; e < P; e++) {
        const float d = to_float(x[k].v[e]) - m;
        v += d * d;
      }
    }
  const float r = 1.f / sqrtf(warp_sum(v) / C + kLayerNormEps);
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int c = (32 * k + lane) * P;
    if (c < C) {
      const Pack<S> w = io.load(weight + c), b = io.load(bias + c);
      Pack<S> y;
#pragma unroll
      for (int e = 0; e < P; e++)
        y.v[e] = from_float<S>((to_float(x[k].v[e]) - m) * r * to_float(w.v[e]) + to_float(b.v[e]));
      io.store(o + c, y);
    }
  }
  if (lane == 0) {
    *mean = m;
    *rstd = r;
  }
}

}  // namespace fastgpt::cuda
