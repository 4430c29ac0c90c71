// AdamW exactly as torch.optim.AdamW computes it (decoupled decay applied to the parameter first, then the Adam
// update with bias corrections), plus the deterministic global gradient norm used for clipping.
#include <cmath>
#include <vector>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

AdamWHyper adamw_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  return {lr, beta1, beta2, eps, weight_decay, (float)(1.0 - std::pow((double)beta1, (double)step)),
          (float)std::sqrt(1.0 - std::pow((double)beta2, (double)step))};
}

namespace {
// lowp == nullptr: the fp32 update alone; else also lowp[i] = round_weight<S>(new param) in the same pass.
template <typename S>
void update(float* param, S* lowp, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
            const RoundKey& key) {
  const float decay = 1.f - h.lr * h.weight_decay;
  const float step_size = h.lr / h.bias_correction1;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float g = grad[i];
    const float mi = m[i] + (1.f - h.beta1) * (g - m[i]);  // torch's lerp form
    const float vi = h.beta2 * v[i] + (1.f - h.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / h.bias_correction2_sqrt + h.eps;
    const float p = param[i] * decay - step_size * mi / denom;
    param[i] = p;
    if (lowp) lowp[i] = round_weight<S>(p, key, i);
  }
}
}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h) {
  update<float>(param, nullptr, grad, m, v, n, h, RoundKey{});
}

template <typename S>
void adamw_update_mixed(float* param, S* lowp, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                        const RoundKey& key) {
  update<S>(param, lowp, grad, m, v, n, h, key);
}
template void adamw_update_mixed<bf16>(float*, bf16*, const float*, float*, float*, int64_t, const AdamWHyper&,
                                       const RoundKey&);
template void adamw_update_mixed<f16>(float*, f16*, const float*, float*, float*, int64_t, const AdamWHyper&,
                                      const RoundKey&);

double sum_squares(const float* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;  // fixed, so the combine order never depends on the thread count
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(nchunks);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; c++) {
    const int64_t i1 = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c * kChunk; i < i1; i++) s += (double)x[i] * x[i];
    partial[c] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

void scale_inplace(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

}  // namespace fastgpt::cpu
