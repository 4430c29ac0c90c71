// Baseline scaled dot-product attention on the GPU, the twin of csrc/cpu/attention.cpp: simple and obviously right,
// to check the flash kernel against later (which replaces it with the same signature and the same saved state:
// out and lse, the log-sum-exp of each scaled, masked score row).
// Forward: split qkv (B, T, 3C) into contiguous per-head q, k, v (B*NH, T, hs); S = scale * Q K^T as one strided
// batched GEMM over B*NH; a row softmax turns S into P in place and writes lse; Y = P V; Y goes back to (B, T, C).
// Backward: recompute S and P = exp(S - lse), dP = dO V^T, D_i = dO_i . O_i, dS = P * (dP - D);
// dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO; then scatter dq | dk | dv into dqkv.
// Memory: this baseline materialises the full (B*NH, T, T) scores (two of them in backward) in scratch taken from
// the stream's memory pool (cudaMallocAsync / cudaFreeAsync): O(B * NH * T^2) floats, fine for checking, not for
// long contexts; the flash kernel removes it. Causal masking is applied in the softmax (masked entries become exact
// zeros), so the GEMMs do the full T x T work. All reductions run in a fixed order: results are deterministic.
#include <cmath>

#include "cuda/check.h"
#include "cuda/cublaslt.h"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// Blocks for a grid-stride loop over n items of `per_block` each; capped, the loop covers the rest.
unsigned grid_for(int64_t n, int64_t per_block) {
  int64_t g = (n + per_block - 1) / per_block;
  if (g < 1) g = 1;
  if (g > (1 << 20)) g = 1 << 20;
  return (unsigned)g;
}

// dst (B, NH, T, hs) contiguous <- columns [0, C) of src (B, T, *) with row stride ld (C = NH * hs).
// Reads run along src rows (coalesced); writes are contiguous runs of hs.
__global__ void to_heads_kernel(float* dst, const float* src, int64_t ld, int T, int NH, int hs, int64_t total) {
  const int64_t C = (int64_t)NH * hs;
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = n % C, bt = n / C, t = bt % T, b = bt / T, h = c / hs, d = c % hs;
    dst[((b * NH + h) * T + t) * hs + d] = src[bt * ld + c];
  }
}

// The inverse: columns [0, C) of dst (B, T, *) with row stride ld <- src (B, NH, T, hs).
__global__ void from_heads_kernel(float* dst, int64_t ld, const float* src, int T, int NH, int hs, int64_t total) {
  const int64_t C = (int64_t)NH * hs;
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = n % C, bt = n / C, t = bt % T, b = bt / T, h = c / hs, d = c % hs;
    dst[bt * ld + c] = src[((b * NH + h) * T + t) * hs + d];
  }
}

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One warp per score row r = (b*NH + h) * T + i of S (rows, T), already scaled: S becomes P (masked entries 0) and
// lse[r] = log sum_j exp(s_j) over the unmasked j (j <= i when causal; never empty, j = i is always kept).
__global__ void softmax_forward_kernel(float* S, float* lse, int T, bool causal, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * kWarpsPerBlock;
  for (int64_t r = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32; r < rows; r += warps) {
    float* s = S + r * T;
    const int i = (int)(r % T), n = causal ? i + 1 : T;
    float mx = -INFINITY;
    for (int j = lane; j < n; j += 32) mx = fmaxf(mx, s[j]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int j = lane; j < n; j += 32) sum += expf(s[j] - mx);
    sum = warp_sum(sum);
    const float inv = 1.f / sum;
    for (int j = lane; j < T; j += 32) s[j] = j < n ? expf(s[j] - mx) * inv : 0.f;
    if (lane == 0) lse[r] = mx + logf(sum);
  }
}

