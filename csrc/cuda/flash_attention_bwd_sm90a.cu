// Flash attention's deterministic backward for Hopper (sm_90a only; see CMakeLists.txt): flash_attention_bwd.cu's
// dkdv_kernel and dq_kernel with their products on warpgroup MMA (wgmma.cuh) reading 128-byte swizzled tiles
// (flash_attention_sm90.cuh) instead of mma.sync and ldmatrix. Each warpgroup owns 64 keys (dkdv) or 64 queries (dq);
// the CTA's warpgroups share the double-buffered blocks of the other side.
// - dkdv: S^T = K Q^T and dP^T = V dO^T (both operands K-major from shared memory), P^T = exp2(S^T scale log2e -
//   lse2) and dS^T = P^T (dP^T - delta) in the accumulators, which are the A operands of dV += P^T dO and
//   dK += dS^T Q (dO and Q read MN-major from the same tiles). The step is flash_attention_sm90.cuh's dkdv_block,
//   which the warp-specialised kernel (flash_attention_bwd_ws_sm90a.cu) shares.
// - dq: S = Q K^T and dP = dO V^T, dS = P (dP - delta), dQ += dS K (K read MN-major).
// Each product is its own wgmma group, waited for only when its result is needed, so that the exponentials and dS
// run while the tensor cores finish the next product. Each sums its blocks in sequence order in one CTA:
// bit-reproducible, as the mma.sync pair, though not the same bits (wgmma's order inside a product). Chosen with the
// dkdv / dq tile options "sm90 ..." of kKernelOptions (flash_attention.cu), for the deterministic backward, on a device
// of compute capability 9.0. Ran and passed its tests on an H200 (2026-11-26): "sm90 128x64" is "auto"'s at d 128
// (deterministic), "sm90 fused" its atomic backward there.
// - fused (the dkdv option "sm90 fused", either backward): the dkdv kernel also makes dQ, so S and dP are computed
//   once (five products per block pair, where the two passes take seven). Each step's dS^T goes to shared memory
//   and warpgroup w multiplies dQ_i[:, w D/2 ...) = dS_i K_j over the CTA's 128 keys, 32 columns per wgmma: dS read
//   MN-major from dS^T, K K-major from a transposed copy made once per CTA (MN-major, 32 columns would be half of
//   the 128-byte swizzle's 64, which CUTLASS's canonical layouts do not allow). The CTAs that meet query step i add
//   their parts into an fp32 buffer in a fixed order, highest key block first, taking turns on a counter per
//   (b, h, i) (CUTLASS's barrier.h pattern: thread 0 waits with an acquire load, then a barrier; a barrier, then
//   thread 0's release add); the last (key block 0) writes dq. So the sums are bit-reproducible without the second
//   pass, as FlashAttention-3's deterministic mode does. Why the order cannot hang: a CTA waits only for CTAs of
//   higher key blocks of its (b, h), which come earlier in the grid (x counts the key blocks down), so the hardware,
//   which starts CTAs in grid order, has started them; and causal key block j + 1 meets step i two steps before j
//   does, so the turn is usually free when j gets there. The dkdv option "sm90 ws fused" is this kernel
//   warp-specialised (flash_attention_bwd_ws_sm90a.cu), with the same bits.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/flash_attention_sm90.cuh"

