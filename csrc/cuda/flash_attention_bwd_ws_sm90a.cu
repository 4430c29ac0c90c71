// Flash attention's fused backward for Hopper, warp-specialised (sm_90a only): flash_attention_bwd_sm90a.cu's
// "sm90 fused" kernel (dk, dv and dq in one; the steps are flash_attention_sm90.cuh's dkdv_block and dq_product)
// with the CTA split by role, as FlashAttention-3's backward splits it. That kernel stops both warpgroups three
// times per query step at __syncthreads, and the dQ sums across CTAs (wait for the turn, read the sum so far from
// L2, add, write back) sit between one step's products and the next. Here:
// - Warpgroup 0 does not multiply. Its warp 0 has the copy engine (TMA, tma.cuh) bring a tile's K and V, then each
//   step's Q and dO, and stages each step's lse and delta itself, into a ring of kStages buffers, each published on
//   a "full" mbarrier (the warp's 32 arrivals and the copies' bytes) and refilled after its "empty" one. Views whose
//   strides a tensor map cannot describe run the "sm90 fused" kernel (the same bits). The dQ parts come from a
//   ring of kDqStages fp32 parts in shared memory, each added in the CTA's turn to the ordered sums: in key blocks
//   j > 0 by one thread that has the copy engine add the whole part in L2 (cp.reduce.async.bulk: dq_adder), in key
//   block 0, the last turn, by warps 1-3, which write dq (dq_writer). The warpgroup gives registers back
//   (setmaxnreg) to the other two (Step<BR>: 208 or 232 each).
// - Warpgroups 1 and 2 own 64 keys each and only multiply: a step waits for its buffer, makes dV, dK and dS^T, hands
//   the buffer back, meets the other warpgroup at one named barrier (dS^T of all 128 keys is in shared memory; two
//   dS^T tiles alternate, so one barrier per step is enough), multiplies its half of the step's dQ part and leaves
//   it in the ring. They never wait for another CTA unless the ring is full. Where the caller asks (Params::kv_part:
//   the engine's qkv bias gradient), they then sum the tile's 128 keys of dK and dV by column (warp_column_sums,
//   then their eight warps' sums in order) into one row of partial sums, so that no pass over dK and dV has to.
// The sums, their order (highest key block first; key block 0 writes dq) and therefore dq, dk and dv are the "sm90
// fused" kernel's bits. Head dim 64 only (the dkdv options "sm90 ws fused" and "sm90 ws fused 128x128"; at 128
// they run "sm90 fused": the kernel there needs all 255 registers). Two step sizes (BR queries per step, Step<BR>):
// - 64 ("sm90 ws fused"): each consumer's S^T, dP^T are 64 x 64; dQ is split by columns, 32 at a time (the 32-column
//   MN-major B would be half a swizzle row: K is read K-major from a transposed copy made once per CTA).
// - 128 ("sm90 ws fused 128x128", FlashAttention-3's tile at d 64): S^T and dP^T are 64 keys x 128 queries, so each
//   step's fixed costs (the waits, the consumers' barrier, the dQ turn and its copy) are spread over twice the
//   products and each wgmma is n 128; dQ is split by rows, each consumer's 64 queries x all 64 columns reading dS and
//   K both MN-major (no K^T). The registers this takes (S^T, dP^T, P^T, dK, dV: 228 per thread at the peak) leave
//   warpgroup 0 40 each; shared memory (K, V, two Q, dO and dS^T tiles: 160 KB) leaves room for one 32 KB dQ part,
//   and key block 0's writers, whose 40 registers hold one chunk of it at a time, have the copy engine add their
//   part and fetch the finished sum (kBulkSum) instead of loading it from L2 chunk by chunk.
// Both give the same bits: every element's products run over the same keys and queries in the same order.
// Tiles (a (b, h)'s key block of KB keys) are numbered (b, h) by (b, h), each one's key blocks counted down, so that a
// tile's dQ turns wait only for tiles numbered below it. The plain launch has one CTA per tile, tile blockIdx.x. The
// persistent ones ("... persistent") have one CTA per SM, each taking tile after tile from a counter in global memory
// (atomicAdd: the tiles go out in number order, to running CTAs, so a tile waits only for tiles already being worked
// on, and the grid cannot deadlock), a dynamic scheduler because a causal tile is 1 to T / 128 steps: a static
// share would leave whole CTAs idle. The CTA's prologue (barriers, registers, the first copies) is paid once, not per
// tile, and the next tile's first Q and dO land while the consumers finish the last tile's last step; only K and V,
// which the consumers read up to that step's dQ product, wait for them (kv_empty).
// Ran and passed its tests on an H200 (2026-11-26); "sm90 ws fused 128x128 persistent" is "auto"'s backward at d 64.
#include <algorithm>
#include <stdexcept>

#include "cuda/check.h"
#include "cuda/flash_attention_sm90.cuh"
#include "cuda/tma.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int KB = 128;                        // keys per CTA
constexpr int kStages = 2;                     // Q/dO/lse/delta buffers
constexpr int kNT = 384, kWriters = 96;        // threads: warpgroup 0 (loader warp, writer warps), two consumers
constexpr int kConsumerBar = 1, kWriterBar = 2;  // named barriers (0 is __syncthreads)
constexpr int kSumsBar = 3;                      // the consumers' eight warps' column sums (kv_sums)

