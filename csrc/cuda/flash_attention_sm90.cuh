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
  return wgmma::desc_add(wgmma::desc(tile + r0 * 128, 16, 1024), (kk / 4) * ROWS * 128 + (kk % 4) * 32);
}
// The MN-major operand of reduction rows [16 ks, 16 ks + 16) (two 8-row groups, 1024 bytes apart) of a tile of ROWS
// rows: its columns run along the rows, 64 per column block, the blocks ROWS * 128 bytes apart (LBO).
template <int ROWS>
__device__ __forceinline__ uint64_t mnmajor(uint32_t tile, int ks) {
  return wgmma::desc_add(wgmma::desc(tile, ROWS * 128, 1024), ks * 2048);
}

// The MN-major operand of column block cb (columns [64 cb, 64 cb + 64)) of a tile of ROWS rows: M = 64 of them.
template <int ROWS>
__device__ __forceinline__ uint64_t mnmajor_block(uint32_t tile, int cb, int ks) {
  return mnmajor<ROWS>(tile + cb * ROWS * 128, ks);
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
// is S_0 alone; block j > 0 issues S_j = Q K_j^T, rescales O by block j - 1's factor (alpha, kept from the step
// before: no wgmma uses O then, and the warpgroup would only wait for S_j) and issues P_{j-1} V_{j-1} behind it,
// then runs block j's softmax while that product is still on the tensor cores; after the last block, the last
// rescale and P V alone. O starts at zero (block 0 leaves it unscaled). After the wait for P V at most P's packing
// is left (below): a rescale there, as before, was 32 multiplies (d 64) between that wait and the next issue. Each
// holds its wgmma and their waits whole: a wait inside a nested branch makes ptxas serialise every wgmma of the
// kernel (C7520), even on a uniform condition. `softmax(s, alpha)` masks and takes the online softmax of S;
// the hooks run once the products are issued (`issued`), once S_j has retired (K_j read: `s_read`) and once P V
// has (V_{j-1} read: `pv_read`): the warp-specialised kernel's turns and buffer releases; no-ops in the other.
// softmax returns the sum of its rows' running sums (l), which next_block settles (wgmma::settle) before the wait
// for P V: so that the softmax is computed while that product is on the tensor cores, not after it. next_block
// packs P_j into pn: with kTwoP a second set of fragments, packed before that wait (the conversions then issue
// between the exponentials, which keep the SFU busy), the caller alternating the two sets from step to step; else
// pa itself, once P V has read it (32 more registers than one set: the three-warpgroup kernels cannot spare them).
template <typename E, int BR, int BC, int D, class Softmax, class Issued, class SRead>
__device__ __forceinline__ void first_block(float (&s)[BC / 8][4], float (&alpha)[2], uint32_t (&pa)[BC / 16][4],
                                            uint32_t aQ, uint32_t kb, int wg, Softmax softmax, Issued issued,
                                            SRead s_read) {
  wgmma::fence();
  qk_product<E, BR, BC, D>(s, aQ, kb, wg);
  wgmma::commit();
  issued();
  wgmma::wait<0>();
  wgmma::keep(s);
  s_read();
  softmax(s, alpha);
  pack_p<E, BC>(pa, s);
}
template <typename E, int BR, int BC, int D, bool kTwoP = false, class Softmax, class Issued, class SRead,
          class PvRead>
__device__ __forceinline__ void next_block(float (&s)[BC / 8][4], float (&o)[D / 8][4], float (&alpha)[2],
                                           uint32_t (&pa)[BC / 16][4], uint32_t (&pn)[BC / 16][4], uint32_t aQ,
                                           uint32_t kb, uint32_t vb, int wg, Softmax softmax, Issued issued,
                                           SRead s_read, PvRead pv_read) {
  wgmma::fence();
  qk_product<E, BR, BC, D>(s, aQ, kb, wg);
  wgmma::commit();
  wgmma::settle(alpha[0] + alpha[1]);  // the rescale after S_j's issue (on the tensor cores meanwhile), not before
  rescale_rows(o, alpha);
  wgmma::fence();  // the rescaled O, before P V reads it
  pv_product<E, BC, D>(o, pa, vb);
  wgmma::commit();
  issued();
  wgmma::wait<1>();  // S_j only: groups retire in order
  wgmma::keep(s);
  s_read();
  const float softmax_done = softmax(s, alpha);
  if constexpr (kTwoP) pack_p<E, BC>(pn, s);
  wgmma::settle(softmax_done);
  wgmma::wait<0>();
  wgmma::keep(o);
  wgmma::keep(pa);
  pv_read();
  if constexpr (!kTwoP) pack_p<E, BC>(pn, s);
}
template <typename E, int BC, int D, class Issued, class PvRead>
__device__ __forceinline__ void last_pv(float (&o)[D / 8][4], const float (&alpha)[2], uint32_t (&pa)[BC / 16][4],
                                        uint32_t vb, Issued issued, PvRead pv_read) {
  rescale_rows(o, alpha);
  wgmma::fence();
  pv_product<E, BC, D>(o, pa, vb);
  wgmma::commit();
  issued();
  wgmma::wait<0>();
  wgmma::keep(o);
  wgmma::keep(pa);
  pv_read();
}

// The warp-specialised forward's end (store_rows' values, placed for a TMA store): one warp's 16 rows of O
// (rows r0 + g, r0 + g + 8 of the swizzled (ROWS, D) tile at `tile`) normalised and rounded to E, and each row's lse
// into lse[q0 + g], lse[q0 + g + 8] (finish_row). Rows past T get whatever 1 / l makes of them: the store leaves
// them out. Each 32-bit store of a warp goes to 8 rows x 4 words whose 16-byte chunks the swizzle spreads over all
// 32 banks.
template <typename E, int ROWS, int D>
__device__ __forceinline__ void stage_rows(const float (&o)[D / 8][4], const float (&m)[2], const float (&l)[2],
                                           unsigned char* tile, int r0, int q0, int g, int c, int T, float* lse) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const float inv = 1.f / finish_row(m[r], l[r], q0 + g + r * 8, c, T, lse);
    // offset<ROWS>(r0 + g + 8 r, 8 t + 2c) as store_ds spells it: the row is g mod 8, so the swizzle XORs the chunk
    // bits with g after a constant per t is added to the thread's base (made opaque: not D / 8 offsets kept live).
    int base = (r0 + g + r * 8) * 128 + 4 * c;
    wgmma::opaque(base);
#pragma unroll
    for (int t = 0; t < D / 8; t++)
      wgmma::st_shared_b32(tile + ((base + (t / 8) * ROWS * 128 + (t % 8) * 16) ^ (16 * g)),
                           Pack<E>::two(o[t][2 * r] * inv, o[t][2 * r + 1] * inv));
  }
}

