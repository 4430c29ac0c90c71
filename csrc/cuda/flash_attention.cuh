// Shared pieces of the flash attention kernels (flash_attention*.cu): the launch parameters, and the warp-level
// building blocks of the tensor-core path: cp.async tile loads (cuda/cp_async.cuh), ldmatrix, mma.sync m16n8k16 with
// fp32 accumulators.
// Fragment layouts follow the PTX ISA ("Matrix fragments for mma.m16n8k16"): in a warp, lane = 4 * g + c
// (g = lane / 4 the group, c = lane % 4); an fp32 accumulator tile 16 x 8 gives each lane rows g and g + 8,
// columns 2c and 2c + 1; an A tile 16 x 16 the same rows at columns 2c, 2c+1 and 2c+8, 2c+9; a B tile 16 x 8
// rows (k) 2c, 2c+1 and 2c+8, 2c+9 of column (n) g. The accumulator of two adjacent 8-wide tiles is therefore the A
// fragment of a 16-wide one, which is how P (and dS) go from one product into the next without touching memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "cuda/cp_async.cuh"
#include "cuda/fast_exp.cuh"
#include "cuda/ops.h"
#include "cuda/smem.cuh"  // sm_count

namespace fastgpt::cuda::flash {

constexpr float kLn2 = 0.6931471805599453f;

// The tile shapes of the tensor-core kernels at head dim 64 (d 128 has only option 0 of each, and the sm90 ones),
// kernel options numbered as flash_attention.cu's kKernelOptions names them (set_flash_tiles' choice counts from
// "auto", its option 0, which make_params resolves to kernel options before any launch): fwd rows per warp x keys per block; dkdv keys per warp x queries per
// step; dq (the deterministic backward's dq pass) queries per warp x keys per block; then each one's Hopper kernels
// ("sm90", the same per CTA).
// 32 rows per warp read each fragment of the other operand from shared memory once for two mma tiles. Every dkdv
// and dq option gives the same bits (the same sums in the same order; a warp skips only products that add zeros),
// and so do the mma.sync fwd options with the same key block.
using Tiles = FlashTiles;

struct Params {
  const void *q, *k, *v;  // (B, H, T, d) views with strides `is`
  void* out;               // strides `os`: written by forward, read by backward
  const void* dout;        // strides `os`
  void *dq, *dk, *dv;      // strides `is`
  float* lse;              // (B, H, T): written by forward, read by backward
  float* delta;            // (B, H, T) scratch: rowsum(dout * out), backward only
  float* dq_accum;         // (B, H, T, d) fp32 scratch for the atomic dq path, (B, H, ceil(T / 128) 128, d) for the
                           // fused sm90 backwards, else nullptr
  int* dq_turn;            // (B, H, ceil(T / 64)): the fused sm90 backward's turn counters, else nullptr
  int* next_tile;          // the persistent ws backward's tile counter (after dq_turn, zeroed with it), else nullptr
  float* kv_part;          // (B ceil(T / 128), 2, H, d) or nullptr: the ws backward's column sums of dK | dV per
                           // (b, key block), (h, column) (kv_sums: flash_attention.cu)
  HeadStrides is, os;
  int B, H, T, d;
  bool causal;
  float scale;  // 1 / sqrt(d)
  Tiles tiles;
};

// float32 on tensor cores (flash_attention_tf32.cu; sm_80 and newer, head dim 64 or 128, rows 16-byte aligned):
// TF32 products, three per product when `split` (fp32 accuracy) or one. The backward is the deterministic one's two
// passes.
void forward_tf32(const Params& p, bool split, Stream stream);
void backward_tf32(const Params& p, bool split, Stream stream);
// The most dynamic shared memory any of them takes at head dim d (64 or 128), in bytes: 102 KB at d 64, 132 KB at 128.
int tf32_smem(int d);
// The current device's most dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), in bytes:
// 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/sm_89 (A10, L4, RTX 30xx/40xx), 64 KB on sm_75; a kernel asking
// for more fails in cudaFuncSetAttribute (flash_attention.cu).
int smem_optin();
// Tensor-core launchers (one per file), instantiated for __nv_bfloat16 and __half; sm_80 and newer only.
template <typename E>
void forward_tc(const Params& p, Stream stream);
// backward_tc -> whether the warp-specialised Hopper backward ran (the one kernel that writes p.kv_part).
template <typename E>
bool backward_tc(const Params& p, bool deterministic, Stream stream);
// The Hopper kernels (flash_attention_sm90a.cu, flash_attention_ws_sm90a.cu, flash_attention_bwd_sm90a.cu;
// compiled for sm_90a only, where FASTGPT_SM90A is defined): the tile options from kFirstSm90 on (per kernel), on a
// device of compute capability 9.0; fwd options from kFirstWsSm90 on are the warp-specialised forward's
// (forward_ws_sm90, its `option` counted from there; forward_sm90 sends them on, and runs its own 128-row kernel, the
// same bits, where forward_ws_sm90 returns false: strides no TMA map can describe); dkdv_sm90 and dq_sm90 are the
// deterministic backward's two passes, backward_fused_sm90 (the dkdv option kFusedSm90) both in one, deterministic
// too; it needs dq_accum and dq_turn, as does backward_ws_sm90 (the dkdv options kWsFusedSm90 and kWsFused128Sm90,
// ws_fused_sm90: its warp-specialised form in steps of 64 or 128 queries, flash_attention_bwd_ws_sm90a.cu; head dim
// 64 only; false, nothing launched, where its TMA maps cannot be made: the caller then runs backward_fused_sm90;
// kWsFusedPersistentSm90 and kWsFused128PersistentSm90 are the same kernels with one CTA per SM taking tiles from a
// counter).
constexpr Tiles kFirstSm90{3, 2, 3};
constexpr int kFusedSm90 = 3, kWsFusedSm90 = 4, kWsFused128Sm90 = 5, kWsFusedPersistentSm90 = 6,
              kWsFused128PersistentSm90 = 7;
// Whether a dkdv option makes dq itself (any fused kernel): it needs dq_accum and dq_turn, and no dq pass.
constexpr bool fused_sm90(int dkdv) { return dkdv >= kFusedSm90 && dkdv <= kWsFused128PersistentSm90; }
constexpr bool ws_fused_sm90(int dkdv) { return dkdv >= kWsFusedSm90 && dkdv <= kWsFused128PersistentSm90; }
constexpr int kFirstWsSm90 = 6;
template <typename E>
void forward_sm90(const Params& p, Stream stream);
template <typename E>
bool forward_ws_sm90(const Params& p, Stream stream, int option);
template <typename E>
void dkdv_sm90(const Params& p, Stream stream);
template <typename E>
void dq_sm90(const Params& p, Stream stream);
template <typename E>
void backward_fused_sm90(const Params& p, Stream stream);
template <typename E>
bool backward_ws_sm90(const Params& p, Stream stream);
// The fused kernels' launch prologue: checks that their grid (B * H * ceil(T / 128) CTAs, one row) fits and zeroes
// the turn counters (one per 64 queries: enough for 128-query steps too) and the tile counter after them on
// `stream`; -> the number of CTAs (of tiles, for the persistent kernels).
// `option` names the choice in the error.
int start_fused_sm90(const Params& p, Stream stream, const char* option);
// The CUDA-core path (flash_attention.cu), for float, __nv_bfloat16 and __half: fp32 at any d <= 256, and 16-bit
// elements on GPUs without the tensor-core kernels (older than sm_80).
template <typename E>
void forward_simt(const Params& p, Stream stream);
template <typename E>
void backward_simt(const Params& p, Stream stream);
// delta = rowsum(dout * out) in fp32, for any element type (flash_attention.cu).
template <typename E>
void compute_delta(const Params& p, Stream stream);

// Whether score (query, key) enters the softmax: both inside [0, T) (tiles overhang T) and, if causal, key <= query.
__device__ __forceinline__ bool visible(int query, int key, int T, bool causal) {
  return query < T && key < T && !(causal && key > query);
}
// Whether a tile of queries [q0, q_end) x keys [k0, k_end) has a score that visible() hides. Where it has none the
// element loops skip the test (the forward's mask_scores, the backward's probs): per score it costs more integer
// instructions than the exponential, and most tiles hide nothing.
__device__ __forceinline__ bool hides_any(int q0, int q_end, int k0, int k_end, int T, bool causal) {
  return q_end > T || k_end > T || (causal && k_end - 1 > q0);
}

// ---- device helpers (tensor-core path)

template <typename E>
struct Pack;  // two fp32 values -> one 32-bit register of two 16-bit elements, the lower column in the low half
template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t two(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Pack<__half> {
  static __device__ __forceinline__ uint32_t two(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// The A fragment (16 x 16) of two adjacent accumulator tiles (16 x 8 each: columns 0-7 in lo, 8-15 in hi).
template <typename E>
__device__ __forceinline__ void a_from_acc(uint32_t* a, const float* lo, const float* hi) {
  a[0] = Pack<E>::two(lo[0], lo[1]);
  a[1] = Pack<E>::two(lo[2], lo[3]);
  a[2] = Pack<E>::two(hi[0], hi[1]);
  a[3] = Pack<E>::two(hi[2], hi[3]);
}

// ---- Steps the tensor-core kernels share on one warp's 16-row accumulator tile: rows g and g + 8, columns 2c and
// 2c + 1 of each 8-wide tile t (mma.sync's m16n8 accumulators and wgmma's per-warp rows are laid out alike).

// The masks below test a lane's score (t, e) by its column's offset off = t * 8 + (e & 1) from the lane's first
// column (2c): a constant once the loops unroll, so that each score costs one compare with a bound worked out per row
// (two for the backward's transposed tiles), not the index arithmetic and two or three compares of visible().
__device__ __forceinline__ int column_offset(int t, int e) { return t * 8 + (e & 1); }
// Queries on the rows (`row` and row + 8), keys key0 + offset on the columns (key0: the lane's first column's key):
// a row sees keys [0, min(T, row + 1)) (causal) or [0, T), so the offsets below a bound per row; with
// `hide_rows_past_t`, a row past T sees none.
struct SeenBelow {
  int below[2];
  __device__ __forceinline__ SeenBelow(int row, int key0, int T, bool causal, bool hide_rows_past_t)
      : below{bound(row, key0, T, causal, hide_rows_past_t), bound(row + 8, key0, T, causal, hide_rows_past_t)} {}
  static __device__ __forceinline__ int bound(int row, int key0, int T, bool causal, bool hide_rows_past_t) {
    if (hide_rows_past_t && row >= T) return 0;
    return (causal && row + 1 < T ? row + 1 : T) - key0;
  }
  __device__ __forceinline__ bool hides(int t, int e) const { return column_offset(t, e) >= below[e >> 1]; }
};

// Forward: -inf where a key is hidden from a query: keys past T and (causal) keys after the query. k0 is the
// block's first key, row0 the tile's first query. Callers skip it for blocks with no such key. Rows past T are left
// as they are (their output is never stored).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int k0, int row0, int g, int c, int T, bool causal) {
  const SeenBelow seen(row0 + g, k0 + 2 * c, T, causal, false);
#pragma unroll
  for (int t = 0; t < NT; t++)
#pragma unroll
    for (int e = 0; e < 4; e++)
      if (seen.hides(t, e)) s[t][e] = -INFINITY;
}

// Forward: the online softmax of one key block of raw scores s (masked: -inf), without O. Each row's values are
// spread over the 4 lanes of its group; m (log2 units: scores times sl2 = scale * log2 e) and l are the running max
// and this lane's share of the sum (the group's shares are added once at the end); s becomes P, and alpha the factor
// O must be rescaled by (before P V is added to it). The max is taken over raw scores (sl2 > 0) and each exponent is
// one FFMA, s sl2 - max, as FlashAttention's: not a multiply per score and then a subtraction.
template <int NT>
__device__ __forceinline__ void softmax_rows(float (&s)[NT][4], float sl2, float (&m)[2], float (&l)[2],
                                             float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    // The row's max as four partial maxima, then theirs pairwise: the value one chain gives (a max is exact, in any
    // order), its compares a chain of NT / 4 + 2 instead of NT + 1, on the way to every exponential (17 at BC 128,
    // the two rows' chains side by side, each compare waiting for the one before; now 6).
    constexpr int kWays = NT >= 4 ? 4 : NT >= 2 ? 2 : 1;
    float part[kWays];
#pragma unroll
    for (int w = 0; w < kWays; w++) part[w] = fmaxf(s[w][2 * r], s[w][2 * r + 1]);
#pragma unroll
    for (int t = kWays; t < NT; t++) part[t % kWays] = fmaxf(part[t % kWays], fmaxf(s[t][2 * r], s[t][2 * r + 1]));
#pragma unroll
    for (int w = kWays / 2; w > 0; w /= 2)
#pragma unroll
      for (int i = 0; i < w; i++) part[i] = fmaxf(part[i], part[i + w]);
    float mx = part[0];
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(m[r], mx * sl2);
    const float base = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet stays all zeros
    alpha[r] = fast_exp2(m[r] - base);
    m[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < NT; t++) {
      s[t][2 * r] = fast_exp2(fmaf(s[t][2 * r], sl2, -base));
      s[t][2 * r + 1] = fast_exp2(fmaf(s[t][2 * r + 1], sl2, -base));
      sum += s[t][2 * r] + s[t][2 * r + 1];
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// O's rows g and g + 8 times alpha[0] and alpha[1].
template <int ND>
__device__ __forceinline__ void rescale_rows(float (&o)[ND][4], const float (&alpha)[2]) {
#pragma unroll
  for (int t = 0; t < ND; t++) {
    o[t][0] *= alpha[0];
    o[t][1] *= alpha[0];
    o[t][2] *= alpha[1];
    o[t][3] *= alpha[1];
  }
}

// Forward: the online softmax of one key block, O rescaled at once (the kernels whose P V follows in order).
template <int NT, int ND>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float sl2, float (&o)[ND][4], float (&m)[2],
                                               float (&l)[2]) {
  float alpha[2];
  softmax_rows(s, sl2, m, l, alpha);
  rescale_rows(o, alpha);
}

// Two adjacent outputs (columns 2c, 2c + 1 of an accumulator tile) stored as E: one 32-bit store of a 16-bit pair,
// or a float2 (8 bytes).
template <typename E>
__device__ __forceinline__ void store_two(E* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = Pack<E>::two(lo, hi);
}
__device__ __forceinline__ void store_two(float* dst, float lo, float hi) {
  float2 v;
  v.x = lo, v.y = hi;
  *reinterpret_cast<float2*>(dst) = v;
}

// The end of a row's online softmax (this thread's m and l of row `row`, g or g + 8 of its tile): l summed over the
// row's four lanes, and (lane c == 0, a row before T) lse = ln(sum_j exp(s_j)) = (m + log2 l) * ln 2 into lse[row].
// -> the row's sum. The forwards' ends: store_rows, sm90::stage_rows.
__device__ __forceinline__ float finish_row(float m, float l, int row, int c, int T, float* lse) {
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (c == 0 && row < T) lse[row] = (m + log2f(l)) * kLn2;
  return l;
}

// Forward's end: O normalised into rows [row0, row0 + 16) of `out` (row stride st; rows past T dropped) and each
// row's lse into lse[row] (finish_row).
template <typename E, int ND>
__device__ __forceinline__ void store_rows(const float (&o)[ND][4], const float (&m)[2], const float (&l)[2],
                                           int row0, int g, int c, int T, E* out, int64_t st, float* lse) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = row0 + g + r * 8;
    const float tot = finish_row(m[r], l[r], row, c, T, lse);
    if (row >= T) continue;
    const float inv = 1.f / tot;
    E* orow = out + (int64_t)row * st;
#pragma unroll
    for (int t = 0; t < ND; t++)
      store_two(orow + t * 8 + 2 * c, o[t][2 * r] * inv, o[t][2 * r + 1] * inv);
  }
}

// Backward's end: one warp's 16 rows [row0, row0 + 16) of an accumulator (rows g and g + 8 of each 16 x 8 tile)
// times `scale` into dst (row stride st; rows past T dropped): dK, dV (scale 1: the same bits) and dQ.
template <typename E, int ND>
__device__ __forceinline__ void store_tile_rows(const float (&acc)[ND][4], int row0, int g, int c, int T, E* dst,
                                                int64_t st, float scale) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = row0 + g + r * 8;
    if (row >= T) continue;
#pragma unroll
    for (int t = 0; t < ND; t++)
      store_two(dst + (int64_t)row * st + t * 8 + 2 * c, acc[t][2 * r] * scale, acc[t][2 * r + 1] * scale);
  }
}

