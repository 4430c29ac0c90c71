// The CPU kernels: the reference implementation of every op fastgpt has, and the backend that lets the whole
// trainer run and be tested without a GPU. Each op lives in csrc/cpu/<op>.cpp beside its CUDA twin
// csrc/cuda/<op>.cu. Kernels know nothing of the model or of Python: raw pointers, row-major, contiguous.
//
// Precision: the ops of the model are templates over the storage type S of activations and compute weights
// (float, bf16 or f16, see dtype.h), instantiated for all three. Arithmetic is float whatever S is (matmuls
// accumulate in float, statistics in float or double); parameter gradients, LayerNorm statistics, log-sum-exps
// and losses are always float32, so gradients accumulate in fp32 across micro-batches.
//
// Conventions: N = number of rows (B*T); gradients of parameters ACCUMULATE (+=) so that gradient accumulation over
// micro-batches is free; gradients of activations overwrite unless stated. Every kernel gives bitwise the same
// result whatever the number of OpenMP threads (no reduction order depends on the thread count).
#pragma once
#include <cstdint>

#include "cpu/adamw.h"
#include "cpu/dtype.h"

namespace fastgpt::cpu {

// ---- encoder: token + position embedding (encoder.cpp)
template <typename S>
void encoder_forward(S* out,                     // (B, T, C)
                     const int32_t* idx,         // (B, T)
                     const S* wte,               // (V, C)
                     const S* wpe,               // (maxT, C)
                     int B, int T, int C);
// dwte's order, the GPU's too (cuda/encoder.cu): with the B T positions sorted by token, stably, each token's rows
// form a run; a run is cut where it crosses a multiple of kEncoderPiece sorted indices. The first piece is added row
// by row in position order onto dwte's row as it was; each later piece is summed from +0 in position order, and the
// pieces are then added to the row in turn. A run within one piece (every token but the commonest few at GPT-2's
// batch) is one chain of adds in position order; GPT-2's "\n" (7,300 to 7,700 of the 65,536 tokens of a batch of
// Tiny Shakespeare) is about 30 chains on a GPU.
constexpr int kEncoderPiece = 256;
template <typename S>
void encoder_backward(float* dwte, float* dwpe,  // += (V, C), (maxT, C)
                      const S* dout,             // (B, T, C)
                      const int32_t* idx, int B, int T, int C);

// ---- layernorm over the last dimension, eps 1e-5 (layernorm.cpp)
template <typename S>
void layernorm_forward(S* out,                   // (N, C)
                       float* mean, float* rstd, // (N)
                       const S* inp,             // (N, C)
                       const S* weight, const S* bias,  // (C)
                       int64_t N, int C);
template <typename S>
void layernorm_backward(S* dinp,                 // += (N, C): the residual stream accumulates
                        float* dweight, float* dbias,  // += (C)
                        const S* dout, const S* inp, const S* weight,
                        const float* mean, const float* rstd, int64_t N, int C,
                        float* dinp_sum = nullptr);  // += (C) the column sums of dinp after the update, or nullptr

// ---- matmul as nn.Linear: out = inp @ weight^T + bias (matmul.cpp)
// A linear layer's bias gradient: dbias (OC) += the column sums of dout (N, OC), each in double over the rows in
// order. Also the LayerNorm backward's dinp_sum (the fused model's residual projections), so both give one bits.
template <typename S>
void bias_backward(float* dbias, const S* dout, int64_t N, int OC);
template <typename S>
void matmul_forward(S* out,                      // (N, OC)
                    const S* inp,                // (N, C)
                    const S* weight,             // (OC, C)
                    const S* bias,               // (OC) or nullptr
                    int64_t N, int C, int OC);
template <typename S>
void matmul_backward(S* dinp,                    // (N, C) overwritten, or nullptr to skip
                     float* dweight,             // += (OC, C)
                     float* dbias,               // += (OC) or nullptr
                     const S* dout,              // (N, OC)
                     const S* inp, const S* weight, int64_t N, int C, int OC);
// float is the sgemm itself; the 16-bit instantiations widen blocks of rows into it.
template <>
void matmul_forward<float>(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                           int OC);
template <>
void matmul_backward<float>(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, int64_t N, int C, int OC);

// ---- matmul with the MLP's GELU around it (matmul.cpp; epilogues of the GPU's products, the two ops here)
template <typename S>
void matmul_forward_gelu(S* out,                 // (N, OC) = gelu(pre)
                         S* pre,                 // (N, OC) = inp @ weight^T + bias, kept for backward
                         const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC);
// The backward of a linear whose input was gelu(pre): the gradient of pre itself.
template <typename S>
void matmul_backward_dgelu(S* dpre,              // (N, C) = (dout @ weight) * gelu'(pre), overwritten
                           float* dweight, float* dbias,  // += (OC, C), (OC) or nullptr
                           const S* dout,        // (N, OC)
                           const S* inp,         // (N, C) = gelu(pre)
                           const S* weight,      // (OC, C)
                           const S* pre,         // (N, C)
                           int64_t N, int C, int OC);

// ---- GELU, tanh approximation (gelu.cpp)
template <typename S>
void gelu_forward(S* out, const S* inp, int64_t n);
template <typename S>
void gelu_backward(S* dinp,                      // overwritten; may alias dout
                   const S* inp, const S* dout, int64_t n);

// ---- residual add (residual.cpp)
template <typename S>
void residual_forward(S* out, const S* a, const S* b, int64_t n);  // out may alias a or b

// ---- residual add fused with the next LayerNorm: res = a + b, out = layernorm(res) (residual_layernorm.cpp)
template <typename S>
void residual_layernorm_forward(S* res,          // (N, C), may alias a or b
                                S* out,          // (N, C)
                                float* mean, float* rstd,  // (N)
                                const S* a, const S* b,    // (N, C)
                                const S* weight, const S* bias,  // (C)
                                int64_t N, int C);

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
// qkv holds q | k | v, each C = NH * hs wide, head h at columns h*hs of its third. 16-bit storage is widened
// exactly, attended in float and rounded once on the way out.
template <typename S>
void attention_forward(S* out,                   // (B, T, C)
                       float* lse,               // (B, NH, T)
                       const S* qkv,             // (B, T, 3C)
                       int B, int T, int C, int NH, bool causal);
// dbias (3C), or nullptr: += the column sums of dqkv (bias_backward's), the qkv projection's bias gradient as the
// fused model takes it (the CUDA twin makes part of it in the attention kernel).
template <typename S>
void attention_backward(S* dqkv,                 // (B, T, 3C) overwritten
                        const S* dout,           // (B, T, C)
                        const S* qkv, const S* out, const float* lse,
                        int B, int T, int C, int NH, bool causal, float* dbias = nullptr);
template <>
void attention_forward<float>(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, bool causal);
template <>
void attention_backward<float>(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                               int B, int T, int C, int NH, bool causal, float* dbias);

// ---- attention against a KV cache, for generation (attention_decode.cpp)
// A layer's cache holds the keys and values of positions [0, Tmax) of each row and head: kcache, vcache
// (B, NH, Tmax, hs), the layout of torch's SDPA. T new positions [t0, t0 + T) arrive as a fused projection qkv
// (B, T, 3C); t0 + T <= Tmax.
// append: their k and v thirds are written into the cache at [t0, t0 + T).
template <typename S>
void attention_decode_append(S* kcache, S* vcache,  // (B, NH, Tmax, hs) written at [t0, t0 + T)
                             const S* qkv,           // (B, T, 3C)
                             int B, int T, int t0, int Tmax, int C, int NH);
// forward: new row t (position t0 + t) attends to the cached positions [0, t0 + t] (after append).
template <typename S>
void attention_decode_forward(S* out,                // (B, T, C)
                              const S* qkv,          // (B, T, 3C): the q third is read
                              const S* kcache, const S* vcache,  // (B, NH, Tmax, hs)
                              int B, int T, int t0, int Tmax, int C, int NH);

// ---- softmax cross-entropy; probabilities are never stored (cross_entropy.cpp)
template <typename S>
void cross_entropy_forward(float* losses,        // (N)
                           float* lse,           // (N) log-sum-exp of each row, for backward
                           const S* logits,      // (N, V)
                           const int32_t* targets, int64_t N, int V);
// dlogits = dloss * (softmax(logits) - onehot(target)); dlogits may alias logits (written in place). dloss_scale:
// null, or a float in memory that multiplies dloss (fp16's loss scale, read when the kernel runs: a recorded step
// reads each step's).
template <typename S>
void cross_entropy_backward(S* dlogits, const S* logits, const float* lse, const int32_t* targets,
                            float dloss, const float* dloss_scale, int64_t N, int V);
// Both in one pass over each row (the training step's classifier, where the loss and its gradient are wanted
// together): losses as forward, dlogits as backward with the row's own lse; dlogits may alias logits.
template <typename S>
void cross_entropy_forward_backward(float* losses,    // (N)
                                    S* dlogits,       // (N, V)
                                    const S* logits,  // (N, V)
                                    const int32_t* targets, float dloss, const float* dloss_scale, int64_t N, int V);

// ---- AdamW as torch.optim.AdamW (adamw.cpp; the shared arithmetic and StepScalars in cpu/adamw.h)
// One contiguous range; bias corrections precomputed by the caller (they depend only on the step).
struct AdamWHyper {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1, bias_correction2_sqrt;  // 1 - beta1^t, sqrt(1 - beta2^t)
};
// The hyper-parameters of update number `step` (1-based): the bias corrections are formed here, in double, once.
AdamWHyper adamw_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step);
// Update number h's step of one range, weight decay h.weight_decay everywhere (fastgpt.ops.adamw_update): the
// engine's adamw_step over one segment, with the scalars single_range_step makes (no clip, h's bias corrections).
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h);
inline void single_range_step(const AdamWHyper& h, int64_t n, StepScalars* s, AdamWSegments* seg) {
  *s = StepScalars{};
  s->applied = 1;
  s->lr = h.lr;
  s->bias_correction1 = h.bias_correction1;
  s->bias_correction2_sqrt = h.bias_correction2_sqrt;
  *seg = AdamWSegments{};
  seg->n = 1;
  seg->end[0] = n;
  seg->weight_decay[0] = h.weight_decay;
}
// The engine's step: one pass over the flat indices of `seg`, each decayed as its segment says, every gradient
// times s->gscale, the learning rate, bias corrections and the rounding key's step from s (nothing when
// !s->applied). param, grad and
// lowp are indexed by flat index, m and v from seg.begin. lowp (S = bf16/f16; null for float): the compute weights,
// written from the new masters as `key` says in the same pass (key.offset 0: the flat index keys the rounding).
template <typename S>
void adamw_step(float* param, S* lowp, const float* grad, float* m, float* v, const AdamWSegments& seg, float beta1,
                float beta2, float eps, const StepScalars* s, RoundKey key);
