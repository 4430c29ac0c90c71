// Softmax cross-entropy over the vocabulary, forward and backward, without ever storing the probabilities:
// forward keeps one log-sum-exp per row; backward rebuilds each probability from it and may write the logit
// gradients over the logits (the classifier layout llm.c uses, and the CUDA kernel will use). forward_backward
// does both in one pass per row: the training step's chunked classifier (csrc/engine/gpt.cpp) wants the loss and
// its gradient together and never keeps the logits.
#include <cmath>

#include "cpu/kernels.h"
#include "cpu/vmath.h"

namespace fastgpt::cpu {

namespace {
// log-sum-exp of one row: float lanes within blocks of 1024 (so the loop vectorises), blocks added in double.
template <typename S>
float row_lse(const S* x, int V) {
  float mx = to_float(x[0]);
#pragma omp simd reduction(max : mx)
  for (int j = 0; j < V; j++) mx = to_float(x[j]) > mx ? to_float(x[j]) : mx;
  double sum = 0.0;
  for (int j0 = 0; j0 < V; j0 += 1024) {
    const int j1 = j0 + 1024 < V ? j0 + 1024 : V;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int j = j0; j < j1; j++) s += vexp(to_float(x[j]) - mx);
    sum += s;
  }
  return mx + (float)std::log(sum);
}

// dx = dloss * (softmax(x) - onehot(tgt)) from the row's lse; dx may be x.
template <typename S>
void row_grad(S* dx, const S* x, float l, int32_t tgt, float dloss, int V) {
  const float xt = to_float(x[tgt]);  // read before the loop: dx may be x
#pragma omp simd
  for (int j = 0; j < V; j++) dx[j] = from_float<S>(vexp(to_float(x[j]) - l) * dloss);
  // The target's term is subtracted before rounding: in 16 bits, p - 1 rounded once, not p rounded then - 1.
  // (Outside the loop, which a j-dependent term would keep from vectorising.)
  dx[tgt] = from_float<S>((vexp(xt - l) - 1.f) * dloss);
}
}  // namespace

template <typename S>
void cross_entropy_forward(float* losses, float* lse, const S* logits, const int32_t* targets, int64_t N, int V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const S* x = logits + n * V;
    const float l = row_lse(x, V);
    lse[n] = l;
    losses[n] = l - to_float(x[targets[n]]);
  }
}

template <typename S>
void cross_entropy_backward(S* dlogits, const S* logits, const float* lse, const int32_t* targets, float dloss,
                            const float* dloss_scale, int64_t N, int V) {
  if (dloss_scale) dloss *= *dloss_scale;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) row_grad(dlogits + n * V, logits + n * V, lse[n], targets[n], dloss, V);
}

template <typename S>
void cross_entropy_forward_backward(float* losses, S* dlogits, const S* logits, const int32_t* targets, float dloss,
                                    const float* dloss_scale, int64_t N, int V) {
  if (dloss_scale) dloss *= *dloss_scale;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const S* x = logits + n * V;
    const float l = row_lse(x, V);
    losses[n] = l - to_float(x[targets[n]]);  // before row_grad: dlogits may be logits
    row_grad(dlogits + n * V, x, l, targets[n], dloss, V);
  }
}

#define FASTGPT_INSTANTIATE(S)                                                                              \
  template void cross_entropy_forward<S>(float*, float*, const S*, const int32_t*, int64_t, int);           \
  template void cross_entropy_backward<S>(S*, const S*, const float*, const int32_t*, float, const float*, int64_t, \
                                         int);                                                                \
  template void cross_entropy_forward_backward<S>(float*, S*, const S*, const int32_t*, float, const float*, \
                                                  int64_t, int);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cpu
