// GELU with the tanh approximation (GPT-2's, torch's approximate="tanh"), forward and backward.
#include <cmath>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoef = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.f + std::tanh(kSqrt2OverPi * (x + kCoef * x * x * x)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float x = inp[i];
    const float t = std::tanh(kSqrt2OverPi * (x + kCoef * x * x * x));
    const float dt = kSqrt2OverPi * (1.f + 3.f * kCoef * x * x) * (1.f - t * t);
    dinp[i] = dout[i] * (0.5f * (1.f + t) + 0.5f * x * dt);
  }
}

}  // namespace fastgpt::cpu
