// Residual add fused with the LayerNorm that reads its sum: res = a + b (rounded once to the storage type), then
// out = LayerNorm(res). Each block ends a residual branch and starts a LayerNorm twice (ln_2 after the attention,
// ln_1 of the next block or ln_f after the MLP), and the fused model runs both as one op so that the GPU reads the
// sum from the registers it was made in instead of from memory. The backward is layernorm_backward into the
// residual gradient, which already accumulates (+=), so there is no fused backward op.
// This reference is the two ops it replaces, in order: on the CPU the fused model is bitwise the unfused one.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

template <typename S>
void residual_layernorm_forward(S* res, S* out, float* mean, float* rstd, const S* a, const S* b, const S* weight,
                                const S* bias, int64_t N, int C) {
  residual_forward(res, a, b, N * C);
  layernorm_forward(out, mean, rstd, (const S*)res, weight, bias, N, C);
}

#define FASTGPT_INSTANTIATE(S)                                                                                   \
  template void residual_layernorm_forward<S>(S*, S*, float*, float*, const S*, const S*, const S*, const S*, \
                                              int64_t, int);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
