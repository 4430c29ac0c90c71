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
// Makes `device` current for the calling thread (the ops select the device their arrays are on).
void set_device(int device);
// Runs a tiny kernel on the device and checks its result: proves that the build's architectures run there.
bool smoke_test(int device);

}  // namespace fastgpt::cuda