// Per step size (BR queries): dQ part buffers, the registers of warpgroup 0 and of the consumers, how many chunks
// dq_writer loads from L2 at once (4: no spills at 80 registers, 5 spilled 28 bytes), and whether key block 0 has the
// copy engine add its part too and bring the finished sum back (kBulkSum: dq_writer's 40 registers hold one chunk,
// and one chunk at a time is 22 round trips to L2 per 32 KB step, in the turn chain's last link).
template <int BR>
struct Step;
template <>
struct Step<64> {
  static constexpr int kDqStages = 2, kCopierRegs = 80, kConsumerRegs = 208, kBatch = 4;
  static constexpr bool kBulkSum = false;
};
template <>
struct Step<128> {
  static constexpr int kDqStages = 1, kCopierRegs = 40, kConsumerRegs = 232;
  static constexpr bool kBulkSum = true;
};
// setmaxnreg.inc blocks until the pool has the registers: ptxas gives the launch 168 per thread (65536 / 384), and
// the consumers' 2 x 128 x (kConsumerRegs - 168) must come from warpgroup 0's 128 x (168 - kCopierRegs).
template <int BR>
constexpr bool fits_pool() {
  return 128 * (168 - Step<BR>::kCopierRegs) >= 256 * (Step<BR>::kConsumerRegs - 168);
}
static_assert(fits_pool<64>() && fits_pool<128>(), "registers: the pool");

// The mbarriers after the tiles: K and V full and empty, then per stage Q full and empty, then per dQ stage full and
// empty, then (kBulkSum) per dQ stage the finished sum's arrival in the part's buffer, then per tile slot (the
// persistent kernel's tile numbers, published by the loader) full and empty.
constexpr int kTileSlots = 2, kTileReaders = 256 + kWriters;  // the consumers and warps 1-3 read each tile number
template <int BR>
struct Bars {
  static constexpr int kDqStages = Step<BR>::kDqStages;
  static constexpr int kQ0 = 2, kDq0 = kQ0 + 2 * kStages, kSum0 = kDq0 + 2 * kDqStages;
  static constexpr int kTile0 = kSum0 + (Step<BR>::kBulkSum ? kDqStages : 0), kCount = kTile0 + 2 * kTileSlots;
  uint32_t base;
  __device__ uint32_t kv_full() const { return base; }
  __device__ uint32_t kv_empty() const { return base + 8; }
  __device__ uint32_t q_full(int s) const { return base + 8 * (kQ0 + 2 * s); }
  __device__ uint32_t q_empty(int s) const { return base + 8 * (kQ0 + 1 + 2 * s); }
  __device__ uint32_t dq_full(int s) const { return base + 8 * (kDq0 + 2 * s); }
  __device__ uint32_t dq_empty(int s) const { return base + 8 * (kDq0 + 1 + 2 * s); }
  __device__ uint32_t dq_sum(int s) const { return base + 8 * (kSum0 + s); }
  __device__ uint32_t tile_full(int s) const { return base + 8 * (kTile0 + 2 * s); }
  __device__ uint32_t tile_empty(int s) const { return base + 8 * (kTile0 + 1 + 2 * s); }
};

// Shared memory, every tile 1024-byte aligned (their sizes are multiples of 1024).
template <int D, int BR>
struct Layout {
  static constexpr bool kHasKt = BR == 64;  // K^T for the 32-column dQ products
  static constexpr int kDqStages = Step<BR>::kDqStages;
  static constexpr int kKBytes = sm90::tile_bytes<KB, D>(), kQBytes = sm90::tile_bytes<BR, D>();
  static constexpr int kSBytes = sm90::tile_bytes<KB, BR>(), kDqBytes = BR * D * 4, kLdBytes = 2 * BR * 4;
  static constexpr int kK = 0, kV = kKBytes, kKt = 2 * kKBytes;   // (KB, D), (KB, D), (D, KB) K^T if kHasKt
  static constexpr int kQ = (kHasKt ? 3 : 2) * kKBytes;           // kStages x (BR, D)
  static constexpr int kdO = kQ + kStages * kQBytes;              // kStages x (BR, D)
  static constexpr int kS = kdO + kStages * kQBytes;              // 2 x (KB, BR) dS^T
  static constexpr int kDq = kS + 2 * kSBytes;                    // kDqStages x (BR, D) fp32, in fragment order
  static constexpr int kLd = kDq + kDqStages * kDqBytes;          // kStages x (lse in log2 units, delta) x BR
  static constexpr int kSums = kLd + kStages * kLdBytes;          // 8 consumer warps x (dK | dV) x D fp32
  static constexpr int kBars = kSums + 2 * 4 * 2 * D * 4;
  static constexpr int kTiles = kBars + 8 * Bars<BR>::kCount;     // kTileSlots tile numbers, 16 bytes apart
  static constexpr int kBytes = kTiles + 16 * kTileSlots + 1024;  // and room to align
};
static_assert(Layout<64, 64>::kBytes <= 227 * 1024 && Layout<64, 128>::kBytes <= 227 * 1024, "shared memory");

