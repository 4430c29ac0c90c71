// Residual add: the skip connections of each block.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

}  // namespace fastgpt::cpu
