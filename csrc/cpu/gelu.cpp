// GELU with the tanh approximation (GPT-2's, torch's approximate="tanh"), forward and backward.
// 0.5 * (1 + tanh(a)) is the logistic sigmoid of 2a, so gelu(x) = x * sigmoid(2a): one vectorisable exp per element
// (cpu/vmath.h) instead of a libm tanh, and no cancellation in 1 + tanh(a) for large negative x.
#include "cpu/kernels.h"
#include "cpu/vmath.h"

namespace fastgpt::cpu {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoef = 0.044715f;
}  // namespace

template <typename S>
void gelu_forward(S* out, const S* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float x = to_float(inp[i]);
    const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
    out[i] = from_float<S>(x / (1.f + vexp(-2.f * a)));
  }
}

template <typename S>
void gelu_backward(S* dinp, const S* inp, const S* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float x = to_float(inp[i]);
    const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
    const float s = 1.f / (1.f + vexp(-2.f * a));  // sigmoid(2a) = 0.5 * (1 + tanh(a))
    const float da = kSqrt2OverPi * (1.f + 3.f * kCoef * x * x);
    dinp[i] = from_float<S>(to_float(dout[i]) * (s + x * 2.f * s * (1.f - s) * da));
  }
}

#define FASTGPT_INSTANTIATE(S)                                 \
  template void gelu_forward<S>(S*, const S*, int64_t);        \
  template void gelu_backward<S>(S*, const S*, const S*, int64_t);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
