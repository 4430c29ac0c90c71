// GELU with the tanh approximation (GPT-2's), forward and backward; CUDA twin of csrc/cpu/gelu.cpp.
// Same sigmoid form as the CPU file: 0.5 * (1 + tanh(a)) == sigmoid(2a), so gelu(x) = x / (1 + exp(-2a)), which
// has no cancellation in 1 + tanh(a) for large negative x. expf (not __expf) keeps the error near the CPU's.
// gelu_backward's dinp may alias dout: each element is read before it is written, so no __restrict__ on them.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoef = 0.044715f;
constexpr int kThreads = 256;

int grid_for(int64_t n) { return (int)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16); }

__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = inp[i];
    const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
    out[i] = x / (1.f + expf(-2.f * a));
  }
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = inp[i];
    const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
    const float s = 1.f / (1.f + expf(-2.f * a));  // sigmoid(2a) = 0.5 * (1 + tanh(a))
    const float da = kSqrt2OverPi * (1.f + 3.f * kCoef * x * x);
    dinp[i] = dout[i] * (s + x * 2.f * s * (1.f - s) * da);
  }
}
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n, Stream stream) {
  if (n <= 0) return;
  gelu_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, inp, n);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, Stream stream) {
  if (n <= 0) return;
  gelu_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dinp, inp, dout, n);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace fastgpt::cuda
