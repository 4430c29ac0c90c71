// Flash attention backward on tensor cores (bf16 / fp16 in, fp32 accumulate), head dim 64 or 128. Nothing of size
// T x T is stored: P is recomputed from the saved lse, and delta_i = dout_i . out_i (computed beforehand) stands in
// for sum_j P_ij dP_ij.
// dkdv_kernel: one CTA of 4 warps owns 16 * MT keys per warp of one (b, h) and walks the query blocks of BR that can
// see them (double-buffered Q and dO via cp.async). Each warp forms the transposed products S^T = K Q^T and
// dP^T = V dO^T for its keys, so P^T and dS^T = P^T (dP^T - delta) sit in registers already laid out as the A
// operands of dV += P^T dO and dK += dS^T Q, which accumulate in registers over all query blocks.
// dQ = dS K needs a sum over every key block: either (fast) each CTA adds its part into an fp32 buffer with atomics,
// via dS staged in shared memory, or (deterministic) dq_kernel, the mirror image of the forward, recomputes S and dP
// per query block and sums its key blocks in a fixed order: bit-reproducible, at 7 instead of 5 GEMM passes.
// The tile shapes (MT, BR) of dkdv and (MT, BC) of dq are Params::tiles' options (kKernelOptions): MT = 2
// reads each Q/dO (K/V) fragment from shared memory once for two mma tiles. Every option sums the same products in
// the same order (k16 chunks of queries, or keys, in sequence order), and a warp skips only the products of a block
// wholly outside its causal triangle, which would add zeros: all options give the same bits.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;

template <int D, int MT, int BR, bool kAtomicDq>
constexpr int dkdv_smem() {
  constexpr int KB = 16 * MT * kWarps;
  return (2 * KB + 4 * BR) * (D + kPad) * 2 + (kAtomicDq ? KB * (BR + kPad) * 2 : 0) + 2 * BR * 4;
}
template <int D, int MT, int BC>
constexpr int dq_smem() {
  return (2 * 16 * MT * kWarps + 4 * BC) * (D + kPad) * 2;
}

