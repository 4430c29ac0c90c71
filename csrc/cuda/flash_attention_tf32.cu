// Flash attention for float32 on tensor cores (sm_80 and newer): TF32 mma.sync m16n8k8 with fp32 accumulators, head
// dim 64 or 128; the forward and the deterministic backward's two passes (dkdv, then dq), laid out as the bf16/fp16
// kernels of flash_attention_fwd.cu / _bwd.cu with 16 rows (queries, or keys in dkdv) per warp, 4 warps per CTA.
// Why: the CUDA-core ("simt") fp32 kernels run at FFMA speed, and PyTorch's own float32 attention on these GPUs
// (its memory-efficient kernel) runs on tensor cores, so fastgpt's fp32/tf32 training ran at 0.61x / 0.36x torch
// eager on an H100 (BENCHMARKS.md, run 3).
// Two kinds of product (kSplit): one TF32 product per product (inputs rounded to 10 mantissa bits, ~1e-3 relative:
// the engine's "tf32" precision), or three (CUTLASS's fast-fp32 trick, as PyTorch's fp32 attention does): x = hi + lo
// with hi = tf32(x), lo = tf32(x - hi), and a b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b: fp32 accuracy (the dropped
// lo_a lo_b and lo's own rounding are ~2^-22 relative) for three times the tensor work.
// Fragments: ldmatrix moves 32-bit words as pairs of 16-bit ones, so its 8 x 8 b16 tiles are 8 x 4 fp32 tiles,
// which are exactly the tf32 A fragment of row-major rows and the B fragment of K-major rows (Q K^T, dO V^T, K Q^T,
// V dO^T). Products whose k runs along keys or queries (P V, P^T dO, dS^T Q, dS K) take A from accumulators: inside
// an 8-wide k chunk the order is free as long as A and B agree, so slot c holds column 2c and slot c + 4 column
// 2c + 1 (the accumulator's own pair: no shuffles), and B's rows 2c and 2c + 1 are read as single words (a row
// pitch of D + 4 words puts the 32 lanes' reads on 32 banks).
#include <algorithm>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"

