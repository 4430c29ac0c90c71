// AdamW exactly as torch.optim.AdamW orders it (decoupled decay on the parameter first, then the Adam step with
// bias corrections); CUDA twin of cpu::adamw_update. Elementwise over one contiguous range, grid-stride loop.
// decay and step_size are formed on the host with the same float expressions as the CPU file.
// Also the global gradient norm's sum of squares (deterministic) and the clip scaling.
// Mixed precision: adamw_update_mixed<S> (S = bf16, f16) makes the same update of the fp32 masters and, in the same
// pass, writes the 16-bit compute weights from the new masters with dtype.h's round_weight<S> (nearest even, or
// bf16 stochastic rounding keyed on (seed, step, key.offset + i): the CPU's bits exactly).
#include <algorithm>
#include <vector>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/scratch.h"

namespace fastgpt::cuda {

namespace {
// lowp == nullptr: the fp32 update alone; else also lowp[i] = round_weight<S>(new param) in the same pass.
template <typename S>
__global__ void adamw_kernel(float* __restrict__ param, S* __restrict__ lowp, const float* __restrict__ grad,
                             float* __restrict__ m, float* __restrict__ v, int64_t n, float beta1, float beta2,
                             float eps, float decay, float step_size, float bias_correction2_sqrt, RoundKey key) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = grad[i];
    const float mo = m[i];
    const float mi = mo + (1.f - beta1) * (g - mo);  // torch's lerp form
    const float vi = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
    const float p = param[i] * decay - step_size * mi / denom;
    param[i] = p;
    if (lowp) lowp[i] = round_weight<S>(p, key, i);
  }
}

template <typename S>
void launch_adamw(float* param, S* lowp, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                  const RoundKey& key, Stream stream) {
  if (n <= 0) return;
  const float decay = 1.f - h.lr * h.weight_decay;
  const float step_size = h.lr / h.bias_correction1;
  constexpr int kThreads = 256;
  const int blocks = (int)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  adamw_kernel<S><<<blocks, kThreads, 0, stream>>>(param, lowp, grad, m, v, n, h.beta1, h.beta2, h.eps, decay,
                                                   step_size, h.bias_correction2_sqrt, key);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

// One block per fixed chunk of kChunk elements: the partition depends only on n, so the sum does too.
constexpr int64_t kChunk = 1 << 16;
constexpr int kReduceThreads = 256;

__global__ void sum_squares_kernel(const float* __restrict__ x, int64_t n, double* __restrict__ partial) {
  __shared__ double warp_sums[kReduceThreads / 32];
  const int64_t begin = blockIdx.x * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  double s = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += (double)x[i] * x[i];
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < kReduceThreads / 32; w++) t += warp_sums[w];
    partial[blockIdx.x] = t;
  }
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] *= s;
}
}  // namespace

double sum_squares(const float* x, int64_t n, Stream stream) {
  if (n <= 0) return 0.0;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  double* partial = nullptr;
  partial = static_cast<double*>(pool_malloc(chunks * sizeof(double), stream));
  sum_squares_kernel<<<(unsigned)chunks, kReduceThreads, 0, stream>>>(x, n, partial);
  FASTGPT_CUDA_CHECK_LAUNCH();
  std::vector<double> host(chunks);
  FASTGPT_CUDA_CHECK(cudaMemcpyAsync(host.data(), partial, chunks * sizeof(double), cudaMemcpyDeviceToHost, stream));
  FASTGPT_CUDA_CHECK(cudaFreeAsync(partial, stream));
  FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total = 0.0;
  for (double p : host) total += p;  // in chunk order, as the CPU does
  return total;
}

void scale_inplace(float* x, int64_t n, float s, Stream stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int blocks = (int)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16);
  scale_kernel<<<blocks, kThreads, 0, stream>>>(x, n, s);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                  Stream stream) {
  launch_adamw<float>(param, nullptr, grad, m, v, n, h, RoundKey{}, stream);
}

template <typename S>
void adamw_update_mixed(float* param, S* lowp, const float* grad, float* m, float* v, int64_t n,
                        const AdamWHyper& h, const RoundKey& key, Stream stream) {
  launch_adamw<S>(param, lowp, grad, m, v, n, h, key, stream);
}

template void adamw_update_mixed<bf16>(float*, bf16*, const float*, float*, float*, int64_t, const AdamWHyper&,
                                       const RoundKey&, Stream);
template void adamw_update_mixed<f16>(float*, f16*, const float*, float*, float*, int64_t, const AdamWHyper&,
                                      const RoundKey&, Stream);

}  // namespace fastgpt::cuda
