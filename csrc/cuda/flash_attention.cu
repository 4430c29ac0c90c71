// Flash attention on the GPU: the entry points (dispatch by dtype, head dim and GPU, scratch for backward), delta,
// and the path on CUDA cores ("simt") that serves fp32 at any head dim up to 256 (at d 64 and 128 on sm_80+, fp32
// runs on TF32 tensor cores unless F32Math::simt is asked for: flash_attention_tf32.cu). The
// bf16/fp16 tensor-core kernels are in flash_attention_fwd.cu and flash_attention_bwd.cu; they need sm_80
// (mma.sync m16n8k16, cp.async), so on older GPUs (T4: sm_75) bf16/fp16 take the simt path too, which reads and
// writes 16-bit elements and computes in fp32.
// simt path: a warp owns 4 rows (forward and dq) or 4 keys (dk/dv) and its lanes run along the other side of the
// score tile (32 keys or 32 queries), so each score is one lane's dot product over d from shared memory, 4 columns
// per load (rows zero-padded to d4, a multiple of 4; the lanes' rows with a pitch that lets 8 lanes' 16-byte reads
// cover all 32 banks), the softmax statistics are warp reductions, and products with V, K, Q or dO broadcast one
// lane's probability at a time (shuffles) while lanes own the NC chunks of 32 columns that d has (a template
// argument: 2, 4 or 8 for d up to 64, 128, 256). Every sum runs in a fixed order (the padding adds exact zeros) and
// nothing uses atomics: the fp32 path is deterministic.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"
#include "cuda/scratch.h"
#include "cuda/storage.cuh"  // Pack, load_pack, aligned16: the delta pass's 16-byte loads
#include "cuda/warp.cuh"