namespace fastgpt::cuda::flash {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps, kRows = 16 * kWarps;  // rows per CTA: 16 per warp
constexpr int kPad32 = 4;  // 16 bytes: 8 consecutive rows start 16 bytes apart mod 128 (ldmatrix conflict-free)

// The other side's block: 64 at d 64; 32 at d 128, where 64 would need more shared memory than an A100 has.
template <int D>
constexpr int kBlock = D == 64 ? 64 : 32;

// Rows [row0, row0 + ROWS) of one (b, h) slice (row stride st) into shared rows of pitch D + kPad32; zeros past T.
template <int ROWS, int D>
__device__ __forceinline__ void load_rows32(float* dst, const float* src, int64_t st, int row0, int T, int tid) {
  constexpr int kChunks = D / 4;  // 16-byte chunks per row
  for (int i = tid; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = row0 + r < T;
    cp_async16(dst + r * (D + kPad32) + c * 4, valid ? src + (int64_t)(row0 + r) * st + c * 4 : src, valid);
  }
}

// N TF32 registers of a fragment: hi, and (kSplit) lo = the rest.
template <bool kSplit, int N>
struct Frag {
  uint32_t hi[N], lo[N];
  __device__ __forceinline__ void set(int i, float x) {
    hi[i] = to_tf32(x);
    if constexpr (kSplit) lo[i] = to_tf32(x - as_float(hi[i]));
  }
};

// A (16 x 8) of shared rows [row0, row0 + 16), columns [k0, k0 + 8).
template <bool kSplit>
__device__ __forceinline__ void load_a(Frag<kSplit, 4>& f, const float* s, int pitch, int row0, int k0, int lane) {
  uint32_t r[4];
  ldmatrix_x4(r, s + (row0 + (lane & 15)) * pitch + k0 + (lane >> 4) * 4);
#pragma unroll
  for (int i = 0; i < 4; i++) f.set(i, as_float(r[i]));
}

// B of two n tiles (registers 0-1: n0 .. n0 + 7, 2-3: the next 8) from K-major shared rows n, columns [k0, k0 + 8).
template <bool kSplit>
__device__ __forceinline__ void load_b2(Frag<kSplit, 4>& f, const float* s, int pitch, int n0, int k0, int lane) {
  uint32_t r[4];
  ldmatrix_x4(r, s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * pitch + k0 + ((lane >> 3) & 1) * 4);
#pragma unroll
  for (int i = 0; i < 4; i++) f.set(i, as_float(r[i]));
}

// B (8 x 8) from shared rows k (keys or queries) [k0, k0 + 8), columns [n0, n0 + 8), in the permuted k order.
template <bool kSplit>
__device__ __forceinline__ void load_b_rows(Frag<kSplit, 2>& f, const float* s, int pitch, int k0, int n0, int g,
                                            int c) {
  f.set(0, s[(k0 + 2 * c) * pitch + n0 + g]);
  f.set(1, s[(k0 + 2 * c + 1) * pitch + n0 + g]);
}

// A (16 x 8) from one accumulator tile (columns 2c, 2c + 1 of rows g, g + 8), in the permuted k order.
template <bool kSplit>
__device__ __forceinline__ void a_from(Frag<kSplit, 4>& f, const float (&acc)[4]) {
  f.set(0, acc[0]);
  f.set(1, acc[2]);
  f.set(2, acc[1]);
  f.set(3, acc[3]);
}

// c += a * b (b's registers from `at`): the small products first, then hi * hi.
template <bool kSplit, int N>
__device__ __forceinline__ void mma3(float (&c)[4], const Frag<kSplit, 4>& a, const Frag<kSplit, N>& b, int at) {
  if constexpr (kSplit) {
    mma_tf32(c, a.lo, b.hi + at);
    mma_tf32(c, a.hi, b.lo + at);
  }
  mma_tf32(c, a.hi, b.hi + at);
}

// acc (16 x 8 ND) += A (16 x 8 NK: accumulator tiles) * B (8 NK shared rows of pitch `pitch` from b, 8 ND columns),
// 8 rows of B at a time. acc runs over the whole sequence (O over keys, dK and dV over queries, dQ over keys), and
// each mma.sync cuts its sum toward zero (the tensor cores' adder; tests/warp_emu/emu.h models it), so adding every
// product straight into acc drifted it toward zero by about half an ulp per mma: 3 x T / 8 of them at T 1000 put
// an H200's fp32 dK 1.1e-5 from float64 (2026-11-26). With three products, each output tile's sum over this
// block's NK k chunks starts from zero (a chain of 3 NK mmas) and joins acc by an fp32 add, rounded to nearest: the
// bias is then a 3 NK chain's (24 mmas at d 64) on each block's part, not 3 T / 8's on the whole sum. (The whole
// block's split A fragments are live at once: dkdv's registers reach 255, with 12 bytes of spill at d 128 on sm_80
// and none on sm_90; summing the block in halves spilled far more, 24-180 bytes.) One TF32 product (~1e-3 from its
// input rounding) keeps the old loop, into acc directly: the per-block loop made ptxas spill its forward (4-16 bytes).
template <bool kSplit, int NK, int ND>
__device__ __forceinline__ void rows_product(float (&acc)[ND][4], const float (&a)[NK][4], const float* b, int pitch,
                                             int g, int c) {
  if constexpr (!kSplit) {
#pragma unroll
    for (int t = 0; t < NK; t++) {
      Frag<kSplit, 4> fa;
      a_from(fa, a[t]);
#pragma unroll
      for (int dn = 0; dn < ND; dn++) {
        Frag<kSplit, 2> fb;
        load_b_rows(fb, b, pitch, t * 8, dn * 8, g, c);
        mma3(acc[dn], fa, fb, 0);
      }
    }
  } else {
    Frag<kSplit, 4> fa[NK];
#pragma unroll
    for (int t = 0; t < NK; t++) a_from(fa[t], a[t]);
#pragma unroll
    for (int dn = 0; dn < ND; dn++) {
      float part[4] = {};
#pragma unroll
      for (int t = 0; t < NK; t++) {
        Frag<kSplit, 2> fb;
        load_b_rows(fb, b, pitch, t * 8, dn * 8, g, c);
        mma3(part, fa[t], fb, 0);
      }
#pragma unroll
      for (int i = 0; i < 4; i++) acc[dn][i] += part[i];
    }
  }
}

// acc (16 x 8 NB) += A B^T over D: A the 16 shared rows [row0, row0 + 16) of a, B the 8 NB shared rows of b (both
// D wide, pitch D + kPad32), 8 columns of D at a time. (Rolled over D: unrolled, the dkdv kernel spilled.)
template <bool kSplit, int D, int NB>
__device__ __forceinline__ void rows_dot(float (&acc)[NB][4], const float* a, int row0, const float* b, int lane) {
  constexpr int P = D + kPad32;
#pragma unroll 1
  for (int kk = 0; kk < D / 8; kk++) {
    Frag<kSplit, 4> fa;
    load_a(fa, a, P, row0, kk * 8, lane);
#pragma unroll
    for (int nn = 0; nn < NB / 2; nn++) {
      Frag<kSplit, 4> fb;
      load_b2(fb, b, P, nn * 16, kk * 8, lane);
      mma3(acc[2 * nn], fa, fb, 0);
      mma3(acc[2 * nn + 1], fa, fb, 2);
    }
  }
}

// A loop step's copies: rows [row0, row0 + ROWS) of x and y start into dx and dy (the buffers the last step freed)
// and this step's own rows, copied before them, are waited for; or (more false) only that wait. The caller's barrier
// then hands this step's rows to every warp.
template <int ROWS, int D>
__device__ __forceinline__ void next_blocks(bool more, float* dx, const float* x, int64_t xst, float* dy,
                                            const float* y, int64_t yst, int row0, int T, int tid) {
  if (more) {
    load_rows32<ROWS, D>(dx, x, xst, row0, T, tid);
    load_rows32<ROWS, D>(dy, y, yst, row0, T, tid);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
}

template <int D>
constexpr int fwd_smem() {
  return (kRows + 4 * kBlock<D>) * (D + kPad32) * 4;  // Q, and K and V twice each
}

template <int D, bool kSplit>
__global__ void __launch_bounds__(kThreads) forward_tf32_kernel(Params p) {
  constexpr int BC = kBlock<D>, P = D + kPad32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);  // (kRows, P)
  float* sK = sQ + kRows * P;                      // 2 x (BC, P)
  float* sV = sK + 2 * BC * P;                     // 2 x (BC, P)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows, bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const float* K = static_cast<const float*>(p.k) + in_off;
  const float* V = static_cast<const float*>(p.v) + in_off;
  const int nblocks = ((p.causal ? min(T, q0 + kRows) : T) + BC - 1) / BC;

  load_rows32<kRows, D>(sQ, static_cast<const float*>(p.q) + in_off, p.is.st, q0, T, tid);
  load_rows32<BC, D>(sK, K, p.is.st, 0, T, tid);
  load_rows32<BC, D>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8; m in log2 units
  const float sl2 = p.scale * kLog2e;
  const int wrow = warp * 16, w0 = q0 + wrow;  // this warp's first row (in the tile, in the sequence)

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * BC;
    next_blocks<BC, D>(j + 1 < nblocks, sK + (buf ^ 1) * BC * P, K, p.is.st, sV + (buf ^ 1) * BC * P, V, p.is.st,
                       k0 + BC, T, tid);
    __syncthreads();
    const float* k_s = sK + buf * BC * P;
    const float* v_s = sV + buf * BC * P;

    // Warp-uniform: a block wholly after the warp's rows would add P = 0 with alpha = 1.
    if (!(p.causal && k0 > w0 + 15)) {
      float s[BC / 8][4] = {};  // S = Q K^T: the warp's 16 rows x BC keys
      rows_dot<kSplit, D>(s, sQ, wrow, k_s, lane);
      if (hides_any(w0, w0 + 16, k0, k0 + BC, T, p.causal)) mask_scores(s, k0, w0, g, c, T, p.causal);
      online_softmax(s, sl2, o, m, l);
      rows_product<kSplit>(o, s, v_s, P, g, c);  // O += P V
    }
    __syncthreads();  // every warp is done with this buffer before iteration j + 1 prefetches into it
  }
  store_rows(o, m, l, w0, g, c, T, static_cast<float*>(p.out) + b * p.os.sb + h * p.os.sh, p.os.st,
             p.lse + (int64_t)bh * T);
}

