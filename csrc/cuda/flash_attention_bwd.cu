// Flash attention backward on tensor cores (bf16 / fp16 in, fp32 accumulate), head dim 64 or 128. Nothing of size
// T x T is stored: P is recomputed from the saved lse, and delta_i = dout_i . out_i (computed beforehand) stands in
// for sum_j P_ij dP_ij.
// dkdv_kernel: one CTA of 4 warps owns 64 keys of one (b, h) (16 per warp) and walks the query blocks that can see
// them (double-buffered Q and dO via cp.async). Each warp forms the transposed products S^T = K Q^T and
// dP^T = V dO^T for its keys, so P^T and dS^T = P^T (dP^T - delta) sit in registers already laid out as the A
// operands of dV += P^T dO and dK += dS^T Q, which accumulate in registers over all query blocks.
// dQ = dS K needs a sum over every key block: either (fast) each CTA adds its part into an fp32 buffer with atomics,
// via dS staged in shared memory, or (deterministic) dq_kernel, the mirror image of the forward, recomputes S and dP
// per query block and sums its key blocks in a fixed order: bit-reproducible, at 7 instead of 5 GEMM passes.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kBc = 64;  // keys per dkdv CTA; also keys per block in dq_kernel
template <int D>
constexpr int kBr = D == 64 ? 64 : 32;  // queries per step of dkdv_kernel: keeps S^T, dP^T, dK, dV in registers

template <int D>
constexpr int dkdv_smem() {
  return (2 * kBc + 4 * kBr<D>) * (D + kPad) * 2 + kBc * (kBr<D> + kPad) * 2 + 2 * kBr<D> * 4;
}
constexpr int dq_smem(int D) { return 6 * 64 * (D + kPad) * 2; }

