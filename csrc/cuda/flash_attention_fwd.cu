// Flash attention forward on tensor cores (bf16 / fp16 in, fp32 accumulate), head dim 64 or 128.
// One CTA of 4 warps takes 64 query rows of one (b, h), 16 rows per warp, and walks the key blocks of 64: S = Q K^T
// (mma), an online softmax in registers (running max m and sum l per row, in log2 units so exp is one exp2),
// O += P V with P fed straight from the S accumulators as the A operand. K and V blocks are double-buffered with
// cp.async, so the next block streams in while this one is multiplied. Only O and the row's log-sum-exp are written.
// Causal: blocks above the diagonal are skipped, the diagonal block is masked; grid order puts the longest (last)
// query blocks first (grid y counts down, and x, the (b, h) pairs, is dispatched first). T needs not be a multiple of 64: rows past T load as zeros and are masked or not stored.
#include "cuda/check.h"
#include "cuda/flash_attention.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kBr = 64, kBc = 64;  // query rows per CTA, keys per block

template <int D>
constexpr int smem_bytes() {
  return (kBr + 4 * kBc) * (D + kPad) * 2;  // Q, and K and V twice each
}

template <typename E, int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sQ = reinterpret_cast<E*>(smem_raw);  // (kBr, D + kPad)
  E* sK = sQ + kBr * (D + kPad);           // 2 x (kBc, D + kPad)
  E* sV = sK + 2 * kBc * (D + kPad);       // 2 x (kBc, D + kPad)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int qblock = gridDim.y - 1 - blockIdx.y, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = qblock * kBr, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const E* Q = static_cast<const E*>(p.q) + in_off;
  const E* K = static_cast<const E*>(p.k) + in_off;
  const E* V = static_cast<const E*>(p.v) + in_off;
  const int kv_end = p.causal ? min(T, q0 + kBr) : T;
  const int nblocks = (kv_end + kBc - 1) / kBc;

  load_tile<E, kBr, D, kThreads>(sQ, Q, p.is.st, q0, T, tid);
  load_tile<E, kBc, D, kThreads>(sK, K, p.is.st, 0, T, tid);
  load_tile<E, kBc, D, kThreads>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  float o[D / 8][4] = {};  // this warp's 16 rows x D of O
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8, m in log2 units
  const float sl2 = p.scale * kLog2e;
  const int row_lo = q0 + warp * 16 + g;  // the query of accumulator elements 0, 1 (2, 3 are row_lo + 8)

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * kBc;
    if (j + 1 < nblocks) {  // prefetch the next block into the other buffer (free since the sync ending j - 1)
      load_tile<E, kBc, D, kThreads>(sK + (buf ^ 1) * kBc * (D + kPad), K, p.is.st, k0 + kBc, T, tid);
      load_tile<E, kBc, D, kThreads>(sV + (buf ^ 1) * kBc * (D + kPad), V, p.is.st, k0 + kBc, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* k_s = sK + buf * kBc * (D + kPad);
    const E* v_s = sV + buf * kBc * (D + kPad);

    float s[kBc / 8][4] = {};  // S = Q K^T for this warp's 16 rows x 64 keys
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t a[4];
      ldmatrix_x4(a, sQ + (warp * 16 + (lane & 15)) * (D + kPad) + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int nn = 0; nn < kBc / 16; nn++) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_s + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * (D + kPad) + kk * 16 +
                            ((lane >> 3) & 1) * 8);
        mma<E>(s[2 * nn], a, bk);
        mma<E>(s[2 * nn + 1], a, bk + 2);
      }
    }

    // Scale to log2 units and mask: keys past T, and (causal) keys after the query.
    const bool need_mask = k0 + kBc > T || (p.causal && k0 + kBc > q0);
#pragma unroll
    for (int t = 0; t < kBc / 8; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = k0 + t * 8 + 2 * c + (e & 1), row = row_lo + (e >> 1) * 8;
        s[t][e] *= sl2;
        if (need_mask && (key >= T || (p.causal && key > row))) s[t][e] = -INFINITY;
      }

    // Online softmax: each row's values are spread over the 4 lanes of its group.
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float mx = m[r];
#pragma unroll
      for (int t = 0; t < kBc / 8; t++) mx = fmaxf(mx, fmaxf(s[t][2 * r], s[t][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet stays all zeros
      const float alpha = exp2f(m[r] - base);
      m[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < kBc / 8; t++) {
        s[t][2 * r] = exp2f(s[t][2 * r] - base);
        s[t][2 * r + 1] = exp2f(s[t][2 * r + 1] - base);
        sum += s[t][2 * r] + s[t][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;  // this lane's share; the group's shares are added once at the end
#pragma unroll
      for (int t = 0; t < D / 8; t++) {
        o[t][2 * r] *= alpha;
        o[t][2 * r + 1] *= alpha;
      }
    }

    // O += P V, 16 keys at a time: P's accumulators of tiles 2ks, 2ks+1 are the A fragment.
#pragma unroll
    for (int ks = 0; ks < kBc / 16; ks++) {
      uint32_t a[4];
      a_from_acc<E>(a, s[2 * ks], s[2 * ks + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; dn++) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_s + (ks * 16 + (lane & 15)) * (D + kPad) + dn * 16 + (lane >> 4) * 8);
        mma<E>(o[2 * dn], a, bv);
        mma<E>(o[2 * dn + 1], a, bv + 2);
      }
    }
    __syncthreads();  // every warp is done with this buffer before iteration j + 1 prefetches into it
  }

  // Normalise and store; rows past T are dropped. lse = ln(sum_j exp(s_j)) = (m + log2 l) * ln 2.
  E* O = static_cast<E*>(p.out) + b * p.os.sb + h * p.os.sh;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float tot = l[r];
    tot += __shfl_xor_sync(0xffffffffu, tot, 1);
    tot += __shfl_xor_sync(0xffffffffu, tot, 2);
    const int row = row_lo + r * 8;
    if (row >= T) continue;
    const float inv = 1.f / tot;
    E* orow = O + (int64_t)row * p.os.st;
#pragma unroll
    for (int t = 0; t < D / 8; t++) {
      const uint32_t v2 = Pack<E>::two(o[t][2 * r] * inv, o[t][2 * r + 1] * inv);
      *reinterpret_cast<uint32_t*>(orow + t * 8 + 2 * c) = v2;
    }
    if (c == 0) p.lse[(int64_t)bh * T + row] = (m[r] + log2f(tot)) * kLn2;
  }
}

template <typename E, int D>
void launch(const Params& p, Stream stream) {
  constexpr int bytes = smem_bytes<D>();
  FASTGPT_CUDA_CHECK(
      cudaFuncSetAttribute(forward_kernel<E, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  dim3 grid(p.B * p.H, (p.T + kBr - 1) / kBr);  // B * H on x: y and z stop at 65535
  forward_kernel<E, D><<<grid, kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <typename E>
void forward_tc(const Params& p, Stream stream) {
  if (p.d == 64)
    launch<E, 64>(p, stream);
  else
    launch<E, 128>(p, stream);
}

template void forward_tc<__nv_bfloat16>(const Params&, Stream);
template void forward_tc<__half>(const Params&, Stream);

}  // namespace fastgpt::cuda::flash
