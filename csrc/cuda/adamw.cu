// AdamW exactly as torch.optim.AdamW orders it (decoupled decay on the parameter first, then the Adam step with
// bias corrections); CUDA twin of cpu/adamw.cpp, the arithmetic shared through cpu/adamw.h. The engine's step is one
// launch over the whole flat buffer (adamw_step: weight decay by segment, the clip factor, the step counter and the
// skip read from device StepScalars), so the step queues without a host sync. Also the global gradient norm's sums
// of squares (fixed chunks, combined in order: deterministic), the loss accumulator and the clip scaling.
// Mixed precision: adamw_step<S> (S = bf16, f16) also writes the 16-bit compute weights from the new masters with
// dtype.h's round_weight<S> (nearest even, or bf16 stochastic rounding keyed on (seed, step, flat index): the CPU's
// bits exactly).
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/scratch.h"

namespace fastgpt::cuda {

namespace {
constexpr int kThreads = 256;

int grid_for(int64_t n) { return (int)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16); }

// lowp == nullptr: the fp32 update alone; else also lowp[i] = round_weight<S>(new param) in the same pass.
template <typename S>
__global__ void adamw_step_kernel(float* __restrict__ param, S* __restrict__ lowp, const float* __restrict__ grad,
                                  float* __restrict__ m, float* __restrict__ v, AdamWSegments seg, float beta1,
                                  float beta2, float eps, const StepScalars* __restrict__ s, RoundKey key) {
  if (!s->applied) return;
  const float lr = s->lr;
  const float step_size = lr / s->bias_correction1, gscale = s->gscale, bc2 = s->bias_correction2_sqrt;
  key.step = (uint64_t)s->t;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, end = seg.end[seg.n - 1];
  int j = 0;  // the segment of i: i only grows, so the search only moves forward
  for (int64_t i = seg.begin + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end; i += stride) {
    while (seg.end[j] <= i) j++;
    float& mi = m[i - seg.begin];
    float& vi = v[i - seg.begin];
    const float p = adamw_element(param[i], mi, vi, grad[i] * gscale, beta1, beta2, eps,
                                  1.f - lr * seg.weight_decay[j], step_size, bc2);
    if (lowp) lowp[i] = round_weight<S>(p, key, i);
  }
}

// One block per fixed chunk of cpu::kSumChunk elements: the partition depends only on n, so the sum does too.
constexpr int kReduceThreads = 256;

__global__ void sum_squares_kernel(const float* __restrict__ x, int64_t n, double* __restrict__ partial) {
  __shared__ double warp_sums[kReduceThreads / 32];
  const int64_t begin = blockIdx.x * cpu::kSumChunk;
  const int64_t end = begin + cpu::kSumChunk < n ? begin + cpu::kSumChunk : n;
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

// One thread: the order of the additions is the host's.
__global__ void sum_in_order_kernel(double* out, const double* x, int64_t n) {
  double total = 0.0;
  for (int64_t i = 0; i < n; i++) total += x[i];
  *out = total;
}

__global__ void adamw_prepare_kernel(StepScalars* s, const float* lr, const double* parts, int nparts,
                                     const double* losses, int nlosses, double max_norm, bool skip, float beta1,
                                     float beta2, LossScale* ls) {
  adamw_prepare(s, lr, parts, nparts, losses, nlosses, max_norm, skip, beta1, beta2, ls);
}

// One block: a fixed tree over fixed strides, so the loss does not depend on anything but n.
constexpr int kLossThreads = 1024;
__global__ void loss_accumulate_kernel(double* acc, const float* __restrict__ losses, int64_t n, double divisor,
                                       bool reset) {
  __shared__ double sums[kLossThreads];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kLossThreads) s += losses[i];
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int half = kLossThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float mean = (float)(sums[0] / n);  // the float a forward returns
    *acc = (reset ? 0.0 : *acc) + (double)mean / divisor;
  }
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] *= s;
}
}  // namespace

template <typename S>
void adamw_step(float* param, S* lowp, const float* grad, float* m, float* v, const AdamWSegments& seg, float beta1,
                float beta2, float eps, const StepScalars* s, const RoundKey& key, Stream stream) {
  if (seg.n < 1 || seg.n > AdamWSegments::kMax || seg.end[seg.n - 1] <= seg.begin) return;
  const int grid = grid_for(seg.end[seg.n - 1] - seg.begin);
  adamw_step_kernel<S><<<grid, kThreads, 0, stream>>>(param, lowp, grad, m, v, seg, beta1, beta2, eps, s, key);
  FASTGPT_CUDA_CHECK_LAUNCH();
}
template void adamw_step<float>(float*, float*, const float*, float*, float*, const AdamWSegments&, float, float, float,
                                const StepScalars*, const RoundKey&, Stream);
template void adamw_step<bf16>(float*, bf16*, const float*, float*, float*, const AdamWSegments&, float, float, float,
                               const StepScalars*, const RoundKey&, Stream);
template void adamw_step<f16>(float*, f16*, const float*, float*, float*, const AdamWSegments&, float, float, float,
                              const StepScalars*, const RoundKey&, Stream);

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                  Stream stream) {
  if (n <= 0) return;
  StepScalars s;
  AdamWSegments seg;
  cpu::single_range_step(h, n, &s, &seg);
  // The op's scalars go to stream-ordered device memory (the engine keeps its own, sized once).
  StepScalars* dev = static_cast<StepScalars*>(pool_malloc(sizeof(StepScalars), stream));
  // From pageable memory: the copy has taken s by the time it returns.
  FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dev, &s, sizeof s, cudaMemcpyHostToDevice, stream));
  adamw_step<float>(param, nullptr, grad, m, v, seg, h.beta1, h.beta2, h.eps, dev, RoundKey{}, stream);
  FASTGPT_CUDA_CHECK(cudaFreeAsync(dev, stream));
}

void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                   int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls, Stream stream) {
  adamw_prepare_kernel<<<1, 1, 0, stream>>>(s, lr, parts, nparts, losses, nlosses, max_norm, skip, beta1, beta2, ls);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void sum_squares_partials(double* partial, const float* x, int64_t n, Stream stream) {
  if (n <= 0) return;
  const unsigned chunks = (unsigned)((n + cpu::kSumChunk - 1) / cpu::kSumChunk);
  sum_squares_kernel<<<chunks, kReduceThreads, 0, stream>>>(x, n, partial);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void sum_in_order(double* out, const double* x, int64_t n, Stream stream) {
  sum_in_order_kernel<<<1, 1, 0, stream>>>(out, x, n);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset, Stream stream) {
  loss_accumulate_kernel<<<1, kLossThreads, 0, stream>>>(acc, losses, n, divisor, reset);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void scale_inplace(float* x, int64_t n, float s, Stream stream) {
  if (n <= 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, s);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace fastgpt::cuda