template <int D>
constexpr int dkdv_smem() {
  return (2 * kRows + 4 * kBlock<D>) * (D + kPad32) * 4 + 2 * kBlock<D> * 4;  // K, V; Q, dO twice; lse, delta
}

// 16 keys per warp; the query blocks that see them, kBlock<D> queries per step.
template <int D, bool kSplit>
__global__ void __launch_bounds__(kThreads) dkdv_tf32_kernel(Params p) {
  constexpr int BR = kBlock<D>, P = D + kPad32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sK = reinterpret_cast<float*>(smem_raw);  // (kRows, P)
  float* sV = sK + kRows * P;                      // (kRows, P)
  float* sQ = sV + kRows * P;                      // 2 x (BR, P)
  float* sdO = sQ + 2 * BR * P;                    // 2 x (BR, P)
  float* sL = sdO + 2 * BR * P;                    // (BR) lse in log2 units
  float* sDl = sL + BR;                            // (BR) delta

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T, k0 = blockIdx.y * kRows;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const float* Q = static_cast<const float*>(p.q) + in_off;
  const float* dO = static_cast<const float*>(p.dout) + out_off;
  const int i_first = p.causal ? k0 / BR : 0, n_q = (T + BR - 1) / BR;

  load_rows32<kRows, D>(sK, static_cast<const float*>(p.k) + in_off, p.is.st, k0, T, tid);
  load_rows32<kRows, D>(sV, static_cast<const float*>(p.v) + in_off, p.is.st, k0, T, tid);
  load_rows32<BR, D>(sQ, Q, p.is.st, i_first * BR, T, tid);
  load_rows32<BR, D>(sdO, dO, p.os.st, i_first * BR, T, tid);
  cp_async_commit();

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};  // this warp's 16 keys x D
  const float sl2 = p.scale * kLog2e;
  const int wkey = warp * 16, kw0 = k0 + wkey;  // this warp's first key (in the tile, in the sequence)

  for (int i = i_first; i < n_q; i++) {
    const int buf = (i - i_first) & 1, q0 = i * BR;
    next_blocks<BR, D>(i + 1 < n_q, sQ + (buf ^ 1) * BR * P, Q, p.is.st, sdO + (buf ^ 1) * BR * P, dO, p.os.st,
                       q0 + BR, T, tid);
    stage_lse_delta(sL, sDl, p, bh, q0, BR, tid);
    __syncthreads();
    const float* q_s = sQ + buf * BR * P;
    const float* do_s = sdO + buf * BR * P;

    // Warp-uniform: a step whose queries all precede the warp's keys adds zeros.
    if (!(p.causal && q0 + BR - 1 < kw0)) {
      float st[BR / 8][4] = {}, dpt[BR / 8][4] = {};  // S^T = K Q^T, dP^T = V dO^T (then P^T, dS^T)
      rows_dot<kSplit, D>(st, sK, wkey, q_s, lane);
      rows_dot<kSplit, D>(dpt, sV, wkey, do_s, lane);
      probs_ds_cols(st, dpt, q0, kw0 + g, c, T, p.causal, hides_any(q0, q0 + BR, kw0, kw0 + 16, T, p.causal), sl2,
                    sL, sDl);  // P^T, dS^T
      // dV += P^T dO, then dK += dS^T Q, 8 queries at a time (one after the other: P^T's registers are free for
      // the second).
      rows_product<kSplit>(dv, st, do_s, P, g, c);
      rows_product<kSplit>(dk, dpt, q_s, P, g, c);
    }
    __syncthreads();  // buffers and sL/sDl are free before the next step refills them
  }

  store_tile_rows(dk, kw0, g, c, T, static_cast<float*>(p.dk) + in_off, p.is.st, p.scale);
  store_tile_rows(dv, kw0, g, c, T, static_cast<float*>(p.dv) + in_off, p.is.st, 1.f);
}

