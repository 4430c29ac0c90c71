// The CUDA kernels: the twin of csrc/cpu/kernels.h, one function per op with the same arguments plus the stream
// it runs on (the caller's current stream), implemented in csrc/cuda/<op>.cu. All pointers are device memory,
// float32 except flash attention's (bf16, fp16 or fp32). Conventions match the CPU kernels exactly:
// parameter gradients accumulate (+=), activation gradients overwrite, results are deterministic (no atomics whose
// order could change a sum). Plain C++ (no CUDA headers), so the binding compiles with or without the toolkit.
#pragma once
#include <cstdint>

#include "cpu/kernels.h"  // AdamWHyper: one definition for both devices

struct CUstream_st;

namespace fastgpt::cuda {

using Stream = CUstream_st*;  // == cudaStream_t

void encoder_forward(float* out, const int32_t* idx, const float* wte, const float* wpe, int B, int T, int C,
                     Stream stream);
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* idx, int B, int T, int C, int V,
                      Stream stream);

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int C, Stream stream);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int C, Stream stream);

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C, int OC,
                    Stream stream);
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int C, int OC, Stream stream);

void gelu_forward(float* out, const float* inp, int64_t n, Stream stream);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, Stream stream);

void residual_forward(float* out, const float* a, const float* b, int64_t n, Stream stream);

// Flash attention (flash_attention.cu, the twin of csrc/cpu/flash_attention.cpp): q, k, v, out and their
// gradients are (B, H, T, d) views described by HeadStrides, in `dtype`; lse (B, H, T) is float32, contiguous.
// bf16/fp16: tensor cores (mma.sync m16n8k16, fp32 accumulation), d 64 or 128, rows 16-byte aligned (st and every
// base pointer a multiple of 8 elements). fp32: CUDA cores, any d <= 256, no alignment needed.
// Backward: deterministic=false sums dq with fp32 atomics (order varies run to run); true runs a separate dq pass
// (bit-reproducible, more FLOPs). The fp32 path is always deterministic.
using HeadStrides = cpu::HeadStrides;
using AttentionShape = cpu::AttentionShape;
enum class DType { f32, bf16, f16 };
void flash_attention_forward(void* out, const HeadStrides& os, float* lse, const void* q, const void* k,
                             const void* v, const HeadStrides& is, const AttentionShape& shape, DType dtype,
                             Stream stream);
void flash_attention_backward(void* dq, void* dk, void* dv, const HeadStrides& is, const void* dout,
                              const void* out, const HeadStrides& os, const void* q, const void* k, const void* v,
                              const float* lse, const AttentionShape& shape, DType dtype, bool deterministic,
                              Stream stream);

// The engine's attention on the fused qkv (B, T, 3C): the fp32 flash path through strides (attention.cu).
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH, bool causal,
                       Stream stream);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int B, int T, int C, int NH, bool causal, Stream stream);

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int V, Stream stream);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            float dloss, int64_t N, int V, Stream stream);

using AdamWHyper = cpu::AdamWHyper;
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWHyper& h,
                  Stream stream);
// Sum of squares over fixed chunks, combined in order in double (deterministic); waits for the stream.
double sum_squares(const float* x, int64_t n, Stream stream);
void scale_inplace(float* x, int64_t n, float s, Stream stream);

}  // namespace fastgpt::cuda