template <typename E, int D, int MT, int BR, bool kAtomicDq>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Params p) {
  constexpr int KB = 16 * MT * kWarps, P = D + kPad;  // keys per CTA, shared-memory row pitch
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sK = reinterpret_cast<E*>(smem_raw);  // (KB, P)
  E* sV = sK + KB * P;                     // (KB, P)
  E* sQ = sV + KB * P;                     // 2 x (BR, P)
  E* sdO = sQ + 2 * BR * P;                // 2 x (BR, P)
  E* sdS = sdO + 2 * BR * P;               // (KB, BR + kPad): dS^T, for the atomic dq only
  float* sL = reinterpret_cast<float*>(sdS + (kAtomicDq ? KB * (BR + kPad) : 0));  // (BR) lse in log2 units
  float* sDl = sL + BR;                                                               // (BR) delta

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T, k0 = blockIdx.y * KB;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E* Q = static_cast<const E*>(p.q) + in_off;
  const E* dO = static_cast<const E*>(p.dout) + out_off;
  const int i_first = p.causal ? k0 / BR : 0, n_q = (T + BR - 1) / BR;

  load_tile<E, KB, D, kThreads>(sK, static_cast<const E*>(p.k) + in_off, p.is.st, k0, T, tid);
  load_tile<E, KB, D, kThreads>(sV, static_cast<const E*>(p.v) + in_off, p.is.st, k0, T, tid);
  load_tile<E, BR, D, kThreads>(sQ, Q, p.is.st, i_first * BR, T, tid);
  load_tile<E, BR, D, kThreads>(sdO, dO, p.os.st, i_first * BR, T, tid);
  cp_async_commit();

  float dk[MT][D / 8][4] = {}, dv[MT][D / 8][4] = {};  // this warp's 16 * MT keys x D
  const float sl2 = p.scale * kLog2e;
  const int wkey = warp * 16 * MT, kw0 = k0 + wkey;  // this warp's first key (in the tile, in the sequence)
  // The key of accumulator elements 0, 1 of m tile mt is kw0 + 16 mt + g; elements 2, 3 are 8 keys further.

  for (int i = i_first; i < n_q; i++) {
    const int buf = (i - i_first) & 1, q0 = i * BR;
    if (i + 1 < n_q) {
      load_tile<E, BR, D, kThreads>(sQ + (buf ^ 1) * BR * P, Q, p.is.st, q0 + BR, T, tid);
      load_tile<E, BR, D, kThreads>(sdO + (buf ^ 1) * BR * P, dO, p.os.st, q0 + BR, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    stage_lse_delta(sL, sDl, p, bh, q0, BR, tid);
    __syncthreads();
    const E* q_s = sQ + buf * BR * P;
    const E* do_s = sdO + buf * BR * P;

    float st[MT][BR / 8][4] = {}, dpt[MT][BR / 8][4] = {};  // S^T and dP^T (then P^T, dS^T): keys x BR queries
    // Warp-uniform: some query of the step sees some key of the warp. Tested at MT 2 only: at MT 1 the first step
    // rarely leaves a warp out, and the test costs d 128 registers it would spill.
    if (MT == 1 || !(p.causal && q0 + BR - 1 < kw0)) {
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        uint32_t ak[MT][4], av[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          ldmatrix_x4(ak[mt], sK + (wkey + mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
          ldmatrix_x4(av[mt], sV + (wkey + mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int nn = 0; nn < BR / 16; nn++) {
          const int off = (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + kk * 16 + ((lane >> 3) & 1) * 8;
          uint32_t bq[4], bo[4];
          ldmatrix_x4(bq, q_s + off);
          ldmatrix_x4(bo, do_s + off);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma<E>(st[mt][2 * nn], ak[mt], bq);
            mma<E>(st[mt][2 * nn + 1], ak[mt], bq + 2);
            mma<E>(dpt[mt][2 * nn], av[mt], bo);
            mma<E>(dpt[mt][2 * nn + 1], av[mt], bo + 2);
          }
        }
      }

      // P^T = exp2(S^T * scale * log2 e - lse2), dS^T = P^T (dP^T - delta); both stay in st / dpt.
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        const int kt = kw0 + mt * 16;  // the tile's first key
        probs_ds_cols(st[mt], dpt[mt], q0, kt + g, c, T, p.causal,
                      hides_any(q0, q0 + BR, kt, kt + 16, T, p.causal), sl2, sL, sDl);
      }

      // dV += P^T dO and dK += dS^T Q, 16 queries at a time.
#pragma unroll
      for (int ks = 0; ks < BR / 16; ks++) {
        uint32_t ap[MT][4], ad[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          a_from_acc<E>(ap[mt], st[mt][2 * ks], st[mt][2 * ks + 1]);
          a_from_acc<E>(ad[mt], dpt[mt][2 * ks], dpt[mt][2 * ks + 1]);
        }
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) {
          const int off = (ks * 16 + (lane & 15)) * P + dn * 16 + (lane >> 4) * 8;
          uint32_t bo[4], bq[4];
          ldmatrix_x4_trans(bo, do_s + off);
          ldmatrix_x4_trans(bq, q_s + off);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma<E>(dv[mt][2 * dn], ap[mt], bo);
            mma<E>(dv[mt][2 * dn + 1], ap[mt], bo + 2);
            mma<E>(dk[mt][2 * dn], ad[mt], bq);
            mma<E>(dk[mt][2 * dn + 1], ad[mt], bq + 2);
          }
        }
      }
    }

    if constexpr (kAtomicDq) {
      // dQ (BR x D) += dS (BR x KB keys) K: dS^T goes through shared memory so every warp sees all KB keys (a warp
      // that skipped its products stores its zeros).
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int t = 0; t < BR / 8; t++)
#pragma unroll
          for (int r = 0; r < 2; r++)
            store_two(sdS + (wkey + mt * 16 + g + r * 8) * (BR + kPad) + t * 8 + 2 * c, dpt[mt][t][2 * r],
                      dpt[mt][t][2 * r + 1]);
      __syncthreads();
      constexpr int kWq = BR / 16, kWd = kWarps / kWq, Dw = D / kWd;  // warps along queries and along d
      const int wq = warp % kWq, d0 = (warp / kWq) * Dw;
      float acc[Dw / 8][4] = {};
#pragma unroll
      for (int ks = 0; ks < KB / 16; ks++) {
        uint32_t a[4];  // A = dS (queries x keys), stored transposed as dS^T (keys x queries)
        ldmatrix_x4_trans(a, sdS + (ks * 16 + (lane & 7) + ((lane >> 4) << 3)) * (BR + kPad) + wq * 16 +
                                 ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int dn = 0; dn < Dw / 16; dn++) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sK + (ks * 16 + (lane & 15)) * P + d0 + dn * 16 + (lane >> 4) * 8);
          mma<E>(acc[2 * dn], a, bk);
          mma<E>(acc[2 * dn + 1], a, bk + 2);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int q = q0 + wq * 16 + g + r * 8;
        if (q >= T) continue;
        float* dst = p.dq_accum + ((int64_t)bh * T + q) * D + d0;
#pragma unroll
        for (int t = 0; t < Dw / 8; t++) {
          atomicAdd(dst + t * 8 + 2 * c, acc[t][2 * r] * p.scale);
          atomicAdd(dst + t * 8 + 2 * c + 1, acc[t][2 * r + 1] * p.scale);
        }
      }
    }
    __syncthreads();  // buffers, sL/sDl and sdS are free before the next step refills them
  }

#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    store_tile_rows(dk[mt], kw0 + mt * 16, g, c, T, static_cast<E*>(p.dk) + in_off, p.is.st, p.scale);
    store_tile_rows(dv[mt], kw0 + mt * 16, g, c, T, static_cast<E*>(p.dv) + in_off, p.is.st, 1.f);
  }
}

