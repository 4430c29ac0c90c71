// replaces mma / ldmatrix of flash_attention.cuh (inside namespace fastgpt::cuda::flash; cp.async: emu_cp_async.h)
template <typename E>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) { emu::mma_emu<E>(c, a, b); }
__device__ __forceinline__ uint32_t to_tf32(float x) { return emu::tf32_round(x); }
__device__ __forceinline__ float as_float(uint32_t bits) { return emu::bits_float(bits); }
__device__ __forceinline__ void mma_tf32(float* c, const uint32_t* a, const uint32_t* b) { emu::mma_tf32_emu(c, a, b); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) { emu::ldsm(r, p, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) { emu::ldsm(r, p, true); }
