// Error checks for every CUDA, cuBLAS(Lt) and NCCL call: a failure throws std::runtime_error naming the call's
// file and line and the library's own message, which the binding turns into a Python RuntimeError.
#pragma once
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

namespace fastgpt::cuda {

[[noreturn]] inline void fail(const char* what, const std::string& msg, const char* file, int line) {
  throw std::runtime_error(std::string(what) + " failed: " + msg + " at " + file + ":" + std::to_string(line));
}

}  // namespace fastgpt::cuda

// The runtime also keeps a failed call's error as its last error: a non-sticky one (out of memory from cudaMalloc or
// cudaMallocAsync) would be reported again by the next launch check, far from where it happened (bench_gpu_train's
// --B max, retrying a smaller batch after running out of memory, would fail on its first kernel). This throw
// reports it: clear it.
#define FASTGPT_CUDA_CHECK(call)                                                                 \
  do {                                                                                           \
    cudaError_t err_ = (call);                                                                   \
    if (err_ != cudaSuccess) {                                                                   \
      (void)cudaGetLastError();                                                                  \
      ::fastgpt::cuda::fail(#call, cudaGetErrorString(err_), __FILE__, __LINE__);                \
    }                                                                                            \
  } while (0)

// After a kernel launch: catches bad launch configurations at the launch site, not at the next sync.
#define FASTGPT_CUDA_CHECK_LAUNCH() FASTGPT_CUDA_CHECK(cudaGetLastError())

#define FASTGPT_CUBLAS_CHECK(call)                                                               \
  do {                                                                                           \
    cublasStatus_t st_ = (call);                                                                 \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                            \
      ::fastgpt::cuda::fail(#call, "cublas status " + std::to_string((int)st_), __FILE__, __LINE__); \
  } while (0)

#define FASTGPT_NCCL_CHECK(call)                                                                 \
  do {                                                                                           \
    ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess) ::fastgpt::cuda::fail(#call, ncclGetErrorString(r_), __FILE__, __LINE__); \
  } while (0)
