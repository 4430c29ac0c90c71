// nn.Linear on the CPU: out = inp @ weight^T + bias, and its backward, all three products through cpu::sgemm.
// The weight gradient accumulates (beta = 1), which is what makes gradient accumulation over micro-batches free.
#include "cpu/gemm.h"
#include "cpu/kernels.h"

namespace fastgpt::cpu {

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                    int OC) {
  float beta = 0.f;
  if (bias) {
    // Seed every row with the bias and let the product add onto it: one pass fewer than adding afterwards.
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      float* o = out + n * OC;
#pragma omp simd
      for (int j = 0; j < OC; j++) o[j] = bias[j];
    }
    beta = 1.f;
  }
  sgemm(false, true, N, OC, C, 1.f, inp, C, weight, C, beta, out, OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int C, int OC) {
  if (dinp) sgemm(false, false, N, C, OC, 1.f, dout, OC, weight, C, 0.f, dinp, C);  // (N,OC) @ (OC,C)
  sgemm(true, false, OC, C, N, 1.f, dout, OC, inp, C, 1.f, dweight, C);            // (OC,N) @ (N,C)
  if (dbias) {
    // Column sums of dout; threads own column blocks and walk the rows in order (deterministic).
    constexpr int kCols = 64;
    const int nblk = (OC + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblk; blk++) {
      const int j0 = blk * kCols, w = j0 + kCols < OC ? kCols : OC - j0;
      double acc[kCols] = {};
      for (int64_t n = 0; n < N; n++) {
        const float* row = dout + n * OC + j0;
#pragma omp simd
        for (int j = 0; j < w; j++) acc[j] += row[j];
      }
      for (int j = 0; j < w; j++) dbias[j0 + j] += (float)acc[j];
    }
  }
}

}  // namespace fastgpt::cpu
