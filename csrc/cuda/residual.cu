// Residual add (the skip connections): out = a + b, elementwise; CUDA twin of csrc/cpu/residual.cpp.
// Templates over the storage type S (float, bf16, f16): the sum in float, rounded once to S. 16-byte packs
// (128-bit loads/stores) when all three pointers are 16-byte aligned, then a scalar tail.
// out may alias a or b, so no __restrict__ here: each element (or pack) is read before it is written, by the same
// thread.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
template <typename S>
__global__ void residual_forward_kernel(S* out, const S* a, const S* b, int64_t n, int64_t nvec) {
  constexpr int N = Pack<S>::N;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<S> x = load_pack(a + v * N), y = load_pack(b + v * N);
    Pack<S> o;
#pragma unroll
    for (int k = 0; k < N; k++) o.v[k] = from_float<S>(to_float(x.v[k]) + to_float(y.v[k]));
    store_pack(out + v * N, o);
  }
  for (int64_t i = nvec * N + tid; i < n; i += stride) out[i] = from_float<S>(to_float(a[i]) + to_float(b[i]));
}
}  // namespace

template <typename S>
void residual_forward(S* out, const S* a, const S* b, int64_t n, Stream stream) {
  if (n <= 0) return;  // a zero-block grid is a launch error
  constexpr int kThreads = 256, N = Pack<S>::N;
  const int64_t nvec = aligned16(out) && aligned16(a) && aligned16(b) ? n / N : 0;
  const int64_t units = std::max(nvec, n - nvec * N);
  const int blocks = (int)std::min<int64_t>((units + kThreads - 1) / kThreads, 1 << 16);  // grid-stride beyond
  residual_forward_kernel<S><<<blocks, kThreads, 0, stream>>>(out, a, b, n, nvec);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template void residual_forward<float>(float*, const float*, const float*, int64_t, Stream);
template void residual_forward<bf16>(bf16*, const bf16*, const bf16*, int64_t, Stream);
template void residual_forward<f16>(f16*, const f16*, const f16*, int64_t, Stream);

}  // namespace fastgpt::cuda
