// Residual add (the skip connections): out = a + b, elementwise; CUDA twin of csrc/cpu/residual.cpp.
// out may alias a or b, so no __restrict__ here: each element is read before it is written, by the same thread.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
__global__ void residual_forward_kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = a[i] + b[i];
}
}  // namespace

void residual_forward(float* out, const float* a, const float* b, int64_t n, Stream stream) {
  if (n <= 0) return;  // a zero-block grid is a launch error
  constexpr int kThreads = 256;
  const int blocks = (int)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);  // grid-stride covers the rest
  residual_forward_kernel<<<blocks, kThreads, 0, stream>>>(out, a, b, n);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace fastgpt::cuda