// A step's dQ part in the ring and in the fp32 sums is in fragment order: float4 number
// (((consumer * kCb + column block) * 4 + warp) * 4 + t) * 32 + lane holds that lane's accumulators of 8-column
// tile t of a block of 32 columns (rows g and g + 8, columns 2c and 2c + 1): each warp stores and each writer thread
// loads 16 contiguous bytes per lane (no bank conflicts), and the sums are one coalesced pass. A consumer has kCb
// blocks of 32 columns: of its D / 2 columns of all 64 queries (BR 64), or of all D columns of its 64 queries (BR
// 128). The float4 number of consumer ci's warp's tile t of column block cb, and (dq_coords) the row and column of
// float4 number q:
template <int D, int BR>
constexpr int kCb = BR == 64 ? D / 64 : D / 32;
template <int D, int BR>
__device__ __forceinline__ int dq_chunk(int ci, int cb, int warp, int t, int lane) {
  return (((ci * kCb<D, BR> + cb) * 4 + warp) * 4 + t) * 32 + lane;
}
template <int D, int BR>
__device__ __forceinline__ void dq_coords(int q, int& row, int& col) {
  const int lane = q % 32, t = q / 32 % 4, warp = q / 128 % 4, cb = q / 512 % kCb<D, BR>, ci = q / (512 * kCb<D, BR>);
  row = (BR == 64 ? 0 : 64 * ci) + 16 * warp + lane / 4;
  col = (BR == 64 ? ci * (D / 2) : 0) + cb * 32 + 8 * t + 2 * (lane % 4);
}

// The TMA maps of Q and dO (boxes of a step's BR queries) and K and V (the CTA's KB keys): kernel parameters
// (__grid_constant__), as the copy instruction wants a map in parameter, constant or global memory.
struct Maps {
  tma::HeadsMap q, k, v, dout;
};

// Tile number t: key block j = n_kb - 1 - t % n_kb of (b, h) = t / n_kb.
struct Tile {
  int bh, j;
};
__device__ __forceinline__ Tile tile_at(int t, int n_kb) { return {t / n_kb, n_kb - 1 - t % n_kb}; }
// Where (b, h) = bh starts in q, k, v and their gradients (strides p.is).
__device__ __forceinline__ int64_t in_offset(const Params& p, int bh) {
  return (int64_t)(bh / p.H) * p.is.sb + (int64_t)(bh % p.H) * p.is.sh;
}

// The CTA's n-th tile number, or -1 past its last. Plain launch: blockIdx.x, then none. Persistent: the loader's lane
// 0 takes the next number from the counter (p.next_tile) and publishes it in slot n % kTileSlots (tile_full) once
// every reader has handed the slot's last number back (tile_empty); -1 once the counter passes the last tile. Every
// loader lane gets it (take_tile); the other roles read it from the slot (read_tile). The slots are 16 bytes apart:
// the emulator's race check follows 16-byte chunks.
template <bool kPersistent, int BR>
__device__ __forceinline__ int take_tile(const Params& p, Bars<BR> bars, int* slots, int n, int tiles, int lane) {
  if constexpr (!kPersistent) {
    return n == 0 ? (int)blockIdx.x : -1;
  } else {
    int t = 0;
    if (lane == 0) {
      const int s = n % kTileSlots;
      if (n >= kTileSlots) wgmma::mbar_wait(bars.tile_empty(s), (n / kTileSlots - 1) & 1);
      t = atomicAdd(p.next_tile, 1);
      if (t >= tiles) t = -1;
      wgmma::st_shared_b32(slots + 4 * s, (uint32_t)t);
      wgmma::mbar_arrive(bars.tile_full(s));
    }
    return wgmma::warp_uniform(t);  // lane 0's tile
  }
}
template <bool kPersistent, bool kLimit, int BR>
__device__ __forceinline__ int read_tile(Bars<BR> bars, const int* slots, int n) {
  if constexpr (!kPersistent) {
    return n == 0 ? (int)blockIdx.x : -1;
  } else {
    const int s = n % kTileSlots;
    wgmma::mbar_wait<kLimit>(bars.tile_full(s), (n / kTileSlots) & 1);
    const int t = (int)wgmma::ld_shared_b32(slots + 4 * s);
    wgmma::mbar_arrive(bars.tile_empty(s));
    return t;
  }
}

