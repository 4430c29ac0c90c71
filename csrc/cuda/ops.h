// The CUDA kernels: the twin of csrc/cpu/kernels.h, one function per op with the same arguments plus the stream
// it runs on (the caller's current stream), implemented in csrc/cuda/<op>.cu. All pointers are device memory.
// Ops of the model are templates over the storage type S (float, bf16, f16 of dtype.h, bit-compatible with
// __nv_bfloat16 / __half), instantiated in each .cu for all three; arithmetic is fp32 whatever S is. Conventions match the CPU kernels exactly:
// parameter gradients accumulate (+=), activation gradients overwrite, results are deterministic (no atomics whose
// order could change a sum). Plain C++ (no CUDA headers), so the binding compiles with or without the toolkit.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/kernels.h"  // AdamWHyper: one definition for both devices

struct CUstream_st;

namespace fastgpt::cuda {

using Stream = CUstream_st*;  // == cudaStream_t

template <typename S>
void encoder_forward(S* out, const int32_t* idx, const S* wte, const S* wpe, int B, int T, int C, Stream stream);
template <typename S>
void encoder_backward(float* dwte, float* dwpe, const S* dout, const int32_t* idx, int B, int T, int C, int V,
                      Stream stream);

template <typename S>
void layernorm_forward(S* out, float* mean, float* rstd, const S* inp, const S* weight, const S* bias, int64_t N,
                       int C, Stream stream);
template <typename S>
void layernorm_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                        const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum, Stream stream);
// dinp_sum (C), if not nullptr, += the column sums of dinp after the update: the bias gradient of the linear layer
// whose output dinp is the gradient of (the fused model's residual projections). 16-bit rows that the one-pass
// kernel takes are summed as they are written (sm_80 and newer, where the shared memory holds the sums); elsewhere
// bias_backward reads dinp again, which gives the unfused model's bits.
template <typename S>
void layernorm_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                        const float* mean, const float* rstd, int64_t N, int C, Stream stream) {
  layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, nullptr, stream);
}
// The LayerNorm kernels read each row once (true, the default). layernorm_forward and residual_layernorm_forward
// keep a row in registers where C is a multiple of 8 16-bit or 4 float values, at most 1024 (layernorm_row_fits in
// layernorm.cuh), else read it for each pass; the two sum a row in different orders, the fused and unfused calls
// in the same one. layernorm_backward reads each row once where layernorm_one_pass_fits says it can (those widths,
// 16-byte aligned rows), else in two passes (dinp, then the partial sums); both give the same dweight/dbias.
// Process-wide, read by every call (a CUDA graph keeps what it recorded); set by benchmarks and tests to compare
// the paths. set_ returns the previous choice.
bool layernorm_one_pass();
bool set_layernorm_one_pass(bool on);
template <typename S>
bool layernorm_one_pass_fits(const S* dinp, const S* dout, const S* inp, const S* weight, int C);

// tf32: fp32 operands multiplied on TF32 tensor cores (cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32); float only.
// 16-bit S: 16-bit A/B with fp32 accumulation (CUBLAS_COMPUTE_32F), bias epilogue in the same type.
template <typename S>
void matmul_forward(S* out, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC, Stream stream,
                    bool tf32 = false);
template <typename S>
void matmul_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight, int64_t N,
                     int C, int OC, Stream stream, bool tf32 = false);

// matmul_backward's bias gradient in 16-bit storage: the column-sum kernel (false, the default; float always runs
// it) or the epilogue of the weight gradient's product (true, cuBLASLt's BGRADB). Process-wide, read by every call
// (a CUDA graph keeps what it recorded); set by benchmarks and tests to compare the two. set_ returns the previous
// choice.
bool bias_grad_epilogue();
bool set_bias_grad_epilogue(bool on);
// The column-sum kernel (matmul_bias.cu): dbias (OC) += the sums over rows of dout (N, OC; row stride ld, 0: OC),
// in an order that depends on N alone (a column's bits do not depend on ld or on the other columns). bias_add:
// dbias += sums (OC), made elsewhere (the epilogue's).
template <typename S>
void bias_backward(float* dbias, const S* dout, int64_t N, int OC, Stream stream, int64_t ld = 0);
void bias_add(float* dbias, const float* sums, int OC, Stream stream);

