// Exponentials on the SFU alone, for kernels whose exponentials are most of their arithmetic: flash attention's
// softmax (which competes with the tensor cores for issue) and the cross-entropy's two passes over the vocabulary
// (which, at 8 bf16 logits to a 16-byte load, ran out of issue slots before memory ran out of bandwidth).
// CUDA-only header. The host branches are the warp emulator's (tests/warp_emu), which runs these kernels on the CPU.
#pragma once
#include <cmath>

namespace fastgpt::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// 2^x as ex2.approx.ftz: at most 2 ulp off, and results below 2^-126 are 0. exp2f without fast math wraps the same
// MUFU.EX2 in a range test and two multiplies (FSETP, FMUL, EX2, FMUL) to keep subnormal results, three issue slots
// more; a probability below 2^-126 of the row's largest adds nothing to a float sum of it.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.f : y;  // flushed below FLT_MIN
#endif
}

// e^x as 2^(x log2 e): one multiply and the SFU, where expf takes eight instructions (its range reduction:
// FFMA.SAT, FFMA.RM, FADD, SHF, two FFMA, then MUFU.EX2 and FMUL). The product's rounding and log2 e's own move the
// result by a relative 1.22 * 2^-24 |x| at most (1.5e-6 at |x| = 20, where e^x is 2e-9), ex2.approx by 2 ulp more:
// the callers pass x = v - max, so the terms that matter have small |x|. The CPU's expf differs in the last bits.
__device__ __forceinline__ float fast_exp(float x) { return fast_exp2(x * kLog2e); }

}  // namespace fastgpt::cuda