// Warp 0 of warpgroup 0, for each of the CTA's tiles: each step's Q and dO (copies that lane 0 asks the copy engine
// for) and lse, delta (each lane's ordinary loads and stores), and after the first step's copies K and V, once the
// consumers are done with the last tile's (kv_empty). The ring of step buffers runs on across tiles (the CTA's u-th
// step uses buffer u % kStages), a buffer refilled once its empty barrier says both consumers are done with it. K
// and V are published by their bytes (their barrier's one arrival is lane 0's, with the count); a step by the 32
// lanes' arrivals once their lse and delta are stored, and the copies' bytes. So no step's publication waits for
// another step's, nor for the consumers (a loader that published a step only once the next was issued waited for
// the hand-back of the buffer before it: a bubble before every step). Only the ring bounds how far ahead the loader
// runs. The next tile is taken only once the ring has a buffer for its first step (the consumers are in the last
// tile's last step): a tile taken early would hold up the tiles that wait for its dQ turns.
template <bool kPersistent, int D, int BR>
__device__ __forceinline__ void loader(const Params& p, const Maps& maps, unsigned char* sm, Bars<BR> bars,
                                       int* slots, int lane) {
  using L = Layout<D, BR>;
  const int T = p.T, n_kb = (T + KB - 1) / KB, n_q = (T + BR - 1) / BR, tiles = p.B * p.H * n_kb;
  if (lane == 0)
    for (const tma::HeadsMap* m : {&maps.k, &maps.v, &maps.q, &maps.dout}) tma::prefetch(&m->map);
  for (int n = 0, u = 0;; n++) {
    if (u >= kStages) wgmma::mbar_wait(bars.q_empty(u % kStages), (u / kStages - 1) & 1);
    const int t = take_tile<kPersistent>(p, bars, slots, n, tiles, lane);
    if (t < 0) return;
    const Tile x = tile_at(t, n_kb);
    const int bh = x.bh, b = bh / p.H, h = bh % p.H, k0 = x.j * KB, i_first = p.causal ? k0 / BR : 0;
    for (int i = i_first; i < n_q; i++, u++) {
      const int s = u % kStages, use = u / kStages, q0 = i * BR;
      if (i > i_first && use > 0) wgmma::mbar_wait(bars.q_empty(s), (use - 1) & 1);  // the first: waited above
      if (lane == 0) {  // the bytes first, so that the phase cannot complete on the lanes' arrivals alone
        tma::expect(bars.q_full(s), 2 * L::kQBytes);
        tma::load_tile<BR, D>(wgmma::shared_addr(sm + L::kQ + s * L::kQBytes), maps.q, bars.q_full(s), q0, h, b);
        tma::load_tile<BR, D>(wgmma::shared_addr(sm + L::kdO + s * L::kQBytes), maps.dout, bars.q_full(s), q0, h, b);
        if (i == i_first) {
          if (n > 0) wgmma::mbar_wait(bars.kv_empty(), (n - 1) & 1);
          tma::arrive_expect(bars.kv_full(), 2 * L::kKBytes);
          tma::load_tile<KB, D>(wgmma::shared_addr(sm + L::kK), maps.k, bars.kv_full(), k0, h, b);
          tma::load_tile<KB, D>(wgmma::shared_addr(sm + L::kV), maps.v, bars.kv_full(), k0, h, b);
        }
      }
      float* ld = reinterpret_cast<float*>(sm + L::kLd + s * L::kLdBytes);
      for (int r = lane; r < BR; r += 32) {  // as stage_lse_delta: zeros past T
        const int q = q0 + r;
        wgmma::st_shared_f32(ld + r, q < T ? p.lse[(int64_t)bh * T + q] * kLog2e : 0.f);
        wgmma::st_shared_f32(ld + BR + r, q < T ? p.delta[(int64_t)bh * T + q] : 0.f);
      }
      wgmma::mbar_arrive(bars.q_full(s));
    }
  }
}

// One thread's hand-off of a dQ part (the ring buffer at shared address `part`) to the copy engine in its turn on
// `counter`: the first turn stores it as the sum at `sum`, each later one adds it there in L2 (an add's operands
// commute: the sums are dq_part's); one bulk group, committed, not waited for.
template <int D, int BR>
__device__ __forceinline__ void add_part(float* sum, uint32_t part, int* counter, int turn) {
  wgmma::wait_count(counter, turn);
  tma::fence_global();  // the sum the turn's acquire made visible, before the copy engine adds to it
  if (turn == 0)
    tma::store(sum, part, Layout<D, BR>::kDqBytes);
  else
    tma::reduce_add(sum, part, Layout<D, BR>::kDqBytes);
  tma::commit();
}

