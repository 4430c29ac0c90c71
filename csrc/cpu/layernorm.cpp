// LayerNorm over the last dimension (eps 1e-5, biased variance, as torch.nn.LayerNorm), forward and backward.
// Row statistics are accumulated in double: the CPU backend is the reference the CUDA kernels are judged against.
// dweight/dbias sum over all rows; rows are cut into fixed chunks whose partial sums are added in a fixed order (in
// double, over kCombineLanes lanes of chunks, then the lanes), so the result does not depend on the thread count.
// A chunk's partial is itself the sum, in order, of its parts' (kRowsPerPart rows each, summed in order). Both are
// the orders the CUDA kernels can keep (cuda/layernorm.cu), so that both sum the same floats the same way. Storage
// may be 16-bit (S); every sum is in float or double.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

namespace {
constexpr float kEps = 1e-5f;
constexpr int64_t kRowsPerChunk = 64;  // cuda/layernorm.cu cuts its rows the same way: keep the two equal
constexpr int64_t kRowsPerPart = 8;
constexpr int kCombineLanes = 16;  // and its combine's lanes
}  // namespace

template <typename S>
void layernorm_forward(S* out, float* mean, float* rstd, const S* inp, const S* weight, const S* bias, int64_t N,
                       int C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const S* x = inp + n * C;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; c++) s += to_float(x[c]);
    const double m = s / C;
    double v = 0.0;
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; c++) v += (to_float(x[c]) - m) * (to_float(x[c]) - m);
    const float r = (float)(1.0 / std::sqrt(v / C + kEps));
    const float mf = (float)m;
    S* o = out + n * C;
#pragma omp simd
    for (int c = 0; c < C; c++)
      o[c] = from_float<S>((to_float(x[c]) - mf) * r * to_float(weight[c]) + to_float(bias[c]));
    mean[n] = mf;
    rstd[n] = r;
  }
}

template <typename S>
void layernorm_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                        const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum) {
  const int64_t nchunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  // Per chunk: dweight (C) | dbias (C) | the part's dweight (C) | its dbias (C). Kept per calling thread and grown
  // only, so a training step allocates nothing.
  thread_local std::vector<float> partial;
  if (partial.size() < (size_t)nchunks * 4 * C) partial.resize((size_t)nchunks * 4 * C);
  float* part = partial.data();  // the OpenMP workers must use this thread's buffer, not their own thread_local
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < nchunks; ch++) {
    float* pw = part + ch * 4 * C;
    float* pb = pw + C;
    float* qw = pb + C;
    float* qb = qw + C;
    const int64_t n1 = (ch + 1) * kRowsPerChunk < N ? (ch + 1) * kRowsPerChunk : N;
    for (int64_t p0 = ch * kRowsPerChunk; p0 < n1; p0 += kRowsPerPart) {
      for (int c = 0; c < C; c++) qw[c] = qb[c] = 0.f;
      for (int64_t n = p0; n < std::min(p0 + kRowsPerPart, n1); n++) {
        const S* x = inp + n * C;
        const S* dy = dout + n * C;
        const float m = mean[n], r = rstd[n];
        // dx = r * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dy * w
        double sd = 0.0, sdn = 0.0;
#pragma omp simd reduction(+ : sd, sdn)
        for (int c = 0; c < C; c++) {
          const float norm = (to_float(x[c]) - m) * r;
          const float dn = to_float(dy[c]) * to_float(weight[c]);
          sd += dn;
          sdn += dn * norm;
        }
        const float md = (float)(sd / C), mdn = (float)(sdn / C);
        S* dx = dinp + n * C;
#pragma omp simd
        for (int c = 0; c < C; c++) {
          const float norm = (to_float(x[c]) - m) * r, g = to_float(dy[c]);
          dx[c] = from_float<S>(to_float(dx[c]) + (g * to_float(weight[c]) - md - norm * mdn) * r);
          qw[c] = std::fma(g, norm, qw[c]);  // the GPU's fmaf, whether or not the build contracts
          qb[c] += g;
        }
      }
      const bool first = p0 == ch * kRowsPerChunk;
      for (int c = 0; c < C; c++) {
        pw[c] = first ? qw[c] : pw[c] + qw[c];
        pb[c] = first ? qb[c] : pb[c] + qb[c];
      }
    }
  }
  // The chunks in double, in kCombineLanes lanes (lane y: chunks y, y + kCombineLanes, ... in order), then the
  // lanes in order: the order in which the CUDA kernel can spread a channel's chunks over threads.
#pragma omp parallel for schedule(static)
  for (int c = 0; c < C; c++) {
    double lw[kCombineLanes] = {}, lb[kCombineLanes] = {};
    for (int64_t ch = 0; ch < nchunks; ch++) {
      lw[ch % kCombineLanes] += part[ch * 4 * C + c];
      lb[ch % kCombineLanes] += part[ch * 4 * C + C + c];
    }
    double w = 0.0, b = 0.0;
    for (int y = 0; y < kCombineLanes; y++) {
      w += lw[y];
      b += lb[y];
    }
    dweight[c] += (float)w;
    dbias[c] += (float)b;
  }
  // Another pass over dinp, in the linear layer's order: the fused model's residual projections get the unfused
  // model's bias gradients, bit for bit (the GPU sums them in the pass above in 16 bits, cuda/layernorm.cu).
  if (dinp_sum) bias_backward(dinp_sum, (const S*)dinp, N, C);
}

#define FASTGPT_INSTANTIATE(S)                                                                                   \
  template void layernorm_forward<S>(S*, float*, float*, const S*, const S*, const S*, int64_t, int);          \
  template void layernorm_backward<S>(S*, float*, float*, const S*, const S*, const S*, const float*, const float*, \
                                      int64_t, int, float*);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
