// Token + position embedding, forward and backward (CPU reference).
// The backward scatters into rows of dwte chosen by the tokens, so two positions with the same token would race if
// threads split the positions. Threads split the channels instead: each owns a column range of dwte and walks every
// position in order, which is race-free and gives the same sums whatever the thread count.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

void encoder_forward(float* out, const int32_t* idx, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
    const float* tok = wte + (int64_t)idx[bt] * C;
    const float* pos = wpe + (bt % T) * C;
    float* o = out + bt * C;
#pragma omp simd
    for (int c = 0; c < C; c++) o[c] = tok[c] + pos[c];
  }
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* idx, int B, int T, int C) {
  constexpr int kCols = 16;  // one cache line of floats per thread slice: no false sharing between threads
  const int nblk = (C + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < nblk; blk++) {
    const int c0 = blk * kCols, c1 = c0 + kCols < C ? c0 + kCols : C;
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
      float* dst = dwte + (int64_t)idx[bt] * C;
      const float* src = dout + bt * C;
      for (int c = c0; c < c1; c++) dst[c] += src[c];
    }
  }
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; t++) {
    float* dst = dwpe + (int64_t)t * C;
    for (int b = 0; b < B; b++) {
      const float* src = dout + ((int64_t)b * T + t) * C;
#pragma omp simd
      for (int c = 0; c < C; c++) dst[c] += src[c];
    }
  }
}

}  // namespace fastgpt::cpu
