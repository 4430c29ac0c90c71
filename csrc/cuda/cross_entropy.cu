// Softmax cross-entropy over the vocabulary, forward and backward, never storing the probabilities; CUDA twin of
// csrc/cpu/cross_entropy.cpp. Forward: one block per row, a max then a sum-of-exp block reduction, keeping only
// lse = max + log(sum) for backward. Backward: one block per row rebuilds each probability from lse.
// dlogits may alias logits (written in place), so no __restrict__ there: each element is read, then written, by one
// thread, and the target element's one-hot is applied by that same thread (no second pass over it).
// Templates over the storage type S (float, bf16, f16) of the logits: widened as loaded, all arithmetic in float,
// losses and lse float. The gradient is (p - onehot) * dloss rounded once to S, as the CPU writes it: in 16 bits
// p - 1 at the target is formed before rounding (not p rounded, then - 1). forward_backward (the training step's
// chunked classifier) does both in one kernel: one read of the row keeps a running (max, sum of exp) per thread,
// merged across the block, and a second read writes the gradient: two reads of the logits instead of three.
#include <cmath>

#include "cuda/check.h"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
constexpr int kThreads = 512;  // a multiple of 32: the block reduction assumes full warps

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Every thread of the block gets the result. Must be reached by all threads of the block.
template <class Op>
__device__ float block_reduce(float v, Op op, float identity) {
  __shared__ float per_warp[32];
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  __syncthreads();  // a previous call's readers are done with per_warp
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  v = lane < nwarps ? per_warp[lane] : identity;  // each warp reduces the per-warp values itself: no broadcast step
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <typename S>
__global__ void cross_entropy_forward_kernel(float* __restrict__ losses, float* __restrict__ lse,
                                             const S* __restrict__ logits, const int32_t* __restrict__ targets,
                                             int V) {
  const int64_t n = blockIdx.x;
  const S* x = logits + n * V;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, to_float(x[j]));
  mx = block_reduce(mx, Max(), -INFINITY);
  float s = 0.f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_float(x[j]) - mx);
  s = block_reduce(s, Sum(), 0.f);
  if (threadIdx.x == 0) {
    const float l = mx + logf(s);
    lse[n] = l;
    losses[n] = l - to_float(x[targets[n]]);
  }
}

template <typename S>
__global__ void cross_entropy_backward_kernel(S* dlogits, const S* logits, const float* __restrict__ lse,
                                              const int32_t* __restrict__ targets, float dloss,
                                              const float* __restrict__ dloss_scale, int V) {
  if (dloss_scale) dloss = __fmul_rn(dloss, *dloss_scale);
  const int64_t n = blockIdx.x;
  const S* x = logits + n * V;
  S* dx = dlogits + n * V;
  const float l = lse[n];
  const int t = targets[n];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    // (p - onehot) * dloss, as the CPU: the subtraction first, one multiply, one rounding to S.
    const float p = expf(to_float(x[j]) - l);
    dx[j] = from_float<S>(__fmul_rn(j == t ? __fsub_rn(p, 1.f) : p, dloss));
  }
}
// (max, sum of exp(x - max)) over a part of a row; an empty part is (-inf, 0).
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};  // both empty: exp(-inf - -inf) would be NaN
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};  // a + b == b + a: every lane ends with the same bits
}

// Every thread of the block gets the row's (max, sum). Must be reached by all threads of the block.
__device__ MaxSum block_reduce(MaxSum v) {
  __shared__ float pm[32];
  __shared__ float ps[32];
  for (int off = 16; off > 0; off >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)});
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) {
    pm[warp] = v.m;
    ps[warp] = v.s;
  }
  __syncthreads();
  v = lane < nwarps ? MaxSum{pm[lane], ps[lane]} : MaxSum{-INFINITY, 0.f};
  for (int off = 16; off > 0; off >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)});
  return v;
}

template <typename S>
__global__ void cross_entropy_forward_backward_kernel(float* __restrict__ losses, S* dlogits, const S* logits,
                                                      const int32_t* __restrict__ targets, float dloss,
                                                      const float* __restrict__ dloss_scale, int V) {
  if (dloss_scale) dloss = __fmul_rn(dloss, *dloss_scale);
  const int64_t n = blockIdx.x;
  const S* x = logits + n * V;
  S* dx = dlogits + n * V;
  MaxSum a{-INFINITY, 0.f};
  for (int j = threadIdx.x; j < V; j += blockDim.x) {  // online: rescale the sum when the max grows
    const float v = to_float(x[j]);
    if (v > a.m) {
      a.s = a.s * expf(a.m - v) + 1.f;
      a.m = v;
    } else {
      a.s += expf(v - a.m);
    }
  }
  a = block_reduce(a);
  const float l = a.m + logf(a.s);
  const int t = targets[n];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = to_float(x[j]);
    const float p = expf(v - l);
    // The loss by the thread that owns the target, from its own read: in place, no other thread writes x[t].
    if (j == t) losses[n] = l - v;
    dx[j] = from_float<S>(__fmul_rn(j == t ? __fsub_rn(p, 1.f) : p, dloss));
  }
}
}  // namespace

template <typename S>
void cross_entropy_forward(float* losses, float* lse, const S* logits, const int32_t* targets, int64_t N, int V,
                           Stream stream) {
  if (N <= 0 || V <= 0) return;
  cross_entropy_forward_kernel<S><<<(unsigned)N, kThreads, 0, stream>>>(losses, lse, logits, targets, V);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void cross_entropy_backward(S* dlogits, const S* logits, const float* lse, const int32_t* targets, float dloss,
                            const float* dloss_scale, int64_t N, int V, Stream stream) {
  if (N <= 0 || V <= 0) return;
  auto* kernel = cross_entropy_backward_kernel<S>;  // (a launch on one line: tests/warp_emu rewrites it)
  kernel<<<(unsigned)N, kThreads, 0, stream>>>(dlogits, logits, lse, targets, dloss, dloss_scale, V);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void cross_entropy_forward_backward(float* losses, S* dlogits, const S* logits, const int32_t* targets, float dloss,
                                    const float* dloss_scale, int64_t N, int V, Stream stream) {
  if (N <= 0 || V <= 0) return;
  auto* kernel = cross_entropy_forward_backward_kernel<S>;  // (a launch on one line: tests/warp_emu rewrites it)
  kernel<<<(unsigned)N, kThreads, 0, stream>>>(losses, dlogits, logits, targets, dloss, dloss_scale, V);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                                                                 \
  template void cross_entropy_forward<S>(float*, float*, const S*, const int32_t*, int64_t, int, Stream);      \
  template void cross_entropy_backward<S>(S*, const S*, const float*, const int32_t*, float, const float*, int64_t, \
                                         int, Stream);                                                        \
  template void cross_entropy_forward_backward<S>(float*, S*, const S*, const int32_t*, float, const float*,  \
                                                  int64_t, int, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
