// Attention against a KV cache on the GPU, for generation: the twin of csrc/cpu/attention_decode.cpp.
// append: one thread per element of the new keys and values, scattered from the fused qkv (B, T, 3C) into the
// per-head cache (B, NH, Tmax, hs). forward: one block per (row, new position, head), its warps splitting the cached
// keys j = warp, warp + kWarps, ... Each warp keeps an online softmax (running max, sum, and the weighted sum of
// values, lane l holding dimensions l, l + 32, ...: coalesced reads of each key and value row), then the warps'
// partial results are merged through shared memory. Scores are float dot products (warp_sum), q . k * 1/sqrt(hs) as
// on the CPU; out is rounded once to S. Decoding is bound by reading the cache, not by arithmetic: no tensor cores.
// Also built on the host by tests/warp_emu/run.sh (launches on one line, dynamic shared memory as `sm`).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/warp.cuh"

namespace fastgpt::cuda {

namespace {
constexpr int kWarps = 4;        // warps per block, splitting the keys
constexpr int kMaxPerLane = 8;   // head dimensions per lane: head size <= 256
constexpr int kAppendThreads = 256;

template <typename S>
__global__ void attention_decode_append_kernel(S* __restrict__ kcache, S* __restrict__ vcache,
                                               const S* __restrict__ qkv, int B, int T, int t0, int Tmax, int C,
                                               int NH) {
  const int64_t n = (int64_t)B * T * C;
  const int hs = C / NH;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    const int h = c / hs, d = c % hs;
    const int64_t at = ((b * NH + h) * Tmax + t0 + t) * hs + d;
    kcache[at] = qkv[bt * 3 * C + C + c];
    vcache[at] = qkv[bt * 3 * C + 2 * C + c];
  }
}

template <typename S>
__global__ void attention_decode_forward_kernel(S* __restrict__ out, const S* __restrict__ qkv,
                                                const S* __restrict__ kcache, const S* __restrict__ vcache, int T,
                                                int t0, int Tmax, int C, int NH, float scale) {
  extern __shared__ float sm[];  // (kWarps, hs + 2): each warp's running max, sum, then its hs accumulators
  const int hs = C / NH;
  const int h = blockIdx.x % NH;
  const int64_t bt = blockIdx.x / NH;  // b * T + t
  const int t = (int)(bt % T);
  const int64_t b = bt / T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const S* qrow = qkv + bt * 3 * C + h * hs;
  float q[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; i++) {
    const int d = lane + 32 * i;
    q[i] = d < hs ? to_float(qrow[d]) : 0.f;
    acc[i] = 0.f;
  }
  const S* K = kcache + (b * NH + h) * Tmax * hs;
  const S* V = vcache + (b * NH + h) * Tmax * hs;
  const int n = t0 + t + 1;  // keys at positions [0, t0 + t]
  float m = -INFINITY, l = 0.f;
  for (int j = warp; j < n; j += kWarps) {  // the same trip count on every lane: warp_sum sees all 32
    const S* kr = K + (int64_t)j * hs;
    const S* vr = V + (int64_t)j * hs;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; i++) {
      const int d = lane + 32 * i;
      if (d < hs) s += q[i] * to_float(kr[d]);
    }
    s = warp_sum(s) * scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), p = expf(s - mn);  // corr = 0 at the first key (m = -inf)
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; i++) {
      const int d = lane + 32 * i;
      if (d < hs) acc[i] = acc[i] * corr + p * to_float(vr[d]);
    }
    m = mn;
  }
  float* mine = sm + warp * (hs + 2);
  if (lane == 0) {
    mine[0] = m;
    mine[1] = l;
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; i++) {
    const int d = lane + 32 * i;
    if (d < hs) mine[2 + d] = acc[i];
  }
  __syncthreads();
  // Merge: warp w's part weighs exp(m_w - M). Warp 0 always saw key 0, so M is finite; a warp that saw no key has
  // m_w = -inf, weight 0, and zero sums.
  float M = -INFINITY;
  for (int w = 0; w < kWarps; w++) M = fmaxf(M, sm[w * (hs + 2)]);
  float f[kWarps], L = 0.f;
  for (int w = 0; w < kWarps; w++) {
    f[w] = expf(sm[w * (hs + 2)] - M);
    L += sm[w * (hs + 2) + 1] * f[w];
  }
  S* orow = out + bt * C + h * hs;
  for (int d = threadIdx.x; d < hs; d += kWarps * 32) {
    float o = 0.f;
    for (int w = 0; w < kWarps; w++) o += sm[w * (hs + 2) + 2 + d] * f[w];
    orow[d] = from_float<S>(o / L);
  }
}

void check_dims(int B, int T, int t0, int Tmax, int C, int NH) {
  if (B < 1 || T < 1 || t0 < 0 || t0 + T > Tmax || NH < 1 || C % NH != 0)
    throw std::invalid_argument("attention_decode: need B, T >= 1, 0 <= t0, t0 + T <= Tmax and NH dividing C; got B=" +
                                std::to_string(B) + " T=" + std::to_string(T) + " t0=" + std::to_string(t0) +
                                " Tmax=" + std::to_string(Tmax) + " C=" + std::to_string(C) + " NH=" +
                                std::to_string(NH));
  if (C / NH > 32 * kMaxPerLane)
    throw std::invalid_argument("attention_decode on CUDA supports head size <= " + std::to_string(32 * kMaxPerLane) +
                                ", got " + std::to_string(C / NH));
}
}  // namespace

template <typename S>
void attention_decode_append(S* kcache, S* vcache, const S* qkv, int B, int T, int t0, int Tmax, int C, int NH,
                             Stream stream) {
  check_dims(B, T, t0, Tmax, C, NH);
  const int64_t n = (int64_t)B * T * C;
  const int blocks = (int)std::min<int64_t>((n + kAppendThreads - 1) / kAppendThreads, 65536);
  attention_decode_append_kernel<S><<<blocks, kAppendThreads, 0, stream>>>(kcache, vcache, qkv, B, T, t0, Tmax, C, NH);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void attention_decode_forward(S* out, const S* qkv, const S* kcache, const S* vcache, int B, int T, int t0, int Tmax,
                              int C, int NH, Stream stream) {
  check_dims(B, T, t0, Tmax, C, NH);
  const int hs = C / NH;
  const size_t smem = (size_t)kWarps * (hs + 2) * sizeof(float);
  const int blocks = B * T * NH;
  const float scale = 1.f / sqrtf((float)hs);
  attention_decode_forward_kernel<S><<<blocks, kWarps * 32, smem, stream>>>(out, qkv, kcache, vcache, T, t0, Tmax, C, NH, scale);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                                                                  \
  template void attention_decode_append<S>(S*, S*, const S*, int, int, int, int, int, int, Stream);            \
  template void attention_decode_forward<S>(S*, const S*, const S*, const S*, int, int, int, int, int, int, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
