// Flash attention forward for Hopper, warp-specialised (sm_90a only): flash_attention_sm90a.cu's products and
// online softmax, with the CTA split by role as FlashAttention-3 splits it.
// - Warpgroup 0 only copies, by TMA (tma.cuh) into rings of kStages<D> buffers: one thread of its warp 0 asks for Q
//   and then K_j for every key block, one thread of its warp 1 for V_j. The copy engine moves each tile and
//   publishes it itself (its bytes complete the tile's "full" mbarrier), so a tile lands and is published however
//   far the issuing thread has gone on: a K tile's publication never waits for a V buffer to be handed back, nor
//   for an issuing thread to be scheduled (cp.async copiers had to wait for their copies, fence them for wgmma and
//   arrive, 64 threads per tile). The warpgroup gives most of its registers back (setmaxnreg), so that the
//   multiplying warpgroups get 240 (two of them) or 160 (three) instead of the 168 or 128 an even split leaves.
//   Views whose strides a tensor map cannot describe (forward_ws_sm90 says so) run flash_attention_sm90a.cu's
//   kernel, whose bits these are.
// - O goes out the same way (FlashAttention-3's epilogue): each consumer thread puts its rows of O, normalised and
//   rounded, into the swizzled layout in its warpgroup's own rows of the tile's Q buffer (read by nothing once the
//   tile's last S product has retired) and arrives on an mbarrier; one thread of warpgroup 0 then has the copy
//   engine store them (TMA tensor stores, rows past T left out) and hands the buffer back to the Q copies once the
//   stores have read it. A consumer thread's 16 (d 64) or 32 (d 128) 4-byte global stores per tile, half sectors
//   each, with their 64-bit addresses, become as many conflict-free shared stores; it then starts the next tile, and
//   the copy engine writes whole 128-byte rows.
// - Warpgroups 1..NC each own 64 query rows and only multiply and take the softmax. They never wait on each other
//   or on the copier at a CTA-wide barrier (the other kernel's __syncthreads per key block): each buffer has a
//   "full" mbarrier (the issuing thread's arrival and the tile's bytes) and an "empty" one (every consumer warp
//   arrives once its wgmma have read the buffer).
// - The consumers take turns to issue their products (named barriers 1..NC, a ring): while one warpgroup's S and
//   P V are on the tensor cores, the others run their softmax, so the tensor cores see one warpgroup's products
//   after another's instead of all at once and then none (FlashAttention-3's "ping-pong" scheduling).
// - A CTA works through a list of tiles (query blocks of a (b, h)): blockIdx.x, then every gridDim.x-th, heaviest
//   first (causal: the last query blocks see the most keys), a persistent CTA one (b, h) at a time where there are
//   more (b, h) than CTAs (Tiles, below: L2 keeps K and V between its query blocks). One tile per CTA is the plain
//   launch; the "persistent" options launch one CTA per SM, whose copier fetches the next tile's Q (two buffers)
//   and key blocks (the rings run on across tiles) while the consumers finish the tile before and write its O: a
//   tile's start (the first copies' latency, the barriers' set-up, a CTA's launch) and end overlap another's work
//   instead of leaving the SM idle, as FlashAttention-3's persistent scheduler does. At GPT-2's T 1024, causal, a
//   tile is 1-8 key blocks.
// Inside a consumer the order is the other kernel's: S_j is issued before P_{j-1} V_{j-1}, and block j's softmax
// runs while that product is still on the tensor cores. Chosen with the fwd tile options "sm90 ws ..."
// (flash_attention.cu's kKernelOptions; "sm90 ws 128x128 persistent" is "auto"'s on an H100/H200). Ran and
// passed its tests on an H200 (2026-11-26).
#include <algorithm>
#include <cstdint>

#include "cuda/check.h"
#include "cuda/flash_attention_sm90.cuh"
#include "cuda/tma.cuh"

