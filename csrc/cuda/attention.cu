// The engine's attention op on the GPU: the fp32 flash path (flash_attention.cu) applied to the fused projection
// qkv (B, T, 3C) through strides, so no per-head copies of q, k, v and no T x T scores are made. The twin of
// csrc/cpu/attention.cpp.
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
HeadStrides qkv_strides(int T, int C, int NH) { return {(int64_t)T * 3 * C, C / NH, 3 * (int64_t)C}; }
HeadStrides out_strides(int T, int C, int NH) { return {(int64_t)T * C, C / NH, C}; }
}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, bool causal,
                       Stream stream) {
  flash_attention_forward(out, out_strides(T, C, NH), lse, qkv, qkv + C, qkv + 2 * C, qkv_strides(T, C, NH),
                          {B, NH, T, C / NH, causal}, DType::f32, stream);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int B, int T, int C, int NH, bool causal, Stream stream) {
  flash_attention_backward(dqkv, dqkv + C, dqkv + 2 * C, qkv_strides(T, C, NH), dout, out, out_strides(T, C, NH),
                           qkv, qkv + C, qkv + 2 * C, lse, {B, NH, T, C / NH, causal}, DType::f32, false, stream);
}

}  // namespace fastgpt::cuda