// Every product's cuBLASLt algorithm: the heuristic's first choice (false, the default, as PyTorch), or (true) the
// fastest of up to 8 of its candidates, timed at the first run of each problem (shape, strides, alignments, types,
// epilogue) on that run's operands, the heuristic's own kept unless another is more than 2% faster
// (cuda/matmul_tune.h). Chosen once per problem and process, never while the stream is being recorded into a
// graph. Process-wide, read when a problem is first met (plans made before a change keep their algorithm; the
// setting is part of the plan cache's key). set_ returns the previous choice. matmul_autotune_report lists every
// decision so far: the problem, each candidate's median time, the one chosen, or why none was timed.
struct MatmulTuneRecord {
  int64_t M = 0, N = 0, K = 0;  // row-major C (M, N) = op(A) (M, K) op(B) (K, N), cublaslt.h's convention
  bool trans_a = false, trans_b = false;
  int batch = 1;
  std::string epilogue, ab_type, c_type, compute;  // e.g. "gelu_aux_bias", "bf16", "fp32", "fp32" or "tf32"
  int candidates = 0, chosen = 0, reps = 0;        // reps: products per timing (0: none timed)
  std::vector<double> ms;                          // per candidate: median ms of one product, -1 where it failed
  std::string skipped;                             // why nothing was timed, or empty
};
bool matmul_autotune();
bool set_matmul_autotune(bool on);
std::vector<MatmulTuneRecord> matmul_autotune_report();

// The MLP's GELU fused into the products around it (cuBLASLt epilogues in 16-bit storage, else the kernels):
// forward: pre = inp @ weight^T + bias, out = gelu(pre); backward of a linear whose input was gelu(pre):
// dpre = (dout @ weight) * gelu'(pre), dweight/dbias as matmul_backward.
template <typename S>
void matmul_forward_gelu(S* out, S* pre, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC,
                         Stream stream, bool tf32 = false);
template <typename S>
void matmul_backward_dgelu(S* dpre, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                           const S* pre, int64_t N, int C, int OC, Stream stream, bool tf32 = false);

template <typename S>
void gelu_forward(S* out, const S* inp, int64_t n, Stream stream);
template <typename S>
void gelu_backward(S* dinp, const S* inp, const S* dout, int64_t n, Stream stream);

template <typename S>
void residual_forward(S* out, const S* a, const S* b, int64_t n, Stream stream);
// res = a + b (res may alias a or b), out = layernorm(res): the same bits as residual_forward then
// layernorm_forward.
template <typename S>
void residual_layernorm_forward(S* res, S* out, float* mean, float* rstd, const S* a, const S* b, const S* weight,
                                const S* bias, int64_t N, int C, Stream stream);

// Flash attention (flash_attention.cu, the twin of csrc/cpu/flash_attention.cpp): q, k, v, out and their
// gradients are (B, H, T, d) views described by HeadStrides, in `dtype`; lse (B, H, T) is float32, contiguous.
// bf16/fp16: tensor cores (mma.sync m16n8k16, fp32 accumulation), d 64 or 128, rows 16-byte aligned (st and every
// base pointer a multiple of 8 elements). fp32: `f32` says how (F32Math); any d <= 256, no alignment needed.
// Backward: deterministic=false sums dq with fp32 atomics (order varies run to run); true runs a separate dq pass
// (bit-reproducible, more FLOPs). The fp32 path is always deterministic.
using HeadStrides = cpu::HeadStrides;
using AttentionShape = cpu::AttentionShape;
using DType = fastgpt::DType;
// How float32 attention multiplies. tf32x3: TF32 tensor cores, three products per product (hi/lo split: fp32
// accuracy, as PyTorch's own fp32 attention on sm_80+); tf32: one TF32 product (inputs rounded to 10 mantissa bits,
// ~1e-3 relative; the engine's "tf32" precision); simt: fp32 FMAs on CUDA cores. The tensor-core ones run where
// they can (sm_80+, d 64 or 128, strides multiples of 4 elements, 16-byte aligned pointers), simt elsewhere.
enum class F32Math { tf32x3, tf32, simt };
void flash_attention_forward(void* out, const HeadStrides& os, float* lse, const void* q, const void* k,
                             const void* v, const HeadStrides& is, const AttentionShape& shape, DType dtype,
                             Stream stream, F32Math f32 = F32Math::tf32x3);
// kv_sums (2, H, d), or nullptr: where the kernel that runs makes them (the warp-specialised Hopper backward, head
// dim 64), += the column sums over (b, t) of dk and dv as stored, per (h, x), and -> true; else untouched and ->
// false. The engine's qkv bias gradient (attention_backward) takes its K and V thirds from them: no pass over dqkv.
bool flash_attention_backward(void* dq, void* dk, void* dv, const HeadStrides& is, const void* dout,
                              const void* out, const HeadStrides& os, const void* q, const void* k, const void* v,
                              const float* lse, const AttentionShape& shape, DType dtype, bool deterministic,
                              Stream stream, F32Math f32 = F32Math::tf32x3, float* kv_sums = nullptr);

