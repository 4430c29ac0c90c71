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
  static void ss_amn(float* d, uint64_t a, uint64_t b, int accumulate) {
    static_assert(N == 32, "ss_amn: wgmma.cuh defines it for N = 32");
    emu::wg_mma(N, false, kHalf, d, nullptr, a, b, accumulate, true);
  }
};
__device__ __forceinline__ void st_shared_b32(void* p, uint32_t v) { emu::st_shared_b32(p, v); }
__device__ __forceinline__ void wait_count(const int* counter, int want) { emu::wait_count(counter, want); }
__device__ __forceinline__ void add_count(int* counter) { emu::add_count(counter); }
