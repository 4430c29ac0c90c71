// The CUDA kernels: the twin of csrc/cpu/kernels.h, one function per op with the same arguments plus the stream
// it runs on (the caller's current stream), implemented in csrc/cuda/<op>.cu. All pointers are device memory,
// float32 for now (bf16/tf32 variants come with the CUDA engine). Conventions match the CPU kernels exactly:
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