namespace fastgpt::cuda {

namespace flash {

namespace {

constexpr int kThreads = 128, kRows = 4;  // 4 warps; rows (or keys) per warp: 16 per CTA
constexpr int kTile = 32;                 // the lanes' side of a score tile

// The simt kernels' shared-memory row widths for head dim d: d4 (d rounded up to 4: the rows read as broadcasts)
// and `lanes` (the lanes' rows): 16-byte aligned and an odd multiple of 4 words, so the 8 lanes of a 16-byte read
// phase start in 8 different groups of 4 banks (d4 + 4 when d4 is a multiple of 8, else d4 itself).
struct SimtPitch {
  int d4, lanes;
  __host__ __device__ explicit SimtPitch(int d) : d4((d + 3) & ~3), lanes(d4 % 8 ? d4 : d4 + 4) {}
};

// rows [row0, row0 + n) of a (b, h) slice with row stride st into dst (n, pitch) as fp32, `width` >= d columns:
// zeros past T and in columns [d, width).
template <typename E>
__device__ void load_rows(float* dst, int pitch, const E* src, int64_t st, int row0, int n, int T, int d, int width) {
  for (int i = threadIdx.x; i < n * width; i += blockDim.x) {
    const int r = i / width, x = i % width;
    dst[r * pitch + x] = row0 + r < T && x < d ? float(src[(int64_t)(row0 + r) * st + x]) : 0.f;
  }
}

// dots[r] = A[warp's row r] . B[row lane], over d4 columns (zero-padded past d), 4 at a time: the warp's rows of A
// (pitch pa) are read as broadcasts, B's rows (pitch pb) one per lane. The sums run over x in order, one
// multiply-add each (fused by nvcc), as one column at a time would.
__device__ __forceinline__ void rows_dot_lanes(float (&dots)[kRows], const float* A, int pa, const float* B, int pb,
                                               int d4, int warp, int lane) {
#pragma unroll
  for (int r = 0; r < kRows; r++) dots[r] = 0.f;
  for (int x = 0; x < d4; x += 4) {
    const float4 b = *reinterpret_cast<const float4*>(B + lane * pb + x);
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      const float4 a = *reinterpret_cast<const float4*>(A + (warp * kRows + r) * pa + x);
      dots[r] += a.x * b.x;
      dots[r] += a.y * b.y;
      dots[r] += a.z * b.z;
      dots[r] += a.w * b.w;
    }
  }
}

// acc[r][i] += sum_j w[r] of lane j * X[j][lane + 32 i], over the tile's kTile rows of X (pitch px): each lane's
// weight is broadcast in turn while every lane owns the NC column chunks (those past d stay zero).
template <int NC>
__device__ __forceinline__ void accumulate_lanes(float (&acc)[kRows][NC], const float (&w)[kRows], const float* X,
                                                 int px, int d, int lane) {
  for (int j = 0; j < kTile; j++) {
    float x[NC];
#pragma unroll
    for (int i = 0; i < NC; i++) x[i] = lane + 32 * i < d ? X[j * px + lane + 32 * i] : 0.f;
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      const float wj = __shfl_sync(0xffffffffu, w[r], j);
#pragma unroll
      for (int i = 0; i < NC; i++) acc[r][i] += wj * x[i];
    }
  }
}

// One row of d values owned as lane + 32 i, times `scale`, to dst (rounded to E once, at the end).
template <typename E, int NC>
__device__ __forceinline__ void store_row(E* dst, const float (&v)[NC], float scale, int d, int lane) {
#pragma unroll
  for (int i = 0; i < NC; i++)
    if (lane + 32 * i < d) dst[lane + 32 * i] = E(v[i] * scale);
}

template <typename E, int NC>
__global__ void __launch_bounds__(kThreads) forward_simt_kernel(Params p) {
  extern __shared__ float sm[];
  const int d = p.d, T = p.T;
  const SimtPitch pt(d);
  float* sQ = sm;                   // (16, d4)
  float* sK = sQ + 16 * pt.d4;      // (32, lanes)
  float* sV = sK + kTile * pt.lanes;  // (32, d)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * 16, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const E *Q = static_cast<const E*>(p.q) + in_off, *K = static_cast<const E*>(p.k) + in_off,
          *V = static_cast<const E*>(p.v) + in_off;
  load_rows(sQ, pt.d4, Q, p.is.st, q0, 16, T, d, pt.d4);

  float o[kRows][NC] = {}, m[kRows], l[kRows];
  for (int r = 0; r < kRows; r++) m[r] = -INFINITY, l[r] = 0.f;
  const int kv_end = p.causal ? min(T, q0 + 16) : T;
  for (int k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    load_rows(sK, pt.lanes, K, p.is.st, k0, kTile, T, d, pt.d4);
    load_rows(sV, d, V, p.is.st, k0, kTile, T, d, d);
    __syncthreads();
    float s[kRows], pe[kRows];
    rows_dot_lanes(s, sQ, pt.d4, sK, pt.lanes, pt.d4, warp, lane);
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      const float sr = visible(q0 + warp * kRows + r, k0 + lane, T, p.causal) ? s[r] * p.scale : -INFINITY;
      const float mn = fmaxf(m[r], warp_max(sr));
      const float base = mn == -INFINITY ? 0.f : mn;
      pe[r] = expf(sr - base);
      const float alpha = expf(m[r] - base);
      l[r] = l[r] * alpha + warp_sum(pe[r]);
      m[r] = mn;
#pragma unroll
      for (int i = 0; i < NC; i++) o[r][i] *= alpha;
    }
    accumulate_lanes(o, pe, sV, d, d, lane);
  }
  E* O = static_cast<E*>(p.out) + b * p.os.sb + h * p.os.sh;
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int row = q0 + warp * kRows + r;
    if (row >= T) continue;
    store_row(O + (int64_t)row * p.os.st, o[r], 1.f / l[r], d, lane);
    if (lane == 0) p.lse[(int64_t)bh * T + row] = m[r] + logf(l[r]);
  }
}

