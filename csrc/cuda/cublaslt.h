// Row-major GEMMs through cuBLASLt, for the CUDA kernels (matmul): fp32, TF32, and 16-bit (bf16/fp16) operands
// with fp32 accumulation. One cuBLASLt handle and one 32 MiB workspace per device, created on first use and kept
// for the life of the process; the matmul descriptors, layouts and heuristic choice are cached per problem (types
// included), so a training step never queries the heuristic again. With matmul autotune (cuda/ops.h) the choice is
// the fastest of the heuristic's candidates, timed at the problem's first run (cuda/matmul_tune.h's rules).
// CUDA-only header: include it from .cu files, never from the binding.
#pragma once
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime.h>

namespace fastgpt::cuda {

// Element types of one product. The scale type (alpha, beta) is always CUDA_R_32F, so the compute type must be one
// of the 32F ones: CUBLAS_COMPUTE_32F (exact fp32, or 16-bit A/B with fp32 accumulation) or
// CUBLAS_COMPUTE_32F_FAST_TF32 (fp32 operands on TF32 tensor cores). Combinations used here (all in cuBLASLt's
// table of supported ones): A/B 32F with C 32F; A/B 16BF (16F) with C 16BF (16F) or C 32F.
// bias: the type of the bias vector; the epilogue is used only if cuBLASLt accepts it, else a kernel adds it.
struct GemmTypes {
  cudaDataType_t a = CUDA_R_32F, b = CUDA_R_32F, c = CUDA_R_32F, bias = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
};

// C(M, N) = alpha * op(A) * op(B) + beta * C  [+ bias broadcast over rows, bias of length N]
// All matrices row-major, leading dimensions and batch strides in elements of their own type. op(A) is (M, K): A is
// stored (M, K) with row stride lda, or (K, M) when trans_a. op(B) is (K, N): B is stored (K, N) with row stride
// ldb, or (N, K) when trans_b. C is (M, N), row stride ldc.
// Strided batch: `batch` independent products, matrix i at A + i * stride_a (etc.); the bias (if any) is the same
// vector for every batch entry. The bias is added after beta * C, as cuBLASLt's BIAS epilogue does; with a 16-bit
// C the sum alpha * AB + beta * C + bias is rounded once, on the epilogue path and on the fallback path alike.
// Runs on `stream`, on the current device; each call takes its cuBLASLt workspace as scratch on that stream (the
// engine's workspace or the stream-ordered pool: scratch.h), so calls on two streams at once do not share one.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, void* C, int64_t ldc, const void* bias, cudaStream_t stream,
          const GemmTypes& types = {}, int batch = 1, int64_t stride_a = 0, int64_t stride_b = 0,
          int64_t stride_c = 0);

// The GELU epilogues of the MLP (batch 1, alpha 1, beta 0, row-major as gemm):
//   forward:  C = gelu(op(A) op(B) + bias), and aux = op(A) op(B) + bias, the pre-activation backward needs
//             (cuBLASLt's GELU_AUX_BIAS, or GELU_AUX without a bias);
//   backward: C = (op(A) op(B)) * gelu'(aux), aux the forward's pre-activation (cuBLASLt's DGELU); bias must be
//             null.
// aux is (M, N) in C's type with row stride ldaux. Returns false, having queued nothing, when cuBLASLt cannot do
// it (ldaux not a multiple of 8, aux or bias not 16-byte aligned, no algorithm, an empty product): the caller then
// runs gemm and the GELU kernel. Plans are cached as gemm's are; a refusal is cached too.
enum class GeluEpilogue { forward, backward };
bool gemm_gelu(GeluEpilogue kind, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
               int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc, const void* bias, void* aux,
               int64_t ldaux, cudaStream_t stream, const GemmTypes& types);

// The bias gradient as the epilogue of a product (batch 1): C = alpha op(A) op(B) + beta C as gemm computes it, and
// dbias (M, in types.bias, written, not added to) = the sum over K of op(A)'s rows, from the tiles of A the product
// loads anyway (cuBLASLt's BGRADB: our A is its B). For a linear layer's weight gradient dW (OC, C) += dout^T inp,
// op(A) = dout^T and dbias is the bias gradient. (On an H200 cuBLASLt 13 ran it as a second kernel after the
// product, globalKernelBgradAB, as slow as a pass over dout: matmul.cu's default is its own column sums.) dbias must
// be 16-byte aligned.
// Returns false, having queued nothing, when cuBLASLt cannot do it (an empty product, no algorithm): the caller
// then runs gemm and its own column sum. Plans and refusals are cached as gemm_gelu's.
bool gemm_bias_grad(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                    int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc, void* dbias,
                    cudaStream_t stream, const GemmTypes& types);

}  // namespace fastgpt::cuda
