// A linear layer's bias gradient on the CPU: dbias (OC) += the column sums of dout (N, OC), for matmul_backward
// (matmul.cpp) and for the LayerNorm backward's dinp_sum (layernorm.cpp: the fused model's residual projections),
// so that the two give one set of bits. Its own file, as cuda/matmul_bias.cu is, so that the warp emulator
// (tests/warp_emu), which compiles the CPU LayerNorm beside the kernels, needs no GEMM.
// Every column is summed in double over the rows in order: the reference order, whatever the thread count.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

template <typename S>
void bias_backward(float* dbias, const S* dout, int64_t N, int OC) {
  // Column sums of dout; threads own column blocks and walk the rows in order (deterministic).
  constexpr int kCols = 64;
  const int nblk = (OC + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < nblk; blk++) {
    const int j0 = blk * kCols, w = j0 + kCols < OC ? kCols : OC - j0;
    double acc[kCols] = {};
    for (int64_t n = 0; n < N; n++) {
      const S* row = dout + n * OC + j0;
#pragma omp simd
      for (int j = 0; j < w; j++) acc[j] += to_float(row[j]);
    }
    for (int j = 0; j < w; j++) dbias[j0 + j] += (float)acc[j];
  }
}
template void bias_backward<float>(float*, const float*, int64_t, int);
template void bias_backward<bf16>(float*, const bf16*, int64_t, int);
template void bias_backward<f16>(float*, const f16*, int64_t, int);

}  // namespace fastgpt::cpu
