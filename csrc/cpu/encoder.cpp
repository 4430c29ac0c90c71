// Token + position embedding, forward and backward (CPU reference).
// The backward scatters into rows of dwte chosen by the tokens, so two positions with the same token would race if
// threads split the positions. Threads split the channels instead: each owns a column range of dwte and walks every
// position in order, which is race-free and gives the same sums whatever the thread count.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

template <typename S>
void encoder_forward(S* out, const int32_t* idx, const S* wte, const S* wpe, int B, int T, int C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
    const S* tok = wte + (int64_t)idx[bt] * C;
    const S* pos = wpe + (bt % T) * C;
    S* o = out + bt * C;
#pragma omp simd
    for (int c = 0; c < C; c++) o[c] = from_float<S>(to_float(tok[c]) + to_float(pos[c]));
  }
}

template <typename S>
void encoder_backward(float* dwte, float* dwpe, const S* dout, const int32_t* idx, int B, int T, int C) {
  constexpr int kCols = 16;  // one cache line of floats per thread slice: no false sharing between threads
  const int nblk = (C + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < nblk; blk++) {
    const int c0 = blk * kCols, c1 = c0 + kCols < C ? c0 + kCols : C;
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
      float* dst = dwte + (int64_t)idx[bt] * C;
      const S* src = dout + bt * C;
      for (int c = c0; c < c1; c++) dst[c] += to_float(src[c]);
    }
  }
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; t++) {
    float* dst = dwpe + (int64_t)t * C;
    for (int b = 0; b < B; b++) {
      const S* src = dout + ((int64_t)b * T + t) * C;
#pragma omp simd
      for (int c = 0; c < C; c++) dst[c] += to_float(src[c]);
    }
  }
}

#define FASTGPT_INSTANTIATE(S)                                                                   \
  template void encoder_forward<S>(S*, const int32_t*, const S*, const S*, int, int, int);       \
  template void encoder_backward<S>(float*, float*, const S*, const int32_t*, int, int, int);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