template <int D>
constexpr int dq_smem() {
  return (2 * kRows + 4 * kBlock<D>) * (D + kPad32) * 4;  // Q, dO; K and V twice each
}

// 16 queries per warp; key blocks of kBlock<D> in order, so dQ's sums have one order: bit-reproducible.
template <int D, bool kSplit>
__global__ void __launch_bounds__(kThreads) dq_tf32_kernel(Params p) {
  constexpr int BC = kBlock<D>, P = D + kPad32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);  // (kRows, P)
  float* sdO = sQ + kRows * P;                     // (kRows, P)
  float* sK = sdO + kRows * P;                     // 2 x (BC, P)
  float* sV = sK + 2 * BC * P;                     // 2 x (BC, P)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows, bh = blockIdx.x, b = bh / p.H, h = bh % p.H, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const float* K = static_cast<const float*>(p.k) + in_off;
  const float* V = static_cast<const float*>(p.v) + in_off;
  const int nblocks = ((p.causal ? min(T, q0 + kRows) : T) + BC - 1) / BC;

  load_rows32<kRows, D>(sQ, static_cast<const float*>(p.q) + in_off, p.is.st, q0, T, tid);
  load_rows32<kRows, D>(sdO, static_cast<const float*>(p.dout) + out_off, p.os.st, q0, T, tid);
  load_rows32<BC, D>(sK, K, p.is.st, 0, T, tid);
  load_rows32<BC, D>(sV, V, p.is.st, 0, T, tid);
  cp_async_commit();

  const int wrow = warp * 16, w0 = q0 + wrow;
  float lse2[2], dl[2];  // rows g and g + 8
  load_row_stats(lse2, dl, p, bh, w0 + g, T);
  float dq[D / 8][4] = {};
  const float sl2 = p.scale * kLog2e;

  for (int j = 0; j < nblocks; j++) {
    const int buf = j & 1, k0 = j * BC;
    next_blocks<BC, D>(j + 1 < nblocks, sK + (buf ^ 1) * BC * P, K, p.is.st, sV + (buf ^ 1) * BC * P, V, p.is.st,
                       k0 + BC, T, tid);
    __syncthreads();
    const float* k_s = sK + buf * BC * P;
    const float* v_s = sV + buf * BC * P;

    if (!(p.causal && k0 > w0 + 15)) {
      float s[BC / 8][4] = {}, dp[BC / 8][4] = {};  // S = Q K^T, dP = dO V^T: 16 rows x BC keys
      rows_dot<kSplit, D>(s, sQ, wrow, k_s, lane);
      rows_dot<kSplit, D>(dp, sdO, wrow, v_s, lane);
      probs_ds_rows(s, dp, k0, w0 + g, c, T, p.causal, hides_any(w0, w0 + 16, k0, k0 + BC, T, p.causal), sl2, lse2,
                    dl);  // P, dS
      rows_product<kSplit>(dq, dp, k_s, P, g, c);  // dQ += dS K
    }
    __syncthreads();
  }

  store_tile_rows(dq, w0, g, c, T, static_cast<float*>(p.dq) + in_off, p.is.st, p.scale);
}

