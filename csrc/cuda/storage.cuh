// Storage types inside CUDA kernels: 16-byte packs for the elementwise kernels' 128-bit loads and stores, and the
// cuBLASLt data type of each storage type. Values are converted with dtype.h's to_float / from_float (integer bit
// operations, round to nearest even), so a GPU kernel rounds exactly as its CPU twin does.
// CUDA-only header: include it from .cu files, never from the binding.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>
#include <library_types.h>

#include "cpu/dtype.h"

namespace fastgpt::cuda {

// 16 bytes of S: 4 floats or 8 16-bit values, moved as one uint4 (ld.global.v4 / st.global.v4).
template <typename S>
struct Pack {
  static constexpr int N = 16 / (int)sizeof(S);
  union {
    uint4 raw;
    S v[N];
  };
};

// A 16-byte access of an address that is not 16-byte aligned faults on a GPU; the warp emulator (tests/warp_emu)
// defines this check to stop there, as the host's own loads would not.
#ifndef FASTGPT_ALIGN16_CHECK
#define FASTGPT_ALIGN16_CHECK(p)
#endif
// The emulator also follows these loads and stores where they touch shared memory (the LayerNorm backward's ring,
// cross-entropy's row copy), in its race check.
#ifndef FASTGPT_PACK_LOADED
#define FASTGPT_PACK_LOADED(p)
#endif
#ifndef FASTGPT_PACK_STORED
#define FASTGPT_PACK_STORED(p)
#endif

template <typename S>
__device__ __forceinline__ Pack<S> load_pack(const S* p) {  // p 16-byte aligned
  FASTGPT_ALIGN16_CHECK(p);
  FASTGPT_PACK_LOADED(p);
  Pack<S> r;
  r.raw = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <typename S>
__device__ __forceinline__ void store_pack(S* p, const Pack<S>& x) {  // p 16-byte aligned
  FASTGPT_ALIGN16_CHECK(p);
  FASTGPT_PACK_STORED(p);
  *reinterpret_cast<uint4*>(p) = x.raw;
}

// A pack's worth of S by 16-byte loads and stores where every view a kernel touches is 16-byte aligned (vec),
// else by N single-element accesses: the same values in the same registers either way, so a kernel that walks its
// data in packs does its arithmetic in one order whatever the alignment (LayerNorm's rows, cross-entropy's).
template <typename S>
struct PackIO {
  bool vec;
  __device__ __forceinline__ Pack<S> load(const S* p) const {
    if (vec) return load_pack(p);
    Pack<S> r;
#pragma unroll
    for (int e = 0; e < Pack<S>::N; e++) r.v[e] = p[e];
    return r;
  }
  __device__ __forceinline__ void store(S* p, const Pack<S>& x) const {
    if (vec) {
      store_pack(p, x);
    } else {
#pragma unroll
      for (int e = 0; e < Pack<S>::N; e++) p[e] = x.v[e];
    }
  }
};

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Threads per block and blocks of the elementwise kernels: nvec packs, then `tail` single elements, each thread
// taking one unit per pass; grid-stride beyond 65536 blocks, and never a zero-block grid (a launch error).
constexpr int kElementwiseThreads = 256;
inline int elementwise_grid(int64_t nvec, int64_t tail) {
  const int64_t units = nvec > tail ? nvec : tail;
  const int64_t blocks = (units + kElementwiseThreads - 1) / kElementwiseThreads;
  return (int)(blocks < 1 ? 1 : blocks > (1 << 16) ? (1 << 16) : blocks);
}

// The cuBLASLt / cudaDataType_t of a storage type.
template <typename S>
constexpr cudaDataType_t data_type();
template <>
constexpr cudaDataType_t data_type<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t data_type<bf16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t data_type<f16>() {
  return CUDA_R_16F;
}

}  // namespace fastgpt::cuda