// One warp per (b, t, h): D[(b*NH + h) * T + t] = dout . out over the head's hs columns (rows of (B, T, C)).
__global__ void rowdot_kernel(float* D, const float* dout, const float* out, int T, int NH, int hs, int64_t rows) {
  const int lane = threadIdx.x % 32;
  const int64_t C = (int64_t)NH * hs, warps = (int64_t)gridDim.x * kWarpsPerBlock;
  for (int64_t r = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t h = r % NH, bt = r / NH, t = bt % T, b = bt / T;
    const float* dy = dout + bt * C + h * hs;
    const float* y = out + bt * C + h * hs;
    float s = 0.f;
    for (int d = lane; d < hs; d += 32) s += dy[d] * y[d];
    s = warp_sum(s);
    if (lane == 0) D[(b * NH + h) * T + t] = s;
  }
}

// Elementwise over (B*NH, T, T): S (scaled scores) becomes P = exp(S - lse), dP becomes dS = P * (dP - D);
// masked entries become exact zeros in both.
__global__ void softmax_backward_kernel(float* S, float* dP, const float* lse, const float* D, int T, bool causal,
                                        int64_t total) {
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = n / T;
    const int j = (int)(n % T), i = (int)(row % T);
    if (causal && j > i) {
      S[n] = 0.f;
      dP[n] = 0.f;
    } else {
      const float p = expf(S[n] - lse[row]);
      S[n] = p;
      dP[n] = p * (dP[n] - D[row]);
    }
  }
}

// Scratch carved out of one pool allocation, each piece starting on a 256-byte boundary (so cuBLASLt sees aligned
// matrices whatever T and hs are).
struct Scratch {
  float* base = nullptr;
  size_t used = 0;  // floats
  static size_t round(size_t n) { return (n + 63) / 64 * 64; }
  float* take(size_t n) {
    float* p = base + used;
    used += round(n);
    return p;
  }
};