namespace fastgpt::cuda::flash {

namespace {

// Keys per CTA x queries per step (dkdv), queries per CTA x keys per block (dq): 128 x 64, two warpgroups.
constexpr int kWG = 2, kNT = 128 * kWG, kRows = 64 * kWG, kStep = 64;

template <int D, bool kDq>
constexpr int dkdv_sm90_smem() {  // K and V, Q and dO twice each, (fused) dS^T and K^T, lse2 and delta, alignment
  return sm90::tile_bytes<2 * kRows + 4 * kStep, D>() +
         (kDq ? sm90::tile_bytes<kRows, kStep>() + sm90::tile_bytes<D, kRows>() : 0) + 2 * kStep * 4 + 1024;
}
template <int D>
constexpr int dq_sm90_smem() {  // Q and dO, K and V twice each, alignment
  return sm90::tile_bytes<2 * kRows + 4 * kStep, D>() + 1024;
}

// The fused backward's dQ for query step i (rows q0 ..): this CTA's part dS_i K_j (dS^T of its KB keys in the tile at
// aS, K^T (D, KB) at aKt), warpgroup wg's D / 2 columns 32 at a time, added in turn (sm90::turn_of) into the fp32
// buffer (key block 0 last, which writes dq instead). wg and warp: the kernel's warp-uniform indices.
template <typename E, int D, int KB, int BR>
__device__ __forceinline__ void dq_part(const Params& p, uint32_t aS, uint32_t aKt, int bh, int j, int n_kb, int i,
                                        int n_q, int q0, int64_t in_off, int wg, int warp, int tid) {
  const int g = tid % 32 / 4, c = tid % 4;
  const int turn = sm90::turn_of<KB, BR>(p.causal, i, j, n_kb);  // parts added before this one
  float* acc = p.dq_accum + ((int64_t)bh * n_q + i) * BR * D;           // (BR, D): the step's rows, past T too
  int* counter = p.dq_turn + (int64_t)bh * n_q + i;
  E* dq = static_cast<E*>(p.dq) + in_off;
#pragma unroll
  for (int h2 = 0; h2 < D / 64; h2++) {
    const int n0 = wg * (D / 2) + h2 * 32;
    float part[4][4];  // this warp's 16 queries x 32 columns
    sm90::dq_product<E, KB, D>(part, aS, aKt, n0);
    if (h2 == 0) {  // this CTA's turn: every part before it is in acc (thread 0's acquire, then the barrier)
      if (tid == 0) wgmma::wait_count(counter, turn);
      __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < 4; t++)
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = 16 * warp + g + 8 * r, col = n0 + 8 * t + 2 * c;
        float2 v = make_float2(part[t][2 * r], part[t][2 * r + 1]);
        float2* a = reinterpret_cast<float2*>(acc + row * D + col);
        if (turn > 0) {  // the sum so far, from L2 (another SM wrote it)
          const float2 o = __ldcg(a);
          v.x += o.x, v.y += o.y;
        }
        if (j > 0)
          __stcg(a, v);
        else if (q0 + row < p.T)
          store_two(dq + (int64_t)(q0 + row) * p.is.st + col, v.x * p.scale, v.y * p.scale);
      }
  }
  if (j > 0) {  // the next CTA's turn, once every thread's sums are out (the barrier, then thread 0's release)
    __syncthreads();
    if (tid == 0) wgmma::add_count(counter);
  }
}

template <typename E, int D, bool kDq>
__global__ void __launch_bounds__(kNT, 1) dkdv_sm90_kernel(Params p) {
  constexpr int KB = kRows, BR = kStep;  // keys per CTA, queries per step
  constexpr int kKBytes = sm90::tile_bytes<KB, D>(), kQBytes = sm90::tile_bytes<BR, D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sK = sm90::aligned(smem_raw);  // (KB, D) swizzled
  unsigned char* sV = sK + kKBytes;             // (KB, D)
  unsigned char* sQ = sV + kKBytes;             // 2 x (BR, D)
  unsigned char* sdO = sQ + 2 * kQBytes;        // 2 x (BR, D)
  unsigned char* sS = sdO + 2 * kQBytes;                        // (KB, BR) dS^T, fused only
  unsigned char* sKt = sS + sm90::tile_bytes<KB, BR>();         // (D, KB) K^T, fused only
  float* sL = reinterpret_cast<float*>(kDq ? sKt + kKBytes : sS);  // (BR) lse in log2 units
  float* sDl = sL + BR;                                            // (BR) delta

  const int tid = threadIdx.x, wg = wgmma::warp_uniform(tid / 128), warp = wgmma::warp_uniform(tid / 32 % 4);
  const int lane = tid % 32, g = lane / 4, c = lane % 4;
  // Fused: one grid row, each (b, h)'s key blocks counted down (the turn order needs the higher ones started first).
  const int n_kb = (p.T + KB - 1) / KB;
  const int bh = kDq ? blockIdx.x / n_kb : blockIdx.x, j = kDq ? n_kb - 1 - blockIdx.x % n_kb : blockIdx.y;
  const int b = bh / p.H, h = bh % p.H, T = p.T, k0 = j * KB;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E* Q = static_cast<const E*>(p.q) + in_off;
  const E* dO = static_cast<const E*>(p.dout) + out_off;
  const int i_first = p.causal ? k0 / BR : 0, n_q = (T + BR - 1) / BR;

  sm90::load<E, KB, D, kNT>(sK, static_cast<const E*>(p.k) + in_off, p.is.st, k0, T, tid);
  sm90::load<E, KB, D, kNT>(sV, static_cast<const E*>(p.v) + in_off, p.is.st, k0, T, tid);
  sm90::load<E, BR, D, kNT>(sQ, Q, p.is.st, i_first * BR, T, tid);
  sm90::load<E, BR, D, kNT>(sdO, dO, p.os.st, i_first * BR, T, tid);
  cp_async_commit();

  const uint32_t aK = wgmma::shared_addr(sK), aV = wgmma::shared_addr(sV), aQ = wgmma::shared_addr(sQ),
                 adO = wgmma::shared_addr(sdO);
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};  // this warp's 16 keys x D (wgmma's accumulators, in order)
  const int kw0 = k0 + wg * 64 + warp * 16;  // the warp's first key