// ---- The backward's pieces (flash_attention_bwd_sm90a.cu, flash_attention_bwd_ws_sm90a.cu)

// A warp's 16 keys (rows r0 ..) x BR queries of dS^T, as dK's A fragments (mma.m16n8k16's A layout: registers 0-3
// are rows g, g + 8, g, g + 8 and queries 2c, 2c, 2c + 8, 2c + 8 of 16 queries each, two per register), into the
// swizzled (KB, BR) tile at sS: the A operand (MN-major: queries along its rows) of the fused backward's dQ.
// Register (ks, r) goes to offset<KB>(r0 + g + 8 (r & 1), 16 ks + 2c + 8 (r >> 1)): its row is g mod 8 (r0 is a
// multiple of 16), so the swizzle XORs that offset's 16-byte chunk bits with g, and the offset is
// (constant + (r0 + g) 128 + 4c) ^ 16 g. The thread's base is made opaque per call: left to itself, ptxas keeps all
// 4 BR / 16 offsets live across the caller's step loop (at 128 queries, 28 of them spilled).
template <int KB, int BR>
__device__ __forceinline__ void store_ds(unsigned char* sS, const uint32_t (&ad)[BR / 16][4], int r0, int g, int c) {
  int base = (r0 + g) * 128 + 4 * c;
  wgmma::opaque(base);
  const int gx = 16 * g;
#pragma unroll
  for (int ks = 0; ks < BR / 16; ks++)
#pragma unroll
    for (int r = 0; r < 4; r++) {
      constexpr int kRow = 128, kChunk = 16;
      const int k = ((ks / 4) * KB + 8 * (r & 1)) * kRow + (2 * (ks % 4) + (r >> 1)) * kChunk;
      wgmma::st_shared_b32(sS + ((base + k) ^ gx), ad[ks][r]);
    }
}

// dst (D, KB) = src (KB, D)^T, both swizzled tiles of 16-bit elements, by NT threads (tid 0 ..): each moves pairs
// of keys of one column.
template <int KB, int D, int NT>
__device__ __forceinline__ void transpose(unsigned char* dst, const unsigned char* src, int tid) {
  for (int e = tid; e < KB / 2 * D; e += NT) {
    const int x = e % D, key = 2 * (e / D);
    const uint32_t lo = wgmma::ld_shared_u16(src + offset<KB>(key, x)),
                   hi = wgmma::ld_shared_u16(src + offset<KB>(key + 1, x));
    wgmma::st_shared_b32(dst + offset<D>(x, key), lo | hi << 16);
  }
}

