// The storage types of mixed precision: bf16 and fp16 as 16-bit bit patterns, their conversions to and from float
// (round to nearest even, as torch's .to() and CUDA's __float2bfloat16_rn / __float2half_rn), the stochastic
// rounding that writes bf16 weights from fp32 masters, and DType dispatch. Kernels load a storage element,
// compute in float and store the rounded result, so a kernel template over S in {float, bf16, f16} is one kernel
// for every precision. Written with integer bit operations only: the same bits on every compiler, vectorisable,
// and usable from CUDA code (the SR hash must give the GPU and the CPU the same weights).
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define FASTGPT_HD __host__ __device__ __forceinline__
#else
#define FASTGPT_HD inline
#endif

namespace fastgpt {

enum class DType { f32, bf16, f16 };

inline const char* dtype_name(DType d) { return d == DType::f32 ? "float32" : d == DType::bf16 ? "bfloat16" : "float16"; }
inline int dtype_size(DType d) { return d == DType::f32 ? 4 : 2; }

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

FASTGPT_HD uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
FASTGPT_HD float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- widen (exact)
FASTGPT_HD float to_float(float x) { return x; }
FASTGPT_HD float to_float(bf16 x) { return bits_float((uint32_t)x.bits << 16); }
FASTGPT_HD float to_float(f16 x) {
  const uint32_t sign = (uint32_t)(x.bits & 0x8000) << 16, e = (x.bits >> 10) & 0x1F, m = x.bits & 0x3FF;
  if (e == 0x1F) return bits_float(sign | 0x7F800000u | (m << 13));  // inf / NaN (payload kept)
  if (e == 0) {                                                     // zero or subnormal: m * 2^-24, exact
    const float v = (float)m * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

// ---- narrow, round to nearest even
template <typename S>
FASTGPT_HD S from_float(float x);
template <>
FASTGPT_HD float from_float<float>(float x) {
  return x;
}
template <>
FASTGPT_HD bf16 from_float<bf16>(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{(uint16_t)((u >> 16) | 0x40)};  // NaN stays a quiet NaN
  return bf16{(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
template <>
FASTGPT_HD f16 from_float<f16>(float x) {
  uint32_t u = float_bits(x);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  u &= 0x7FFFFFFFu;
  if (u >= 0x7F800000u) return f16{(uint16_t)(sign | (u > 0x7F800000u ? 0x7E00 : 0x7C00))};
  if (u >= 0x477FF000u) return f16{(uint16_t)(sign | 0x7C00)};  // >= 65520 rounds to inf
  if (u >= 0x38800000u) {                                      // a normal half: rebias, round off 13 bits
    const uint32_t r = u - 0x38000000u;
    return f16{(uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13))};
  }
  if (u < 0x33000000u) return f16{sign};  // below 2^-25 (ties at 2^-25 go to even: 0)
  // Subnormal half: round(value * 2^24) with value = m * 2^(e - 150).
  const uint32_t e = u >> 23, m = (u & 0x7FFFFFu) | 0x800000u, shift = 126 - e;  // shift in [14, 24]
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return f16{(uint16_t)(sign | q)};
}

// ---- stochastic rounding of fp32 masters to bf16 weights
// 32 random bits from (seed, step, element index): a splitmix64 finaliser over a mix of the three, so a run is
// reproducible, every element of every step draws independently, and the CPU and the GPU round alike.
FASTGPT_HD uint32_t sr_bits(uint64_t seed, uint64_t step, uint64_t index) {
  uint64_t z = index + 0x9E3779B97F4A7C15ull * (step + 1) + 0xD1B54A32D192ED03ull * seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (uint32_t)((z ^ (z >> 31)) >> 32);
}
// Rounds up in magnitude with probability (dropped bits) / 2^16: unbiased, E[to_float(result)] = x.
FASTGPT_HD bf16 bf16_stochastic(float x, uint32_t rnd) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return from_float<bf16>(x);  // inf / NaN: nothing to round
  return bf16{(uint16_t)((u + (rnd & 0xFFFFu)) >> 16)};
}

// How masters become compute weights: round to nearest, or stochastically (bf16 weights after an optimizer step).
struct RoundKey {
  bool stochastic = false;
  uint64_t seed = 0, step = 0, offset = 0;  // offset: index of element 0 in the whole parameter buffer
};
template <typename S>
FASTGPT_HD S round_weight(float x, const RoundKey& key, int64_t i) {
  return from_float<S>(x);
}
template <>
FASTGPT_HD bf16 round_weight<bf16>(float x, const RoundKey& key, int64_t i) {
  return key.stochastic ? bf16_stochastic(x, sr_bits(key.seed, key.step, key.offset + (uint64_t)i))
                        : from_float<bf16>(x);
}

// Calls f(S{}) with S the C++ type of `d`: the one switch between a run-time precision and a kernel template.
template <typename F>
decltype(auto) with_dtype(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(float{});
    case DType::bf16: return f(bf16{});
    case DType::f16: return f(f16{});
  }
  throw std::logic_error("unknown DType");
}

}  // namespace fastgpt
