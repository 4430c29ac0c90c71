// Attention against a KV cache, for generation: the keys and values of every position seen so far stay in a
// per-layer cache, so a new token costs one row of attention instead of a forward over the whole sequence.
// append copies the k and v thirds of the fused projection into the cache; forward attends each new query row to
// the cached positions up to its own (causal with an offset: query t sits at position t0 + t). The reference for
// csrc/cuda/attention_decode.cu. Arithmetic in float (16-bit storage widened exactly), out rounded once, as
// attention.cpp does for the full sequence, so the decode step and the full forward see the same numbers.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

template <typename S>
void attention_decode_append(S* kcache, S* vcache, const S* qkv, int B, int T, int t0, int Tmax, int C, int NH) {
  const int hs = C / NH;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const S* row = qkv + ((int64_t)b * T + t) * 3 * C;
      for (int h = 0; h < NH; h++) {
        const int64_t at = (((int64_t)b * NH + h) * Tmax + t0 + t) * hs;
        std::copy(row + C + h * hs, row + C + (h + 1) * hs, kcache + at);
        std::copy(row + 2 * C + h * hs, row + 2 * C + (h + 1) * hs, vcache + at);
      }
    }
}

template <typename S>
void attention_decode_forward(S* out, const S* qkv, const S* kcache, const S* vcache, int B, int T, int t0, int Tmax,
                              int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.f / std::sqrt((float)hs);
#pragma omp parallel
  {
    std::vector<float> q(hs), p(t0 + T), o(hs);
#pragma omp for collapse(3) schedule(static)
    for (int b = 0; b < B; b++)
      for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
          const S* qrow = qkv + ((int64_t)b * T + t) * 3 * C + h * hs;
          for (int i = 0; i < hs; i++) q[i] = to_float(qrow[i]);
          const S* K = kcache + ((int64_t)b * NH + h) * Tmax * hs;
          const S* V = vcache + ((int64_t)b * NH + h) * Tmax * hs;
          const int n = t0 + t + 1;  // keys at positions [0, t0 + t]
          float mx = -INFINITY;
          for (int j = 0; j < n; j++) {
            float s = 0.f;
            for (int i = 0; i < hs; i++) s += q[i] * to_float(K[(int64_t)j * hs + i]);
            p[j] = s * scale;
            mx = std::max(mx, p[j]);
          }
          float sum = 0.f;
          for (int j = 0; j < n; j++) sum += (p[j] = std::exp(p[j] - mx));
          std::fill(o.begin(), o.end(), 0.f);
          for (int j = 0; j < n; j++) {
            const float w = p[j];
            for (int i = 0; i < hs; i++) o[i] += w * to_float(V[(int64_t)j * hs + i]);
          }
          S* orow = out + ((int64_t)b * T + t) * C + h * hs;
          const float inv = 1.f / sum;
          for (int i = 0; i < hs; i++) orow[i] = from_float<S>(o[i] * inv);
        }
  }
}

#define FASTGPT_INSTANTIATE(S)                                                                                      \
  template void attention_decode_append<S>(S*, S*, const S*, int, int, int, int, int, int);                        \
  template void attention_decode_forward<S>(S*, const S*, const S*, const S*, int, int, int, int, int, int);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
