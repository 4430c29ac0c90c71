// Causal (or full) scaled dot-product attention on the CPU, the way a flash kernel does it: forward keeps only
// the log-sum-exp of each score row, backward recomputes the probabilities from it. No T x T matrix is ever stored,
// so memory stays O(T) per thread, and the saved state (out, lse) is the same the CUDA flash kernel will save.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/vmath.h"

namespace fastgpt::cpu {

namespace {
inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}
}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, bool causal) {
  const int hs = C / NH;
  const int64_t C3 = 3 * (int64_t)C;
  const float scale = 1.f / std::sqrt((float)hs);
#pragma omp parallel
  {
    std::vector<float> p(T);  // one row of scores, then probabilities (unnormalised)
#pragma omp for collapse(3) schedule(static)
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++)
        for (int i = 0; i < T; i++) {
          const float* base = qkv + (int64_t)b * T * C3 + h * hs;
          const float* q = base + i * C3;
          const int jn = causal ? i + 1 : T;
          float mx = -std::numeric_limits<float>::infinity();
          for (int j = 0; j < jn; j++) {
            p[j] = dot(q, base + j * C3 + C, hs) * scale;
            mx = p[j] > mx ? p[j] : mx;
          }
          double sum = 0.0;
#pragma omp simd reduction(+ : sum)
          for (int j = 0; j < jn; j++) {
            p[j] = vexp(p[j] - mx);
            sum += p[j];
          }
          float* o = out + ((int64_t)b * T + i) * C + h * hs;
          for (int d = 0; d < hs; d++) o[d] = 0.f;
          for (int j = 0; j < jn; j++) {
            const float* v = base + j * C3 + 2 * C;
            const float pj = p[j];
#pragma omp simd
            for (int d = 0; d < hs; d++) o[d] += pj * v[d];
          }
          const float inv = (float)(1.0 / sum);
          for (int d = 0; d < hs; d++) o[d] *= inv;
          lse[((int64_t)b * NH + h) * T + i] = mx + (float)std::log(sum);
        }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int B, int T, int C, int NH, bool causal) {
  const int hs = C / NH;
  const int64_t C3 = 3 * (int64_t)C;
  const float scale = 1.f / std::sqrt((float)hs);
  // Each (b, h) is independent and owns its dq/dk/dv columns, so threads split over (b, h): dk and dv accumulate
  // across query rows without atomics, in a fixed row order.
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float* base = qkv + (int64_t)b * T * C3 + h * hs;
      float* dbase = dqkv + (int64_t)b * T * C3 + h * hs;
      for (int t = 0; t < T; t++)
        for (int s = 0; s < 3; s++)
          for (int d = 0; d < hs; d++) dbase[t * C3 + s * C + d] = 0.f;
      for (int i = 0; i < T; i++) {
        const float* q = base + i * C3;
        const float* dy = dout + ((int64_t)b * T + i) * C + h * hs;
        const float* y = out + ((int64_t)b * T + i) * C + h * hs;
        const float Di = dot(dy, y, hs);  // sum_j p_ij * dp_ij, by the identity out_i = sum_j p_ij v_j
        const float li = lse[((int64_t)b * NH + h) * T + i];
        float* dq = dbase + i * C3;
        const int jn = causal ? i + 1 : T;
        for (int j = 0; j < jn; j++) {
          const float* k = base + j * C3 + C;
          const float* v = base + j * C3 + 2 * C;
          const float p = vexp(dot(q, k, hs) * scale - li);
          const float ds = p * (dot(dy, v, hs) - Di) * scale;
          float* dk = dbase + j * C3 + C;
          float* dv = dbase + j * C3 + 2 * C;
#pragma omp simd
          for (int d = 0; d < hs; d++) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
            dv[d] += p * dy[d];
          }
        }
      }
    }
}

}  // namespace fastgpt::cpu
