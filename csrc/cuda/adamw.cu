// AdamW exactly as torch.optim.AdamW orders it (decoupled decay on the parameter first, then the Adam step with
// bias corrections); CUDA twin of cpu::adamw_update. Elementwise over one contiguous range, grid-stride loop.
// decay and step_size are formed on the host with the same float expressions as the CPU file.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, int64_t n, float beta1, float beta2, float eps, float decay,
                             float step_size, float bias_correction2_sqrt) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = grad[i];
    const float mo = m[i];
    const float mi = mo + (1.f - beta1) * (g - mo);  // torch's lerp form
    const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
    param[i] = param[i] * decay - step_size * mi / denom;
  }
}
}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                  Stream stream) {
  if (n <= 0) return;
  const float decay = 1.f - h.lr * h.weight_decay;
  const float step_size = h.lr / h.bias_correction1;
  constexpr int kThreads = 256;
  const int blocks = (int)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  adamw_kernel<<<blocks, kThreads, 0, stream>>>(param, grad, m, v, n, h.beta1, h.beta2, h.eps, decay, step_size,
                                                h.bias_correction2_sqrt);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace fastgpt::cuda
