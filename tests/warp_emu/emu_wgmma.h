// replaces the PTX part of wgmma.cuh (inside namespace fastgpt::cuda::wgmma) with emu.h's warpgroup collectives
__device__ __forceinline__ uint32_t shared_addr(const void* p) { return emu::shared_offset(p); }
__device__ __forceinline__ void fence() { emu::wg_fence(); }
__device__ __forceinline__ void commit() { emu::wg_commit(); }
template <int N>
__device__ __forceinline__ void wait() { emu::wg_wait(N); }
__device__ __forceinline__ void fence_proxy_async() { emu::proxy_fence(); }
__device__ __forceinline__ void keep(float&) {}
__device__ __forceinline__ void keep(uint32_t&) {}
__device__ __forceinline__ void opaque(int&) {}
__device__ __forceinline__ void settle(float x) {  // the GPU's trap, which a softmax's sums never reach
  if (x < -1.f) emu::die("wgmma::settle: a softmax sum below -1");
}
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
  static void ss_mn(float* d, uint64_t a, uint64_t b, int accumulate) {
    static_assert(N == 64, "ss_mn: wgmma.cuh defines it for N = 64");
    emu::wg_mma(N, false, kHalf, d, nullptr, a, b, accumulate, true, true);
  }
};
__device__ __forceinline__ void st_shared_b32(void* p, uint32_t v) { emu::st_shared_b32(p, v); }
__device__ __forceinline__ float ld_shared_f32(const float* p) { return emu::ld_shared(p, "a load"); }
__device__ __forceinline__ uint32_t ld_shared_b32(const void* p) {
  return emu::ld_shared(static_cast<const uint32_t*>(p), "a load");
}
__device__ __forceinline__ uint16_t ld_shared_u16(const void* p) {
  return emu::ld_shared(static_cast<const uint16_t*>(p), "a load");
}
__device__ __forceinline__ void st_shared_f32(float* p, float v) { emu::st_shared(p, v, "a store"); }
__device__ __forceinline__ float4 ld_shared_v4(const float4* p) { return emu::ld_shared(p, "a load"); }
__device__ __forceinline__ void st_shared_v4(float4* p, float4 v) { emu::st_shared(p, v, "a store"); }
__device__ __forceinline__ void wait_count(const int* counter, int want) { emu::wait_count(counter, want); }
__device__ __forceinline__ void add_count(int* counter) { emu::add_count(counter); }
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) { emu::mbar_init(bar, count); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) { emu::mbar_arrive(bar); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t count) { emu::mbar_arrive(bar, 0, (int)count); }
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool arrive) {
  if (arrive) emu::mbar_arrive(bar);
}
template <bool kLimit = true>  // the emulator's waits all have its own limit
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) { emu::mbar_wait(bar, parity); }
__device__ __forceinline__ void bar_sync(int id, int count) { emu::bar_sync(id, count); }
__device__ __forceinline__ void bar_arrive(int id, int count) { emu::bar_arrive(id, count); }
template <int N>
__device__ __forceinline__ void regs_dec() {  // register counts only matter to the hardware's allocator
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
}