// Key block 0's warps 1-3 of warpgroup 0 (wt 0-95): each step's dQ part from the ring, added in this CTA's turn (the
// last) to the sums of query step i and written to dq (times the scale, rounded once), as dq_part in
// flash_attention_bwd_sm90a.cu: the same additions in the same order. The part is ready once thread wt 0 (thread 32,
// also dq_adder: it follows every step of the CTA, so its dq_full waits name the right phases) has waited for it;
// the others learn that from wt 0 (dq_sum, or the writers' barrier) and then wait for dq_full themselves, where the
// phase can no longer be an older one of the same parity (the next cannot complete before they arrive on dq_empty;
// in a persistent CTA they skip the key blocks j > 0 that dq_adder serves, and a wait before wt 0's could pass on a
// phase two steps back). That own wait orders nothing more for the GPU, but compute-sanitizer's racecheck takes an
// mbarrier as ordering only the accesses of the threads that arrived on it before those of the threads that waited
// for it, not what the arriving thread had itself waited for (the PTX memory model's cumulativity), and flagged
// every reader but thread 0 on the H200 (2026-11-26) when it reached the consumers' stores only through wt 0. For
// the same reason each thread hands the buffer back itself (dq_empty). u0: the CTA's steps before this
// tile (the ring's count); w0: its key block 0 steps before it (dq_sum's). Two ways to the finished sum:
// - kBulkSum (128-query steps): thread wt 0 has the copy engine add the part to the sum in L2, as dq_adder does,
//   and bring the finished sum back into the part's buffer (one bulk copy each way, the whole 32 KB in flight at
//   once); the writers read it there. Where no other key block meets the step (turn 0) the part is the sum.
// - else: each thread loads kBatch chunks of the sum from L2 at a time, all before the first add: at BR 64, three
//   round trips to L2 per step (d 64), not one per chunk.
template <typename E, int D, int BR>
__device__ __forceinline__ void dq_writer(const Params& p, unsigned char* sm, Bars<BR> bars, int bh, int n_kb,
                                          int i_first, int n_q, int u0, int w0, int wt) {
  using L = Layout<D, BR>;
  constexpr int kChunks = BR * D / 4, kDqStages = L::kDqStages;
  static_assert(!Step<BR>::kBulkSum || kDqStages == 1, "dq_sum's phases: one per key block 0 step");
  E* dq = static_cast<E*>(p.dq) + in_offset(p, bh);
  const auto write = [&](int q, int q0, float4 v) {  // float4 number q of the step's sum, scaled, rounded, to dq
    int row, col;
    dq_coords<D, BR>(q, row, col);
    if (q0 + row < p.T) store_two(dq + (int64_t)(q0 + row) * p.is.st + col, v.x * p.scale, v.y * p.scale);
    if (q0 + row + 8 < p.T) store_two(dq + (int64_t)(q0 + row + 8) * p.is.st + col, v.z * p.scale, v.w * p.scale);
  };
  for (int i = i_first; i < n_q; i++) {
    const int u = u0 + i - i_first, s = u % kDqStages, q0 = i * BR;
    const int turn = sm90::turn_of<KB, BR>(p.causal, i, 0, n_kb);  // every other key block's part comes first
    float* sum = p.dq_accum + ((int64_t)bh * n_q + i) * BR * D;
    const float4* part = reinterpret_cast<const float4*>(sm + L::kDq + s * L::kDqBytes);
    if constexpr (Step<BR>::kBulkSum) {
      if (wt == 0) {
        const uint32_t at = wgmma::shared_addr(part);
        wgmma::mbar_wait(bars.dq_full(s), (u / kDqStages) & 1);  // the consumers' stores are behind their fence
        if (turn > 0) {
          add_part<D, BR>(sum, at, p.dq_turn + (int64_t)bh * n_q + i, turn);
          tma::wait<0>();       // the sum is finished (and the part read: its buffer may be overwritten)
          tma::fence_global();  // the finished sum, visible to this thread, before the copy engine reads it
          tma::arrive_expect(bars.dq_sum(s), L::kDqBytes);
          tma::load_bulk(at, sum, L::kDqBytes, bars.dq_sum(s));
        } else {
          wgmma::mbar_arrive(bars.dq_sum(s));
        }
      }
      wgmma::mbar_wait(bars.dq_sum(s), (w0 + i - i_first) & 1);
      if (wt != 0) wgmma::mbar_wait(bars.dq_full(s), (u / kDqStages) & 1);  // (racecheck: above)
      for (int q = wt; q < kChunks; q += kWriters) write(q, q0, wgmma::ld_shared_v4(part + q));
    } else {
      if (wt == 0) {
        wgmma::mbar_wait(bars.dq_full(s), (u / kDqStages) & 1);
        wgmma::wait_count(p.dq_turn + (int64_t)bh * n_q + i, turn);
      }
      wgmma::bar_sync(kWriterBar, kWriters);  // the part is ready, the turn is this CTA's: the sums before it visible
      if (wt != 0) wgmma::mbar_wait(bars.dq_full(s), (u / kDqStages) & 1);  // (racecheck: above)
      const float4* acc = reinterpret_cast<const float4*>(sum);
      constexpr int kBatch = Step<BR>::kBatch;
      for (int qb = wt; qb < kChunks; qb += kBatch * kWriters) {
        float4 v[kBatch], o[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; k++)
          if (qb + k * kWriters < kChunks) {
            v[k] = wgmma::ld_shared_v4(part + qb + k * kWriters);
            if (turn > 0) o[k] = __ldcg(acc + qb + k * kWriters);  // the sum so far, from L2 (other SMs made it)
          }
#pragma unroll
        for (int k = 0; k < kBatch; k++) {
          if (qb + k * kWriters >= kChunks) continue;
          if (turn > 0) v[k].x += o[k].x, v[k].y += o[k].y, v[k].z += o[k].z, v[k].w += o[k].w;
          write(qb + k * kWriters, q0, v[k]);
        }
      }
    }
    wgmma::mbar_arrive(bars.dq_empty(s));  // this thread has read its chunks of the part
  }
}

// Key blocks j > 0, one thread (wg 0's thread 32): each step's dQ part goes to the query step's fp32 sums by the copy
// engine, in this CTA's turn (add_part). The part is 16 KB at d 64 (32 KB at 128 queries), contiguous in the ring
// and in the sums (both in fragment order): one copy. Its buffer goes back to the consumers once the copy has read it; the turn passes on once the sum is
// written. Before, three warps moved each part through their registers: three round trips to L2 per step, each sum
// read into the SM and written back, the turn held meanwhile.
template <int D, int BR>
__device__ __forceinline__ void dq_adder(const Params& p, unsigned char* sm, Bars<BR> bars, int bh, int j, int n_kb,
                                         int i_first, int n_q, int u0) {
  using L = Layout<D, BR>;
  constexpr int kDqStages = L::kDqStages;
  for (int i = i_first; i < n_q; i++) {
    const int u = u0 + i - i_first, s = u % kDqStages;
    const int turn = sm90::turn_of<KB, BR>(p.causal, i, j, n_kb);
    float* acc = p.dq_accum + ((int64_t)bh * n_q + i) * BR * D;
    int* counter = p.dq_turn + (int64_t)bh * n_q + i;
    const uint32_t part = wgmma::shared_addr(sm + L::kDq + s * L::kDqBytes);
    wgmma::mbar_wait(bars.dq_full(s), (u / kDqStages) & 1);  // the consumers' stores are behind their proxy fence
    add_part<D, BR>(acc, part, counter, turn);
    tma::wait_read<0>();
    wgmma::mbar_arrive(bars.dq_empty(s), kWriters);  // the count dq_writer's threads arrive with, one each
    tma::wait<0>();
    wgmma::add_count(counter);  // a release: the sum is written
  }
}

