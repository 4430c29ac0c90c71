// GELU with the tanh approximation (GPT-2's), forward and backward; CUDA twin of csrc/cpu/gelu.cpp.
// Same sigmoid form as the CPU file: 0.5 * (1 + tanh(a)) == sigmoid(2a), so gelu(x) = x / (1 + exp(-2a)), which
// has no cancellation in 1 + tanh(a) for large negative x. expf (not __expf) keeps the error near the CPU's.
// Templates over the storage type S (float, bf16, f16): load S, compute in float, store S rounded once to nearest
// even. Memory-bound, so 16-byte packs (128-bit loads/stores) when every pointer is 16-byte aligned, then a scalar
// tail; the per-element arithmetic is the same either way, so the result does not depend on the path.
// gelu_backward's dinp may alias dout: each element is read before it is written by the same thread, so no
// __restrict__ on them.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoef = 0.044715f;
constexpr int kThreads = 256;

__device__ __forceinline__ float gelu(float x) {
  const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
  return x / (1.f + expf(-2.f * a));
}

__device__ __forceinline__ float gelu_grad(float x, float dy) {
  const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
  const float s = 1.f / (1.f + expf(-2.f * a));  // sigmoid(2a) = 0.5 * (1 + tanh(a))
  const float da = kSqrt2OverPi * (1.f + 3.f * kCoef * x * x);
  return dy * (s + x * 2.f * s * (1.f - s) * da);
}

// nvec packs first (0 when a pointer is misaligned), then elements [nvec * N, n) one by one.
int grid_for(int64_t nvec, int64_t tail) {
  const int64_t units = std::max(nvec, tail);
  return (int)std::max<int64_t>(1, std::min<int64_t>((units + kThreads - 1) / kThreads, 1 << 16));
}

template <typename S>
__global__ void gelu_forward_kernel(S* out, const S* inp, int64_t n, int64_t nvec) {
  constexpr int N = Pack<S>::N;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<S> x = load_pack(inp + v * N);
    Pack<S> o;
#pragma unroll
    for (int k = 0; k < N; k++) o.v[k] = from_float<S>(gelu(to_float(x.v[k])));
    store_pack(out + v * N, o);
  }
  for (int64_t i = nvec * N + tid; i < n; i += stride) out[i] = from_float<S>(gelu(to_float(inp[i])));
}

template <typename S>
__global__ void gelu_backward_kernel(S* dinp, const S* inp, const S* dout, int64_t n, int64_t nvec) {
  constexpr int N = Pack<S>::N;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<S> x = load_pack(inp + v * N), dy = load_pack(dout + v * N);
    Pack<S> o;
#pragma unroll
    for (int k = 0; k < N; k++) o.v[k] = from_float<S>(gelu_grad(to_float(x.v[k]), to_float(dy.v[k])));
    store_pack(dinp + v * N, o);
  }
  for (int64_t i = nvec * N + tid; i < n; i += stride)
    dinp[i] = from_float<S>(gelu_grad(to_float(inp[i]), to_float(dout[i])));
}
}  // namespace

template <typename S>
void gelu_forward(S* out, const S* inp, int64_t n, Stream stream) {
  if (n <= 0) return;
  constexpr int N = Pack<S>::N;
  const int64_t nvec = aligned16(out) && aligned16(inp) ? n / N : 0;
  gelu_forward_kernel<S><<<grid_for(nvec, n - nvec * N), kThreads, 0, stream>>>(out, inp, n, nvec);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void gelu_backward(S* dinp, const S* inp, const S* dout, int64_t n, Stream stream) {
  if (n <= 0) return;
  constexpr int N = Pack<S>::N;
  const int64_t nvec = aligned16(dinp) && aligned16(inp) && aligned16(dout) ? n / N : 0;
  gelu_backward_kernel<S><<<grid_for(nvec, n - nvec * N), kThreads, 0, stream>>>(dinp, inp, dout, n, nvec);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                             \
  template void gelu_forward<S>(S*, const S*, int64_t, Stream);            \
  template void gelu_backward<S>(S*, const S*, const S*, int64_t, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