// cpu/adamw.h's adamw_prepare: the step's scalars from partial sums of squares (in order) and the mean loss.
void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                   int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls);
// Sums of squares in float64 over fixed chunks of kSumChunk elements (partial: ceil(n / kSumChunk)), so the total,
// the chunks added in order (sum_in_order), is the same for any thread count and on either device.
constexpr int64_t kSumChunk = 1 << 16;
void sum_squares_partials(double* partial, const float* x, int64_t n);
void sum_in_order(double* out, const double* x, int64_t n);  // *out = x[0] + x[1] + ... in that order
// acc (one double) += (double)(float)(mean of the n losses) / divisor; reset: acc = that. The mean is the float a
// forward returns; a training step's loss is the sum over its micro-steps, divided by their count.
void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset);
void scale_inplace(float* x, int64_t n, float s);

// ---- conversions between float32 and the storage types (cast.cpp)
template <typename S>
void widen(float* out, const S* in, int64_t n);
// Masters to compute weights; RoundKey{} rounds to nearest even.
template <typename S>
void narrow(S* out, const float* in, int64_t n, const RoundKey& key = {});
// Float scratch of the calling thread, grown only (a training step allocates nothing after the first): the fp32
// copies of 16-bit operands that the sgemm and flash kernels widen into. Slots are independent buffers. Its size in
// bf16/fp16 training: one fp32 copy of the largest weight (wte), matmul rows in blocks of at most 2^24 floats per
// slot, and the fp32 copies of one layer's attention operands. Not counted by GPT::memory (not engine memory).
constexpr int kScratchSlots = 5;
float* scratch(int slot, int64_t n);
template <typename S>
const float* widened(int slot, const S* p, int64_t n) {  // p's n values, widened into scratch slot `slot`
  float* w = scratch(slot, n);
  widen(w, p, n);
  return w;
}

}  // namespace fastgpt::cpu
