// GELU with the tanh approximation (GPT-2's), forward and backward; CUDA twin of csrc/cpu/gelu.cpp.
// Same sigmoid form as the CPU file: 0.5 * (1 + tanh(a)) == sigmoid(2a), so gelu(x) = x / (1 + exp(-2a)), which
// has no cancellation in 1 + tanh(a) for large negative x. expf (not __expf) keeps the error near the CPU's.
// Templates over the storage type S (float, bf16, f16): load S, compute in float, store S rounded once to nearest
// even, through the shared elementwise map (cuda/elementwise.cuh: 16-byte packs where aligned; gelu_backward's
// dinp may alias dout).
#include "cuda/elementwise.cuh"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoef = 0.044715f;

struct Gelu {
  __device__ float operator()(float x) const {
    const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
    return x / (1.f + expf(-2.f * a));
  }
};

struct GeluGrad {  // d(gelu)/dx times dy
  __device__ float operator()(float x, float dy) const {
    const float a = kSqrt2OverPi * (x + kCoef * x * x * x);
    const float s = 1.f / (1.f + expf(-2.f * a));  // sigmoid(2a) = 0.5 * (1 + tanh(a))
    const float da = kSqrt2OverPi * (1.f + 3.f * kCoef * x * x);
    return dy * (s + x * 2.f * s * (1.f - s) * da);
  }
};
}  // namespace

template <typename S>
void gelu_forward(S* out, const S* inp, int64_t n, Stream stream) {
  elementwise(out, inp, (const S*)nullptr, n, Gelu{}, stream);
}

template <typename S>
void gelu_backward(S* dinp, const S* inp, const S* dout, int64_t n, Stream stream) {
  elementwise(dinp, inp, dout, n, GeluGrad{}, stream);
}

#define FASTGPT_INSTANTIATE(S)                                             \
  template void gelu_forward<S>(S*, const S*, int64_t, Stream);            \
  template void gelu_backward<S>(S*, const S*, const S*, int64_t, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
