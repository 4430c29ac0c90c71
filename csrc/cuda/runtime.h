// What the rest of the tree may ask of the CUDA side. Plain C++ (no CUDA headers), so the binding compiles with
// or without the toolkit; csrc/cuda/runtime.cu implements it when FASTGPT_WITH_CUDA is set.
#pragma once
#include <cstdint>
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
// Makes `prev` current again after `now` was (nothing for the same device, or -1); never throws.
void restore_device(int prev, int now);
// Makes `device` the calling thread's current device for good: a data-parallel rank's own GPU (distributed.py), as
// torch.cuda.set_device(local_rank) in a DDP script. Guards then never switch, and never restore the default device
// 0, whose primary context cudaSetDevice would create: a context (hundreds of MB) on GPU 0 from every rank.
void set_device(int device);
// Why `precision` cannot train on a GPU of compute capability major.minor, or "" if it can. bf16 and TF32 need the
// tensor cores of sm_80 (Ampere) and newer; fp16 and fp32 run from sm_75 (T4), the oldest this build targets.
// Plain logic, so the CPU tests can check the messages a T4 user would see.
inline std::string precision_unsupported(int major, int minor, const std::string& precision) {
  const std::string cc = "sm_" + std::to_string(major) + std::to_string(minor);
  if (major < 7 || (major == 7 && minor < 5))
    return "this GPU (" + cc + ") is older than fastgpt's oldest target, sm_75 (T4)";
  if ((precision == "bf16" || precision == "tf32") && major < 8)
    return "precision='" + precision + "' needs a GPU of compute capability 8.0 or newer (" +
           (precision == "bf16" ? "bfloat16" : "TF32") + " tensor cores: A100, A10, L4, RTX 30xx/40xx, H100); this " +
           cc + " GPU trains in " + (precision == "bf16" ? "'fp16' (with loss scaling) or 'fp32'" : "'fp32'");
  return "";
}
// Runs a tiny kernel on the device and checks its result: proves that the build's architectures run there.
bool smoke_test(int device);
// Bytes the device's stream-ordered pool holds (cudaMemPoolAttrReservedMemCurrent): the kernels' scratch, in use
// or kept for reuse (scratch.h); a deleted model gives its part back (backend_cuda.cu).
int64_t pool_reserved(int device);

}  // namespace fastgpt::cuda
