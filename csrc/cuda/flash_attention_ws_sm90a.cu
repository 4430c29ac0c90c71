// Flash attention forward for Hopper, warp-specialised (sm_90a only): flash_attention_sm90a.cu's products and
// online softmax, with the CTA split by role as FlashAttention-3 splits it.
// - Warpgroup 0 only copies: Q, then K_j and V_j for every key block, with cp.async into a ring of kStages
//   buffers per tile kind. It gives most of its registers back (setmaxnreg), so that the multiplying warpgroups get
//   232 (two of them) or 160 (three) instead of the 168 or 128 an even split would leave them.
// - Warpgroups 1..NC each own 64 query rows and only multiply and take the softmax. They never wait on each other
//   or on the copier at a CTA-wide barrier (the other kernel's __syncthreads per key block): each buffer has a
//   "full" mbarrier (the copier's 128 threads arrive once their copies have landed and been fenced for wgmma) and
//   an "empty" one (every consumer warp arrives once its wgmma have read the buffer).
// - The consumers take turns to issue their products (named barriers 1..NC, a ring): while one warpgroup's S and
//   P V are on the tensor cores, the others run their softmax, so the tensor cores see one warpgroup's products
//   after another's instead of all at once and then none (FlashAttention-3's "ping-pong" scheduling).
// Inside a consumer the order is the other kernel's: S_j is issued before P_{j-1} V_{j-1}, and block j's softmax
// runs while that product is still on the tensor cores. Chosen with the fwd tile options "sm90 ws ..."
// (flash_attention.cu's kTileOptions). Written and run only in the warp emulator (tests/warp_emu) so far.
#include "cuda/check.h"
#include "cuda/flash_attention_sm90.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int kStages = 2;  // buffers per tile kind (K, V): the copier fills one while the consumers read the other

// The mbarriers after the tiles, as indices into them: Q's full, then per stage K full, K empty, V full, V empty.
struct Bars {
  uint32_t base;
  __device__ uint32_t q_full() const { return base; }
  __device__ uint32_t k_full(int s) const { return base + 8 * (1 + 4 * s); }
  __device__ uint32_t k_empty(int s) const { return base + 8 * (2 + 4 * s); }
  __device__ uint32_t v_full(int s) const { return base + 8 * (3 + 4 * s); }
  __device__ uint32_t v_empty(int s) const { return base + 8 * (4 + 4 * s); }
};
constexpr int kBarBytes = 8 * (1 + 4 * kStages);

template <int D, int NC, int BC>
constexpr int ws_smem_bytes() {
  return sm90::tile_bytes<64 * NC + 2 * kStages * BC, D>() + kBarBytes + 1024;  // Q, the K and V rings, room to align
}

// Registers per thread after setmaxnreg: the copier keeps few, the consumers share the rest of the 64K.
template <int NC>
constexpr int kCopierRegs = NC == 2 ? 40 : 32;
template <int NC>
constexpr int kConsumerRegs = NC == 2 ? 232 : 160;
static_assert(128 * kCopierRegs<2> + 256 * kConsumerRegs<2> <= 65536, "registers: two consumers");
static_assert(128 * kCopierRegs<3> + 384 * kConsumerRegs<3> <= 65536, "registers: three consumers");

// Warpgroup 0: the tiles in the order the consumers use them (Q, K_0, V_0, K_1, V_1, ...), each one cp.async group.
// A tile's full barrier is arrived at once the next tile is issued and this one has landed (wait_group 1) and been
// fenced for wgmma (fence.proxy.async, by the thread that copied: the consumers' wgmma read through the async
// proxy), so one tile is always in flight behind the one being published.
template <typename E, int D, int NC, int BC>
__device__ __forceinline__ void copier(const Params& p, const E* Q, const E* K, const E* V, unsigned char* sQ,
                                       unsigned char* sK, unsigned char* sV, Bars bars, int q0, int nblocks,
                                       int tid) {
  constexpr int BR = 64 * NC, kKVBytes = sm90::tile_bytes<BC, D>();
  const int T = p.T;
  sm90::load<E, BR, D, 128>(sQ, Q, p.is.st, q0, T, tid);
  cp_async_commit();
  uint32_t last = bars.q_full();  // the barrier of the tile issued last, not yet published
  auto publish_and = [&](uint32_t next) {
    cp_async_wait<1>();
    wgmma::fence_proxy_async();
    wgmma::mbar_arrive(last);
    last = next;
  };
  for (int j = 0; j < nblocks; j++) {
    const int s = j % kStages, use = j / kStages;
    if (use > 0) wgmma::mbar_wait(bars.k_empty(s), (use - 1) & 1);  // every consumer has read K_{j - kStages}
    sm90::load<E, BC, D, 128>(sK + s * kKVBytes, K, p.is.st, j * BC, T, tid);
    cp_async_commit();
    publish_and(bars.k_full(s));
    if (use > 0) wgmma::mbar_wait(bars.v_empty(s), (use - 1) & 1);
    sm90::load<E, BC, D, 128>(sV + s * kKVBytes, V, p.is.st, j * BC, T, tid);
    cp_async_commit();
    publish_and(bars.v_full(s));
  }
  cp_async_wait<0>();
  wgmma::fence_proxy_async();
  wgmma::mbar_arrive(last);
}