  for (int i = i_first; i < n_q; i++) {
    const int buf = (i - i_first) & 1, q0 = i * BR;
    if (i + 1 < n_q) {
      sm90::load<E, BR, D, kNT>(sQ + (buf ^ 1) * kQBytes, Q, p.is.st, q0 + BR, T, tid);
      sm90::load<E, BR, D, kNT>(sdO + (buf ^ 1) * kQBytes, dO, p.os.st, q0 + BR, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    stage_lse_delta(sL, sDl, p, bh, q0, BR, tid);
    wgmma::fence_proxy_async();
    __syncthreads();
    if constexpr (kDq)
      if (i == i_first) sm90::transpose<KB, D, kNT>(sKt, sK, tid);  // K has landed; read after the next barrier
    sm90::dkdv_block<E, KB, BR, D, kDq>(dk, dv, aK, aV, aQ + buf * kQBytes, adO + buf * kQBytes, sL, sDl, sS, p, wg,
                                        warp, k0, q0, tid);
    if constexpr (kDq) {
      wgmma::fence_proxy_async();
      __syncthreads();  // both warpgroups' dS^T are in the tile
      dq_part<E, D, KB, BR>(p, wgmma::shared_addr(sS), wgmma::shared_addr(sKt), bh, j, n_kb, i, n_q, q0, in_off, wg,
                            warp, tid);
    }
    __syncthreads();  // buffers and sL/sDl are free before the next step refills them
  }

  store_tile_rows(dk, kw0, g, c, T, static_cast<E*>(p.dk) + in_off, p.is.st, p.scale);
  store_tile_rows(dv, kw0, g, c, T, static_cast<E*>(p.dv) + in_off, p.is.st, 1.f);
}

template <typename E, int D>
__global__ void __launch_bounds__(kNT, 1) dq_sm90_kernel(Params p) {
  constexpr int QB = kRows, BC = kStep;  // queries per CTA, keys per block
  constexpr int kQBytes = sm90::tile_bytes<QB, D>(), kKBytes = sm90::tile_bytes<BC, D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sQ = sm90::aligned(smem_raw);  // (QB, D) swizzled
  unsigned char* sdO = sQ + kQBytes;            // (QB, D)
  unsigned char* sK = sdO + kQBytes;            // 2 x (BC, D)
  unsigned char* sV = sK + 2 * kKBytes;         // 2 x (BC, D)

  const int tid = threadIdx.x, wg = wgmma::warp_uniform(tid / 128), warp = wgmma::warp_uniform(tid / 32 % 4);
  const int lane = tid % 32, g = lane / 4, c = lane % 4;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * QB, bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E* K = static_cast<const E*>(p.k) + in_off;
  const E* V = static_cast<const E*>(p.v) + in_off;
  const int nblocks = ((p.causal ? min(T, q0 + QB) : T) + BC - 1) / BC;

  sm90::load<E, QB, D, kNT>(sQ, static_cast<const E*>(p.q) + in_off, p.is.st, q0, T, tid);
  sm90::load<E, QB, D, kNT>(sdO, static_cast<const E*>(p.dout) + out_off, p.os.st, q0, T, tid);
  sm90::load<E, BC, D, kNT>(sK, K, p.is.st, 0, T, tid);
  sm90::load<E, BC, D, kNT>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  const uint32_t aQ = wgmma::shared_addr(sQ), adO = wgmma::shared_addr(sdO), aK = wgmma::shared_addr(sK),
                 aV = wgmma::shared_addr(sV);
  const int wq0 = q0 + wg * 64, w0 = wq0 + warp * 16;  // the warpgroup's and the warp's first query
  float lse2[2], dl[2];                               // rows g and g + 8
  load_row_stats(lse2, dl, p, bh, w0 + g, T);
  float dq[D / 8][4] = {};  // this warp's 16 queries x D
  const float sl2 = p.scale * kLog2e;

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * BC;
    if (j + 1 < nblocks) {
      sm90::load<E, BC, D, kNT>(sK + (buf ^ 1) * kKBytes, K, p.is.st, k0 + BC, T, tid);
      sm90::load<E, BC, D, kNT>(sV + (buf ^ 1) * kKBytes, V, p.is.st, k0 + BC, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    wgmma::fence_proxy_async();
    __syncthreads();

    // Warpgroup-uniform: some key of the block is visible to some row of the warpgroup.
    if (!(p.causal && k0 > wq0 + 63)) {
      const uint32_t kb = aK + buf * kKBytes, vb = aV + buf * kKBytes;
      float s[BC / 8][4], dp[BC / 8][4];  // S = Q K^T, dP = dO V^T (then dS): this warp's 16 rows x BC keys
      // S's exponentials run while dP is on the tensor cores (two groups, each waited for when needed).
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++)
        wgmma::Mma<E, BC>::ss(&s[0][0], sm90::kmajor<QB>(aQ, wg * 64, kk), sm90::kmajor<BC>(kb, 0, kk), kk > 0);
      wgmma::commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++)
        wgmma::Mma<E, BC>::ss(&dp[0][0], sm90::kmajor<QB>(adO, wg * 64, kk), sm90::kmajor<BC>(vb, 0, kk), kk > 0);
      wgmma::commit();
      wgmma::wait<1>();  // S (groups retire in order)
      wgmma::keep(s);
      probs_rows(s, k0, w0 + g, c, T, p.causal, hides_any(w0, w0 + 16, k0, k0 + BC, T, p.causal), sl2, lse2);  // P
      wgmma::wait<0>();
      wgmma::keep(dp);
#pragma unroll
      for (int t = 0; t < BC / 8; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) dp[t][e] = s[t][e] * (dp[t][e] - dl[e >> 1]);  // dS
      uint32_t ad[BC / 16][4];
#pragma unroll
      for (int ks = 0; ks < BC / 16; ks++) a_from_acc<E>(ad[ks], dp[2 * ks], dp[2 * ks + 1]);
      wgmma::fence();
#pragma unroll
      for (int ks = 0; ks < BC / 16; ks++) wgmma::Mma<E, D>::rs(&dq[0][0], ad[ks], sm90::mnmajor<BC>(kb, ks), 1);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::keep(dq);
      wgmma::keep(ad);
    }
    __syncthreads();
  }

  store_tile_rows(dq, w0, g, c, T, static_cast<E*>(p.dq) + in_off, p.is.st, p.scale);
}

// Either pass: a CTA of two warpgroups per 128 keys (dkdv) or queries (dq) of each (b, h); B * H on x. The fused
// kernel: one row of B * H * (key blocks) CTAs (its turn order; see the top).
template <typename Kernel>
void launch(Kernel kernel, int bytes, const Params& p, Stream stream, bool fused = false) {
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const int blocks = (p.T + kRows - 1) / kRows;
  const dim3 grid = fused ? dim3(p.B * p.H * blocks) : dim3(p.B * p.H, blocks);
  kernel<<<grid, kNT, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <typename E>
void dkdv_sm90(const Params& p, Stream stream) {
  if (p.d == 64)
    launch(dkdv_sm90_kernel<E, 64, false>, dkdv_sm90_smem<64, false>(), p, stream);
  else
    launch(dkdv_sm90_kernel<E, 128, false>, dkdv_sm90_smem<128, false>(), p, stream);
}

int start_fused_sm90(const Params& p, Stream stream, const char* option) {
  const int64_t blocks = (int64_t)p.B * p.H * ((p.T + kRows - 1) / kRows);
  // below 2^30: the persistent kernels' tile counter goes past the last tile by up to one per CTA
  if (blocks >= (1 << 30))
    throw std::invalid_argument(std::string("flash attention backward ('") + option +
                                "'): B * H * ceil(T / 128) must be below 2^30");
  const int64_t turns = (int64_t)p.B * p.H * ((p.T + kStep - 1) / kStep);
  FASTGPT_CUDA_CHECK(cudaMemsetAsync(p.dq_turn, 0, (turns + 1) * sizeof(int), stream));  // and next_tile
  return (int)blocks;
}

template <typename E>
void backward_fused_sm90(const Params& p, Stream stream) {
  start_fused_sm90(p, stream, "sm90 fused");
  if (p.d == 64)
    launch(dkdv_sm90_kernel<E, 64, true>, dkdv_sm90_smem<64, true>(), p, stream, true);
  else
    launch(dkdv_sm90_kernel<E, 128, true>, dkdv_sm90_smem<128, true>(), p, stream, true);
}

template <typename E>
void dq_sm90(const Params& p, Stream stream) {
  if (p.d == 64)
    launch(dq_sm90_kernel<E, 64>, dq_sm90_smem<64>(), p, stream);
  else
    launch(dq_sm90_kernel<E, 128>, dq_sm90_smem<128>(), p, stream);
}

template void dkdv_sm90<__nv_bfloat16>(const Params&, Stream);
template void dkdv_sm90<__half>(const Params&, Stream);
template void dq_sm90<__nv_bfloat16>(const Params&, Stream);
template void dq_sm90<__half>(const Params&, Stream);
template void backward_fused_sm90<__nv_bfloat16>(const Params&, Stream);
template void backward_fused_sm90<__half>(const Params&, Stream);

}  // namespace fastgpt::cuda::flash
