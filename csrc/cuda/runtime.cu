// Device queries and a smoke-test kernel: the slot the CUDA engine (issue 3) and flash attention (issue 4) grow in.
// Built only with FASTGPT_WITH_CUDA; csrc/binding.cpp supplies the CPU-only stand-ins otherwise.
#include <cudaTypedefs.h>

#include <vector>

#include "cuda/check.h"
#include "cuda/runtime.h"

namespace fastgpt::cuda {

namespace {
__global__ void axpy_kernel(float* y, const float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
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

namespace {
// Whether `device`'s primary context exists (cuDevicePrimaryCtxGetState, through the runtime's driver entry point,
// as tma.cu takes its encoder: the extension links no libcuda). True when the driver cannot say.
bool primary_context_active(int device) {
  using GetState = PFN_cuDevicePrimaryCtxGetState_v7000;
  using Get = PFN_cuDeviceGet_v2000;
  static const auto fns = [] {
    void *state = nullptr, *get = nullptr;
    cudaDriverEntryPointQueryResult q1{}, q2{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &state, 7000, cudaEnableDefault, &q1) !=
            cudaSuccess ||
        cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 2000, cudaEnableDefault, &q2) != cudaSuccess ||
        q1 != cudaDriverEntryPointSuccess || q2 != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return std::pair<GetState, Get>{nullptr, nullptr};
    }
    return std::pair<GetState, Get>{reinterpret_cast<GetState>(state), reinterpret_cast<Get>(get)};
  }();
  if (!fns.first || !fns.second) return true;
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  if (fns.second(&dev, device) != CUDA_SUCCESS || fns.first(dev, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}
}  // namespace

DeviceGuard::DeviceGuard(int device) : device_(device) {
  FASTGPT_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device_) FASTGPT_CUDA_CHECK(cudaSetDevice(device_));
}

DeviceGuard::~DeviceGuard() { restore_device(prev_, device_); }

void restore_device(int prev, int now) {
  // cudaGetDevice says 0 on a thread that never chose one, and cudaSetDevice initialises the device's primary
  // context: restoring a device the caller never used would put a context (hundreds of MB) on it, on device 0 from
  // every data-parallel rank but the first. Nothing to restore then. A failed restore (an exclusive-process GPU)
  // must not leave its error for the next launch check.
  if (prev < 0 || prev == now || !primary_context_active(prev)) return;
  if (cudaSetDevice(prev) != cudaSuccess) (void)cudaGetLastError();
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
