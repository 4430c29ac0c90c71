// The DLPack tensor ABI (v0.8 layout, the one `__dlpack__()` capsules named "dltensor" carry), declared from the
// specification at dmlc/dlpack. Only the consumer side is needed: read a producer's tensor without copying it.
// Declared here rather than taken from a package because no PyPI package ships the header for a `pip install .`
// build to find; the layout is a fixed C ABI, so these declarations are interchangeable with the official ones.
#pragma once
#include <cstdint>

extern "C" {

enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };

struct DLDevice {
  DLDeviceType device_type;
  int32_t device_id;
};

enum DLDataTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;    // (ndim)
  int64_t* strides;  // (ndim) in elements, or nullptr for compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // extern "C"
