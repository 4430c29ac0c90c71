// cp.async (sm_80 and newer): 16-byte copies from global to shared memory that hold no registers while in flight,
// so a kernel can have rows or tiles on their way while it works on others (the flash attention tile loaders, the
// LayerNorm backward's row ring). Each thread commits its copies in groups and waits for all but its newest N;
// what a thread copied is then visible to that thread (others see it after a barrier).
// A build for older GPUs (sm_75) compiles these with a trap in their place: the callers never launch their kernels
// there, or leave the calls out where kCpAsync is false (cross_entropy.cu's kept-row kernel does run on a T4).
// tests/warp_emu swaps this header for an emulated one (emu_cp_async.h).
// CUDA-only header: include it from .cu files.
#pragma once
#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FASTGPT_SM80_ASM(...) __trap()
#else
#define FASTGPT_SM80_ASM(...) asm volatile(__VA_ARGS__)
#endif

namespace fastgpt::cuda {

// Whether this compilation's device code has cp.async (false in an sm_75 device pass), for callers that keep a
// form without it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kCpAsync = false;
#else
constexpr bool kCpAsync = true;
#endif

// 16 bytes global -> shared; `valid` false writes zeros and reads nothing (the source must still be a valid
// address: callers pass a tensor's base for rows past its end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  FASTGPT_SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                       static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
                   "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { FASTGPT_SM80_ASM("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  FASTGPT_SM80_ASM("cp.async.wait_group %0;\n" ::"n"(N) : "memory");  // shared reads must not move above it
}

// No instruction: the compiler may not move this thread's memory accesses across it. Before a cp.async that refills
// shared memory this thread has read (a cp.async asm names no memory, so the reads could otherwise sink below it).
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

}  // namespace fastgpt::cuda
