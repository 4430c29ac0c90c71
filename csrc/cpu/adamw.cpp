// AdamW exactly as torch.optim.AdamW computes it (decoupled decay applied to the parameter first, then the Adam
// update with bias corrections), plus the deterministic global gradient norm used for clipping. The engine's step
// (adamw_step) is one pass over the whole flat buffer that reads its scalars (clip factor, step counter, whether to
// skip) from adamw_prepare's StepScalars; the arithmetic of both is cpu/adamw.h, shared with the CUDA kernels.
#include "cpu/adamw.h"

#include <cmath>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

AdamWHyper adamw_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  return {lr, beta1, beta2, eps, weight_decay, (float)(1.0 - std::pow((double)beta1, (double)step)),
          (float)std::sqrt(1.0 - std::pow((double)beta2, (double)step))};
}

template <typename S>
void adamw_step(float* param, S* lowp, const float* grad, float* m, float* v, const AdamWSegments& seg, float beta1,
                float beta2, float eps, const StepScalars* s, RoundKey key) {
  if (!s->applied) return;
  const float lr = s->lr;
  const float step_size = lr / s->bias_correction1, gscale = s->gscale, bc2 = s->bias_correction2_sqrt;
  key.step = (uint64_t)s->t;
  int64_t a = seg.begin;
  for (int j = 0; j < seg.n; a = seg.end[j++]) {
    const int64_t b = seg.end[j];
    const float decay = 1.f - lr * seg.weight_decay[j];
    float* mo = m - seg.begin;  // moments are indexed from the first updated element
    float* vo = v - seg.begin;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = a; i < b; i++) {
      const float p = adamw_element(param[i], mo[i], vo[i], grad[i] * gscale, beta1, beta2, eps, decay, step_size,
                                    bc2);
      if (lowp) lowp[i] = round_weight<S>(p, key, i);
    }
  }
}
template void adamw_step<float>(float*, float*, const float*, float*, float*, const AdamWSegments&, float, float, float,
                                const StepScalars*, RoundKey);
template void adamw_step<bf16>(float*, bf16*, const float*, float*, float*, const AdamWSegments&, float, float, float,
                               const StepScalars*, RoundKey);
template void adamw_step<f16>(float*, f16*, const float*, float*, float*, const AdamWSegments&, float, float, float,
                              const StepScalars*, RoundKey);

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h) {
  StepScalars s;
  AdamWSegments seg;
  single_range_step(h, n, &s, &seg);
  adamw_step<float>(param, nullptr, grad, m, v, seg, h.beta1, h.beta2, h.eps, &s, RoundKey{});
}

void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                   int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls) {
  fastgpt::adamw_prepare(s, lr, parts, nparts, losses, nlosses, max_norm, skip, beta1, beta2, ls);
}

void sum_squares_partials(double* partial, const float* x, int64_t n) {
  const int64_t nchunks = (n + kSumChunk - 1) / kSumChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; c++) {
    const int64_t i1 = (c + 1) * kSumChunk < n ? (c + 1) * kSumChunk : n;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c * kSumChunk; i < i1; i++) s += (double)x[i] * x[i];
    partial[c] = s;
  }
}

void sum_in_order(double* out, const double* x, int64_t n) {
  double total = 0.0;
  for (int64_t i = 0; i < n; i++) total += x[i];
  *out = total;
}

void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i++) sum += losses[i];
  const float mean = (float)(sum / n);  // the float a forward returns
  *acc = (reset ? 0.0 : *acc) + (double)mean / divisor;
}

void scale_inplace(float* x, int64_t n, float s) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

}  // namespace fastgpt::cpu
