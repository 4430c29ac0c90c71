// Residual add: the skip connections of each block.
#include "cpu/kernels.h"

namespace fastgpt::cpu {

template <typename S>
void residual_forward(S* out, const S* a, const S* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = from_float<S>(to_float(a[i]) + to_float(b[i]));
}

template void residual_forward<float>(float*, const float*, const float*, int64_t);
template void residual_forward<bf16>(bf16*, const bf16*, const bf16*, int64_t);
template void residual_forward<f16>(f16*, const f16*, const f16*, int64_t);

}  // namespace fastgpt::cpu