// Deterministic dQ: 16 * MT queries per warp, key blocks of BC in order, K and V double-buffered.
template <typename E, int D, int MT, int BC>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  constexpr int QB = 16 * MT * kWarps, P = D + kPad;  // queries per CTA, shared-memory row pitch
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sQ = reinterpret_cast<E*>(smem_raw);  // (QB, P)
  E* sdO = sQ + QB * P;                    // (QB, P)
  E* sK = sdO + QB * P;                    // 2 x (BC, P)
  E* sV = sK + 2 * BC * P;                 // 2 x (BC, P)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * QB, bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E* K = static_cast<const E*>(p.k) + in_off;
  const E* V = static_cast<const E*>(p.v) + in_off;
  const int nblocks = ((p.causal ? min(T, q0 + QB) : T) + BC - 1) / BC;

  load_tile<E, QB, D, kThreads>(sQ, static_cast<const E*>(p.q) + in_off, p.is.st, q0, T, tid);
  load_tile<E, QB, D, kThreads>(sdO, static_cast<const E*>(p.dout) + out_off, p.os.st, q0, T, tid);
  load_tile<E, BC, D, kThreads>(sK, K, p.is.st, 0, T, tid);
  load_tile<E, BC, D, kThreads>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  const int wrow = warp * 16 * MT, w0 = q0 + wrow;  // this warp's first query (in the tile, in the sequence)
  float lse2[MT][2], dl[MT][2];                     // rows g and g + 8 of each m tile
