// Conversions between float32 and the 16-bit storage types on the GPU; CUDA twin of csrc/cpu/cast.cpp.
// widen<S>: exact, 16-bit -> float (e.g. to show compute weights or activations as float32).
// narrow<S>: fp32 masters -> 16-bit compute weights with dtype.h's round_weight<S>(in[i], key, i): nearest even, or
// bf16 stochastic rounding keyed on (seed, step, key.offset + i), so the GPU writes the very bits the CPU does.
// Memory-bound: 16-byte packs of the 16-bit side (8 elements; two float packs) when both pointers are 16-byte
// aligned, then a scalar tail; each element's value is the same on either path.

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
constexpr int kThreads = kElementwiseThreads;
constexpr int N = 8;  // 16-bit elements per 16-byte pack

template <typename S>
__global__ void widen_kernel(float* __restrict__ out, const S* __restrict__ in, int64_t n, int64_t nvec) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<S> x = load_pack(in + v * N);
    Pack<float> lo, hi;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      lo.v[k] = to_float(x.v[k]);
      hi.v[k] = to_float(x.v[k + 4]);
    }
    store_pack(out + v * N, lo);
    store_pack(out + v * N + 4, hi);
  }
  for (int64_t i = nvec * N + tid; i < n; i += stride) out[i] = to_float(in[i]);
}

template <typename S>
__global__ void narrow_kernel(S* __restrict__ out, const float* __restrict__ in, int64_t n, int64_t nvec,
                              RoundKey key) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<float> lo = load_pack(in + v * N), hi = load_pack(in + v * N + 4);
    Pack<S> o;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      o.v[k] = round_weight<S>(lo.v[k], key, v * N + k);
      o.v[k + 4] = round_weight<S>(hi.v[k], key, v * N + k + 4);
    }
    store_pack(out + v * N, o);
  }
  for (int64_t i = nvec * N + tid; i < n; i += stride) out[i] = round_weight<S>(in[i], key, i);
}
}  // namespace

template <typename S>
void widen(float* out, const S* in, int64_t n, Stream stream) {
  if (n <= 0) return;
  const int64_t nvec = aligned16(out) && aligned16(in) ? n / N : 0;
  widen_kernel<S><<<elementwise_grid(nvec, n - nvec * N), kThreads, 0, stream>>>(out, in, n, nvec);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void narrow(S* out, const float* in, int64_t n, const RoundKey& key, Stream stream) {
  if (n <= 0) return;
  const int64_t nvec = aligned16(out) && aligned16(in) ? n / N : 0;
  narrow_kernel<S><<<elementwise_grid(nvec, n - nvec * N), kThreads, 0, stream>>>(out, in, n, nvec, key);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template void widen<bf16>(float*, const bf16*, int64_t, Stream);
template void widen<f16>(float*, const f16*, int64_t, Stream);
template void narrow<bf16>(bf16*, const float*, int64_t, const RoundKey&, Stream);
template void narrow<f16>(f16*, const float*, int64_t, const RoundKey&, Stream);

}  // namespace fastgpt::cuda
