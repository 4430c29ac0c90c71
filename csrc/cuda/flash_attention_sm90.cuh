// Shared pieces of the Hopper flash attention kernels (flash_attention_sm90a.cu, flash_attention_bwd_sm90a.cu): tiles
// of 16-bit rows in the 128-byte swizzled shared-memory layout wgmma reads (wgmma.cuh), and their descriptors.
// A tile of ROWS x D elements is D / 64 column blocks, one after the other, of ROWS rows of 128 bytes (64 elements);
// 16-byte chunk j of row r sits at chunk j ^ (r % 8) of its row. The same tile serves as a K-major operand (rows
// are M or N, the reduction runs along the row: Q and K in S = Q K^T) and as an MN-major one (rows are the
// reduction: V in O = P V, K in dQ = dS K, Q and dO in dK = dS^T Q, dV = P^T dO). Tiles start 1024-byte aligned.
#pragma once
#include "cuda/flash_attention.cuh"
#include "cuda/wgmma.cuh"

namespace fastgpt::cuda::flash::sm90 {

// Byte offset of element (r, col) in a tile of ROWS rows: the loader's layout (column block, swizzled chunk).
template <int ROWS>
__device__ __forceinline__ int offset(int r, int col) {
  return ((col / 64) * ROWS + r) * 128 + (((col % 64 / 8) ^ (r % 8)) * 16) + (col % 8) * 2;
}

// Rows [row0, row0 + ROWS) of one (b, h) slice (row stride st), D wide, into a swizzled tile; rows at or past T
// are zeros. Eight consecutive threads fill one 128-byte row: coalesced reads, conflict-free writes.
template <typename E, int ROWS, int D, int NT>
__device__ __forceinline__ void load(unsigned char* dst, const E* src, int64_t st, int row0, int T, int tid) {
  constexpr int kChunks = D / 8;
  for (int i = tid; i < ROWS * kChunks; i += NT) {
    const int r = i / kChunks, j = i % kChunks;
    const bool valid = row0 + r < T;
    const E* s = valid ? src + (int64_t)(row0 + r) * st + j * 8 : src;
    cp_async16(dst + offset<ROWS>(r, j * 8), s, valid);
  }
}

// Bytes of a tile of ROWS x D 16-bit elements.
template <int ROWS, int D>
__host__ __device__ constexpr int tile_bytes() {
  return ROWS * D * 2;
}

// The K-major operand of rows [r0, r0 + 64 or N) of a tile of ROWS rows at shared address `tile`, reduction columns
// [16 kk, 16 kk + 16): 32 bytes into a 64-column block. 8-row groups are 1024 bytes apart (SBO); LBO is unused.
template <int ROWS>
__device__ __forceinline__ uint64_t kmajor(uint32_t tile, int r0, int kk) {
  return wgmma::desc(tile + (kk / 4) * ROWS * 128 + r0 * 128 + (kk % 4) * 32, 16, 1024);
}
// The MN-major operand of reduction rows [16 ks, 16 ks + 16) (two 8-row groups, 1024 bytes apart) of a tile of ROWS
// rows: its columns run along the rows, 64 per column block, the blocks ROWS * 128 bytes apart (LBO).
template <int ROWS>
__device__ __forceinline__ uint64_t mnmajor(uint32_t tile, int ks) {
  return wgmma::desc(tile + ks * 2048, ROWS * 128, 1024);
}


// The first 1024-byte aligned address in dynamic shared memory (the launch asks for 1024 bytes more).
__device__ __forceinline__ unsigned char* aligned(unsigned char* smem) {
  return smem + (1024 - wgmma::shared_addr(smem) % 1024) % 1024;
}

}  // namespace fastgpt::cuda::flash::sm90
