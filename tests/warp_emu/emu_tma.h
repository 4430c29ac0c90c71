// replaces the PTX part of tma.cuh (inside namespace fastgpt::cuda::tma) with emu.h's TMA: maps encoded here, with
// the encoder's documented requirements checked, and copies made at issue by emu::tma_load; the bulk copies to global
// memory by emu::bulk_issue (tensor stores by emu::tma_store) and their waits, the bulk copy back from global memory
// by emu::bulk_load; the ranges the host marks written for initcheck kept for emu::tma_stores_marked
inline void encode(CUtensorMap* map, const void* base, const uint64_t (&dims)[4], const uint64_t (&strides)[3],
                   const uint32_t (&box)[4]) {
  emu::tma_encode(map, base, dims, strides, box);
}
inline void mark_stored(const void* base, size_t bytes, cudaStream_t) { emu::initcheck_mark(base, bytes); }
inline void mark_stored(const void* base, size_t bytes, int64_t count, size_t pitch, cudaStream_t) {
  for (int64_t i = 0; i < count; i++) emu::initcheck_mark(static_cast<const char*>(base) + i * pitch, bytes);
}
__device__ __forceinline__ void prefetch(const CUtensorMap* map) { emu::tma_map(map); }
__device__ __forceinline__ void arrive_expect(uint32_t bar, uint32_t bytes) { emu::mbar_arrive(bar, bytes); }
__device__ __forceinline__ void expect(uint32_t bar, uint32_t bytes) { emu::mbar_expect(bar, bytes); }
__device__ __forceinline__ void load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                     int c3) {
  emu::tma_load(dst, map, bar, {c0, c1, c2, c3});
}
__device__ __forceinline__ void load_bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  emu::bulk_load(dst, src, bytes, bar);
}
__device__ __forceinline__ void store(void* dst, uint32_t src, uint32_t bytes) {
  emu::bulk_issue(dst, src, bytes, false);
}
__device__ __forceinline__ void reduce_add(float* dst, uint32_t src, uint32_t bytes) {
  emu::bulk_issue(dst, src, bytes, true);
}
__device__ __forceinline__ void store_box(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  emu::tma_store(map, src, {c0, c1, c2, c3});
}
__device__ __forceinline__ void commit() { emu::bulk_commit(); }
template <int N>
__device__ __forceinline__ void wait_read() {
  emu::bulk_wait(N, true);
}
template <int N>
__device__ __forceinline__ void wait() {
  emu::bulk_wait(N, false);
}
__device__ __forceinline__ void fence_global() { emu::bulk_fence_global(); }