// dK, dV for 16 keys per CTA, over the query tiles that can see them: lanes run along the queries.
template <typename E, int NC>
__global__ void __launch_bounds__(kThreads) dkdv_simt_kernel(Params p) {
  extern __shared__ float sm[];
  const int d = p.d, T = p.T;
  const SimtPitch pt(d);
  const int dp = pt.lanes;
  float* sK = sm;                // (16, d4)
  float* sV = sK + 16 * pt.d4;   // (16, d4)
  float* sQ = sV + 16 * pt.d4;   // (32, lanes)
  float* sdO = sQ + kTile * dp;  // (32, lanes)
  float* sL = sdO + kTile * dp;  // (32)
  float* sDl = sL + kTile;       // (32)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k0 = blockIdx.y * 16, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E *Q = static_cast<const E*>(p.q) + in_off, *dO = static_cast<const E*>(p.dout) + out_off;
  load_rows(sK, pt.d4, static_cast<const E*>(p.k) + in_off, p.is.st, k0, 16, T, d, pt.d4);
  load_rows(sV, pt.d4, static_cast<const E*>(p.v) + in_off, p.is.st, k0, 16, T, d, pt.d4);

  float dk[kRows][NC] = {}, dv[kRows][NC] = {};
  for (int qt = p.causal ? k0 / kTile * kTile : 0; qt < T; qt += kTile) {
    __syncthreads();
    load_rows(sQ, dp, Q, p.is.st, qt, kTile, T, d, pt.d4);
    load_rows(sdO, dp, dO, p.os.st, qt, kTile, T, d, pt.d4);
    if (threadIdx.x < kTile) {
      const int q = qt + threadIdx.x;
      sL[threadIdx.x] = q < T ? p.lse[(int64_t)bh * T + q] : 0.f;
      sDl[threadIdx.x] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
    }
    __syncthreads();
    float s[kRows], dpv[kRows], pr[kRows], ds[kRows];  // S^T, dP^T, P^T, dS^T: this warp's keys x the lanes' queries
    rows_dot_lanes(s, sK, pt.d4, sQ, dp, pt.d4, warp, lane);
    rows_dot_lanes(dpv, sV, pt.d4, sdO, dp, pt.d4, warp, lane);
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      pr[r] = visible(qt + lane, k0 + warp * kRows + r, T, p.causal) ? expf(s[r] * p.scale - sL[lane]) : 0.f;
      ds[r] = pr[r] * (dpv[r] - sDl[lane]);
    }
    accumulate_lanes(dv, pr, sdO, dp, d, lane);
    accumulate_lanes(dk, ds, sQ, dp, d, lane);
  }
  E *dK = static_cast<E*>(p.dk) + in_off, *dV = static_cast<E*>(p.dv) + in_off;
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int key = k0 + warp * kRows + r;
    if (key >= T) continue;
    store_row(dK + (int64_t)key * p.is.st, dk[r], p.scale, d, lane);
    store_row(dV + (int64_t)key * p.is.st, dv[r], 1.f, d, lane);
  }
}

// dQ for 16 queries per CTA, over the key tiles they see: lanes run along the keys.
template <typename E, int NC>
__global__ void __launch_bounds__(kThreads) dq_simt_kernel(Params p) {
  extern __shared__ float sm[];
  const int d = p.d, T = p.T;
  const SimtPitch pt(d);
  const int dp = pt.lanes;
  float* sQ = sm;                // (16, d4)
  float* sdO = sQ + 16 * pt.d4;  // (16, d4)
  float* sK = sdO + 16 * pt.d4;  // (32, lanes)
  float* sV = sK + kTile * dp;   // (32, lanes)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * 16, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const E *K = static_cast<const E*>(p.k) + in_off, *V = static_cast<const E*>(p.v) + in_off;
  load_rows(sQ, pt.d4, static_cast<const E*>(p.q) + in_off, p.is.st, q0, 16, T, d, pt.d4);
  load_rows(sdO, pt.d4, static_cast<const E*>(p.dout) + out_off, p.os.st, q0, 16, T, d, pt.d4);
  float lse[kRows], dl[kRows];
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int q = q0 + warp * kRows + r;
    lse[r] = q < T ? p.lse[(int64_t)bh * T + q] : 0.f;
    dl[r] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
  }
  float dq[kRows][NC] = {};
  const int kv_end = p.causal ? min(T, q0 + 16) : T;
  for (int k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();
    load_rows(sK, dp, K, p.is.st, k0, kTile, T, d, pt.d4);
    load_rows(sV, dp, V, p.is.st, k0, kTile, T, d, pt.d4);
    __syncthreads();
    float s[kRows], dpv[kRows], ds[kRows];
    rows_dot_lanes(s, sQ, pt.d4, sK, dp, pt.d4, warp, lane);
    rows_dot_lanes(dpv, sdO, pt.d4, sV, dp, pt.d4, warp, lane);
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      const float pr = visible(q0 + warp * kRows + r, k0 + lane, T, p.causal) ? expf(s[r] * p.scale - lse[r]) : 0.f;
      ds[r] = pr * (dpv[r] - dl[r]);
    }
    accumulate_lanes(dq, ds, sK, dp, d, lane);
  }
  E* dQ = static_cast<E*>(p.dq) + in_off;
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int q = q0 + warp * kRows + r;
    if (q < T) store_row(dQ + (int64_t)q * p.is.st, dq[r], p.scale, d, lane);
  }
}