// dV += P^T dO for a warpgroup's 64 keys: 16 queries (two 8-row groups of the (BR, D) dO tile at ob, read MN-major)
// per wgmma, P^T from registers.
template <typename E, int BR, int D>
__device__ __forceinline__ void dv_product(float (&dv)[D / 8][4], const uint32_t (&ap)[BR / 16][4], uint32_t ob) {
#pragma unroll
  for (int ks = 0; ks < BR / 16; ks++) wgmma::Mma<E, D>::rs(&dv[0][0], ap[ks], mnmajor<BR>(ob, ks), 1);
}

// One backward step of warpgroup wg's 64 keys (from k0 + 64 wg; rows 64 wg .. of the (KB, D) K and V tiles at aK,
// aV) against BR queries (from q0; the (BR, D) Q and dO tiles at qb, ob, their lse in log2 units and delta at sL,
// sDl): S^T = K Q^T and dP^T = V dO^T (both operands K-major), P^T = exp2(S^T scale log2e - lse2) and
// dS^T = P^T (dP^T - delta) in the accumulators, which are the A operands of dV += P^T dO and dK += dS^T Q (dO and
// Q read MN-major). Each product is its own wgmma group, waited for only when its result is needed: P^T's
// exponentials run while dP^T is on the tensor cores, and dS^T while dV is. At d 128 (dK, dV, S^T, dP^T and the
// fragments fill the registers) ptxas serialises split groups (its C7520 warning): there S^T with dP^T, and dV with
// dK, are one group each. At 128 queries (d 64: S^T and dP^T take 64 registers each) dV is issued with dK, after
// dS^T, and P^T's fragments are packed only then: S^T, dP^T and P^T's fragments live at once beside dK and dV (224)
// would not fit the warp-specialised kernel's 232. kDq: dS^T also goes into the (KB, BR) tile at sS for the fused
// backward's dQ (zeros from a warpgroup none of whose keys a query of the step sees; it multiplies nothing). Every
// wgmma has retired on return: the Q and dO tiles, sL and sDl may be refilled once the warpgroup's threads are past
// it. wg and warp: the caller's warp-uniform indices (wgmma::warp_uniform, once a kernel: a broadcast here would be
// a shuffle every step).
template <typename E, int KB, int BR, int D, bool kDq>
__device__ __forceinline__ void dkdv_block(float (&dk)[D / 8][4], float (&dv)[D / 8][4], uint32_t aK, uint32_t aV,
                                           uint32_t qb, uint32_t ob, const float* sL, const float* sDl,
                                           unsigned char* sS, const Params& p, int wg, int warp, int k0, int q0,
                                           int tid) {
  const int lane = tid % 32, g = lane / 4, c = lane % 4;
  const int wk0 = k0 + wg * 64, kw0 = wk0 + warp * 16;  // the warpgroup's and the warp's first key
  if (p.causal && q0 + BR - 1 < wk0) {  // warpgroup-uniform: no query of the step sees a key of the warpgroup
    if constexpr (kDq) {
      uint32_t zero[BR / 16][4] = {};
      store_ds<KB, BR>(sS, zero, wg * 64 + warp * 16, g, c);
    }
    return;
  }
  const int T = p.T;
  const float sl2 = p.scale * kLog2e;
  float st[BR / 8][4], dpt[BR / 8][4];      // S^T and dP^T (then P^T, dS^T): this warp's 16 keys x BR queries
  uint32_t ap[BR / 16][4], ad[BR / 16][4];  // P^T and dS^T as A fragments
  constexpr bool kSplit = D == 64, kEarlyDv = kSplit && BR == 64, kLateP = kSplit && !kEarlyDv;
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++)
    wgmma::Mma<E, BR>::ss(&st[0][0], kmajor<KB>(aK, wg * 64, kk), kmajor<BR>(qb, 0, kk), kk > 0);
  if constexpr (kSplit) wgmma::commit();
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++)
    wgmma::Mma<E, BR>::ss(&dpt[0][0], kmajor<KB>(aV, wg * 64, kk), kmajor<BR>(ob, 0, kk), kk > 0);
  wgmma::commit();
  wgmma::wait<kSplit ? 1 : 0>();  // S^T (groups retire in order)
  wgmma::keep(st);
  probs(st, sl2, hides_any(q0, q0 + BR, kw0, kw0 + 16, T, p.causal),
        [&](int t, int e) { return wgmma::ld_shared_f32(sL + t * 8 + 2 * c + (e & 1)); },
        [&, seen = SeenBy(kw0 + g, q0 + 2 * c, T, p.causal)](int t, int e) { return seen.hides(t, e); });
  if constexpr (!kLateP) {
#pragma unroll
    for (int ks = 0; ks < BR / 16; ks++) a_from_acc<E>(ap[ks], st[2 * ks], st[2 * ks + 1]);
  }
  if constexpr (kEarlyDv) {
    wgmma::fence();
    dv_product<E, BR, D>(dv, ap, ob);
    wgmma::commit();
    wgmma::wait<1>();  // dP^T
  } else if constexpr (kLateP) {
    wgmma::wait<0>();  // dP^T
  }
  wgmma::keep(dpt);
