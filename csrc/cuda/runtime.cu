// Device queries and a smoke-test kernel: the slot the CUDA engine (issue 3) and flash attention (issue 4) grow in.
// Built only with FASTGPT_WITH_CUDA; csrc/binding.cpp supplies the CPU-only stand-ins otherwise.
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/runtime.h"

namespace fastgpt::cuda {

namespace {
__global__ void axpy_kernel(float* y, const float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

// A device index from Python: a clear error for one that is not there, not a CUDA one.
void check_visible(int device) {
  const int n = device_count();
  if (device < 0 || device >= n)
    throw std::invalid_argument("device " + std::to_string(device) + " is not a visible CUDA device (" +
                                std::to_string(n) + " visible)");
}
}  // namespace

bool built_with_cuda() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls start clean
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp prop;
  FASTGPT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  FASTGPT_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device_) FASTGPT_CUDA_CHECK(cudaSetDevice(device_));
}

DeviceGuard::~DeviceGuard() { restore_device(prev_, device_); }

void restore_device(int prev, int now) {
  // A failed restore (an exclusive-process GPU another process holds) must not leave its error for the next launch
  // check to report.
  if (prev >= 0 && prev != now && cudaSetDevice(prev) != cudaSuccess) (void)cudaGetLastError();
}

void set_device(int device) {
  check_visible(device);
  FASTGPT_CUDA_CHECK(cudaSetDevice(device));
}

int64_t pool_reserved(int device) {
  check_visible(device);
  cudaMemPool_t pool;
  FASTGPT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t bytes = 0;  // the attribute is a cuuint64_t (cuda.h), 64 bits
  FASTGPT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &bytes));
  return (int64_t)bytes;
}

bool smoke_test(int device) {
  const DeviceGuard guard(device);
  const int n = 1000;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; i++) {
    x[i] = (float)i;
    y[i] = 1.f;
  }
  float *dx = nullptr, *dy = nullptr;
  FASTGPT_CUDA_CHECK(cudaMalloc(&dx, n * sizeof(float)));
  FASTGPT_CUDA_CHECK(cudaMalloc(&dy, n * sizeof(float)));
  FASTGPT_CUDA_CHECK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  FASTGPT_CUDA_CHECK(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  axpy_kernel<<<(n + 255) / 256, 256>>>(dy, dx, 2.f, n);
  FASTGPT_CUDA_CHECK_LAUNCH();
  FASTGPT_CUDA_CHECK(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost));
  FASTGPT_CUDA_CHECK(cudaFree(dx));
  FASTGPT_CUDA_CHECK(cudaFree(dy));
  for (int i = 0; i < n; i++)
    if (y[i] != 1.f + 2.f * i) return false;
  return true;
}

}  // namespace fastgpt::cuda
