// Softmax cross-entropy over the vocabulary, forward and backward, never storing the probabilities; CUDA twin of
// csrc/cpu/cross_entropy.cpp. Forward: one block per row, a max then a sum-of-exp block reduction, keeping only
// lse = max + log(sum) for backward. Backward: one block per row rebuilds each probability from lse.
// dlogits may alias logits (written in place), so no __restrict__ there: each element is read, then written, by one
// thread, and the target element's "- dloss" is applied by that same thread (no second pass over it).
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

__global__ void cross_entropy_forward_kernel(float* __restrict__ losses, float* __restrict__ lse,
                                             const float* __restrict__ logits, const int32_t* __restrict__ targets,
                                             int V) {
  const int64_t n = blockIdx.x;
  const float* x = logits + n * V;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, x[j]);
  mx = block_reduce(mx, Max(), -INFINITY);
  float s = 0.f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(x[j] - mx);
  s = block_reduce(s, Sum(), 0.f);
  if (threadIdx.x == 0) {
    const float l = mx + logf(s);
    lse[n] = l;
    losses[n] = l - x[targets[n]];
  }
}

__global__ void cross_entropy_backward_kernel(float* dlogits, const float* logits, const float* __restrict__ lse,
                                              const int32_t* __restrict__ targets, float dloss, int V) {
  const int64_t n = blockIdx.x;
  const float* x = logits + n * V;
  float* dx = dlogits + n * V;
  const float l = lse[n];
  const int t = targets[n];
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    // __fmul_rn: no fused multiply-subtract at the target, so it is (p * dloss) - dloss as on the CPU.
    float d = __fmul_rn(expf(x[j] - l), dloss);
    if (j == t) d -= dloss;
    dx[j] = d;
  }
}
}  // namespace

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int V, Stream stream) {
  if (N <= 0 || V <= 0) return;
  cross_entropy_forward_kernel<<<(unsigned)N, kThreads, 0, stream>>>(losses, lse, logits, targets, V);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            float dloss, int64_t N, int V, Stream stream) {
  if (N <= 0 || V <= 0) return;
  cross_entropy_backward_kernel<<<(unsigned)N, kThreads, 0, stream>>>(dlogits, logits, lse, targets, dloss, V);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace fastgpt::cuda
