// Softmax cross-entropy over the vocabulary, forward and backward, without ever storing the probabilities:
// forward keeps one log-sum-exp per row; backward rebuilds each probability from it and may write the logit
// gradients over the logits (the classifier layout llm.c uses, and the CUDA kernel will use).
#include <cmath>

#include "cpu/kernels.h"
#include "cpu/vmath.h"

namespace fastgpt::cpu {

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float* x = logits + n * V;
    float mx = x[0];
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
    // float lanes within blocks of 1024 (so the loop vectorises), blocks added in double.
    double sum = 0.0;
    for (int j0 = 0; j0 < V; j0 += 1024) {
      const int j1 = j0 + 1024 < V ? j0 + 1024 : V;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int j = j0; j < j1; j++) s += vexp(x[j] - mx);
      sum += s;
    }
    const float l = mx + (float)std::log(sum);
    lse[n] = l;
    losses[n] = l - x[targets[n]];
  }
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            float dloss, int64_t N, int V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float* x = logits + n * V;
    float* dx = dlogits + n * V;
    const float l = lse[n];
#pragma omp simd
    for (int j = 0; j < V; j++) dx[j] = vexp(x[j] - l) * dloss;
    dx[targets[n]] -= dloss;
  }
}

}  // namespace fastgpt::cpu
