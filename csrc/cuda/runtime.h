// What the rest of the tree may ask of the CUDA side. Plain C++ (no CUDA headers), so the binding compiles with
// or without the toolkit; csrc/cuda/runtime.cu implements it when FASTGPT_WITH_CUDA is set.
#pragma once
#include <string>

namespace fastgpt::cuda {

bool built_with_cuda();
// Number of usable devices; 0 when there is no driver or no GPU (never throws: a CPU machine is not an error).
int device_count();
// "name (sm_XY)" of a device; throws std::runtime_error when it cannot be queried.
std::string device_name(int device);
// Makes `device` current for the calling thread until the guard ends, then restores the caller's device: after an
// op or a model call, torch's "cuda" (or any framework's current device) is what it was before.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_, prev_ = -1;
};
// Runs a tiny kernel on the device and checks its result: proves that the build's architectures run there.
bool smoke_test(int device);

}  // namespace fastgpt::cuda
