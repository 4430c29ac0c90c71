// LayerNorm over the last dimension (eps 1e-5, biased variance), forward and backward; CUDA twin of
// csrc/cpu/layernorm.cpp. One warp per row for everything that reduces across a row (two-pass mean then variance in
// float, warp-shuffle sums; the forward's row is in cuda/layernorm.cuh, shared with residual_layernorm.cu). dinp
// accumulates (+=), as on the CPU: the residual stream sums into it.
// dweight/dbias sum over all rows without atomics: partial sums over fixed chunks of kRowsPerChunk rows (the CPU's
// chunking: each partial is the same in-order float sum) go to a scratch buffer, then one thread per channel adds
// the chunks in order in double, as the CPU does. The result never depends on launch configuration or timing.
// Templates over the storage type S (float, bf16, f16): inputs are widened to float as they are loaded, every sum
// is in float (or double for the chunk combine), out is rounded once to S, mean/rstd and dweight/dbias are float,
// and dinp += is read as S, added in float and rounded once.
#include <cmath>

#include "cuda/check.h"
#include "cuda/layernorm.cuh"
#include "cuda/ops.h"
#include "cuda/scratch.h"

namespace fastgpt::cuda {

namespace {
constexpr int kRowsPerChunk = 64;  // must stay equal to the CPU's for the partial sums to match it
constexpr int kWarpsPerBlock = 8;
constexpr int kColThreads = 128;

template <typename S>
__global__ void layernorm_forward_kernel(S* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                         const S* __restrict__ inp, const S* __restrict__ weight,
                                         const S* __restrict__ bias, int64_t N, int C) {
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;  // whole warp leaves together: the shuffles below see all 32 lanes
  const int lane = threadIdx.x % 32;
  const S* x = inp + n * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += to_float(x[c]);
  layernorm_row(out + n * C, mean + n, rstd + n, x, weight, bias, C, lane, s);
}

// dx += r * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dy * w. One warp per row.
template <typename S>
__global__ void layernorm_backward_dinp_kernel(S* __restrict__ dinp, const S* __restrict__ dout,
                                               const S* __restrict__ inp, const S* __restrict__ weight,
                                               const float* __restrict__ mean, const float* __restrict__ rstd,
                                               int64_t N, int C) {
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;
  const int lane = threadIdx.x % 32;
  const S* x = inp + n * C;
  const S* dy = dout + n * C;
  const float m = mean[n], r = rstd[n];
  float sd = 0.f, sdn = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float norm = (to_float(x[c]) - m) * r;
    const float dn = to_float(dy[c]) * to_float(weight[c]);
    sd += dn;
    sdn += dn * norm;
  }
  const float md = warp_sum(sd) / C, mdn = warp_sum(sdn) / C;
  S* dx = dinp + n * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (to_float(x[c]) - m) * r;
    dx[c] = from_float<S>(to_float(dx[c]) + (to_float(dy[c]) * to_float(weight[c]) - md - norm * mdn) * r);
  }
}

// grid: (nchunks, ceil(C / kColThreads)); one thread per (chunk, channel), rows of the chunk in order.
// partial layout per chunk: dweight (C) | dbias (C).
template <typename S>
__global__ void layernorm_backward_partial_kernel(float* __restrict__ partial, const S* __restrict__ dout,
                                                  const S* __restrict__ inp, const float* __restrict__ mean,
                                                  const float* __restrict__ rstd, int64_t N, int C) {
  const int64_t ch = blockIdx.x;
  const int c = blockIdx.y * kColThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t n0 = ch * kRowsPerChunk;
  const int64_t n1 = n0 + kRowsPerChunk < N ? n0 + kRowsPerChunk : N;
  float pw = 0.f, pb = 0.f;
  for (int64_t n = n0; n < n1; n++) {
    const float dy = to_float(dout[n * C + c]);
    const float norm = (to_float(inp[n * C + c]) - mean[n]) * rstd[n];
    pw += dy * norm;
    pb += dy;
  }
  partial[ch * 2 * C + c] = pw;
  partial[ch * 2 * C + C + c] = pb;
}

__global__ void layernorm_backward_combine_kernel(float* __restrict__ dweight, float* __restrict__ dbias,
                                                  const float* __restrict__ partial, int64_t nchunks, int C) {
  const int c = blockIdx.x * kColThreads + threadIdx.x;
  if (c >= C) return;
  double w = 0.0, b = 0.0;
  for (int64_t ch = 0; ch < nchunks; ch++) {
    w += partial[ch * 2 * C + c];
    b += partial[ch * 2 * C + C + c];
  }
  dweight[c] += (float)w;
  dbias[c] += (float)b;
}
}  // namespace

template <typename S>
void layernorm_forward(S* out, float* mean, float* rstd, const S* inp, const S* weight, const S* bias, int64_t N,
                       int C, Stream stream) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  auto* kernel = layernorm_forward_kernel<S>;  // one-line launch: the warp emulator rewrites it
  kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void layernorm_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                        const float* mean, const float* rstd, int64_t N, int C, Stream stream) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  auto* dinp_kernel = layernorm_backward_dinp_kernel<S>;
  dinp_kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  FASTGPT_CUDA_CHECK_LAUNCH();

  const int64_t nchunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  const unsigned col_blocks = (unsigned)((C + kColThreads - 1) / kColThreads);
  // Scratch until the combine kernel has been queued: no sync.
  Scratch scratch((size_t)nchunks * 2 * C, stream);
  float* partial = scratch.ptr;
  const dim3 grid((unsigned)nchunks, col_blocks);
  auto* partial_kernel = layernorm_backward_partial_kernel<S>;
  partial_kernel<<<grid, kColThreads, 0, stream>>>(partial, dout, inp, mean, rstd, N, C);
  FASTGPT_CUDA_CHECK_LAUNCH();
  layernorm_backward_combine_kernel<<<col_blocks, kColThreads, 0, stream>>>(dweight, dbias, partial, nchunks, C);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                                                               \
  template void layernorm_forward<S>(S*, float*, float*, const S*, const S*, const S*, int64_t, int, Stream); \
  template void layernorm_backward<S>(S*, float*, float*, const S*, const S*, const S*, const float*,         \
                                      const float*, int64_t, int, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
