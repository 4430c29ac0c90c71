// Token + position embedding, forward and backward (CPU reference).
// The backward scatters into rows of dwte chosen by the tokens, so two positions with the same token would race if
// threads split the positions. Threads split the channels instead: each owns a column range of dwte and walks every
// position in order, which is race-free and gives the same sums whatever the thread count. dwte's adds follow the
// pieces of kEncoderPiece sorted indices (cpu/kernels.h), the order the GPU's warps can share a long run in: a row
// in its token's first piece goes onto dwte, a row in a later piece onto that piece's partial sum (from +0), and the
// partial sums go onto dwte afterwards, piece by piece in sorted order.
#include <algorithm>
#include <numeric>
#include <vector>

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
  const int64_t BT = (int64_t)B * T;
  // piece[bt]: -1 for a row in its token's first piece, else its piece (sorted index / kEncoderPiece).
  std::vector<int64_t> order(BT);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
  std::vector<int64_t> piece(BT, -1);
  for (int64_t i = 0, start = 0; i < BT; i++) {
    if (i > 0 && idx[order[i]] != idx[order[i - 1]]) start = i;
    if (i / kEncoderPiece != start / kEncoderPiece) piece[order[i]] = i / kEncoderPiece;
  }
  const int64_t npiece = (BT + kEncoderPiece - 1) / kEncoderPiece;
  std::vector<float> partial(npiece > 1 ? (size_t)npiece * C : 0, 0.0f);  // (npiece, C), row p: piece p's sum
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < nblk; blk++) {
    const int c0 = blk * kCols, c1 = c0 + kCols < C ? c0 + kCols : C;
    for (int64_t bt = 0; bt < BT; bt++) {
      float* dst = piece[bt] < 0 ? dwte + (int64_t)idx[bt] * C : partial.data() + piece[bt] * C;
      const S* src = dout + bt * C;
      for (int c = c0; c < c1; c++) dst[c] += to_float(src[c]);
    }
  }
  for (int64_t p = 1; p < npiece; p++) {
    const int64_t i = p * kEncoderPiece;  // the piece's first sorted index: mid-run if its token is the one before
    if (idx[order[i]] != idx[order[i - 1]]) continue;
    float* dst = dwte + (int64_t)idx[order[i]] * C;
    for (int c = 0; c < C; c++) dst[c] += partial[(size_t)p * C + c];
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