#pragma unroll
  for (int t = 0; t < BR / 8; t++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      dpt[t][e] = st[t][e] * (dpt[t][e] - wgmma::ld_shared_f32(sDl + t * 8 + 2 * c + (e & 1)));  // dS^T
#pragma unroll
  for (int ks = 0; ks < BR / 16; ks++) {
    if constexpr (kLateP) a_from_acc<E>(ap[ks], st[2 * ks], st[2 * ks + 1]);
    a_from_acc<E>(ad[ks], dpt[2 * ks], dpt[2 * ks + 1]);
  }
  wgmma::fence();
  if constexpr (!kEarlyDv) dv_product<E, BR, D>(dv, ap, ob);
#pragma unroll
  for (int ks = 0; ks < BR / 16; ks++)  // dK += dS^T Q, 16 queries (two 8-row groups of Q) per wgmma
    wgmma::Mma<E, D>::rs(&dk[0][0], ad[ks], mnmajor<BR>(qb, ks), 1);
  wgmma::commit();
  if constexpr (kDq) store_ds<KB, BR>(sS, ad, wg * 64 + warp * 16, g, c);  // while dK (and dV) are in flight
  wgmma::wait<0>();
  wgmma::keep(dk);
  wgmma::keep(dv);
  wgmma::keep(ap);
  wgmma::keep(ad);
}

// The fused backward's dQ part for one step: columns [n0, n0 + 32) of dS K_j over the CTA's KB keys (dS^T in the
// (KB, BR) tile at aS, read MN-major; K^T (D, KB) at aKt, K-major): this warp's 16 queries x 32 columns.
template <typename E, int KB, int D>
__device__ __forceinline__ void dq_product(float (&part)[4][4], uint32_t aS, uint32_t aKt, int n0) {
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < KB / 16; ks++)
    wgmma::Mma<E, 32>::ss_amn(&part[0][0], mnmajor<KB>(aS, ks), kmajor<D>(aKt, n0, ks), ks > 0);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::keep(part);
}

// The 128-query warp-specialised backward's dQ part for one step: warpgroup wg's 64 queries (column block wg of the
// (KB, 128) dS^T tile at aS) of dS K_j over the CTA's KB keys, all D = 64 columns: dS and K (the (KB, D) tile at aK,
// as V in P V) both read MN-major, so no K^T is needed. This warp's 16 queries x D.
template <typename E, int KB, int D>
__device__ __forceinline__ void dq_rows_product(float (&part)[D / 8][4], uint32_t aS, uint32_t aK, int wg) {
  static_assert(D == 64, "dq_rows_product: one 64-column block (wgmma n 64)");
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < KB / 16; ks++)
    wgmma::Mma<E, D>::ss_mn(&part[0][0], mnmajor_block<KB>(aS, wg, ks), mnmajor<KB>(aK, ks), ks > 0);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::keep(part);
}

// The fused backwards' order of dQ's sums for query step i (BR queries from i BR): the highest key block (of KB keys)
// that meets the step adds first, key block 0 last. -> how many parts come before key block j's. Causal: key block j
// first meets the queries at row j KB.
template <int KB, int BR>
__device__ __forceinline__ int turn_of(bool causal, int i, int j, int n_kb) {
  return (causal ? min(i * BR / KB, n_kb - 1) : n_kb - 1) - j;
}

// The first 1024-byte aligned address in dynamic shared memory (the launch asks for 1024 bytes more).
__device__ __forceinline__ unsigned char* aligned(unsigned char* smem) {
  return smem + (1024 - wgmma::shared_addr(smem) % 1024) % 1024;
}

}  // namespace fastgpt::cuda::flash::sm90
