// The engine's attention op on the CPU: the flash kernel (flash_attention.cpp) applied to the fused projection
// qkv (B, T, 3C) through strides, so no per-head copies of q, k, v are made here. 16-bit storage is widened into
// float scratch, attended in float, and the outputs rounded once.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

namespace {
// q, k, v inside qkv (B, T, 3C): head h of row t at column h*hs of its third; out (B, T, C) likewise.
HeadStrides qkv_strides(int T, int C, int NH) { return {(int64_t)T * 3 * C, C / NH, 3 * (int64_t)C}; }
HeadStrides out_strides(int T, int C, int NH) { return {(int64_t)T * C, C / NH, C}; }
}  // namespace

template <>
void attention_forward<float>(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, bool causal) {
  flash_attention_forward(out, out_strides(T, C, NH), lse, qkv, qkv + C, qkv + 2 * C, qkv_strides(T, C, NH),
                          {B, NH, T, C / NH, causal});
}

template <>
void attention_backward<float>(float* dqkv, const float* dout, const float* qkv, const float* out,
                               const float* lse, int B, int T, int C, int NH, bool causal, float* dbias) {
  flash_attention_backward(dqkv, dqkv + C, dqkv + 2 * C, qkv_strides(T, C, NH), dout, out, out_strides(T, C, NH),
                           qkv, qkv + C, qkv + 2 * C, lse, {B, NH, T, C / NH, causal});
  if (dbias) bias_backward(dbias, dqkv, (int64_t)B * T, 3 * C);
}

template <typename S>
void attention_forward(S* out, float* lse, const S* qkv, int B, int T, int C, int NH, bool causal) {
  const int64_t BT = (int64_t)B * T;
  float* o = scratch(1, BT * C);
  attention_forward<float>(o, lse, widened(0, qkv, BT * 3 * C), B, T, C, NH, causal);
  narrow(out, o, BT * C);
}

template <typename S>
void attention_backward(S* dqkv, const S* dout, const S* qkv, const S* out, const float* lse, int B, int T, int C,
                        int NH, bool causal, float* dbias) {
  const int64_t BT = (int64_t)B * T;
  float* d = scratch(3, BT * 3 * C);
  attention_backward<float>(d, widened(0, dout, BT * C), widened(1, qkv, BT * 3 * C), widened(2, out, BT * C), lse,
                            B, T, C, NH, causal, nullptr);
  narrow(dqkv, d, BT * 3 * C);
  if (dbias) bias_backward(dbias, (const S*)dqkv, BT, 3 * C);  // of the rounded dqkv, as matmul_backward sums it
}

#define FASTGPT_INSTANTIATE(S)                                                                                   \
  template void attention_forward<S>(S*, float*, const S*, int, int, int, int, bool);                           \
  template void attention_backward<S>(S*, const S*, const S*, const S*, const float*, int, int, int, int, bool, \
                                      float*);
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
