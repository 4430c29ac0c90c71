// Softmax cross-entropy over the vocabulary, forward and backward, without ever storing the probabilities:
// forward keeps one log-sum-exp per row; backward rebuilds each probability from it and may write the logit
// gradients over the logits (the classifier layout llm.c uses, and the CUDA kernel will use).
#include <cmath>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    const float* x = logits + n * V;
    float mx = x[0];
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < V; j++) sum += std::exp(x[j] - mx);
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
    for (int j = 0; j < V; j++) dx[j] = std::exp(x[j] - l) * dloss;
    dx[targets[n]] -= dloss;
  }
}

}  // namespace fastgpt::cpu