// kv_part (Params): the column sums of dK and dV, the K and V thirds of the engine's qkv bias gradient, made where
// the tiles are in registers instead of by a pass over dqkv (issue 10). A value as stored: times `scale`, rounded to
// E, as store_tile_rows stores it (so that the sums are dqkv's column sums, in another order).
template <typename E>
__device__ __forceinline__ float2 as_stored(float lo, float hi) {
  const uint32_t u = Pack<E>::two(lo, hi);
  const E* e = reinterpret_cast<const E*>(&u);
  return make_float2(static_cast<float>(e[0]), static_cast<float>(e[1]));
}
// One exchange of warp_column_sums: a lane holds N tiles' two column sums; it keeps the half that its lane bit
// `d` (16, 8 or 4: g's bits 2, 1, 0) picks and adds the other lane's sums of that half to its own.
template <int N>
__device__ __forceinline__ void keep_half(float (&v)[8][2], int lane, int d) {
  const bool upper = lane & d;
#pragma unroll
  for (int k = 0; k < N / 2; k++)
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const float keep = upper ? v[k + N / 2][e] : v[k][e], give = upper ? v[k][e] : v[k + N / 2][e];
      v[k][e] = keep + __shfl_xor_sync(0xffffffffu, give, d);
    }
}
// One warp's 16 rows (row0 + g and + 8) of a head-dim-64 accumulator, as stored, summed by column (rows past T left
// out). A lane adds its two rows; three exchanges (keep_half) then halve the 8-column tiles it holds, so that lane
// (g, c) ends with tile g's columns 2c and 2c + 1: 14 shuffles a matrix, where every column on every lane takes 48.
template <typename E>
__device__ __forceinline__ float2 warp_column_sums(const float (&acc)[8][4], int row0, int g, int lane, int T,
                                                   float scale) {
  const bool r0 = row0 + g < T, r1 = row0 + g + 8 < T;
  float v[8][2];
#pragma unroll
  for (int t = 0; t < 8; t++) {
    const float2 a = as_stored<E>(acc[t][0] * scale, acc[t][1] * scale);
    const float2 b = as_stored<E>(acc[t][2] * scale, acc[t][3] * scale);
    v[t][0] = (r0 ? a.x : 0.f) + (r1 ? b.x : 0.f);
    v[t][1] = (r0 ? a.y : 0.f) + (r1 ? b.y : 0.f);
  }
  keep_half<8>(v, lane, 16);
  keep_half<4>(v, lane, 8);
  keep_half<2>(v, lane, 4);
  return make_float2(v[0][0], v[0][1]);
}

