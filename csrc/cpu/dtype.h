// The storage types of mixed precision: bf16 and fp16 as 16-bit bit patterns, their conversions to and from float
// (round to nearest even, as torch's .to() but for NaN, and as CUDA's __float2bfloat16_rn / __float2half_rn: bit
// for bit over all 2^32 inputs), the stochastic rounding that writes bf16 weights from fp32 masters, and DType
// dispatch. Kernels load a storage element, compute in float and store the rounded result, so a kernel template over
// S in {float, bf16, f16} is one kernel for every precision. Written with integer bit operations only: the same bits
// on every compiler, vectorisable, and usable from CUDA code (the SR hash must give the GPU and the CPU the same
// weights). The one exception: GPU code for sm_80 and newer narrows with the hardware's conversion (cvt.rn), one
// instruction a value where the bit operations took seven to ten (the bf16 LayerNorm backward's row loop at GPT-2's
// width: 1,010 SASS instructions a row before, 824 after; the kernels that store 16-bit values ran more instructions
// than their bytes need). The same bits for every value; a NaN becomes the canonical NaN 0x7FFF on both sides, as
// cvt makes it (and CUDA's own host conversions; torch keeps sign or payload bits).
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define FASTGPT_HD __host__ __device__ __forceinline__
#else
#define FASTGPT_HD inline __attribute__((always_inline))
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
// Branch-free (selects only), so loops over f16 vectorise: rebias the exponent; inf/NaN get the top exponent;
// subnormals are renormalised by one exact float subtraction.
FASTGPT_HD float to_float(f16 x) {
  const uint32_t h = x.bits, em = (h & 0x7FFFu) << 13, e = em & 0x0F800000u;
  uint32_t o = em + 0x38000000u;                 // exponent 15 -> 127 bias
  o = e == 0x0F800000u ? o + 0x38000000u : o;    // inf / NaN (payload kept)
  const uint32_t sub = float_bits(bits_float(o + 0x00800000u) - bits_float(0x38800000u));  // m * 2^-24, exact
  o = e == 0 ? sub : o;
  return bits_float(o | ((h & 0x8000u) << 16));
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // The pair form, 0 in the upper half: always F2FP, as the flash kernels' packing of P (off the XU pipe by the
  // seventh run's ncu counts). ptxas made the single form F2F.BF16.F32 in the LayerNorm backward, a type conversion
  // (the CUDA guide rates those at 16 a clock an SM), though F2FP in a kernel of one conversion.
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.f), "f"(x));
  return bf16{(uint16_t)r};
#else
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{0x7FFFu};  // NaN: the canonical one
  return bf16{(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
#endif
}
// Branch-free as well: the normal-range rounding, the subnormal rounding (one float add of 0.5, whose ulp is the
// half subnormal step 2^-24, so the FPU rounds to nearest even for us) and inf/NaN, then a select.
template <>
FASTGPT_HD f16 from_float<f16>(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t h;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(0.f), "f"(x));
  return f16{(uint16_t)h};
#else
  const uint32_t u0 = float_bits(x), sign = (u0 >> 16) & 0x8000u, u = u0 & 0x7FFFFFFFu;
  const uint32_t r = u - 0x38000000u;                             // rebias 127 -> 15
  const uint32_t normal = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;  // a carry into the exponent is right (65520 -> inf)
  const uint32_t sub = float_bits(bits_float(u) + 0.5f) - 0x3F000000u;
  uint32_t o = u < 0x38800000u ? sub : normal;                     // below 2^-14: subnormal half (or 0)
  o = u >= 0x47800000u ? 0x7C00u : o;                             // >= 65536: inf (65520..65536 carry above)
  o |= sign;
  return f16{(uint16_t)(u > 0x7F800000u ? 0x7FFFu : o)};         // NaN: the canonical one, unsigned
#endif
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
