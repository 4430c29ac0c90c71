// Stands in for csrc/cuda/cp_async.cuh (run.sh copies it there): the cp.async helpers as the emulator's copies
// (emu.h: at issue, or lazily at the group's wait), and the compiler fence as a signal fence (no reordering of this
// thread's accesses across it by the host compiler either).
#pragma once
#include <atomic>
#include <cstdint>

#include "../emu.h"

namespace fastgpt::cuda {
constexpr bool kCpAsync = true;
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) { emu::cp16(dst, src, valid); }
__device__ __forceinline__ void cp_async_commit() { emu::commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::wait_group(N); }
__device__ __forceinline__ void compiler_fence() { std::atomic_signal_fence(std::memory_order_seq_cst); }
}  // namespace fastgpt::cuda