// The tensor-core kernels' tile shapes (flash_attention.cuh): a process-wide choice, so that a benchmark can time
// each on the GPU at hand. Option 0 of each, the default, is "auto": the Hopper kernels measured fastest where they
// run (bf16/fp16 on compute capability 9.0 with sm_90a code), else the mma.sync "16x64" (option 1); d 128 runs the
// first mma.sync option of each and the sm90 ones. set_flash_tiles returns the previous choice and throws
// std::invalid_argument for an option out of range. Each call reads the choice when it launches (a recorded CUDA
// graph keeps the kernels it was recorded with).
struct FlashTiles {
  int fwd = 0, dkdv = 0, dq = 0;
};
struct FlashTileOptions {
  std::vector<std::string> fwd, dkdv, dq;  // names, by option
};
FlashTiles flash_tiles();
FlashTiles set_flash_tiles(const FlashTiles& tiles);
FlashTileOptions flash_tile_options();

// The engine's attention on the fused qkv (B, T, 3C): the flash kernels through strides (attention.cu); fp32 as
// `f32` says (the fp32 precision tf32x3, tf32 tf32), bf16/fp16 on the tensor-core kernels (head size 64 or 128).
template <typename S>
void attention_forward(S* out, float* lse, const S* qkv, int B, int T, int C, int NH, bool causal, Stream stream,
                       F32Math f32 = F32Math::tf32x3);
// dbias (3C), or nullptr: += the column sums of dqkv, the qkv projection's bias gradient (the fused model's: one
// pass over dqkv fewer than matmul_backward's). Its K and V thirds come from the kernel where it makes them
// (flash_attention_backward's kv_sums), in another order than a pass over dqkv adds them; else that pass, whose
// bits matmul_backward's are.
template <typename S>
void attention_backward(S* dqkv, const S* dout, const S* qkv, const S* out, const float* lse, int B, int T, int C,
                        int NH, bool causal, float* dbias, Stream stream, F32Math f32 = F32Math::tf32x3);

// Generation against a KV cache (attention_decode.cu, the twin of csrc/cpu/attention_decode.cpp): kcache, vcache
// (B, NH, Tmax, hs); append writes the k/v thirds of qkv (B, T, 3C) at positions [t0, t0 + T); forward attends new
// row t (position t0 + t) to the cached positions [0, t0 + t]. Head size at most 256 (std::invalid_argument).
template <typename S>
void attention_decode_append(S* kcache, S* vcache, const S* qkv, int B, int T, int t0, int Tmax, int C, int NH,
                             Stream stream);
template <typename S>
void attention_decode_forward(S* out, const S* qkv, const S* kcache, const S* vcache, int B, int T, int t0, int Tmax,
                              int C, int NH, Stream stream);

template <typename S>
void cross_entropy_forward(float* losses, float* lse, const S* logits, const int32_t* targets, int64_t N, int V,
                           Stream stream);
template <typename S>
void cross_entropy_backward(S* dlogits, const S* logits, const float* lse, const int32_t* targets, float dloss,
                            const float* dloss_scale, int64_t N, int V, Stream stream);
template <typename S>
void cross_entropy_forward_backward(float* losses, S* dlogits, const S* logits, const int32_t* targets, float dloss,
                                    const float* dloss_scale, int64_t N, int V, Stream stream);

using AdamWHyper = cpu::AdamWHyper;
// CUDA twins of cpu/kernels.h's AdamW functions (adamw.cu); scalars and partial sums live in device memory.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                  Stream stream);
template <typename S>
void adamw_step(float* param, S* lowp, const float* grad, float* m, float* v, const AdamWSegments& seg, float beta1,
                float beta2, float eps, const StepScalars* s, const RoundKey& key, Stream stream);
void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                   int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls, Stream stream);
void sum_squares_partials(double* partial, const float* x, int64_t n, Stream stream);
void sum_in_order(double* out, const double* x, int64_t n, Stream stream);
void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset, Stream stream);
// Conversions (cast.cu): widen 16-bit to float; narrow float masters to 16-bit compute weights.
template <typename S>
void widen(float* out, const S* in, int64_t n, Stream stream);
template <typename S>
void narrow(S* out, const float* in, int64_t n, const RoundKey& key, Stream stream);
void scale_inplace(float* x, int64_t n, float s, Stream stream);

}  // namespace fastgpt::cuda