void to_heads(float* dst, const float* src, int64_t ld, int B, int T, int NH, int hs, Stream stream) {
  const int64_t total = (int64_t)B * T * NH * hs;
  to_heads_kernel<<<grid_for(total, kThreads), kThreads, 0, stream>>>(dst, src, ld, T, NH, hs, total);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void from_heads(float* dst, int64_t ld, const float* src, int B, int T, int NH, int hs, Stream stream) {
  const int64_t total = (int64_t)B * T * NH * hs;
  from_heads_kernel<<<grid_for(total, kThreads), kThreads, 0, stream>>>(dst, ld, src, T, NH, hs, total);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, bool causal,
                       Stream stream) {
  if (B <= 0 || T <= 0 || C <= 0) return;
  const int hs = C / NH, BH = B * NH;
  const int64_t C3 = 3 * (int64_t)C, sTh = (int64_t)T * hs, sTT = (int64_t)T * T;
  const size_t nh = (size_t)BH * sTh, ns = (size_t)BH * sTT;
  const float scale = 1.f / std::sqrt((float)hs);

  Scratch sc;
  FASTGPT_CUDA_CHECK(cudaMallocAsync((void**)&sc.base, (4 * Scratch::round(nh) + Scratch::round(ns)) * sizeof(float),
                                     stream));
  float *q = sc.take(nh), *k = sc.take(nh), *v = sc.take(nh), *y = sc.take(nh), *S = sc.take(ns);

  to_heads(q, qkv, C3, B, T, NH, hs, stream);
  to_heads(k, qkv + C, C3, B, T, NH, hs, stream);
  to_heads(v, qkv + 2 * C, C3, B, T, NH, hs, stream);
  // S (T, T) = scale * Q (T, hs) @ K^T, K stored (T, hs): per (b, h).
  gemm(false, true, T, T, hs, scale, q, hs, k, hs, 0.f, S, T, nullptr, stream, BH, sTh, sTh, sTT);
  const int64_t rows = (int64_t)BH * T;
  softmax_forward_kernel<<<grid_for(rows, kWarpsPerBlock), kThreads, 0, stream>>>(S, lse, T, causal, rows);
  FASTGPT_CUDA_CHECK_LAUNCH();
  // Y (T, hs) = P (T, T) @ V (T, hs).
  gemm(false, false, T, hs, T, 1.f, S, T, v, hs, 0.f, y, hs, nullptr, stream, BH, sTT, sTh, sTh);
  from_heads(out, C, y, B, T, NH, hs, stream);
  FASTGPT_CUDA_CHECK(cudaFreeAsync(sc.base, stream));
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int B, int T, int C, int NH, bool causal, Stream stream) {
  if (B <= 0 || T <= 0 || C <= 0) return;
  const int hs = C / NH, BH = B * NH;
  const int64_t C3 = 3 * (int64_t)C, sTh = (int64_t)T * hs, sTT = (int64_t)T * T;
  const size_t nh = (size_t)BH * sTh, ns = (size_t)BH * sTT, nr = (size_t)BH * T;
  const float scale = 1.f / std::sqrt((float)hs);

  Scratch sc;
  FASTGPT_CUDA_CHECK(cudaMallocAsync(
      (void**)&sc.base, (7 * Scratch::round(nh) + 2 * Scratch::round(ns) + Scratch::round(nr)) * sizeof(float),
      stream));
  float *q = sc.take(nh), *k = sc.take(nh), *v = sc.take(nh), *dy = sc.take(nh);
  float *dq = sc.take(nh), *dk = sc.take(nh), *dv = sc.take(nh);
  float *S = sc.take(ns), *dP = sc.take(ns), *D = sc.take(nr);

  to_heads(q, qkv, C3, B, T, NH, hs, stream);
  to_heads(k, qkv + C, C3, B, T, NH, hs, stream);
  to_heads(v, qkv + 2 * C, C3, B, T, NH, hs, stream);
  to_heads(dy, dout, C, B, T, NH, hs, stream);
  rowdot_kernel<<<grid_for((int64_t)nr, kWarpsPerBlock), kThreads, 0, stream>>>(D, dout, out, T, NH, hs,
                                                                                 (int64_t)nr);
  FASTGPT_CUDA_CHECK_LAUNCH();

  // S = scale * Q K^T exactly as in forward (same GEMM, same cached algorithm), dP = dO V^T.
  gemm(false, true, T, T, hs, scale, q, hs, k, hs, 0.f, S, T, nullptr, stream, BH, sTh, sTh, sTT);
  gemm(false, true, T, T, hs, 1.f, dy, hs, v, hs, 0.f, dP, T, nullptr, stream, BH, sTh, sTh, sTT);
  softmax_backward_kernel<<<grid_for((int64_t)ns, kThreads), kThreads, 0, stream>>>(S, dP, lse, D, T, causal,
                                                                                     (int64_t)ns);
  FASTGPT_CUDA_CHECK_LAUNCH();
  // dV (T, hs) = P^T @ dO: P stored (T, T), transposed.
  gemm(true, false, T, hs, T, 1.f, S, T, dy, hs, 0.f, dv, hs, nullptr, stream, BH, sTT, sTh, sTh);
  // dQ = scale * dS (T, T) @ K (T, hs).
  gemm(false, false, T, hs, T, scale, dP, T, k, hs, 0.f, dq, hs, nullptr, stream, BH, sTT, sTh, sTh);
  // dK = scale * dS^T @ Q: dS stored (T, T), transposed.
  gemm(true, false, T, hs, T, scale, dP, T, q, hs, 0.f, dk, hs, nullptr, stream, BH, sTT, sTh, sTh);

  from_heads(dqkv, C3, dq, B, T, NH, hs, stream);
  from_heads(dqkv + C, C3, dk, B, T, NH, hs, stream);
  from_heads(dqkv + 2 * C, C3, dv, B, T, NH, hs, stream);
  FASTGPT_CUDA_CHECK(cudaFreeAsync(sc.base, stream));
}

}  // namespace fastgpt::cuda