template <typename E, int D, int NC, int BC>
__global__ void __launch_bounds__(128 * (NC + 1), 1) forward_ws_kernel(Params p) {
  constexpr int BR = 64 * NC, kQBytes = sm90::tile_bytes<BR, D>(), kKVBytes = sm90::tile_bytes<BC, D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sQ = sm90::aligned(smem_raw);     // (BR, D) swizzled (flash_attention_sm90.cuh)
  unsigned char* sK = sQ + kQBytes;                // kStages x (BC, D)
  unsigned char* sV = sK + kStages * kKVBytes;     // kStages x (BC, D)
  const Bars bars{wgmma::shared_addr(sV + kStages * kKVBytes)};

  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32 % 4, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int qblock = gridDim.y - 1 - blockIdx.y, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = qblock * BR, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const int kv_end = p.causal ? min(T, q0 + BR) : T;
  const int nblocks = (kv_end + BC - 1) / BC;

  if (tid == 0) {
    wgmma::mbar_init(bars.q_full(), 128);
    for (int s = 0; s < kStages; s++) {
      wgmma::mbar_init(bars.k_full(s), 128);  // the copier's threads
      wgmma::mbar_init(bars.v_full(s), 128);
      wgmma::mbar_init(bars.k_empty(s), 4 * NC);  // one arrival per consumer warp
      wgmma::mbar_init(bars.v_empty(s), 4 * NC);
    }
  }
  __syncthreads();  // the barriers are initialised before anyone uses them; the only CTA-wide barrier

  if (wg == 0) {
    wgmma::regs_dec<kCopierRegs<NC>>();
    copier<E, D, NC, BC>(p, static_cast<const E*>(p.q) + in_off, static_cast<const E*>(p.k) + in_off,
                         static_cast<const E*>(p.v) + in_off, sQ, sK, sV, bars, q0, nblocks, tid);
    return;
  }
  wgmma::regs_inc<kConsumerRegs<NC>>();
  const int ci = wg - 1;                                // this consumer's 64 rows of the Q tile
  const int wg0 = q0 + ci * 64, w0 = wg0 + warp * 16;  // its first query, and its warp's
  // The blocks this warpgroup multiplies (causal: those with a key at or before its last query), a prefix of the
  // CTA's; the rest it only waits for and hands back, so that every buffer's empty barrier completes.
  const int nvis = p.causal ? min(nblocks, (wg0 + 64 + BC - 1) / BC) : nblocks;
  const int turn = 1 + ci, next_turn = 1 + (ci + 1) % NC;  // named barriers of the issue ring, 256 threads each
  const bool leader = lane == 0;                         // arrives on the empty barriers for its warp

  const uint32_t aQ = wgmma::shared_addr(sQ), aK = wgmma::shared_addr(sK), aV = wgmma::shared_addr(sV);
  float o[D / 8][4] = {};  // this warp's 16 rows x D of O
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8; m in log2 units
  float s[BC / 8][4];       // S = Q K^T for this warp's 16 rows x BC keys, then P
  uint32_t pa[BC / 16][4];  // P of the block before, as wgmma A fragments
  const float sl2 = p.scale * kLog2e;

  if (ci == NC - 1) wgmma::bar_arrive(next_turn, 256);  // consumer 0 issues first
  wgmma::mbar_wait(bars.q_full(), 0);
  // Step j issues S_j (j < nvis) and P_{j-1} V_{j-1} (1 <= j <= nvis) in this warpgroup's turn, then hands the turn
  // on. Every warpgroup takes nblocks + 1 turns whatever its nvis, so the ring stays in step; the last consumer's
  // last hand-on is left out, so that every named barrier ends with no arrival pending. Both tiles are waited for
  // before the turn: a wait (a loop) between the two products makes ptxas serialise every wgmma (C7520), and V_{j-1}
  // is published before K_j anyway (the copier's order).
  for (int j = 0; j <= nblocks; j++) {
    const int sk = j % kStages, sv = (j + kStages - 1) % kStages;  // K_j's and V_{j-1}'s buffers
    const uint32_t pk = (j / kStages) & 1, pv = ((j - 1) / kStages) & 1;
    const bool hand_on = !(ci == NC - 1 && j == nblocks);
    if (j < nblocks) wgmma::mbar_wait(bars.k_full(sk), pk);
    if (j > 0) wgmma::mbar_wait(bars.v_full(sv), pv);
    wgmma::bar_sync(turn, 256);
    const uint32_t kb = aK + sk * kKVBytes, vb = aV + sv * kKVBytes;
    const int k0 = j * BC;
    // (The mask test inside: computed before the branches, three consumers spill 68 bytes at 160 registers.)
    const auto softmax = [&](float (&sc)[BC / 8][4], float (&alpha)[2]) {
      if (hides_any(w0, w0 + 16, k0, k0 + BC, T, p.causal)) mask_scores(sc, k0, w0, g, c, T, p.causal);
      softmax_rows(sc, sl2, m, l, alpha);
    };
    const auto issued = [&] {  // the next consumer's turn
      if (hand_on) wgmma::bar_arrive(next_turn, 256);
    };
    const auto k_read = [&] {  // this warp is done with K_j's buffer
      if (leader) wgmma::mbar_arrive(bars.k_empty(sk));
    };
    const auto v_read = [&] {
      if (leader) wgmma::mbar_arrive(bars.v_empty(sv));
    };
    if (j == 0) {  // S_0 alone (block 0 is visible to every warpgroup)
      sm90::first_block<E, BR, BC, D>(s, o, pa, aQ, kb, ci, softmax, issued, k_read);
    } else if (j < nvis) {  // S_j, with P_{j-1} V_{j-1} behind it
      sm90::next_block<E, BR, BC, D>(s, o, pa, aQ, kb, vb, ci, softmax, issued, k_read, v_read);
    } else if (j == nvis) {  // the last P V
      sm90::last_pv<E, BC, D>(o, pa, vb, issued, v_read);
    } else {  // past this warpgroup's last block: V_{j-1} is not used, only handed back
      issued();
      v_read();
    }
    if (j >= nvis && j < nblocks) k_read();  // K_j, not used here
  }

  store_rows(o, m, l, w0, g, c, T, static_cast<E*>(p.out) + b * p.os.sb + h * p.os.sh, p.os.st,
             p.lse + (int64_t)bh * T);
}

