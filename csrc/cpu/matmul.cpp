// nn.Linear on the CPU: out = inp @ weight^T + bias, and its backward, all three products through cpu::sgemm; and
// the pair the fused model's MLP runs with GELU on the GPU's epilogues (matmul_forward_gelu, matmul_backward_dgelu).
// The weight gradient accumulates (beta = 1), which is what makes gradient accumulation over micro-batches free.
// 16-bit operands are widened exactly into float scratch and the product runs in float: a 16-bit GEMM with fp32
// accumulation, the output rounded once, as a tensor-core GEMM does.
#include <algorithm>

#include "cpu/gemm.h"
#include "cpu/kernels.h"

namespace fastgpt::cpu {

namespace {
// Rows at or below which the forward is a matrix-vector product per row (generation's decode step: one position per
// sequence): the weight streams through once, row by row, each output a contiguous dot product. sgemm's packing
// of the weight costs more than the product itself at these sizes. Chosen by the shape alone: deterministic.
constexpr int64_t kGemvRows = 4;

void gemv_rows(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C, int OC) {
#pragma omp parallel for schedule(static)
  for (int o = 0; o < OC; o++) {
    const float* w = weight + (int64_t)o * C;
    for (int64_t n = 0; n < N; n++) {
      const float* x = inp + n * C;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int c = 0; c < C; c++) s += x[c] * w[c];
      out[n * OC + o] = bias ? s + bias[o] : s;
    }
  }
}
}  // namespace

template <>
void matmul_forward<float>(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                           int OC) {
  if (N <= kGemvRows) return gemv_rows(out, inp, weight, bias, N, C, OC);
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

template <>
void matmul_backward<float>(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, int64_t N, int C, int OC) {
  if (dinp) sgemm(false, false, N, C, OC, 1.f, dout, OC, weight, C, 0.f, dinp, C);  // (N,OC) @ (OC,C)
  sgemm(true, false, OC, C, N, 1.f, dout, OC, inp, C, 1.f, dweight, C);            // (OC,N) @ (N,C)
  if (dbias) bias_backward(dbias, dout, N, OC);
}

namespace {
// Rows per block of the 16-bit paths, so that no widened operand of a block passes 2^24 floats (64 MiB): the
// classifier's (B*T, V) logits are never copied whole. Fixed by the shapes alone, so results stay deterministic.
int64_t block_rows(int64_t N, int64_t width) {
  return std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(1) << 24) / width));
}
}  // namespace

template <typename S>
void matmul_forward(S* out, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC) {
  const float* w = widened(0, weight, (int64_t)OC * C);
  const float* b = bias ? widened(2, bias, OC) : nullptr;
  const int64_t rows = block_rows(N, std::max(C, OC));
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t n = std::min(rows, N - r0);
    float* o = scratch(3, n * OC);
    matmul_forward<float>(o, widened(1, inp + r0 * C, n * C), w, b, n, C, OC);
    narrow(out + r0 * OC, o, n * OC);
  }
}

template <typename S>
void matmul_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight, int64_t N,
                     int C, int OC) {
  const float* w = widened(0, weight, (int64_t)OC * C);
  const int64_t rows = block_rows(N, std::max(C, OC));
  for (int64_t r0 = 0; r0 < N; r0 += rows) {  // dweight accumulates block by block, in block order
    const int64_t n = std::min(rows, N - r0);
    float* dx = dinp ? scratch(3, n * C) : nullptr;
    matmul_backward<float>(dx, dweight, nullptr, widened(2, dout + r0 * OC, n * OC), widened(1, inp + r0 * C, n * C),
                           w, n, C, OC);
    if (dinp) narrow(dinp + r0 * C, dx, n * C);
  }
  if (dbias) bias_backward(dbias, dout, N, OC);  // over all rows at once, as the LayerNorm's dinp_sum takes it
}

#define FASTGPT_INSTANTIATE(S)                                                                              \
  template void matmul_forward<S>(S*, const S*, const S*, const S*, int64_t, int, int);                     \
  template void matmul_backward<S>(S*, float*, float*, const S*, const S*, const S*, int64_t, int, int);
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

// The MLP's GELU with the products around it: on the CPU the two ops in turn, so the fused model keeps the unfused
// model's bits here (the GPU runs each pair as one cuBLASLt call with a GELU epilogue).
template <typename S>
void matmul_forward_gelu(S* out, S* pre, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC) {
  matmul_forward(pre, inp, weight, bias, N, C, OC);
  gelu_forward(out, (const S*)pre, N * OC);
}

template <typename S>
void matmul_backward_dgelu(S* dpre, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                           const S* pre, int64_t N, int C, int OC) {
  matmul_backward(dpre, dweight, dbias, dout, inp, weight, N, C, OC);
  gelu_backward(dpre, pre, (const S*)dpre, N * C);
}

#define FASTGPT_INSTANTIATE(S)                                                                                    \
  template void matmul_forward_gelu<S>(S*, S*, const S*, const S*, const S*, int64_t, int, int);                  \
  template void matmul_backward_dgelu<S>(S*, float*, float*, const S*, const S*, const S*, const S*, int64_t, int, \
                                         int);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
