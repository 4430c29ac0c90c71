// nn.Linear on the GPU: out = inp @ weight^T + bias, and its backward; the twin of csrc/cpu/matmul.cpp.
// The three products go through the cuBLASLt wrapper (the forward bias rides in its epilogue; the fused model's
// MLP also its GELU, forward and backward, in 16-bit storage). The bias gradient, a column sum of dout, is by
// default our own kernel (matmul_bias.cu: no atomics, every sum in an order that depends on N alone, never on the
// GPU or the launch). In 16-bit storage set_bias_grad_epilogue(true) makes it the epilogue of the weight gradient's
// product instead (cuBLASLt's BGRADB; its C is fp32, so the sum is too), added to dbias by bias_add. That was the
// default until the 2026-11-26 H200 run: there cuBLASLt ran the epilogue as a second pass over dout anyway (its
// own kernel, no faster than our column sums then were), and the products that carried it took 1.3 ms more per
// step of GPT-2 124M at B 64 (BENCHMARKS.md). (cuBLASLt documents bitwise repeatable results on one GPU model.)
// Templates over the storage type S: float runs fp32 GEMMs (CUBLAS_COMPUTE_32F, or _FAST_TF32 when tf32 is asked
// for); bf16/fp16 run 16-bit A/B with fp32 accumulation (CUBLAS_COMPUTE_32F): out and dinp are written in S
// (rounded once, the forward bias in S through the epilogue), dweight is an fp32 C accumulated with beta = 1, and
// dbias sums the widened 16-bit dout into float (the kernel's sums in the same fixed order as for float).
#include <atomic>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/cublaslt.h"
#include "cuda/ops.h"
#include "cuda/scratch.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {

// Read by every matmul_backward (set_bias_grad_epilogue): benchmarks and tests compare the two bias gradients.
std::atomic<bool> g_bias_grad_epilogue{false};

// The GEMM types of one precision: A/B (and the forward's C and bias) in S; tf32 applies to float only.
template <typename S>
GemmTypes gemm_types(bool tf32) {
  GemmTypes t;
  t.a = t.b = t.c = t.bias = data_type<S>();
  t.compute = std::is_same_v<S, float> && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  return t;
}

}  // namespace

template <typename S>
void matmul_forward(S* out, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC, Stream stream,
                    bool tf32) {
  // out (N, OC) = inp (N, C) @ weight^T, weight stored (OC, C): B transposed.
  gemm(false, true, N, OC, C, 1.f, inp, C, weight, C, 0.f, out, OC, bias, stream, gemm_types<S>(tf32));
}

template <typename S>
void matmul_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight, int64_t N,
                     int C, int OC, Stream stream, bool tf32) {
  const GemmTypes t = gemm_types<S>(tf32);
  // dinp (N, C) = dout (N, OC) @ weight (OC, C), overwritten, in S.
  if (dinp) gemm(false, false, N, C, OC, 1.f, dout, OC, weight, C, 0.f, dinp, C, nullptr, stream, t);
  // dweight (OC, C) += dout^T (OC, N) @ inp (N, C): A = dout stored (N, OC), transposed; beta = 1 accumulates into
  // the fp32 gradient whatever S is (16-bit A/B with an fp32 C/D).
  GemmTypes tw = t;
  tw.c = tw.bias = CUDA_R_32F;
  // 16-bit only: with fp32 operands on TF32 tensor cores, whether BGRADB sums dout or its TF32 rounding is not
  // documented, and float (the reference precision) keeps the kernel's fixed-order fp32 sum.
  if (dbias && !std::is_same_v<S, float> && g_bias_grad_epilogue.load() && N > 0 && OC > 0) {
    Scratch sums((size_t)OC, stream);  // the epilogue writes; dbias accumulates over micro-steps
    if (gemm_bias_grad(true, false, OC, C, N, 1.f, dout, OC, inp, C, 1.f, dweight, C, sums.ptr, stream, tw)) {
      bias_add(dbias, sums.ptr, OC, stream);
      return;
    }
  }
  gemm(true, false, OC, C, N, 1.f, dout, OC, inp, C, 1.f, dweight, C, nullptr, stream, tw);
  if (dbias) bias_backward(dbias, dout, N, OC, stream);
}

bool bias_grad_epilogue() { return g_bias_grad_epilogue.load(); }
bool set_bias_grad_epilogue(bool on) { return g_bias_grad_epilogue.exchange(on); }

// The MLP's GELU in the products around it (16-bit storage): cuBLASLt applies it to the fp32 accumulator and
// rounds once, where the unfused kernels round the pre-activation first and then its GELU. float (fp32, tf32)
// keeps the GELU kernels, which are the CPU's arithmetic: the reference precision stays exact.
template <typename S>
void matmul_forward_gelu(S* out, S* pre, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC,
                         Stream stream, bool tf32) {
  if (!std::is_same_v<S, float> &&
      gemm_gelu(GeluEpilogue::forward, false, true, N, OC, C, inp, C, weight, C, out, OC, bias, pre, OC, stream,
                gemm_types<S>(tf32)))
    return;
  matmul_forward(pre, inp, weight, bias, N, C, OC, stream, tf32);
  gelu_forward(out, (const S*)pre, N * OC, stream);
}

template <typename S>
void matmul_backward_dgelu(S* dpre, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                           const S* pre, int64_t N, int C, int OC, Stream stream, bool tf32) {
  // dpre (N, C) = (dout (N, OC) @ weight (OC, C)) * gelu'(pre): the GELU's backward as the product's epilogue.
  const bool fused = !std::is_same_v<S, float> &&
                     gemm_gelu(GeluEpilogue::backward, false, false, N, C, OC, dout, OC, weight, C, dpre, C, nullptr,
                               const_cast<S*>(pre), C, stream, gemm_types<S>(tf32));
  matmul_backward(fused ? nullptr : dpre, dweight, dbias, dout, inp, weight, N, C, OC, stream, tf32);
  if (!fused) gelu_backward(dpre, pre, (const S*)dpre, N * C, stream);
}

#define FASTGPT_INSTANTIATE(S)                                                                                  \
  template void matmul_forward<S>(S*, const S*, const S*, const S*, int64_t, int, int, Stream, bool);           \
  template void matmul_backward<S>(S*, float*, float*, const S*, const S*, const S*, int64_t, int, int, Stream, \
                                   bool);                                                                       \
  template void matmul_forward_gelu<S>(S*, S*, const S*, const S*, const S*, int64_t, int, int, Stream, bool);  \
  template void matmul_backward_dgelu<S>(S*, float*, float*, const S*, const S*, const S*, const S*, int64_t,   \
                                         int, int, Stream, bool);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