namespace fastgpt::cuda::flash {

namespace {

// Buffers per tile kind (K, V): the copy engine refills one while the consumers read the others. Three at head dim
// 64, so that V_j, whose buffer is handed back only once every consumer's P_{j-3} V_{j-3} has retired, has a step
// more to land before P_j V_j; two at 128 (three would leave no shared memory to spare).
template <int D>
constexpr int kStages = D == 64 ? 3 : 2;

// The mbarriers after the tiles, as indices into them: per Q buffer full, empty and O staged (o_full: the buffer
// holds the tile's O for store_o), then per stage K full, K empty, V full, V empty. full / empty take the tile kind
// (kK or kV), for the two issuing threads.
constexpr int kK = 0, kV = 1;
struct Bars {
  uint32_t base;
  __device__ uint32_t q_full(int qs) const { return base + 8 * (3 * qs); }
  __device__ uint32_t q_empty(int qs) const { return base + 8 * (3 * qs + 1); }
  __device__ uint32_t o_full(int qs) const { return base + 8 * (3 * qs + 2); }
  __device__ uint32_t full(int kind, int s) const { return base + 8 * (6 + 2 * kind + 4 * s); }
  __device__ uint32_t empty(int kind, int s) const { return base + 8 * (7 + 2 * kind + 4 * s); }
  __device__ uint32_t k_full(int s) const { return full(kK, s); }
  __device__ uint32_t k_empty(int s) const { return empty(kK, s); }
  __device__ uint32_t v_full(int s) const { return full(kV, s); }
  __device__ uint32_t v_empty(int s) const { return empty(kV, s); }
};
template <int D>
constexpr int kBarBytes = 8 * (6 + 4 * kStages<D>);

// Q buffers: a CTA's next tile's Q lands while the consumers still read the one before.
constexpr int kQBuffers = 2;

// The tiles, BR query rows each, numbered t = 0 .. n - 1; a CTA takes blockIdx.x and every gridDim.x-th after it.
// The (b, h) are taken in groups of `group` (the grid's CTAs, or all BH = B H when there are as many CTAs as that;
// the last group may have fewer), one group after another; within a group, t - (the group's first tile) = i is query
// block nqb - 1 - i / heads of the group's (b, h) number i % heads: the heaviest query blocks (causal) first, every
// CTA's tile of a round as heavy as the others'. With a group as large as the persistent grid, a CTA takes one (b,
// h)'s query blocks one after another, so its K and V, read again for each query block, are still in L2; numbered
// across all BH (b, h) (the seventh GPU run), a (b, h)'s next query block came BH tiles later, after L2 had let them
// go: each K and V block came from DRAM about twice (BENCHMARKS.md). The counts are the launch's (a kernel
// parameter): worked out per thread, their divisions cost the three-consumer kernel 8 bytes of spills. It keeps 4
// (the tile's (b, h), for its lse, stored once a tile and loaded once), where ptxas worked t % BH out again.
struct Tiles {
  int BH, nqb, n, group;
};
struct Tile {
  int q0, b, h, bh, nblocks;  // first query row, its (b, h), the key blocks of BC it multiplies
};
template <int BR, int BC>
__device__ __forceinline__ Tile tile_at(const Params& p, const Tiles& ts, int t) {
  Tile x;
  const int first = t / (ts.group * ts.nqb) * ts.group;  // the group's first (b, h)
  const int heads = min(ts.group, ts.BH - first), i = t - first * ts.nqb;
  x.bh = first + i % heads;
  x.b = x.bh / p.H, x.h = x.bh % p.H;
  x.q0 = (ts.nqb - 1 - i / heads) * BR;
  const int kv_end = p.causal ? min(p.T, x.q0 + BR) : p.T;
  x.nblocks = (kv_end + BC - 1) / BC;
  return x;
}

template <int D, int NC, int BC>
constexpr int ws_smem_bytes() {  // the Q buffers, the K and V rings, the barriers, room to align
  return sm90::tile_bytes<kQBuffers * 64 * NC + 2 * kStages<D> * BC, D>() + kBarBytes<D> + 1024;
}

// Registers per thread after setmaxnreg: the copier keeps few (24 is setmaxnreg's least), the consumers share the
// rest of the 64K.
template <int NC>
constexpr int kCopierRegs = NC == 2 ? 24 : 32;
template <int NC>
constexpr int kConsumerRegs = NC == 2 ? 240 : 160;
static_assert(128 * kCopierRegs<2> + 256 * kConsumerRegs<2> <= 65536, "registers: two consumers");
static_assert(128 * kCopierRegs<3> + 384 * kConsumerRegs<3> <= 65536, "registers: three consumers");

// The TMA maps of Q (boxes of the CTA's BR rows), K and V (BC rows): kernel parameters (__grid_constant__), as
// the copy instruction wants a map in parameter, constant or global memory.
struct Maps {
  tma::HeadsMap q, k, v, o;  // o: boxes of one consumer's 64 rows
};

// One issuing thread's ring of tile kind KIND (K or V) over the CTA's tiles: key block j of a tile, the CTA's n-th
// key block in all, goes into buffer n % S of the ring at shared address `ring`, once the buffer's empty barrier says
// every consumer is done with block n - S; the tile is published on its full barrier by this thread's arrival (with
// the tile's byte count) and the copy's bytes. The K thread first asks for each tile's Q (BR rows), into Q buffer
// u % 2 of the CTA's u-th tile once tile u - 2's O stores have read that buffer (store_o hands it back). Only the
// rings bound how far ahead a thread runs.
template <int D, int S, int BC, int BR, int KIND>
__device__ __forceinline__ void copy_ring(const Params& p, const Tiles& ts, const Maps& maps, uint32_t ring,
                                          uint32_t sQ, Bars bars) {
  constexpr uint32_t kTileBytes = sm90::tile_bytes<BC, D>(), kQBytes = sm90::tile_bytes<BR, D>();
  const tma::HeadsMap& src = KIND == kK ? maps.k : maps.v;
  tma::prefetch(&src.map);
  if constexpr (KIND == kK) tma::prefetch(&maps.q.map);
  int n = 0;  // key blocks asked for so far
  for (int t = blockIdx.x, u = 0; t < ts.n; t += gridDim.x, u++) {
    const Tile x = tile_at<BR, BC>(p, ts, t);
    if constexpr (KIND == kK) {
      const int qs = u % kQBuffers;
      if (u >= kQBuffers) wgmma::mbar_wait(bars.q_empty(qs), (u / kQBuffers - 1) & 1);
      tma::arrive_expect(bars.q_full(qs), kQBytes);
      tma::load_tile<BR, D>(sQ + qs * kQBytes, maps.q, bars.q_full(qs), x.q0, x.h, x.b);
    }
    for (int j = 0; j < x.nblocks; j++, n++) {
      const int s = n % S, use = n / S;
      if (use > 0) wgmma::mbar_wait(bars.empty(KIND, s), (use - 1) & 1);
      tma::arrive_expect(bars.full(KIND, s), kTileBytes);
      tma::load_tile<BC, D>(ring + s * kTileBytes, src, bars.full(KIND, s), j * BC, x.h, x.b);
    }
  }
}

// Warp 2's first thread of warpgroup 0: each tile's O, once every consumer thread has staged its rows in the tile's
// Q buffer (o_full), to global memory by TMA stores (one per consumer and 64 columns; rows past T left out), and
// the buffer back to the copier (q_empty) once they have read it. The consumers never wait for a store: a thread
// waits only for its own bulk groups, and a wait in the consumers' code made ptxas hold it to the launch's 168
// registers (hundreds of bytes spilled).
template <int D, int BR, int BC>
__device__ __forceinline__ void store_o(const Params& p, const Tiles& ts, const Maps& maps, uint32_t sQ, Bars bars) {
  constexpr uint32_t kQBytes = sm90::tile_bytes<BR, D>();
  tma::prefetch(&maps.o.map);
  for (int t = blockIdx.x, u = 0; t < ts.n; t += gridDim.x, u++) {
    const Tile x = tile_at<BR, BC>(p, ts, t);
    const int qs = u % kQBuffers;
    wgmma::mbar_wait(bars.o_full(qs), (u / kQBuffers) & 1);
    for (int r0 = 0; r0 < BR && x.q0 + r0 < p.T; r0 += 64)
      tma::store_tile<D>(sQ + qs * kQBytes + r0 * 128, BR * 128, maps.o, x.q0 + r0, x.h, x.b);
    tma::commit();
    tma::wait_read<0>();
    wgmma::mbar_arrive(bars.q_empty(qs));
  }
}

template <typename E, int D, int NC, int BC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    forward_ws_kernel(Params p, const __grid_constant__ Maps maps, Tiles ts) {
  constexpr int BR = 64 * NC, kQBytes = sm90::tile_bytes<BR, D>(), kKVBytes = sm90::tile_bytes<BC, D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sQ = sm90::aligned(smem_raw);     // kQBuffers x (BR, D) swizzled (flash_attention_sm90.cuh)
  constexpr int S = kStages<D>;
  unsigned char* sK = sQ + kQBuffers * kQBytes;    // S x (BC, D)
  unsigned char* sV = sK + S * kKVBytes;           // S x (BC, D)
  const Bars bars{wgmma::shared_addr(sV + S * kKVBytes)};

  const int tid = threadIdx.x, wg = wgmma::warp_uniform(tid / 128), warp = wgmma::warp_uniform(tid / 32 % 4);
  const int lane = tid % 32, g = lane / 4, c = lane % 4;
  const int T = p.T;

  if (tid == 0) {
    for (int qs = 0; qs < kQBuffers; qs++) {
      wgmma::mbar_init(bars.q_full(qs), 1);       // the K thread (and Q's bytes)
      wgmma::mbar_init(bars.q_empty(qs), 1);        // store_o, once its stores have read the buffer
      wgmma::mbar_init(bars.o_full(qs), 128 * NC);  // every consumer thread, its O staged in the buffer
    }
    for (int s = 0; s < S; s++) {
      wgmma::mbar_init(bars.k_full(s), 1);  // the issuing thread (and the tile's bytes)
      wgmma::mbar_init(bars.v_full(s), 1);
      wgmma::mbar_init(bars.k_empty(s), 4 * NC);  // one arrival per consumer warp
      wgmma::mbar_init(bars.v_empty(s), 4 * NC);
    }
  }
  __syncthreads();  // the barriers are initialised before anyone uses them; the only CTA-wide barrier

  if (wg == 0) {
    wgmma::regs_dec<kCopierRegs<NC>>();
    const uint32_t aK = wgmma::shared_addr(sK), aV = wgmma::shared_addr(sV), aQ = wgmma::shared_addr(sQ);
    if (tid == 0) copy_ring<D, S, BC, BR, kK>(p, ts, maps, aK, aQ, bars);
    if (tid == 32) copy_ring<D, S, BC, BR, kV>(p, ts, maps, aV, aQ, bars);
    if (tid == 64) store_o<D, BR, BC>(p, ts, maps, aQ, bars);
    return;
  }
  wgmma::regs_inc<kConsumerRegs<NC>>();
  const int ci = wg - 1;                                   // this consumer's 64 rows of each Q tile
  const int turn = 1 + ci, next_turn = 1 + (ci + 1) % NC;  // named barriers of the issue ring, 256 threads each
  const bool leader = lane == 0;                           // arrives on the empty barriers for its warp
  const uint32_t aK = wgmma::shared_addr(sK), aV = wgmma::shared_addr(sV);
  const float sl2 = p.scale * kLog2e;

  if (ci == NC - 1) wgmma::bar_arrive(next_turn, 256);  // consumer 0 issues first
  int n0 = 0;  // the CTA's key blocks before this tile's (the rings' count)
  for (int t = blockIdx.x, u = 0; t < ts.n; t += gridDim.x, u++) {
    const Tile x = tile_at<BR, BC>(p, ts, t);
    const int nblocks = x.nblocks, q0 = x.q0;
    const int wg0 = q0 + ci * 64, w0 = wg0 + warp * 16;  // this warpgroup's first query, and its warp's
    // The blocks this warpgroup multiplies (causal: those with a key at or before its last query), a prefix of the
    // tile's; the rest it only waits for and hands back, so that every buffer's empty barrier completes.
    const int nvis = p.causal ? min(nblocks, (wg0 + 64 + BC - 1) / BC) : nblocks;
    const bool last_tile = t + (int)gridDim.x >= ts.n;
    const int qs = u % kQBuffers;
    const uint32_t aQ = wgmma::shared_addr(sQ) + qs * kQBytes;
    float o[D / 8][4] = {};  // this warp's 16 rows x D of O
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8; m in log2 units
    float s[BC / 8][4];       // S = Q K^T for this warp's 16 rows x BC keys, then P
    // P of the block before, as wgmma A fragments: two sets where the registers allow (two consumers), P_j packed
    // into one while P_{j-1} V_{j-1} reads the other (next_block's kTwoP); odd steps read pa, even ones pB.
    constexpr bool kTwoP = NC == 2;
    uint32_t pa[BC / 16][4], pb[BC / 16][4];
    uint32_t(&pB)[BC / 16][4] = *(kTwoP ? &pb : &pa);
    float alpha[2];           // O's factor from the block before's softmax, applied before its P V

    wgmma::mbar_wait(bars.q_full(qs), (u / kQBuffers) & 1);
    // Step j issues S_j (j < nvis) and P_{j-1} V_{j-1} (1 <= j <= nvis) in this warpgroup's turn, then hands the
    // turn on. Every warpgroup takes nblocks + 1 turns of a tile whatever its nvis, so the ring stays in step (from
    // tile to tile too); the last consumer's last hand-on of the CTA's last tile is left out, so that every named
    // barrier ends with no arrival pending. Both tiles are waited for before the turn: a wait (a loop) between the
    // two products makes ptxas serialise every wgmma (C7520), and the turn issues both anyway.
    for (int j = 0; j <= nblocks; j++) {
      const int nk = n0 + j, nv = nk + S - 1;  // K_j's and (j > 0) V_{j-1}'s place in the rings, V's plus S
      const int sk = nk % S, sv = nv % S;
      const uint32_t pk = (nk / S) & 1, pv = (nv / S - 1) & 1;
      const bool hand_on = !(ci == NC - 1 && j == nblocks && last_tile);
      if (j < nblocks) wgmma::mbar_wait(bars.k_full(sk), pk);
      if (j > 0) wgmma::mbar_wait(bars.v_full(sv), pv);
      wgmma::bar_sync(turn, 256);
      const uint32_t kb = aK + sk * kKVBytes, vb = aV + sv * kKVBytes;
      const int k0 = j * BC;
      // (The mask test inside: computed before the branches, three consumers spill 68 bytes at 160 registers.)
      const auto softmax = [&](float (&sc)[BC / 8][4], float (&factor)[2]) {
        if (hides_any(w0, w0 + 16, k0, k0 + BC, T, p.causal)) mask_scores(sc, k0, w0, g, c, T, p.causal);
        softmax_rows(sc, sl2, m, l, factor);
        return l[0] + l[1];
      };
      const auto issued = [&] {  // the next consumer's turn
        if (hand_on) wgmma::bar_arrive(next_turn, 256);
      };
      const auto k_read = [&] {  // this warp is done with K_j's buffer
        wgmma::mbar_arrive_if(bars.k_empty(sk), leader);
      };
      const auto v_read = [&] {
        wgmma::mbar_arrive_if(bars.v_empty(sv), leader);
      };
      if (j == 0) {  // S_0 alone (block 0 is visible to every warpgroup)
        sm90::first_block<E, BR, BC, D>(s, alpha, pa, aQ, kb, ci, softmax, issued, k_read);
      } else if (j < nvis && (!kTwoP || j % 2 == 1)) {  // S_j, with P_{j-1} V_{j-1} behind it
        sm90::next_block<E, BR, BC, D, kTwoP>(s, o, alpha, pa, pB, aQ, kb, vb, ci, softmax, issued, k_read, v_read);
      } else if (j < nvis) {
        sm90::next_block<E, BR, BC, D, kTwoP>(s, o, alpha, pB, pa, aQ, kb, vb, ci, softmax, issued, k_read, v_read);
      } else if (j == nvis && (!kTwoP || j % 2 == 1)) {  // the last P V
        sm90::last_pv<E, BC, D>(o, alpha, pa, vb, issued, v_read);
      } else if (j == nvis) {
        sm90::last_pv<E, BC, D>(o, alpha, pB, vb, issued, v_read);
      } else {  // past this warpgroup's last block: V_{j-1} is not used, only handed back
        issued();
        v_read();
      }
      if (j >= nvis && j < nblocks) k_read();  // K_j, not used here
    }
    n0 += nblocks;

    // O goes out through the warpgroup's rows of the Q buffer (every S product of the tile has retired, and no other
    // warpgroup reads them); store_o has the copy engine write it while this warpgroup goes on to the next tile.
    sm90::stage_rows<E, BR, D>(o, m, l, sQ + qs * kQBytes, ci * 64 + warp * 16, w0, g, c, T,
                               p.lse + (int64_t)x.bh * T);
    wgmma::fence_proxy_async();  // this thread's O, for the copy engine
    wgmma::mbar_arrive(bars.o_full(qs));
  }
}

// false: a tensor's strides (q, k, v or out) give no TMA map, or there are too many tiles for the kernel's int counts
// (a tile index plus the grid must fit), and nothing was launched.
// persistent: one CTA per SM (the kernel's registers allow one), each taking its share of the tiles; else one per
// tile.
template <typename E, int D, int NC, int BC>
bool launch_ws(const Params& p, Stream stream, bool persistent) {
  constexpr int bytes = ws_smem_bytes<D, NC, BC>(), rows = 64 * NC;
  const int nqb = (p.T + rows - 1) / rows;
  const int64_t tiles = (int64_t)p.B * p.H * nqb;
  Maps maps;
  size_t o_bytes = 0;  // O's bytes where it has no gaps
  if (tiles > INT32_MAX / 2 || !tma::make_heads_map(maps.q, p.q, p.B, p.H, p.T, D, p.is, rows) ||
      !tma::make_heads_map(maps.k, p.k, p.B, p.H, p.T, D, p.is, BC) ||
      !tma::make_heads_map(maps.v, p.v, p.B, p.H, p.T, D, p.is, BC) ||
      !tma::make_heads_map(maps.o, p.out, p.B, p.H, p.T, D, p.os, 64, &o_bytes))
    return false;
  int ctas = (int)tiles;
  if (persistent) {
    ctas = (int)std::min<int64_t>(tiles, sm_count());
  }
  const Tiles ts{p.B * p.H, nqb, (int)tiles, std::min(ctas, p.B * p.H)};
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(forward_ws_kernel<E, D, NC, BC>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  forward_ws_kernel<E, D, NC, BC><<<ctas, 128 * (NC + 1), bytes, stream>>>(p, maps, ts);
  FASTGPT_CUDA_CHECK_LAUNCH();
  // O is written by tensor stores alone, which initcheck does not see: marked for it, where O is one range (an O
  // with gaps stays unmarked: marking the gaps would hide them from the tool).
  if (o_bytes > 0) tma::mark_stored(p.out, o_bytes, stream);
  return true;
}

}  // namespace

// The "sm90 ws" fwd options (flash_attention_sm90a.cu's forward_sm90 sends them here, counted from the first),
// CTA query rows x keys per block: 0 "128x128" (two consumers), 1 "192x128" (three; head dim 128 runs 128x128: 160
// registers would spill); 2 and 3 the same, persistent. false where the inputs' strides give no TMA map (nothing
// launched: the caller runs its own kernel).
template <typename E>
bool forward_ws_sm90(const Params& p, Stream stream, int option) {
  const bool persistent = option >= 2;
  if (p.d == 64 && option % 2 == 1) return launch_ws<E, 64, 3, 128>(p, stream, persistent);
  if (p.d == 64) return launch_ws<E, 64, 2, 128>(p, stream, persistent);
  return launch_ws<E, 128, 2, 128>(p, stream, persistent);
}

template bool forward_ws_sm90<__nv_bfloat16>(const Params&, Stream, int);
template bool forward_ws_sm90<__half>(const Params&, Stream, int);

}  // namespace fastgpt::cuda::flash
