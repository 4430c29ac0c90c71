// Residual add fused with the LayerNorm that reads the sum; CUDA twin of csrc/cpu/residual_layernorm.cpp.
// One warp per row: each lane adds its columns of a and b (in float, rounded once to S, as residual.cu does),
// writes them to res and sums them as it goes, then runs the row's LayerNorm (cuda/layernorm.cuh, the body
// layernorm.cu runs too) over what it wrote. So the result is the unfused pair's bits, with one kernel instead of
// two and the sum never read back from another thread: each lane reads only the columns it wrote (from L1).
// res may alias a or b (the engine adds the skip in place): each element is read, then written, by one lane, so no
// __restrict__ on those three.
// Where the row fits in registers (layernorm_row_fits, and layernorm_one_pass on, as layernorm_forward decides), a
// lane keeps its packs of the sum from the add to the output (layernorm_row_packs): a and b are read once, res
// written once and never read back.
#include "cuda/check.h"
#include "cuda/layernorm.cuh"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
constexpr int kWarpsPerBlock = 8;

template <typename S>
__global__ void residual_layernorm_forward_kernel(S* res, S* __restrict__ out, float* __restrict__ mean,
                                                  float* __restrict__ rstd, const S* a, const S* b,
                                                  const S* __restrict__ weight, const S* __restrict__ bias,
                                                  int64_t N, int C) {
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;  // whole warp leaves together: the shuffles see all 32 lanes
  const int lane = threadIdx.x % 32;
  S* x = res + n * C;
  const S* ra = a + n * C;
  const S* rb = b + n * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) {
    const S v = from_float<S>(to_float(ra[c]) + to_float(rb[c]));
    x[c] = v;
    s += to_float(v);
  }
  layernorm_row(out + n * C, mean + n, rstd + n, (const S*)x, weight, bias, C, lane, s);
}

template <typename S>
__global__ void residual_layernorm_forward_one_pass_kernel(S* res, S* __restrict__ out, float* __restrict__ mean,
                                                           float* __restrict__ rstd, const S* a, const S* b,
                                                           const S* __restrict__ weight, const S* __restrict__ bias,
                                                           int64_t N, int C, RowPack<S> io) {
  constexpr int P = RowPack<S>::P;
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;
  layernorm_row_packs(out + n * C, mean + n, rstd + n, weight, bias, C, threadIdx.x % 32, io, [&](int c) {
    const int64_t i = n * C + c;
    const Pack<S> pa = io.load(a + i), pb = io.load(b + i);
    Pack<S> x;
#pragma unroll
    for (int e = 0; e < P; e++) x.v[e] = from_float<S>(to_float(pa.v[e]) + to_float(pb.v[e]));
    io.store(res + i, x);
    return x;
  });
}
}  // namespace

template <typename S>
void residual_layernorm_forward(S* res, S* out, float* mean, float* rstd, const S* a, const S* b, const S* weight,
                                const S* bias, int64_t N, int C, Stream stream) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (layernorm_one_pass() && layernorm_row_fits<S>(C)) {
    const RowPack<S> io{{aligned16(res) && aligned16(out) && aligned16(a) && aligned16(b) && aligned16(weight) &&
                         aligned16(bias)}};
    auto* kernel = residual_layernorm_forward_one_pass_kernel<S>;  // one-line launch: the warp emulator rewrites it
    kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(res, out, mean, rstd, a, b, weight, bias, N, C, io);
  } else {
    auto* kernel = residual_layernorm_forward_kernel<S>;
    kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(res, out, mean, rstd, a, b, weight, bias, N, C);
  }
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                                                                   \
  template void residual_layernorm_forward<S>(S*, S*, float*, float*, const S*, const S*, const S*, const S*, \
                                              int64_t, int, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
