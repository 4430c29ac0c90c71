// Shared pieces of the Hopper flash attention kernels (flash_attention_sm90a.cu, flash_attention_ws_sm90a.cu,
// flash_attention_bwd_sm90a.cu): tiles of 16-bit rows in the 128-byte swizzled shared-memory layout wgmma reads
// (wgmma.cuh), their descriptors, and the forwards' products and steps.
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

// S = Q K^T for warpgroup wg's 64 rows of the (BR, D) Q tile at aQ and the (BC, D) K tile at kb: one wgmma per 16
// columns of d, both operands K-major.
template <typename E, int BR, int BC, int D>
__device__ __forceinline__ void qk_product(float (&s)[BC / 8][4], uint32_t aQ, uint32_t kb, int wg) {
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++)
    wgmma::Mma<E, BC>::ss(&s[0][0], kmajor<BR>(aQ, wg * 64, kk), kmajor<BC>(kb, 0, kk), kk > 0);
}

// O += P V: 16 keys (two 8-row groups of the (BC, D) V tile at vb, read MN-major) per wgmma, P from registers.
template <typename E, int BC, int D>
__device__ __forceinline__ void pv_product(float (&o)[D / 8][4], const uint32_t (&pa)[BC / 16][4], uint32_t vb) {
#pragma unroll
  for (int ks = 0; ks < BC / 16; ks++) wgmma::Mma<E, D>::rs(&o[0][0], pa[ks], mnmajor<BC>(vb, ks), 1);
}

// P (in the S accumulators) as wgmma A fragments: tiles 2ks and 2ks + 1 make fragment ks.
template <typename E, int BC>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[BC / 16][4], const float (&s)[BC / 8][4]) {
#pragma unroll
  for (int ks = 0; ks < BC / 16; ks++) a_from_acc<E>(pa[ks], s[2 * ks], s[2 * ks + 1]);
}

// The three kinds of forward step of a warpgroup (64 query rows), FlashAttention-3's intra-warpgroup overlap: block 0
// is S_0 alone; block j > 0 issues S_j = Q K_j^T and then P_{j-1} V_{j-1} behind it, runs block j's softmax while
// that product is still on the tensor cores, and rescales O once it is in; after the last block, P V alone. Each
// holds its wgmma and their waits whole: a wait inside a nested branch makes ptxas serialise every wgmma of the
// kernel (C7520), even on a uniform condition. `softmax(s, alpha)` scales, masks and takes the online softmax of S;
// the hooks run once the products are issued (`issued`), once S_j has retired (K_j read: `s_read`) and once P V
// has (V_{j-1} read: `pv_read`): the warp-specialised kernel's turns and buffer releases; no-ops in the other.
template <typename E, int BR, int BC, int D, class Softmax, class Issued, class SRead>
__device__ __forceinline__ void first_block(float (&s)[BC / 8][4], float (&o)[D / 8][4], uint32_t (&pa)[BC / 16][4],
                                            uint32_t aQ, uint32_t kb, int wg, Softmax softmax, Issued issued,
                                            SRead s_read) {
  wgmma::fence();
  qk_product<E, BR, BC, D>(s, aQ, kb, wg);
  wgmma::commit();
  issued();
  wgmma::wait<0>();
  wgmma::keep(s);
  s_read();
  float alpha[2];
  softmax(s, alpha);
  rescale_rows(o, alpha);
  pack_p<E, BC>(pa, s);
}
template <typename E, int BR, int BC, int D, class Softmax, class Issued, class SRead, class PvRead>
__device__ __forceinline__ void next_block(float (&s)[BC / 8][4], float (&o)[D / 8][4], uint32_t (&pa)[BC / 16][4],
                                           uint32_t aQ, uint32_t kb, uint32_t vb, int wg, Softmax softmax,
                                           Issued issued, SRead s_read, PvRead pv_read) {
  wgmma::fence();
  qk_product<E, BR, BC, D>(s, aQ, kb, wg);
  wgmma::commit();
  pv_product<E, BC, D>(o, pa, vb);
  wgmma::commit();
  issued();
  wgmma::wait<1>();  // S_j only: groups retire in order
  wgmma::keep(s);
  s_read();
  float alpha[2];
  softmax(s, alpha);
  wgmma::wait<0>();
  wgmma::keep(o);
  wgmma::keep(pa);
  pv_read();
  rescale_rows(o, alpha);
  pack_p<E, BC>(pa, s);
}
template <typename E, int BC, int D, class Issued, class PvRead>
__device__ __forceinline__ void last_pv(float (&o)[D / 8][4], uint32_t (&pa)[BC / 16][4], uint32_t vb, Issued issued,
                                        PvRead pv_read) {
  wgmma::fence();
  pv_product<E, BC, D>(o, pa, vb);
  wgmma::commit();
  issued();
  wgmma::wait<0>();
  wgmma::keep(o);
  wgmma::keep(pa);
  pv_read();
}

// The first 1024-byte aligned address in dynamic shared memory (the launch asks for 1024 bytes more).
__device__ __forceinline__ unsigned char* aligned(unsigned char* smem) {
  return smem + (1024 - wgmma::shared_addr(smem) % 1024) % 1024;
}

}  // namespace fastgpt::cuda::flash::sm90