// delta_i = dO_i . O_i for every row i = (b, h, t): the backward's first pass (FlashAttention-2's preprocessing),
// memory-bound (it reads out and dout once: 2 B T H d elements). A row's d elements are 16-byte packs (8 bf16/fp16
// or 4 floats) spread over the row's `lanes` lanes (a power of two, at most 32; blockDim.x / lanes rows per block,
// rows counted across heads), each lane summing its packs k = lane, lane + lanes, ... in order, then the row's lanes
// joined by butterfly. Where some row would not start 16-byte aligned (out, dout or a stride that is used), or d is
// not whole packs, the call loads one element at a time into the same packs: the same sums in the same order, so the
// same bits. A row's (b, h, t) takes two 32-bit divisions: the old one-warp-per-row kernel took four 64-bit ones per
// row and lane and 2-byte loads, and ran at about 1 TB/s on the H200 (2.3-2.5 ms of a GPT-2 124M step at B 64: the
// 2026-11-26 profile's attention remainder).
template <typename E>
__global__ void delta_kernel(Params p, int lanes, uint32_t rows, bool vec) {
  constexpr int N = cuda::Pack<E>::N;  // storage.cuh's 16 bytes (flash::Pack packs two values)
  const int g = threadIdx.x % lanes, packs = (p.d + N - 1) / N;
  const uint32_t per_block = blockDim.x / lanes, T = p.T, H = p.H;
  for (uint64_t r0 = (uint64_t)blockIdx.x * per_block; r0 < rows; r0 += (uint64_t)gridDim.x * per_block) {
    const uint64_t r = r0 + threadIdx.x / lanes;
    const uint32_t row = r < rows ? (uint32_t)r : rows;  // rows < 2^32 (compute_delta): 32-bit divisions below
    float s = 0.f;
    if (row < rows) {
      const uint32_t bh = row / T, t = row - bh * T, b = bh / H, h = bh - b * H;
      const int64_t off = (int64_t)b * p.os.sb + (int64_t)h * p.os.sh + (int64_t)t * p.os.st;
      const E *o = static_cast<const E*>(p.out) + off, *dO = static_cast<const E*>(p.dout) + off;
      for (int k = g; k < packs; k += lanes) {
        const int x0 = k * N, n = min(N, p.d - x0);
        cuda::Pack<E> a, c;
        if (vec) {
          a = load_pack(o + x0), c = load_pack(dO + x0);
        } else {  // (PackIO would read a whole pack: the last one of a row may be part-full)
#pragma unroll
          for (int e = 0; e < N; e++)  // unrolled: registers, not a local array
            if (e < n) a.v[e] = o[x0 + e], c.v[e] = dO[x0 + e];
        }
#pragma unroll
        for (int e = 0; e < N; e++)
          if (e < n) s += float(a.v[e]) * float(c.v[e]);
      }
    }
    for (int m = lanes / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);  // every lane: full mask
    if (row < rows && g == 0) p.delta[row] = s;
  }
}