template <typename E, int D, int BR, bool kPersistent>
__global__ void __launch_bounds__(kNT, 1) backward_ws_kernel(Params p, const __grid_constant__ Maps maps) {
  using L = Layout<D, BR>;
  constexpr int kDqStages = L::kDqStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sm = sm90::aligned(smem_raw);
  const Bars<BR> bars{wgmma::shared_addr(sm + L::kBars)};
  int* slots = reinterpret_cast<int*>(sm + L::kTiles);

  const int tid = threadIdx.x, wg = wgmma::warp_uniform(tid / 128);
  const int n_kb = (p.T + KB - 1) / KB, n_q = (p.T + BR - 1) / BR;

  if (tid == 0) {
    wgmma::mbar_init(bars.kv_full(), 1);     // the loader's lane 0 (and the copies' bytes)
    wgmma::mbar_init(bars.kv_empty(), 256);  // every consumer thread, after its tile's last product
    for (int s = 0; s < kStages; s++) {
      wgmma::mbar_init(bars.q_full(s), 32);  // the loader's lanes (and the copies' bytes)
      wgmma::mbar_init(bars.q_empty(s), 256);  // every consumer thread (each read lse and delta itself)
    }
    for (int s = 0; s < kDqStages; s++) {
      wgmma::mbar_init(bars.dq_full(s), 256);  // every consumer thread (each stored its part)
      wgmma::mbar_init(bars.dq_empty(s), kWriters);  // dq_writer's threads, or dq_adder's for all of them
      if (Step<BR>::kBulkSum) wgmma::mbar_init(bars.dq_sum(s), 1);  // dq_writer's thread 0 (and the copy's bytes)
    }
    for (int s = 0; s < kTileSlots; s++) {
      wgmma::mbar_init(bars.tile_full(s), 1);  // the loader's lane 0
      wgmma::mbar_init(bars.tile_empty(s), kTileReaders);
    }
  }
  __syncthreads();  // the barriers are initialised before anyone uses them; the only CTA-wide barrier

  if (wg == 0) {
    wgmma::regs_dec<Step<BR>::kCopierRegs>();
    if (tid < 32) return loader<kPersistent, D, BR>(p, maps, sm, bars, slots, tid);
    // warps 1-3: every tile's dQ parts, by dq_writer in key block 0, else by dq_adder (thread 32)
    for (int n = 0, u = 0, w = 0;; n++) {
      const int t = read_tile<kPersistent, true>(bars, slots, n);
      if (t < 0) return;
      const Tile x = tile_at(t, n_kb);
      const int i_first = p.causal ? x.j * KB / BR : 0;
      if (x.j == 0)
        dq_writer<E, D, BR>(p, sm, bars, x.bh, n_kb, i_first, n_q, u, w, tid - 32), w += n_q - i_first;
      else if (tid == 32)
        dq_adder<D, BR>(p, sm, bars, x.bh, x.j, n_kb, i_first, n_q, u);
      u += n_q - i_first;
    }
  }
  wgmma::regs_inc<Step<BR>::kConsumerRegs>();
  const int ci = wg - 1, ct = tid - 128;  // this consumer's 64 keys; the consumers' thread index
  const int warp = wgmma::warp_uniform(tid / 32 % 4), lane = tid % 32, g = lane / 4, c = lane % 4;
  const uint32_t aK = wgmma::shared_addr(sm + L::kK), aV = wgmma::shared_addr(sm + L::kV);
  const uint32_t aKt = wgmma::shared_addr(sm + L::kKt);

  // The consumers' waits have no 60 s limit (wgmma.cuh's mbar_wait: with it, ptxas held this code to 168 registers).
  // A consumer that never gets its buffer still ends in a trap: the writer waits, with the limit, for its dQ part.
  for (int n = 0, u = 0;; n++) {  // u: the CTA's steps so far (the rings' count)
    const int t = read_tile<kPersistent, false>(bars, slots, n);
    if (t < 0) return;
    const Tile x = tile_at(t, n_kb);
    const int j = x.j, k0 = j * KB, i_first = p.causal ? k0 / BR : 0;
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};  // this warp's 16 keys x D
    wgmma::mbar_wait<false>(bars.kv_full(), n & 1);
    // K^T is read after the first step's barrier; the last tile's readers are done (they arrived on kv_empty
    // before the loader brought this K)
    if constexpr (L::kHasKt) sm90::transpose<KB, D, 256>(sm + L::kKt, sm + L::kK, ct);
    for (int i = i_first; i < n_q; i++, u++) {
      const int s = u % kStages, sd = u % kDqStages, q0 = i * BR;
      const float* ld = reinterpret_cast<const float*>(sm + L::kLd + s * L::kLdBytes);
      unsigned char* sS = sm + L::kS + (u & 1) * L::kSBytes;
      wgmma::mbar_wait<false>(bars.q_full(s), (u / kStages) & 1);
      sm90::dkdv_block<E, KB, BR, D, true>(dk, dv, aK, aV, wgmma::shared_addr(sm + L::kQ + s * L::kQBytes),
                                           wgmma::shared_addr(sm + L::kdO + s * L::kQBytes), ld, ld + BR, sS, p,
                                           ci, warp, k0, q0, ct);
      wgmma::mbar_arrive(bars.q_empty(s));  // its wgmma have retired, its lse and delta loads are done
      wgmma::fence_proxy_async();           // its dS^T (and K^T) stores, for wgmma
      // Both consumers' dS^T are in sS. The other dS^T tile is free: the other consumer passed this barrier after
      // its last product from it.
      wgmma::bar_sync(kConsumerBar, 256);
      if (u >= kDqStages) wgmma::mbar_wait<false>(bars.dq_empty(sd), (u / kDqStages - 1) & 1);
      float4* ring = reinterpret_cast<float4*>(sm + L::kDq + sd * L::kDqBytes);
      if constexpr (BR == 64) {
#pragma unroll
        for (int cb = 0; cb < D / 64; cb++) {
          float part[4][4];  // this warp's 16 queries x 32 columns of dQ
          sm90::dq_product<E, KB, D>(part, wgmma::shared_addr(sS), aKt, ci * (D / 2) + cb * 32);
#pragma unroll
          for (int t4 = 0; t4 < 4; t4++)
            wgmma::st_shared_v4(ring + dq_chunk<D, BR>(ci, cb, warp, t4, lane),
                                make_float4(part[t4][0], part[t4][1], part[t4][2], part[t4][3]));
        }
      } else {
        float part[D / 8][4];  // this warp's 16 of the consumer's 64 queries x D columns of dQ
        sm90::dq_rows_product<E, KB, D>(part, wgmma::shared_addr(sS), aK, ci);
#pragma unroll
        for (int t8 = 0; t8 < D / 8; t8++)
          wgmma::st_shared_v4(ring + dq_chunk<D, BR>(ci, t8 / 4, warp, t8 % 4, lane),
                              make_float4(part[t8][0], part[t8][1], part[t8][2], part[t8][3]));
      }
      // dq_adder's copy (and kBulkSum's in key block 0) reads the part through the async proxy
      if (j > 0 || Step<BR>::kBulkSum) wgmma::fence_proxy_async();
      wgmma::mbar_arrive(bars.dq_full(sd));
    }
    wgmma::mbar_arrive(bars.kv_empty());  // this tile's products from K, V (and K^T) have retired

    const int kw0 = k0 + ci * 64 + warp * 16;
    const int64_t in_off = in_offset(p, x.bh);
    store_tile_rows(dk, kw0, g, c, p.T, static_cast<E*>(p.dk) + in_off, p.is.st, p.scale);
    store_tile_rows(dv, kw0, g, c, p.T, static_cast<E*>(p.dv) + in_off, p.is.st, 1.f);
    if (p.kv_part) {  // the tile's 128 keys' column sums of dK and dV: its row of kv_part
      static_assert(D == 64, "warp_column_sums: eight 8-column tiles");
      float* sums = reinterpret_cast<float*>(sm + L::kSums);  // (8 warps: consumer 0's, then 1's; dK | dV; D)
      const float2 sk = warp_column_sums<E>(dk, kw0, g, lane, p.T, p.scale);
      const float2 sv = warp_column_sums<E>(dv, kw0, g, lane, p.T, 1.f);
      float* mine = sums + (ci * 4 + warp) * 2 * D + 8 * g + 2 * c;
      wgmma::st_shared_f32(mine, sk.x), wgmma::st_shared_f32(mine + 1, sk.y);
      wgmma::st_shared_f32(mine + D, sv.x), wgmma::st_shared_f32(mine + D + 1, sv.y);
      // sums is written again only after the next step's consumer barrier, which every thread passes after its reads
      wgmma::bar_sync(kSumsBar, 256);
      if (ct < 2 * D) {  // ct: (dK | dV, column)
        const int b = x.bh / p.H, h = x.bh % p.H;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < 8; w++) total += wgmma::ld_shared_f32(sums + w * 2 * D + ct);
        p.kv_part[(int64_t)(b * n_kb + j) * 2 * p.H * D + (ct / D) * p.H * D + h * D + ct % D] = total;
      }
    }
  }
}

