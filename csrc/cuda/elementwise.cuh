// One elementwise map for the storage type S (float, bf16, f16), written once for GELU forward and backward and
// the residual add: out[i] = f(a[i]) or f(a[i], b[i]), loaded as S, computed in float, rounded once to S. Memory-
// bound, so 16-byte packs (128-bit loads/stores) when every pointer is 16-byte aligned, then a scalar tail; the
// per-element arithmetic is the same on both paths, so the result does not depend on alignment.
// out may alias an input (gelu_backward writes dinp over dout, the residual add writes over one operand): each
// element (or pack) is read before it is written, by the same thread, so no __restrict__.
// CUDA-only header with a launch: include it from .cu files.
#pragma once
#include <type_traits>

#include "cuda/check.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace detail {
template <typename F, typename S>
__device__ __forceinline__ float apply(const F& f, S a, S b) {
  if constexpr (std::is_invocable_v<F, float>)
    return f(to_float(a));
  else
    return f(to_float(a), to_float(b));
}

template <typename S, typename F>
__global__ void map_kernel(S* out, const S* a, const S* b, int64_t n, int64_t nvec, F f) {
  constexpr int N = Pack<S>::N;
  constexpr bool unary = std::is_invocable_v<F, float>;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<S> x = load_pack(a + v * N);
    Pack<S> y{}, o;
    if constexpr (!unary) y = load_pack(b + v * N);
#pragma unroll
    for (int k = 0; k < N; k++) o.v[k] = from_float<S>(apply(f, x.v[k], y.v[k]));
    store_pack(out + v * N, o);
  }
  for (int64_t i = nvec * N + tid; i < n; i += stride) out[i] = from_float<S>(apply(f, a[i], unary ? a[i] : b[i]));
}
}  // namespace detail

// f: a functor with a __device__ float operator()(float) (b == nullptr) or (float, float).
template <typename S, typename F>
void elementwise(S* out, const S* a, const S* b, int64_t n, F f, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int N = Pack<S>::N;
  const int64_t nvec = aligned16(out) && aligned16(a) && aligned16(b) ? n / N : 0;
  detail::map_kernel<S, F><<<elementwise_grid(nvec, n - nvec * N), kElementwiseThreads, 0, stream>>>(out, a, b, n,
                                                                                                      nvec, f);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace fastgpt::cuda