// Backward (dkdv): the lse (in log2 units) and delta of queries [q0, q0 + n) into shared memory, by threads 0..n-1;
// zeros past T.
__device__ __forceinline__ void stage_lse_delta(float* sL, float* sDl, const Params& p, int bh, int q0, int n,
                                                int tid) {
  if (tid < n) {
    const int q = q0 + tid;
    sL[tid] = q < p.T ? p.lse[(int64_t)bh * p.T + q] * kLog2e : 0.f;
    sDl[tid] = q < p.T ? p.delta[(int64_t)bh * p.T + q] : 0.f;
  }
}

// Backward (dq): the lse (in log2 units) and delta of rows `row` and row + 8 (a lane's two rows of its warp's 16);
// zeros past T.
__device__ __forceinline__ void load_row_stats(float (&lse2)[2], float (&dl)[2], const Params& p, int bh, int row,
                                               int T) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int q = row + r * 8;
    lse2[r] = q < T ? p.lse[(int64_t)bh * T + q] * kLog2e : 0.f;
    dl[r] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
  }
}

// Backward, on a lane's accumulators of 8N columns (columns t * 8 + 2c and + 1 of rows g and g + 8): the
// probabilities P = 2^(s sl2 - lse2(t, e)) in place of the scores, 0 where hidden(t, e) (the query does not see the
// key), which is asked only when `mask` (hides_any over the warp's tile: most tiles hide nothing). One FFMA and one
// EX2 per score otherwise.
template <int N, class Lse2, class Hidden>
__device__ __forceinline__ void probs(float (&s)[N][4], float sl2, bool mask, Lse2 lse2, Hidden hidden) {
  if (mask) {
#pragma unroll
    for (int t = 0; t < N; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[t][e] = hidden(t, e) ? 0.f : fast_exp2(fmaf(s[t][e], sl2, -lse2(t, e)));
  } else {
#pragma unroll
    for (int t = 0; t < N; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[t][e] = fast_exp2(fmaf(s[t][e], sl2, -lse2(t, e)));
  }
}

// Backward (dq), queries on the rows (a lane's `row` and row + 8, their lse in log2 units in lse2), keys k0 +
// column: probs. `mask`: hides_any over the warp's tile.
template <int N>
__device__ __forceinline__ void probs_rows(float (&s)[N][4], int k0, int row, int c, int T, bool causal, bool mask,
                                           float sl2, const float (&lse2)[2]) {
  const SeenBelow seen(row, k0 + 2 * c, T, causal, true);
  probs(s, sl2, mask, [&](int, int e) { return lse2[e >> 1]; }, [&](int t, int e) { return seen.hides(t, e); });
}

// Its transpose: keys on the rows (`key` and key + 8), queries q0c + offset on the columns (q0c: the lane's first
// column's query): the query sees the key iff it is below T and (causal) at or after the key, so the key keeps the
// offsets in [from, to): from = key - q0c (causal; else none below), to = T - q0c; a key past T keeps none.
struct SeenBy {
  int from[2], to;
  __device__ __forceinline__ SeenBy(int key, int q0c, int T, bool causal) : to(T - q0c) {
    for (int r = 0; r < 2; r++) {
      const int k = key + 8 * r;
      from[r] = k >= T ? to : causal ? k - q0c : INT_MIN;
    }
  }
  __device__ __forceinline__ bool hides(int t, int e) const {
    const int off = column_offset(t, e);
    return off < from[e >> 1] || off >= to;
  }
};

// Backward, on a warp's 16 rows x 8N columns of m16n8 accumulators (a lane holds rows `row` and row + 8, columns
// t * 8 + 2c and + 1): P (probs) in place of S, and dS = P (dP - delta) in place of dP. Queries on the rows (dq: keys
// k0 + column), or keys (dkdv: queries q0 + column, their lse and delta staged in shared memory by stage_lse_delta).
// `mask`: hides_any over the warp's tile. The Hopper kernels split the two halves around their wgmma waits (the dq
// pass's P by probs_rows).
template <int N>
__device__ __forceinline__ void probs_ds_rows(float (&s)[N][4], float (&dp)[N][4], int k0, int row, int c, int T,
                                              bool causal, bool mask, float sl2, const float (&lse2)[2],
                                              const float (&dl)[2]) {
  probs_rows(s, k0, row, c, T, causal, mask, sl2, lse2);
#pragma unroll
  for (int t = 0; t < N; t++)
#pragma unroll
    for (int e = 0; e < 4; e++) dp[t][e] = s[t][e] * (dp[t][e] - dl[e >> 1]);
}
template <int N>
__device__ __forceinline__ void probs_ds_cols(float (&st)[N][4], float (&dpt)[N][4], int q0, int row, int c, int T,
                                              bool causal, bool mask, float sl2, const float* sL, const float* sDl) {
  const SeenBy seen(row, q0 + 2 * c, T, causal);
  probs(st, sl2, mask, [&](int t, int e) { return sL[t * 8 + 2 * c + (e & 1)]; },
        [&](int t, int e) { return seen.hides(t, e); });
#pragma unroll
  for (int t = 0; t < N; t++)
#pragma unroll
    for (int e = 0; e < 4; e++) dpt[t][e] = st[t][e] * (dpt[t][e] - sDl[t * 8 + 2 * c + (e & 1)]);
}

// c (16 x 8, fp32) += a (16 x 16) * b (16 x 8).
// (mma.sync m16n8k16 and cp.async are sm_80 instructions. A build for older GPUs (sm_75) compiles these kernels with
// a trap in their place (FASTGPT_SM80_ASM, cuda/cp_async.cuh); the dispatch in flash_attention.cu never launches them
// there.)
template <typename E>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float* c, const uint32_t* a, const uint32_t* b) {
  FASTGPT_SM80_ASM(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma<__half>(float* c, const uint32_t* a, const uint32_t* b) {
  FASTGPT_SM80_ASM(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// TF32 (sm_80): x rounded to TF32 (10 mantissa bits, to nearest, ties away from zero: cvt.rna), as the 32-bit
// pattern mma.sync's .tf32 operands take; and such a pattern (or any float's) as a float.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r = 0;
  FASTGPT_SM80_ASM("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float as_float(uint32_t bits) { return __uint_as_float(bits); }
// c (16 x 8, fp32) += a (16 x 8, TF32) * b (8 x 8, TF32). Fragments (PTX ISA, "mma.m16n8k8", .tf32): a0 (g, c),
// a1 (g + 8, c), a2 (g, c + 4), a3 (g + 8, c + 4); b0 (k c, n g), b1 (k c + 4, n g); c as m16n8k16's.
__device__ __forceinline__ void mma_tf32(float* c, const uint32_t* a, const uint32_t* b) {
  FASTGPT_SM80_ASM(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 tiles of 16-bit elements; lanes 8i..8i+7 give the row addresses of tile i, register i receives it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// The same, each tile transposed: lane g*4+c receives elements (2c, g) and (2c+1, g) of the stored tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Rows [row0, row0 + ROWS) of one (b, h) slice of a view with row stride st (elements), D wide, into shared memory
// with row pitch D + kPad, by all NT threads; rows at or past T become zeros.
constexpr int kPad = 8;  // 16 bytes: consecutive rows start 4 banks apart, so ldmatrix's 8 rows hit 32 banks
template <typename E, int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(E* dst, const E* src, int64_t st, int row0, int T, int tid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = tid; i < ROWS * kChunks; i += NT) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = row0 + r < T;
    const E* s = valid ? src + (int64_t)(row0 + r) * st + c * 8 : src;
    cp_async16(dst + r * (D + kPad) + c * 8, s, valid);
  }
}

}  // namespace fastgpt::cuda::flash