#pragma unroll
  for (int mt = 0; mt < MT; mt++) load_row_stats(lse2[mt], dl[mt], p, bh, w0 + mt * 16 + g, T);
  float dq[MT][D / 8][4] = {};
  const float sl2 = p.scale * kLog2e;

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * BC;
    if (j + 1 < nblocks) {
      load_tile<E, BC, D, kThreads>(sK + (buf ^ 1) * BC * P, K, p.is.st, k0 + BC, T, tid);
      load_tile<E, BC, D, kThreads>(sV + (buf ^ 1) * BC * P, V, p.is.st, k0 + BC, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* k_s = sK + buf * BC * P;
    const E* v_s = sV + buf * BC * P;

    // Warp-uniform: some key of the block is visible to some row of the warp (always so at MT 1).
    if (MT == 1 || !(p.causal && k0 > w0 + 16 * MT - 1)) {
      float s[MT][BC / 8][4] = {}, dp[MT][BC / 8][4] = {};  // S = Q K^T, dP = dO V^T: rows x BC keys
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        uint32_t aq[MT][4], ao[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          const int aoff = (wrow + mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8;
          ldmatrix_x4(aq[mt], sQ + aoff);
          ldmatrix_x4(ao[mt], sdO + aoff);
        }
#pragma unroll
        for (int nn = 0; nn < BC / 16; nn++) {
          const int off = (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + kk * 16 + ((lane >> 3) & 1) * 8;
          uint32_t bk[4], bv[4];
          ldmatrix_x4(bk, k_s + off);
          ldmatrix_x4(bv, v_s + off);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma<E>(s[mt][2 * nn], aq[mt], bk);
            mma<E>(s[mt][2 * nn + 1], aq[mt], bk + 2);
            mma<E>(dp[mt][2 * nn], ao[mt], bv);
            mma<E>(dp[mt][2 * nn + 1], ao[mt], bv + 2);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {  // P, dS
        const int qt = w0 + mt * 16;      // the tile's first query
        probs_ds_rows(s[mt], dp[mt], k0, qt + g, c, T, p.causal, hides_any(qt, qt + 16, k0, k0 + BC, T, p.causal),
                      sl2, lse2[mt], dl[mt]);
      }
#pragma unroll
      for (int ks = 0; ks < BC / 16; ks++) {  // dQ += dS K
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) a_from_acc<E>(a[mt], dp[mt][2 * ks], dp[mt][2 * ks + 1]);
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, k_s + (ks * 16 + (lane & 15)) * P + dn * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma<E>(dq[mt][2 * dn], a[mt], bk);
            mma<E>(dq[mt][2 * dn + 1], a[mt], bk + 2);
          }
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    store_tile_rows(dq[mt], w0 + mt * 16, g, c, T, static_cast<E*>(p.dq) + in_off, p.is.st, p.scale);
}

// dq (strided, E) <- dq_accum (B, H, T, D) fp32, after the atomic dkdv pass.
template <typename E>
__global__ void dq_convert_kernel(Params p) {
  const int64_t total = (int64_t)p.B * p.H * p.T * p.d;
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t dd = n % p.d, row = n / p.d, t = row % p.T, bh = row / p.T;
    const int64_t b = bh / p.H, h = bh % p.H;
    static_cast<E*>(p.dq)[b * p.is.sb + h * p.is.sh + t * p.is.st + dd] = E(p.dq_accum[n]);
  }
}

template <typename K>
void set_smem(K* kernel, int bytes) {
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <typename E, int D, int MT, int BR, bool kAtomicDq>
void launch_dkdv(const Params& p, Stream stream) {
  constexpr int bytes = dkdv_smem<D, MT, BR, kAtomicDq>(), keys = 16 * MT * kWarps;
  set_smem(dkdv_kernel<E, D, MT, BR, kAtomicDq>, bytes);
  // B * H on x: y stops at 65535
  dkdv_kernel<E, D, MT, BR, kAtomicDq><<<dim3(p.B * p.H, (p.T + keys - 1) / keys), kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename E, int D, int MT, int BC>
void launch_dq(const Params& p, Stream stream) {
  constexpr int bytes = dq_smem<D, MT, BC>(), rows = 16 * MT * kWarps;
  set_smem(dq_kernel<E, D, MT, BC>, bytes);
  dq_kernel<E, D, MT, BC><<<dim3(p.B * p.H, (p.T + rows - 1) / rows), kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

// The dkdv / dq options of kKernelOptions (flash_attention.cu) in order; head dim 128 has only the first of each (more
// would not fit in registers), with 32 queries per dkdv step (and, on GPUs with 99 KB of shared memory, 32 keys per dq
// block), and the sm90 ones (flash_attention_bwd_sm90a.cu,
// passed on to only where the caller found them runnable). The atomic path keeps the first dkdv shape; the fused
// sm90 ones (dq in the dkdv kernel, plain or warp-specialised: flash_attention_bwd_ws_sm90a.cu, head dim 64; at 128
// it runs the plain one) serve both.
template <typename E, int D>
bool launch(const Params& p, bool deterministic, Stream stream) {
  constexpr int kBr = D == 64 ? 64 : 32;  // dkdv's first option: S^T, dP^T, dK, dV fit in registers
#ifdef FASTGPT_SM90A
  // (deterministic either way; the warp-specialised kernel declines views it can make no TMA map of)
  if (D == 64 && ws_fused_sm90(p.tiles.dkdv) && backward_ws_sm90<E>(p, stream)) return true;
  if (fused_sm90(p.tiles.dkdv)) {
    backward_fused_sm90<E>(p, stream);
    return false;
  }
#endif
  if (deterministic) {
    // d 128's mma.sync options past the first fall back to it; the sm90 ones stay.
    const int dkdv = D == 64 || p.tiles.dkdv >= kFirstSm90.dkdv ? p.tiles.dkdv : 0;
    const int dq = D == 64 || p.tiles.dq >= kFirstSm90.dq ? p.tiles.dq : 0;
#ifdef FASTGPT_SM90A
    if (dkdv >= kFirstSm90.dkdv) dkdv_sm90<E>(p, stream);
    if (dq >= kFirstSm90.dq) dq_sm90<E>(p, stream);
#endif
    if constexpr (D == 64) {
      if (dkdv == 1) launch_dkdv<E, D, 2, 32, false>(p, stream);
      if (dq == 1) launch_dq<E, D, 2, 64>(p, stream);
      if (dq == 2) launch_dq<E, D, 2, 32>(p, stream);
    }
    if (dkdv == 0) launch_dkdv<E, D, 1, kBr, false>(p, stream);
    if (dq == 0) {
      // d 128 in blocks of 64 keys takes 102 KB of shared memory, more than sm_86/sm_89 allow (99 KB): blocks of 32
      // there (the same sums in the same order: the same bits).
      if constexpr (D == 128)
        if (dq_smem<D, 1, 64>() > smem_optin()) {
          launch_dq<E, D, 1, 32>(p, stream);
          return false;
        }
      launch_dq<E, D, 1, 64>(p, stream);
    }
    return false;
  }
  FASTGPT_CUDA_CHECK(
      cudaMemsetAsync(p.dq_accum, 0, (size_t)p.B * p.H * p.T * D * sizeof(float), stream));
  launch_dkdv<E, D, 1, kBr, true>(p, stream);
  const int64_t total = (int64_t)p.B * p.H * p.T * D;
  const unsigned blocks = (unsigned)std::min<int64_t>((total + 255) / 256, 1 << 16);
  dq_convert_kernel<E><<<blocks, 256, 0, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
  return false;
}

}  // namespace

template <typename E>
bool backward_tc(const Params& p, bool deterministic, Stream stream) {
  return p.d == 64 ? launch<E, 64>(p, deterministic, stream) : launch<E, 128>(p, deterministic, stream);
}

template bool backward_tc<__nv_bfloat16>(const Params&, bool, Stream);
template bool backward_tc<__half>(const Params&, bool, Stream);

}  // namespace fastgpt::cuda::flash