// Sets up and launches the kernel of step BR, persistent (one CTA per SM, at most one per tile) or one CTA per tile;
// false (nothing launched) where no TMA map describes the views.
template <typename E, int BR, bool kPersistent>
bool launch_ws(const Params& p, Stream stream, const char* option) {
  Maps maps;
  if (!tma::make_heads_map(maps.q, p.q, p.B, p.H, p.T, 64, p.is, BR) ||
      !tma::make_heads_map(maps.k, p.k, p.B, p.H, p.T, 64, p.is, KB) ||
      !tma::make_heads_map(maps.v, p.v, p.B, p.H, p.T, 64, p.is, KB) ||
      !tma::make_heads_map(maps.dout, p.dout, p.B, p.H, p.T, 64, p.os, BR))
    return false;
  int blocks = start_fused_sm90(p, stream, option);  // one per tile; the tile counter zeroed
  if (kPersistent) {
    blocks = std::min(blocks, sm_count());
  }
  const auto kernel = backward_ws_kernel<E, 64, BR, kPersistent>;
  constexpr int bytes = Layout<64, BR>::kBytes;
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  // The dQ sums are written by bulk copies alone (add_part), which initcheck does not count as writes, and read by
  // the same kernel (dq_writer): marked for the tool before the launch. Exactly the query steps that a key block
  // j > 0 meets (key block 0's turn_of > 0): each (b, h)'s steps from i0 on, whole steps (rows past T too).
  const int n_kb = (p.T + KB - 1) / KB, n_q = (p.T + BR - 1) / BR, i0 = p.causal ? KB / BR : 0;
  if (n_kb > 1) {  // (then n_q > i0)
    const size_t step = (size_t)BR * 64 * sizeof(float);
    tma::mark_stored(p.dq_accum + (size_t)i0 * BR * 64, (n_q - i0) * step, (int64_t)p.B * p.H, n_q * step, stream);
  }
  kernel<<<blocks, kNT, bytes, stream>>>(p, maps);
  FASTGPT_CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

// The dkdv options "sm90 ws fused" (step 64), "sm90 ws fused 128x128" (step 128) and the two persistent at head dim
// 64 (flash_attention_bwd.cu sends head dim 128 to backward_fused_sm90). The turn counters, the tile counter,
// dq_accum and the tile order are the "sm90 fused" kernel's (start_fused_sm90 checks the grid and zeroes the
// counters; flash_attention.cu allocates the buffers, dq_accum's rows padded to 128). false where the inputs'
// strides give no TMA map (nothing launched: the caller runs "sm90 fused").
template <typename E>
bool backward_ws_sm90(const Params& p, Stream stream) {
  if (p.d != 64) throw std::logic_error("backward_ws_sm90: head dim 64 only");
  switch (p.tiles.dkdv) {
    case kWsFusedSm90:
      return launch_ws<E, 64, false>(p, stream, "sm90 ws fused");
    case kWsFused128Sm90:
      return launch_ws<E, 128, false>(p, stream, "sm90 ws fused 128x128");
    case kWsFusedPersistentSm90:
      return launch_ws<E, 64, true>(p, stream, "sm90 ws fused persistent");
    case kWsFused128PersistentSm90:
      return launch_ws<E, 128, true>(p, stream, "sm90 ws fused 128x128 persistent");
  }
  throw std::logic_error("backward_ws_sm90: not a warp-specialised dkdv option");
}

template bool backward_ws_sm90<__nv_bfloat16>(const Params&, Stream);
template bool backward_ws_sm90<__half>(const Params&, Stream);

}  // namespace fastgpt::cuda::flash