void set_smem(const void* kernel, int bytes) {
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <typename E, int NC>
void forward_simt_nc(const Params& p, Stream stream) {
  const SimtPitch pt(p.d);
  const int bytes = (16 * pt.d4 + kTile * pt.lanes + kTile * p.d) * sizeof(float);
  set_smem((const void*)forward_simt_kernel<E, NC>, bytes);
  forward_simt_kernel<E, NC><<<dim3(p.B * p.H, (p.T + 15) / 16), kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename E, int NC>
void backward_simt_nc(const Params& p, Stream stream) {
  const SimtPitch pt(p.d);
  const int kv_bytes = (32 * pt.d4 + 2 * kTile * pt.lanes + 2 * kTile) * sizeof(float);
  set_smem((const void*)dkdv_simt_kernel<E, NC>, kv_bytes);
  dkdv_simt_kernel<E, NC><<<dim3(p.B * p.H, (p.T + 15) / 16), kThreads, kv_bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
  const int q_bytes = (32 * pt.d4 + 2 * kTile * pt.lanes) * sizeof(float);
  set_smem((const void*)dq_simt_kernel<E, NC>, q_bytes);
  dq_simt_kernel<E, NC><<<dim3(p.B * p.H, (p.T + 15) / 16), kThreads, q_bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

// NC, the 32-column chunks a lane owns: the fewest of 2, 4, 8 that cover d (the check allows d <= 256).
template <typename E>
void forward_simt(const Params& p, Stream stream) {
  if (p.d <= 64) return forward_simt_nc<E, 2>(p, stream);
  if (p.d <= 128) return forward_simt_nc<E, 4>(p, stream);
  forward_simt_nc<E, 8>(p, stream);
}

template <typename E>
void backward_simt(const Params& p, Stream stream) {
  if (p.d <= 64) return backward_simt_nc<E, 2>(p, stream);
  if (p.d <= 128) return backward_simt_nc<E, 4>(p, stream);
  backward_simt_nc<E, 8>(p, stream);
}

int smem_optin() {
  int device = 0, bytes = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

template <typename E>
void compute_delta(const Params& p, Stream stream) {
  constexpr int N = cuda::Pack<E>::N, kThreads = 256;
  const int packs = (p.d + N - 1) / N;
  int lanes = 1;
  while (lanes < packs && lanes < 32) lanes *= 2;
  const int64_t rows = (int64_t)p.B * p.H * p.T, per_block = kThreads / lanes;
  if (rows == 0) return;  // (a zero-block launch is an error)
  if (rows >= UINT32_MAX)  // ~4e9 rows: hundreds of GB at any d, so never in practice
    throw std::invalid_argument("flash attention backward: B * H * T = " + std::to_string(rows) +
                                " rows, more than it counts (2^32)");
  const bool vec = p.d % N == 0 && (p.B == 1 || p.os.sb % N == 0) && (p.H == 1 || p.os.sh % N == 0) &&
                   (p.T == 1 || p.os.st % N == 0) && aligned16(p.out) && aligned16(p.dout);  // unused strides: any
  // At most 64 blocks per SM (8-11 waves: 32-40 registers leave room for 6-8 resident blocks of 256; each thread's
  // 32 bytes in flight are then 48-64 KB an SM, more than the memory's latency needs); past that the blocks loop.
  const unsigned grid = (unsigned)std::min<int64_t>((rows + per_block - 1) / per_block, 64 * (int64_t)sm_count());
  delta_kernel<E><<<grid, kThreads, 0, stream>>>(p, lanes, (uint32_t)rows, vec);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace flash

namespace {

// The tile choice (set_flash_tiles): read by every call, set by benchmarks between calls. It holds option indices
// of kTileOptions, where 0 is "auto" and k > 0 names kernel option k - 1 (flash::Tiles, kKernelOptions' order).
std::atomic<int> g_fwd_tiles{0}, g_dkdv_tiles{0}, g_dq_tiles{0};
const FlashTileOptions kKernelOptions{{"16x64", "32x64", "16x128", "sm90 128x128", "sm90 192x128", "sm90 128x64",
                                       "sm90 ws 128x128", "sm90 ws 192x128", "sm90 ws 128x128 persistent",
                                       "sm90 ws 192x128 persistent"},
                                      {"16x64", "32x32", "sm90 128x64", "sm90 fused", "sm90 ws fused",
                                       "sm90 ws fused 128x128", "sm90 ws fused persistent",
                                       "sm90 ws fused 128x128 persistent"},
                                      {"16x64", "32x64", "32x32", "sm90 128x64"}};
static_assert(flash::kFirstSm90.fwd == 3 && flash::kFirstSm90.dkdv == 2 && flash::kFirstSm90.dq == 3,
              "kKernelOptions: the sm90 options start at kFirstSm90");
static_assert(flash::kFusedSm90 == 3 && flash::kWsFusedSm90 == 4 && flash::kWsFused128Sm90 == 5 &&
                  flash::kWsFusedPersistentSm90 == 6 && flash::kWsFused128PersistentSm90 == 7,
              "kKernelOptions: dkdv's 'sm90 fused' is kFusedSm90, 'sm90 ws fused' kWsFusedSm90, "
              "'sm90 ws fused 128x128' kWsFused128Sm90, then the two persistent");
static_assert(flash::kFirstWsSm90 == 6, "kKernelOptions: the fwd 'sm90 ws' options start at kFirstWsSm90");
const FlashTileOptions kTileOptions = [] {
  FlashTileOptions o = kKernelOptions;
  for (auto* names : {&o.fwd, &o.dkdv, &o.dq}) names->insert(names->begin(), "auto");
  return o;
}();
// What "auto" runs on an H100/H200 (bf16/fp16 with sm_90a code), the fastest in the 2026-11-26 H200 runs
// (BENCHMARKS.md): GPT-2's d 64, T 1024 causal at 269 TFLOP/s forward and 256 backward, against 194 and 136 for
// the mma.sync kernels (16x64, deterministic), and its B 64 training step 1.08x torch.compile's where 16x64 gave
// 0.96x. Forward "sm90 ws 128x128 persistent"; backward at d 64 "sm90 ws fused 128x128 persistent" (dq made in the
// same kernel, for either backward), at d 128, where the warp-specialised backward does not run, "sm90 128x64" for
// both passes of the deterministic backward (170-228 TFLOP/s against 131-150 for "sm90 fused") and "sm90 fused" for
// the atomic one (which takes no two-pass choice: the mma.sync atomic kernels gave 94-116). Elsewhere "auto" is the
// mma.sync 16x64 kernels, kernel option 0. A dq left at "auto" beside a chosen dkdv is 16x64 at d 64.
constexpr int kAutoFwdSm90 = flash::kFirstWsSm90 + 2, kAutoDkdvSm90 = flash::kWsFused128PersistentSm90,
              kAutoAtomic128 = flash::kFusedSm90;
static_assert(kAutoFwdSm90 == 8, "kKernelOptions: fwd 'sm90 ws 128x128 persistent' is kAutoFwdSm90");

// The kernel options a choice (public indices) names; "auto" (0) stays -1.
flash::Tiles named(const FlashTiles& t) { return {t.fwd - 1, t.dkdv - 1, t.dq - 1}; }

// Whether a choice of kernel options names a Hopper kernel, per kernel.
bool any_sm90(const flash::Tiles& t) {
  return t.fwd >= flash::kFirstSm90.fwd || t.dkdv >= flash::kFirstSm90.dkdv || t.dq >= flash::kFirstSm90.dq;
}

// Everything the kernels assume, checked before any launch (the binding relies on these for GPU arrays).
// The tensor-core kernels need sm_80 (mma.sync m16n8k16, cp.async); the current device decides, per call, because
// ops run on whatever device their tensors live on.
bool tensor_cores() {
  int device = 0, major = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 8;
}

// Whether the current device runs flash_attention_sm90a.cu's kernels: compute capability exactly 9.0 (sm_90a code
// runs nowhere else) and a build that compiled them. False, not an error, without a device.
bool sm90_kernels() {
#ifdef FASTGPT_SM90A
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // leave no sticky error for the next check
    return false;
  }
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// Whether float32 attention runs on the TF32 tensor-core kernels (flash_attention_tf32.cu): asked for, and their
// layout holds (head dim 64 or 128, rows 16-byte aligned: strides multiples of 4 floats, aligned base pointers), on a
// GPU whose shared memory takes all of them (forward and backward alike, so that both use the same products): not
// sm_86/sm_89 (99 KB per block), which take the simt kernels.
bool tf32_kernels(F32Math f32, const AttentionShape& s, const HeadStrides& is, const HeadStrides& os,
                  std::initializer_list<const void*> ptrs) {
  if (f32 == F32Math::simt || (s.d != 64 && s.d != 128)) return false;
  for (const HeadStrides& st : {is, os})
    if (st.sb % 4 != 0 || st.sh % 4 != 0 || st.st % 4 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return tensor_cores() && flash::tf32_smem(s.d) <= flash::smem_optin();
}

// deterministic: the backward's (forward: any), which "auto" at d 128 chooses by.
flash::Params make_params(const HeadStrides& is, const HeadStrides& os, const AttentionShape& s, bool tc,
                          bool deterministic = true) {
  flash::Params p{};
  p.is = is;
  p.os = os;
  p.B = s.B, p.H = s.H, p.T = s.T, p.d = s.d;
  p.causal = s.causal;
  p.scale = 1.f / std::sqrt((float)s.d);
  p.tiles = named(flash_tiles());
  flash::Tiles& t = p.tiles;
  if (!(any_sm90(t) || t.fwd < 0 || t.dkdv < 0 || t.dq < 0)) return p;  // mma.sync options: no device to ask
  if (tc && sm90_kernels()) {  // "auto": the Hopper kernels above
    if (t.fwd < 0) t.fwd = kAutoFwdSm90;
    if (t.dkdv < 0) t.dkdv = s.d == 64 ? kAutoDkdvSm90 : deterministic ? flash::kFirstSm90.dkdv : kAutoAtomic128;
    if (t.dq < 0) t.dq = s.d == 64 ? 0 : flash::kFirstSm90.dq;  // (unused where dkdv makes dq)
  } else {  // another device of the process, fp32, no sm_90a code: "auto" and the sm90 options run mma.sync 16x64
    if (t.fwd < 0 || t.fwd >= flash::kFirstSm90.fwd) t.fwd = 0;
    if (t.dkdv < 0 || t.dkdv >= flash::kFirstSm90.dkdv) t.dkdv = 0;
    if (t.dq < 0 || t.dq >= flash::kFirstSm90.dq) t.dq = 0;
  }
  return p;
}

// tc: the bf16/fp16 tensor-core kernels run; otherwise the simt kernels (any dtype).
void check_args(const AttentionShape& s, DType dtype, bool tc, const HeadStrides& is, const HeadStrides& os,
                std::initializer_list<std::pair<const void*, const char*>> tensors) {
  const auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  const std::string d = std::to_string(s.d);
  if (!tc) {
    need(s.d <= 256, std::string(dtype == DType::f32 ? "float32" : "bfloat16/float16 (on a GPU older than sm_80)") +
                         " attention on a GPU needs head dim d <= 256, got " + d);
  } else {
    need(s.d == 64 || s.d == 128, "bfloat16/float16 attention on a GPU needs head dim d 64 or 128, got " + d +
                                      " (float32 takes any d <= 256)");
    for (const HeadStrides& st : {is, os})
      need(st.sb % 8 == 0 && st.sh % 8 == 0 && st.st % 8 == 0, "bfloat16/float16 attention needs strides that are "
                                                                "multiples of 8 elements");
    for (auto [ptr, name] : tensors)
      need(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, std::string(name) + " must be 16-byte aligned");
  }
  const int64_t max_t = 65535LL * (tc ? 64 : 16);  // the grid's y dimension, in tiles of 64 or 16 rows
  need((int64_t)s.T <= max_t, "attention on a GPU takes T <= " + std::to_string(max_t) + " here (" +
                                  (tc ? "tensor cores" : "CUDA cores") + "), got " + std::to_string(s.T));
}

}  // namespace

FlashTiles flash_tiles() { return {g_fwd_tiles.load(), g_dkdv_tiles.load(), g_dq_tiles.load()}; }

FlashTileOptions flash_tile_options() { return kTileOptions; }

FlashTiles set_flash_tiles(const FlashTiles& tiles) {
  const auto need = [](int option, const std::vector<std::string>& names, const char* kernel) {
    if (option < 0 || option >= (int)names.size())
      throw std::invalid_argument(std::string("flash attention tiles: ") + kernel + " takes an option in [0, " +
                                  std::to_string(names.size()) + "), got " + std::to_string(option));
  };
  need(tiles.fwd, kTileOptions.fwd, "fwd");
  need(tiles.dkdv, kTileOptions.dkdv, "dkdv");
  need(tiles.dq, kTileOptions.dq, "dq");
  const flash::Tiles kernels = named(tiles);
  if (any_sm90(kernels) && !sm90_kernels()) {  // ("auto" is taken anywhere)
    const bool f = kernels.fwd >= flash::kFirstSm90.fwd, k = kernels.dkdv >= flash::kFirstSm90.dkdv;
    const std::string which = f ? "fwd option '" + kTileOptions.fwd[tiles.fwd]
                              : k ? "dkdv option '" + kTileOptions.dkdv[tiles.dkdv]
                                  : "dq option '" + kTileOptions.dq[tiles.dq];
    throw std::invalid_argument("flash attention tiles: " + which +
                                "' needs a GPU of compute capability 9.0 (H100/H200) and a build with sm_90a code "
#ifdef FASTGPT_SM90A
                                "(this build has it; the current CUDA device, if any, is not one)"
#else
                                "(this build has none: build for architecture 90 with nvcc 12 or newer)"
#endif
    );
  }
  const FlashTiles before = flash_tiles();
  g_fwd_tiles = tiles.fwd, g_dkdv_tiles = tiles.dkdv, g_dq_tiles = tiles.dq;
  return before;
}

void flash_attention_forward(void* out, const HeadStrides& os, float* lse, const void* q, const void* k,
                             const void* v, const HeadStrides& is, const AttentionShape& shape, DType dtype,
                             Stream stream, F32Math f32) {
  const bool tc = dtype != DType::f32 && tensor_cores();
  check_args(shape, dtype, tc, is, os, {{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
  const bool tf32 = dtype == DType::f32 && tf32_kernels(f32, shape, is, os, {q, k, v, out});
  flash::Params p = make_params(is, os, shape, tc);
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  if (shape.B * shape.H * shape.T == 0) return;
#ifdef FASTGPT_SM90A
  if (p.tiles.fwd >= flash::kFirstSm90.fwd)  // make_params keeps it only where it runs: bf16/fp16 on sm_90
    return dtype == DType::bf16 ? flash::forward_sm90<__nv_bfloat16>(p, stream)
                                : flash::forward_sm90<__half>(p, stream);
#endif
  switch (dtype) {
    case DType::bf16:
      return tc ? flash::forward_tc<__nv_bfloat16>(p, stream) : flash::forward_simt<__nv_bfloat16>(p, stream);
    case DType::f16:
      return tc ? flash::forward_tc<__half>(p, stream) : flash::forward_simt<__half>(p, stream);
    case DType::f32:
      return tf32 ? flash::forward_tf32(p, f32 == F32Math::tf32x3, stream) : flash::forward_simt<float>(p, stream);
  }
}

bool flash_attention_backward(void* dq, void* dk, void* dv, const HeadStrides& is, const void* dout,
                              const void* out, const HeadStrides& os, const void* q, const void* k, const void* v,
                              const float* lse, const AttentionShape& shape, DType dtype, bool deterministic,
                              Stream stream, F32Math f32, float* kv_sums) {
  const bool tc = dtype != DType::f32 && tensor_cores();
  check_args(shape, dtype, tc, is, os,
             {{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {dout, "dout"}, {dq, "dq"}, {dk, "dk"}, {dv, "dv"}});
  const bool tf32 = dtype == DType::f32 && tf32_kernels(f32, shape, is, os, {q, k, v, out, dout, dq, dk, dv});
  const int64_t rows = (int64_t)shape.B * shape.H * shape.T;
  if (rows == 0) return false;
  flash::Params p = make_params(is, os, shape, tc, deterministic);
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.dq = dq, p.dk = dk, p.dv = dv;
  p.out = const_cast<void*>(out), p.lse = const_cast<float*>(lse);  // only read in backward
  Scratch delta(rows, stream);
  // dq's fp32 sums: the atomic path's (the simt path is deterministic anyway), or the fused sm90 kernels', whose
  // rows are padded to their steps (64 or 128 queries: to 128 for both), with their turn counters after them (one
  // per step of 64, enough for either) and the persistent kernels' tile counter.
  const bool fused = flash::fused_sm90(p.tiles.dkdv);  // make_params keeps it only where it runs
  const int64_t padded = (int64_t)shape.B * shape.H * ((shape.T + 127) / 128) * 128,
                turns = (int64_t)shape.B * shape.H * ((shape.T + 63) / 64);
  Scratch accum(fused ? padded * shape.d + turns + 1 : tc && !deterministic ? rows * shape.d : 0, stream);
  p.delta = delta.ptr;
  p.dq_accum = accum.ptr;
  if (fused) p.dq_turn = reinterpret_cast<int*>(accum.ptr + padded * shape.d), p.next_tile = p.dq_turn + turns;
  // kv_sums: the warp-specialised backward (head dim 64) writes each (b, key block)'s column sums of dK and dV
  // (Params::kv_part), added up here (GPT-2 at B 64, T 1024: 512 rows, one pass); the other kernels have no such
  // rows, and the caller sums dk, dv itself.
  const bool ws = kv_sums && flash::ws_fused_sm90(p.tiles.dkdv) && shape.d == 64;
  const int64_t kv_rows = (int64_t)shape.B * ((shape.T + 127) / 128), kv_cols = 2 * (int64_t)shape.H * shape.d;
  Scratch kv_part(ws ? kv_rows * kv_cols : 0, stream);
  p.kv_part = kv_part.ptr;
  bool ws_ran = false;
  switch (dtype) {
    case DType::bf16:
      flash::compute_delta<__nv_bfloat16>(p, stream);
      if (tc)
        ws_ran = flash::backward_tc<__nv_bfloat16>(p, deterministic, stream);
      else
        flash::backward_simt<__nv_bfloat16>(p, stream);
      break;
    case DType::f16:
      flash::compute_delta<__half>(p, stream);
      if (tc)
        ws_ran = flash::backward_tc<__half>(p, deterministic, stream);
      else
        flash::backward_simt<__half>(p, stream);
      break;
    case DType::f32:
      flash::compute_delta<float>(p, stream);
      if (tf32)
        flash::backward_tf32(p, f32 == F32Math::tf32x3, stream);
      else
        flash::backward_simt<float>(p, stream);
      break;
  }
  if (!(ws && ws_ran)) return false;  // (kv_part unwritten: the caller sums dk, dv)
  bias_backward(kv_sums, kv_part.ptr, kv_rows, (int)kv_cols, stream);
  return true;
}

}  // namespace fastgpt::cuda
