// The CPU kernels: the reference implementation of every op fastgpt has, and the backend that lets the whole
// trainer run and be tested without a GPU. Each op lives in csrc/cpu/<op>.cpp beside its CUDA twin
// csrc/cuda/<op>.cu. Kernels know nothing of the model or of Python: raw float32 pointers, row-major, contiguous.
//
// Conventions: N = number of rows (B*T); gradients of parameters ACCUMULATE (+=) so that gradient accumulation over
// micro-batches is free; gradients of activations overwrite unless stated. Every kernel gives bitwise the same
// result whatever the number of OpenMP threads (no reduction order depends on the thread count).
#pragma once
#include <cstdint>

namespace fastgpt::cpu {

// ---- encoder: token + position embedding (encoder.cpp)
void encoder_forward(float* out,                 // (B, T, C)
                     const int32_t* idx,         // (B, T)
                     const float* wte,           // (V, C)
                     const float* wpe,           // (maxT, C)
                     int B, int T, int C);
void encoder_backward(float* dwte, float* dwpe,  // += (V, C), (maxT, C)
                      const float* dout,         // (B, T, C)
                      const int32_t* idx, int B, int T, int C);

// ---- layernorm over the last dimension, eps 1e-5 (layernorm.cpp)
void layernorm_forward(float* out,               // (N, C)
                       float* mean, float* rstd, // (N)
                       const float* inp,         // (N, C)
                       const float* weight, const float* bias,  // (C)
                       int64_t N, int C);
void layernorm_backward(float* dinp,             // += (N, C): the residual stream accumulates
                        float* dweight, float* dbias,  // += (C)
                        const float* dout, const float* inp, const float* weight,
                        const float* mean, const float* rstd, int64_t N, int C);

// ---- matmul as nn.Linear: out = inp @ weight^T + bias (matmul.cpp)
void matmul_forward(float* out,                  // (N, OC)
                    const float* inp,            // (N, C)
                    const float* weight,         // (OC, C)
                    const float* bias,           // (OC) or nullptr
                    int64_t N, int C, int OC);
void matmul_backward(float* dinp,                // (N, C) overwritten, or nullptr to skip
                     float* dweight,             // += (OC, C)
                     float* dbias,               // += (OC) or nullptr
                     const float* dout,          // (N, OC)
                     const float* inp, const float* weight, int64_t N, int C, int OC);

// ---- GELU, tanh approximation (gelu.cpp)
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp,                  // overwritten; may alias dout
                   const float* inp, const float* dout, int64_t n);

// ---- residual add (residual.cpp)
void residual_forward(float* out, const float* a, const float* b, int64_t n);  // out may alias a or b

// ---- flash attention: scaled dot-product attention that saves only the log-sum-exp; backward recomputes
// (flash_attention.cpp). q, k, v, out and the gradients are (B, H, T, d) views, unit stride along d: element
// (b, h, t, i) of a view lives at ptr[b * sb + h * sh + t * st + i]. One description covers separate (B, H, T, d)
// or (B, T, H, d) tensors and the engine's fused qkv (B, T, 3C). The scale is 1/sqrt(d).
struct HeadStrides {
  int64_t sb, sh, st;
};
struct AttentionShape {
  int B, H, T, d;
  bool causal;
};
void flash_attention_forward(float* out, const HeadStrides& os,  // (B, H, T, d) view
                             float* lse,                         // (B, H, T) contiguous
                             const float* q, const float* k, const float* v, const HeadStrides& is,
                             const AttentionShape& shape);
// dq, dk, dv (overwritten) share the strides `is` of q, k, v; dout shares those of out.
void flash_attention_backward(float* dq, float* dk, float* dv, const HeadStrides& is, const float* dout,
                              const float* out, const HeadStrides& os, const float* q, const float* k,
                              const float* v, const float* lse, const AttentionShape& shape);

// ---- attention as the engine lays it out: the flash kernel on the fused projection (attention.cpp)
// qkv holds q | k | v, each C = NH * hs wide, head h at columns h*hs of its third.
void attention_forward(float* out,               // (B, T, C)
                       float* lse,               // (B, NH, T)
                       const float* qkv,         // (B, T, 3C)
                       int B, int T, int C, int NH, bool causal);
void attention_backward(float* dqkv,             // (B, T, 3C) overwritten
                        const float* dout,       // (B, T, C)
                        const float* qkv, const float* out, const float* lse,
                        int B, int T, int C, int NH, bool causal);

// ---- softmax cross-entropy; probabilities are never stored (cross_entropy.cpp)
void cross_entropy_forward(float* losses,        // (N)
                           float* lse,           // (N) log-sum-exp of each row, for backward
                           const float* logits,  // (N, V)
                           const int32_t* targets, int64_t N, int V);
// dlogits = dloss * (softmax(logits) - onehot(target)); dlogits may alias logits (written in place).
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            float dloss, int64_t N, int V);

// ---- AdamW as torch.optim.AdamW (adamw.cpp)
// One contiguous range; bias corrections precomputed by the caller (they depend only on the step).
struct AdamWHyper {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1, bias_correction2_sqrt;  // 1 - beta1^t, sqrt(1 - beta2^t)
};
// The hyper-parameters of update number `step` (1-based): the bias corrections are formed here, in double, once.
AdamWHyper adamw_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h);
// Sum of squares in float64, over fixed-size chunks combined in order: deterministic for any thread count.
double sum_squares(const float* x, int64_t n);
void scale_inplace(float* x, int64_t n, float s);

}  // namespace fastgpt::cpu
