// Residual add (the skip connections): out = a + b, elementwise; CUDA twin of csrc/cpu/residual.cpp.
// Templates over the storage type S (float, bf16, f16): the sum in float, rounded once to S, through the shared
// elementwise map (cuda/elementwise.cuh: 16-byte packs where aligned; out may alias a or b).
#include "cuda/elementwise.cuh"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
}  // namespace

template <typename S>
void residual_forward(S* out, const S* a, const S* b, int64_t n, Stream stream) {
  elementwise(out, a, b, n, Add{}, stream);
}

template void residual_forward<float>(float*, const float*, const float*, int64_t, Stream);
template void residual_forward<bf16>(bf16*, const bf16*, const bf16*, int64_t, Stream);
template void residual_forward<f16>(f16*, const f16*, const f16*, int64_t, Stream);

}  // namespace fastgpt::cuda
