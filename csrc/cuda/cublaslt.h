// Row-major float32 GEMMs through cuBLASLt, for the CUDA kernels (matmul, attention). One cuBLASLt handle and one
// 32 MiB workspace per device, created on first use and kept for the life of the process; the matmul descriptors,
// layouts and heuristic choice are cached per problem, so a training step never queries the heuristic again.
// CUDA-only header: include it from .cu files, never from the binding.
#pragma once
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime.h>

namespace fastgpt::cuda {

// C(M, N) = alpha * op(A) * op(B) + beta * C  [+ bias broadcast over rows, bias of length N]
// All matrices row-major. op(A) is (M, K): A is stored (M, K) with row stride lda, or (K, M) when trans_a.
// op(B) is (K, N): B is stored (K, N) with row stride ldb, or (N, K) when trans_b. C is (M, N), row stride ldc.
// Strided batch: `batch` independent products, matrix i at A + i * stride_a (etc.); the bias (if any) is the same
// vector for every batch entry. The bias is added after beta * C, as cuBLASLt's BIAS epilogue does.
// compute: CUBLAS_COMPUTE_32F (exact fp32, the default) or e.g. CUBLAS_COMPUTE_32F_FAST_TF32 later.
// Runs on `stream`, on the current device. Not safe for two streams of one device at once: they share one
// workspace (fastgpt runs one compute stream per device).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const float* bias, cudaStream_t stream,
          int batch = 1, int64_t stride_a = 0, int64_t stride_b = 0, int64_t stride_c = 0,
          cublasComputeType_t compute = CUBLAS_COMPUTE_32F);

}  // namespace fastgpt::cuda
