// replaces the PTX part of wgmma.cuh (inside namespace fastgpt::cuda::wgmma) with emu.h's warpgroup collectives
__device__ __forceinline__ uint32_t shared_addr(const void* p) { return emu::shared_offset(p); }
__device__ __forceinline__ void fence() { emu::wg_fence(); }
__device__ __forceinline__ void commit() { emu::wg_commit(); }
template <int N>
__device__ __forceinline__ void wait() { emu::wg_wait(N); }
__device__ __forceinline__ void fence_proxy_async() { emu::proxy_fence(); }
__device__ __forceinline__ void keep(float&) {}
__device__ __forceinline__ void keep(uint32_t&) {}
template <typename E, int N>
struct Mma {
  static constexpr bool kHalf = std::is_same<E, __half>::value;
  static void ss(float* d, uint64_t a, uint64_t b, int accumulate) {
    emu::wg_mma(N, false, kHalf, d, nullptr, a, b, accumulate);
  }
  static void rs(float* d, const uint32_t* a, uint64_t b, int accumulate) {
    emu::wg_mma(N, true, kHalf, d, a, 0, b, accumulate);
  }
};
