// Single-precision GEMM for the CPU backend: every matmul of the model (layers, logits, weight gradients) goes
// through here, so it is a packed, register-blocked, OpenMP-parallel kernel rather than a naive loop, and it is
// deterministic: each output element is summed over K in a fixed order, whatever the number of threads.
#pragma once
#include <cstdint>

namespace fastgpt::cpu {

// C (M,N) = alpha * op(A) * op(B) + beta * C, all row-major.
// op(A) is (M,K): A itself (M,K) with row stride lda when !trans_a, else A is (K,M) with row stride lda.
// op(B) is (K,N): B itself (K,N) with row stride ldb when !trans_b, else B is (N,K) with row stride ldb.
// beta == 0 overwrites C without reading it (C may hold NaN). M, N or K may be 0 (K == 0: C = beta*C).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace fastgpt::cpu
