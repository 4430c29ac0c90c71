// Flash attention forward on tensor cores (bf16 / fp16 in, fp32 accumulate), head dim 64 or 128.
// One CTA of 4 warps takes 16 * MT query rows per warp of one (b, h) and walks the key blocks of BC: S = Q K^T (mma),
// an online softmax in registers (running max m and sum l per row, in log2 units so exp is one exp2), O += P V with P
// fed straight from the S accumulators as the A operand. K and V blocks are double-buffered with cp.async, so the next
// block streams in while this one is multiplied. Only O and the row's log-sum-exp are written. (MT, BC) is the tile
// shape (Params::tiles.fwd; option names in flash_attention.cu's kKernelOptions): with MT = 2 every K and V fragment
// read from shared memory feeds two mma tiles instead of one (twice the rows per CTA, the same shared-memory reads per
// block). Causal: blocks above the diagonal are skipped, the diagonal block is masked, and a warp skips the products of
// a block that lies wholly after its rows (it would add P = 0 with alpha = 1: the same bits); grid order puts the
// longest (last) query blocks first (grid y counts down, and x, the (b, h) pairs, is dispatched first). T needs not be
// a multiple of the tiles: rows past T load as zeros and are masked or not stored.
#include "cuda/check.h"
#include "cuda/flash_attention.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;

template <int D, int MT, int BC>
constexpr int smem_bytes() {
  return (16 * MT * kWarps + 4 * BC) * (D + kPad) * 2;  // Q, and K and V twice each
}

template <typename E, int D, int MT, int BC>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  constexpr int BR = 16 * MT * kWarps, P = D + kPad;  // query rows per CTA, shared-memory row pitch
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* sQ = reinterpret_cast<E*>(smem_raw);  // (BR, P)
  E* sK = sQ + BR * P;                     // 2 x (BC, P)
  E* sV = sK + 2 * BC * P;                 // 2 x (BC, P)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int qblock = gridDim.y - 1 - blockIdx.y, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = qblock * BR, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const E* Q = static_cast<const E*>(p.q) + in_off;
  const E* K = static_cast<const E*>(p.k) + in_off;
  const E* V = static_cast<const E*>(p.v) + in_off;
  const int kv_end = p.causal ? min(T, q0 + BR) : T;
  const int nblocks = (kv_end + BC - 1) / BC;

  load_tile<E, BR, D, kThreads>(sQ, Q, p.is.st, q0, T, tid);
  load_tile<E, BC, D, kThreads>(sK, K, p.is.st, 0, T, tid);
  load_tile<E, BC, D, kThreads>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  float o[MT][D / 8][4] = {};  // this warp's 16 * MT rows x D of O
  float m[MT][2], l[MT][2];    // rows g and g + 8 of each m tile; m in log2 units
#pragma unroll
  for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const int wrow = warp * 16 * MT, w0 = q0 + wrow;  // this warp's first row (in the tile, in the sequence)
  // The query of accumulator elements 0, 1 of m tile mt is w0 + 16 mt + g; elements 2, 3 are 8 rows below.

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * BC;
    if (j + 1 < nblocks) {  // prefetch the next block into the other buffer (free since the sync ending j - 1)
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

    // Warp-uniform: some key of the block is visible to some row of the warp (always so at MT 1, whose check would
    // only cost registers).
    if (MT == 1 || !(p.causal && k0 > w0 + 16 * MT - 1)) {
      float s[MT][BC / 8][4] = {};  // S = Q K^T for this warp's rows x BC keys
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
          ldmatrix_x4(a[mt], sQ + (wrow + mt * 16 + (lane & 15)) * P + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int nn = 0; nn < BC / 16; nn++) {
          uint32_t bk[4];
          ldmatrix_x4(bk, k_s + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma<E>(s[mt][2 * nn], a[mt], bk);
            mma<E>(s[mt][2 * nn + 1], a[mt], bk + 2);
          }
        }
      }

      // Mask (blocks that hide a key from some row), then the online softmax (flash_attention.cuh).
      if (hides_any(w0, w0 + 16 * MT, k0, k0 + BC, T, p.causal)) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) mask_scores(s[mt], k0, w0 + mt * 16, g, c, T, p.causal);
      }
#pragma unroll
      for (int mt = 0; mt < MT; mt++) online_softmax(s[mt], sl2, o[mt], m[mt], l[mt]);

      // O += P V, 16 keys at a time: P's accumulators of tiles 2ks, 2ks+1 are the A fragment.
#pragma unroll
      for (int ks = 0; ks < BC / 16; ks++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) a_from_acc<E>(a[mt], s[mt][2 * ks], s[mt][2 * ks + 1]);
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, v_s + (ks * 16 + (lane & 15)) * P + dn * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; mt++) {
            mma<E>(o[mt][2 * dn], a[mt], bv);
            mma<E>(o[mt][2 * dn + 1], a[mt], bv + 2);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this buffer before iteration j + 1 prefetches into it
  }

  E* O = static_cast<E*>(p.out) + b * p.os.sb + h * p.os.sh;
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    store_rows(o[mt], m[mt], l[mt], w0 + mt * 16, g, c, T, O, p.os.st, p.lse + (int64_t)bh * T);
}

template <typename E, int D, int MT, int BC>
void launch(const Params& p, Stream stream) {
  constexpr int bytes = smem_bytes<D, MT, BC>(), rows = 16 * MT * kWarps;
  FASTGPT_CUDA_CHECK(
      cudaFuncSetAttribute(forward_kernel<E, D, MT, BC>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  dim3 grid(p.B * p.H, (p.T + rows - 1) / rows);  // B * H on x: y and z stop at 65535
  forward_kernel<E, D, MT, BC><<<grid, kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

// The fwd options of kKernelOptions in order; head dim 128 has only the first (more rows per warp would not fit in
// registers).
template <typename E, int D>
void launch_tiles(const Params& p, Stream stream) {
  if constexpr (D == 64) {
    if (p.tiles.fwd == 1) return launch<E, D, 2, 64>(p, stream);
    if (p.tiles.fwd == 2) return launch<E, D, 1, 128>(p, stream);
  }
  launch<E, D, 1, 64>(p, stream);
}

}  // namespace

template <typename E>
void forward_tc(const Params& p, Stream stream) {
  if (p.d == 64)
    launch_tiles<E, 64>(p, stream);
  else
    launch_tiles<E, 128>(p, stream);
}

template void forward_tc<__nv_bfloat16>(const Params&, Stream);
template void forward_tc<__half>(const Params&, Stream);

}  // namespace fastgpt::cuda::flash