template <typename E, int D, bool kAtomicDq>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Params p) {
  constexpr int Br = kBr<D>, P = D + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sK = reinterpret_cast<E*>(smem_raw);  // (kBc, P)
  E* sV = sK + kBc * P;                    // (kBc, P)
  E* sQ = sV + kBc * P;                    // 2 x (Br, P)
  E* sdO = sQ + 2 * Br * P;                // 2 x (Br, P)
  E* sdS = sdO + 2 * Br * P;               // (kBc, Br + kPad): dS^T, for the atomic dq
  float* sL = reinterpret_cast<float*>(sdS + kBc * (Br + kPad));  // (Br) lse in log2 units
  float* sDl = sL + Br;                                            // (Br) delta

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T, k0 = blockIdx.y * kBc;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E* Q = static_cast<const E*>(p.q) + in_off;
  const E* dO = static_cast<const E*>(p.dout) + out_off;
  const int i_first = p.causal ? k0 / Br : 0, n_q = (T + Br - 1) / Br;

  load_tile<E, kBc, D, kThreads>(sK, static_cast<const E*>(p.k) + in_off, p.is.st, k0, T, tid);
  load_tile<E, kBc, D, kThreads>(sV, static_cast<const E*>(p.v) + in_off, p.is.st, k0, T, tid);
  load_tile<E, Br, D, kThreads>(sQ, Q, p.is.st, i_first * Br, T, tid);
  load_tile<E, Br, D, kThreads>(sdO, dO, p.os.st, i_first * Br, T, tid);
  cp_async_commit();

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};  // this warp's 16 keys x D
  const float sl2 = p.scale * kLog2e;
  const int key_lo = k0 + warp * 16 + g;  // key of accumulator elements 0, 1 (2, 3: key_lo + 8)

  for (int i = i_first; i < n_q; i++) {
    const int buf = (i - i_first) & 1, q0 = i * Br;
    if (i + 1 < n_q) {
      load_tile<E, Br, D, kThreads>(sQ + (buf ^ 1) * Br * P, Q, p.is.st, q0 + Br, T, tid);
      load_tile<E, Br, D, kThreads>(sdO + (buf ^ 1) * Br * P, dO, p.os.st, q0 + Br, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if (tid < Br) {
      const int q = q0 + tid;
      sL[tid] = q < T ? p.lse[(int64_t)bh * T + q] * kLog2e : 0.f;
      sDl[tid] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
    }
    __syncthreads();
    const E* q_s = sQ + buf * Br * P;
    const E* do_s = sdO + buf * Br * P;

    float st[Br / 8][4] = {}, dpt[Br / 8][4] = {};  // S^T and dP^T: 16 keys x Br queries
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t ak[4], av[4];
      ldmatrix_x4(ak, sK + (warp * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
      ldmatrix_x4(av, sV + (warp * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nn = 0; nn < Br / 16; nn++) {
        const int off = (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t bq[4], bo[4];
        ldmatrix_x4(bq, q_s + off);
        ldmatrix_x4(bo, do_s + off);
        mma<E>(st[2 * nn], ak, bq);
        mma<E>(st[2 * nn + 1], ak, bq + 2);
        mma<E>(dpt[2 * nn], av, bo);
        mma<E>(dpt[2 * nn + 1], av, bo + 2);
      }
    }

    // P^T = exp2(S^T * scale * log2 e - lse2), dS^T = P^T (dP^T - delta); both stay in st / dpt.
#pragma unroll
    for (int t = 0; t < Br / 8; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int ql = t * 8 + 2 * c + (e & 1), key = key_lo + (e >> 1) * 8;
        const float pv = visible(q0 + ql, key, T, p.causal) ? exp2f(st[t][e] * sl2 - sL[ql]) : 0.f;
        st[t][e] = pv;
        dpt[t][e] = pv * (dpt[t][e] - sDl[ql]);
      }

    // dV += P^T dO and dK += dS^T Q, 16 queries at a time.
#pragma unroll
    for (int ks = 0; ks < Br / 16; ks++) {
      uint32_t ap[4], ad[4];
      a_from_acc<E>(ap, st[2 * ks], st[2 * ks + 1]);
      a_from_acc<E>(ad, dpt[2 * ks], dpt[2 * ks + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; dn++) {
        const int off = (ks * 16 + (lane & 15)) * P + dn * 16 + (lane >> 4) * 8;
        uint32_t bo[4], bq[4];
        ldmatrix_x4_trans(bo, do_s + off);
        ldmatrix_x4_trans(bq, q_s + off);
        mma<E>(dv[2 * dn], ap, bo);
        mma<E>(dv[2 * dn + 1], ap, bo + 2);
        mma<E>(dk[2 * dn], ad, bq);
        mma<E>(dk[2 * dn + 1], ad, bq + 2);
      }
    }

    if constexpr (kAtomicDq) {
      // dQ (Br x D) += dS (Br x 64 keys) K: dS^T goes through shared memory so every warp sees all 64 keys.
#pragma unroll
      for (int t = 0; t < Br / 8; t++)
#pragma unroll
        for (int r = 0; r < 2; r++)
          *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g + r * 8) * (Br + kPad) + t * 8 + 2 * c) =
              Pack<E>::two(dpt[t][2 * r], dpt[t][2 * r + 1]);
      __syncthreads();
      constexpr int kWq = Br / 16, kWd = kWarps / kWq, Dw = D / kWd;  // warps along queries and along d
      const int wq = warp % kWq, d0 = (warp / kWq) * Dw;
      float acc[Dw / 8][4] = {};
#pragma unroll
      for (int ks = 0; ks < kBc / 16; ks++) {
        uint32_t a[4];  // A = dS (queries x keys), stored transposed as dS^T (keys x queries)
        ldmatrix_x4_trans(a, sdS + (ks * 16 + (lane & 7) + ((lane >> 4) << 3)) * (Br + kPad) + wq * 16 +
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

  E* dK = static_cast<E*>(p.dk) + in_off;
  E* dV = static_cast<E*>(p.dv) + in_off;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int key = key_lo + r * 8;
    if (key >= T) continue;
#pragma unroll
    for (int t = 0; t < D / 8; t++) {
      const int64_t o = (int64_t)key * p.is.st + t * 8 + 2 * c;
      *reinterpret_cast<uint32_t*>(dK + o) = Pack<E>::two(dk[t][2 * r] * p.scale, dk[t][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dV + o) = Pack<E>::two(dv[t][2 * r], dv[t][2 * r + 1]);
    }
  }
}

// Deterministic dQ: 64 queries per CTA (16 per warp), key blocks in order, K and V double-buffered.
template <typename E, int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  constexpr int Bq = 64, P = D + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sQ = reinterpret_cast<E*>(smem_raw);  // (Bq, P)
  E* sdO = sQ + Bq * P;                    // (Bq, P)
  E* sK = sdO + Bq * P;                    // 2 x (kBc, P)
  E* sV = sK + 2 * kBc * P;                // 2 x (kBc, P)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * Bq, bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E* K = static_cast<const E*>(p.k) + in_off;
  const E* V = static_cast<const E*>(p.v) + in_off;
  const int nblocks = ((p.causal ? min(T, q0 + Bq) : T) + kBc - 1) / kBc;

  load_tile<E, Bq, D, kThreads>(sQ, static_cast<const E*>(p.q) + in_off, p.is.st, q0, T, tid);
  load_tile<E, Bq, D, kThreads>(sdO, static_cast<const E*>(p.dout) + out_off, p.os.st, q0, T, tid);
  load_tile<E, kBc, D, kThreads>(sK, K, p.is.st, 0, T, tid);
  load_tile<E, kBc, D, kThreads>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  const int row_lo = q0 + warp * 16 + g;
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int q = row_lo + r * 8;
    lse2[r] = q < T ? p.lse[(int64_t)bh * T + q] * kLog2e : 0.f;
    dl[r] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
  }
  float dq[D / 8][4] = {};
  const float sl2 = p.scale * kLog2e;

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * kBc;
    if (j + 1 < nblocks) {
      load_tile<E, kBc, D, kThreads>(sK + (buf ^ 1) * kBc * P, K, p.is.st, k0 + kBc, T, tid);
      load_tile<E, kBc, D, kThreads>(sV + (buf ^ 1) * kBc * P, V, p.is.st, k0 + kBc, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* k_s = sK + buf * kBc * P;
    const E* v_s = sV + buf * kBc * P;

    float s[kBc / 8][4] = {}, dp[kBc / 8][4] = {};  // S = Q K^T, dP = dO V^T: 16 rows x 64 keys
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t aq[4], ao[4];
      const int aoff = (warp * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8;
      ldmatrix_x4(aq, sQ + aoff);
      ldmatrix_x4(ao, sdO + aoff);
#pragma unroll
      for (int nn = 0; nn < kBc / 16; nn++) {
        const int off = (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, k_s + off);
        ldmatrix_x4(bv, v_s + off);
        mma<E>(s[2 * nn], aq, bk);
        mma<E>(s[2 * nn + 1], aq, bk + 2);
        mma<E>(dp[2 * nn], ao, bv);
        mma<E>(dp[2 * nn + 1], ao, bv + 2);
      }
    }
#pragma unroll
    for (int t = 0; t < kBc / 8; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = k0 + t * 8 + 2 * c + (e & 1), r = e >> 1;
        const float pv = visible(row_lo + r * 8, key, T, p.causal) ? exp2f(s[t][e] * sl2 - lse2[r]) : 0.f;
        dp[t][e] = pv * (dp[t][e] - dl[r]);  // dS
      }
#pragma unroll
    for (int ks = 0; ks < kBc / 16; ks++) {  // dQ += dS K
      uint32_t a[4];
      a_from_acc<E>(a, dp[2 * ks], dp[2 * ks + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; dn++) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, k_s + (ks * 16 + (lane & 15)) * P + dn * 16 + (lane >> 4) * 8);
        mma<E>(dq[2 * dn], a, bk);
        mma<E>(dq[2 * dn + 1], a, bk + 2);
      }
    }
    __syncthreads();
  }

  E* dQ = static_cast<E*>(p.dq) + in_off;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int q = row_lo + r * 8;
    if (q >= T) continue;
#pragma unroll
    for (int t = 0; t < D / 8; t++)
      *reinterpret_cast<uint32_t*>(dQ + (int64_t)q * p.is.st + t * 8 + 2 * c) =
          Pack<E>::two(dq[t][2 * r] * p.scale, dq[t][2 * r + 1] * p.scale);
  }
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

template <typename E, int D>
void launch(const Params& p, bool deterministic, Stream stream) {
  const dim3 kgrid(p.B * p.H, (p.T + kBc - 1) / kBc);  // B * H on x: y stops at 65535
  constexpr int kbytes = dkdv_smem<D>();
  if (deterministic) {
    FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(dkdv_kernel<E, D, false>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, kbytes));
    dkdv_kernel<E, D, false><<<kgrid, kThreads, kbytes, stream>>>(p);
    FASTGPT_CUDA_CHECK_LAUNCH();
    const int qbytes = dq_smem(D);
    FASTGPT_CUDA_CHECK(
        cudaFuncSetAttribute(dq_kernel<E, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, qbytes));
    dq_kernel<E, D><<<dim3(p.B * p.H, (p.T + 63) / 64), kThreads, qbytes, stream>>>(p);
    FASTGPT_CUDA_CHECK_LAUNCH();
    return;
  }
  FASTGPT_CUDA_CHECK(
      cudaMemsetAsync(p.dq_accum, 0, (size_t)p.B * p.H * p.T * D * sizeof(float), stream));
  FASTGPT_CUDA_CHECK(
      cudaFuncSetAttribute(dkdv_kernel<E, D, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kbytes));
  dkdv_kernel<E, D, true><<<kgrid, kThreads, kbytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
  const int64_t total = (int64_t)p.B * p.H * p.T * D;
  const unsigned blocks = (unsigned)std::min<int64_t>((total + 255) / 256, 1 << 16);
  dq_convert_kernel<E><<<blocks, 256, 0, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <typename E>
void backward_tc(const Params& p, bool deterministic, Stream stream) {
  if (p.d == 64)
    launch<E, 64>(p, deterministic, stream);
  else
    launch<E, 128>(p, deterministic, stream);
}

template void backward_tc<__nv_bfloat16>(const Params&, bool, Stream);
template void backward_tc<__half>(const Params&, bool, Stream);

}  // namespace fastgpt::cuda::flash