template <typename K>
void set_smem(K* kernel, int bytes) {
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Grids: B * H on x (y and z stop at 65535), the row tiles on y.
template <int D, bool kSplit>
void launch_forward(const Params& p, Stream stream) {
  constexpr int bytes = fwd_smem<D>();
  set_smem(forward_tf32_kernel<D, kSplit>, bytes);
  forward_tf32_kernel<D, kSplit><<<dim3(p.B * p.H, (p.T + kRows - 1) / kRows), kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <int D, bool kSplit>
void launch_backward(const Params& p, Stream stream) {
  const dim3 grid(p.B * p.H, (p.T + kRows - 1) / kRows);
  constexpr int kv_bytes = dkdv_smem<D>(), q_bytes = dq_smem<D>();
  set_smem(dkdv_tf32_kernel<D, kSplit>, kv_bytes);
  dkdv_tf32_kernel<D, kSplit><<<grid, kThreads, kv_bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
  set_smem(dq_tf32_kernel<D, kSplit>, q_bytes);
  dq_tf32_kernel<D, kSplit><<<grid, kThreads, q_bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <bool kSplit>
void forward_d(const Params& p, Stream stream) {
  if (p.d == 64)
    launch_forward<64, kSplit>(p, stream);
  else
    launch_forward<128, kSplit>(p, stream);
}

template <bool kSplit>
void backward_d(const Params& p, Stream stream) {
  if (p.d == 64)
    launch_backward<64, kSplit>(p, stream);
  else
    launch_backward<128, kSplit>(p, stream);
}

}  // namespace

void forward_tf32(const Params& p, bool split, Stream stream) {
  return split ? forward_d<true>(p, stream) : forward_d<false>(p, stream);
}

void backward_tf32(const Params& p, bool split, Stream stream) {
  return split ? backward_d<true>(p, stream) : backward_d<false>(p, stream);
}

int tf32_smem(int d) {
  return d == 64 ? std::max({fwd_smem<64>(), dkdv_smem<64>(), dq_smem<64>()})
                 : std::max({fwd_smem<128>(), dkdv_smem<128>(), dq_smem<128>()});
}

}  // namespace fastgpt::cuda::flash
