// exp written so that the compiler vectorises it. glibc offers vector expf only under -ffast-math, which we will
// not use (it would loosen every kernel's rounding), so a scalar libm call per element would otherwise dominate
// the softmax of the classifier (B*T*V exps per pass) and GELU. Range reduction x = n*ln2 + r with |r| <= ln2/2,
// a degree-7 polynomial for e^r, and 2^n built in the exponent bits: within 2 ulp of expf over the float range.
#pragma once
#include <cstdint>
#include <cstring>

namespace fastgpt::cpu {

#pragma omp declare simd notinbranch
inline float vexp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln2 split so n*kLn2Hi is exact
  constexpr float kShift = 12582912.f;                               // 1.5 * 2^23: rounds to the nearest integer
  const float xc = x < -87.33654f ? -87.33654f : (x > 88.f ? 88.f : x);
  const float t = xc * kLog2e + kShift;
  const float n = t - kShift;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return x < -87.33654f ? 0.f : (x > 88.f ? __builtin_inff() : y);
}

}  // namespace fastgpt::cpu