template <typename E, int D, int NC, int BC>
void launch_ws(const Params& p, Stream stream) {
  constexpr int bytes = ws_smem_bytes<D, NC, BC>(), rows = 64 * NC;
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(forward_ws_kernel<E, D, NC, BC>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  dim3 grid(p.B * p.H, (p.T + rows - 1) / rows);  // B * H on x: y and z stop at 65535
  forward_ws_kernel<E, D, NC, BC><<<grid, 128 * (NC + 1), bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

// The "sm90 ws" fwd options (flash_attention_sm90a.cu's forward_sm90 sends them here), CTA query rows x keys per
// block: 0 "128x128" (two consumers), 1 "192x128" (three; head dim 128 runs 128x128: 160 registers would spill).
template <typename E>
void forward_ws_sm90(const Params& p, Stream stream, int option) {
  if (p.d == 64 && option == 1) return launch_ws<E, 64, 3, 128>(p, stream);
  if (p.d == 64) return launch_ws<E, 64, 2, 128>(p, stream);
  launch_ws<E, 128, 2, 128>(p, stream);
}

template void forward_ws_sm90<__nv_bfloat16>(const Params&, Stream, int);
template void forward_ws_sm90<__half>(const Params&, Stream, int);

}  // namespace fastgpt::cuda::flash
