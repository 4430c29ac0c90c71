// The arithmetic of one AdamW step that the CPU reference (adamw.cpp) and the CUDA kernels (cuda/adamw.cu) share,
// written once as host-device functions so both devices give the same bits for the same inputs:
// - adamw_prepare: the step's scalars, computed where the buffers live (one thread on a GPU): the gradients' global
//   norm from partial sums of squares, the clip factor, whether the step is applied (finite loss and norm) and
//   AdamW's step counter with its bias corrections. A training step therefore never waits for the host to see the
//   norm, and a CUDA graph can replay it (torch's capturable AdamW keeps its step on the device for that reason).
// - adamw_element: torch.optim.AdamW's update of one element (decoupled decay first, lerp-form first moment).
#pragma once
#include <cmath>
#include <cstdint>

#include "cpu/dtype.h"

namespace fastgpt {

// The scalars of the optimizer step, in the memory of the buffers they describe (device memory on a GPU).
struct StepScalars {
  double sumsq = 0.0;  // of the gradients over all ranks (before clipping)
  double norm = 0.0;   // sqrt(sumsq): what torch.nn.utils.clip_grad_norm_ returns
  float gscale = 1.f;  // times every gradient in the update: max_norm / (norm + 1e-6) when that is below 1
  float lr = 0.f;      // of this step: read from memory by adamw_prepare, so a replayed graph takes each step's
  float bias_correction1 = 1.f, bias_correction2_sqrt = 1.f;  // 1 - beta1^t, sqrt(1 - beta2^t)
  int32_t applied = 0;  // the last step updated the weights; 0: skipped (told to, or a non-finite loss or norm)
  int64_t t = 0;        // updates applied: AdamW's step counter (bias corrections, bf16's rounding key)
  int64_t skipped = 0;  // steps skipped
};

// fp16's dynamic loss scale, torch.amp.GradScaler's rules, kept in the memory of the gradients it scales: the loss
// gradient is multiplied by `scale` (the cross-entropy kernels read it from there, so a recorded step reads each
// step's), and the step divides it back out, skipping a step whose gradients overflowed (inf/NaN): then the scale
// is multiplied by backoff_factor; after growth_interval finite steps in a row, by growth_factor.
struct LossScale {
  float scale = 65536.f;
  float growth_factor = 2.f, backoff_factor = 0.5f;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;  // finite steps since the last change
};

FASTGPT_HD void loss_scale_update(LossScale* ls, bool found_inf) {
  if (found_inf) {
    ls->scale *= ls->backoff_factor;
    ls->growth_tracker = 0;
  } else if (++ls->growth_tracker == ls->growth_interval) {
    ls->scale *= ls->growth_factor;
    ls->growth_tracker = 0;
  }
}

// Where weight decay switches on and off in the flat parameter buffer: segment j is [end[j-1], end[j]) (the first
// starts at `begin`), decayed by weight_decay[j]. 2-D weights decay, biases and LayerNorm parameters do not.
struct AdamWSegments {
  static constexpr int kMax = 32;
  int n = 0;
  int64_t begin = 0;
  int64_t end[kMax] = {};
  float weight_decay[kMax] = {};
};

// x - x is 0 for a finite x and NaN for inf or NaN: a finiteness test that compiles alike for host and device.
FASTGPT_HD bool finite_double(double x) { return x - x == 0.0; }

// lr: this step's learning rate, in memory (null: keep s->lr). parts: nparts partial sums of squares, added in order
// (nparts 0: no norm is taken, sumsq 0). losses: the step's
// mean loss (nlosses 1), every rank's (data parallel: all skip together), or none. max_norm: +inf for no clipping.
// skip: the caller skips this step (fp16's overflow, found by the host). ls: fp16's loss scale when the gradients
// still carry it (null otherwise): the norm and the update divide it out (exact for a power-of-two scale, so the
// bits of unscaling the gradients first), and the scale takes this step's overflow (a non-finite sum of squares).
FASTGPT_HD void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                              int nlosses, double max_norm, bool skip, float beta1, float beta2,
                              LossScale* ls = nullptr) {
  if (lr) s->lr = *lr;
  double ss = 0.0;
  for (int k = 0; k < nparts; k++) ss += parts[k];
  const bool grads_finite = finite_double(ss);
  const float unscale = ls ? 1.f / ls->scale : 1.f;
  if (ls && grads_finite) ss *= (double)unscale * (double)unscale;
  s->sumsq = ss;
  s->norm = sqrt(ss);
  const double coef = max_norm / (s->norm + 1e-6);  // torch's clip_grad_norm_ rule
  s->gscale = (coef < 1.0 ? (float)coef : 1.f) * unscale;
  if (ls) loss_scale_update(ls, !grads_finite);
  bool ok = !skip && grads_finite;
  for (int k = 0; k < nlosses; k++) ok = ok && finite_double(losses[k]);
  s->applied = ok ? 1 : 0;
  if (!ok) {
    s->skipped++;
    return;
  }
  s->t++;
  // In double, once per step, as cpu::adamw_hyper forms them.
  s->bias_correction1 = (float)(1.0 - pow((double)beta1, (double)s->t));
  s->bias_correction2_sqrt = (float)sqrt(1.0 - pow((double)beta2, (double)s->t));
}

// One element: g is the (clipped) gradient. decay = 1 - lr * weight_decay, step_size = lr / bias_correction1.
FASTGPT_HD float adamw_element(float& param, float& m, float& v, float g, float beta1, float beta2, float eps,
                               float decay, float step_size, float bias_correction2_sqrt) {
  const float mi = m + (1.f - beta1) * (g - m);  // torch's lerp form
  const float vi = beta2 * v + (1.f - beta2) * g * g;
  m = mi;
  v = vi;
  const float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
  param = param * decay - step_size * mi / denom;
  return param;
}

}  // namespace fastgpt
