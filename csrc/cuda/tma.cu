// The host half of tma.cuh: tensor maps encoded by the driver's cuTensorMapEncodeTiled. The function is taken
// through the runtime's driver entry point (cudaGetDriverEntryPointByVersion), so the extension does not link
// libcuda itself (the toolkit's stub would otherwise be baked in); it is looked up once per process. And the marks
// that tell compute-sanitizer's initcheck what the tensor stores wrote (NVTX's header-only memory API).
// This file is built with every CUDA build, but only the sm_90a kernels call it, and CMake compiles those with nvcc
// 12.0 or newer alone: an older toolkit (no CUtensorMap in cuda.h) compiles nothing here, so that its build goes on.
#include "cuda/check.h"

#if CUDART_VERSION >= 12000
#include <string>
#include <vector>

#include <cudaTypedefs.h>
#if __has_include(<nvtx3/nvToolsExtMemCudaRt.h>)  // NVTX 3.1's memory API (in the toolkit's headers since about 12.2)
#include <nvtx3/nvToolsExtMemCudaRt.h>
#define FASTGPT_NVTX_MEM 1
#endif

#include "cuda/tma.cuh"

namespace fastgpt::cuda::tma {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  // (A function-local static: initialised once, thread-safely; a lookup that throws is tried again next time.)
  static const auto fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    FASTGPT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                                        &found));
#else  // 12.0-12.4 have no ByVersion (12.5 on); unversioned, the lookup gives the toolkit's version: v12000 here
    FASTGPT_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found));
#endif
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      fail("the driver entry point lookup of cuTensorMapEncodeTiled",
           "the driver has no tensor-map encoder (query result " + std::to_string((int)found) + ")", __FILE__,
           __LINE__);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

void encode(CUtensorMap* map, const void* base, const uint64_t (&dims)[4], const uint64_t (&strides)[3],
            const uint32_t (&box)[4]) {
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encoder()(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box,
                               element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    fail("cuTensorMapEncodeTiled", "CUresult " + std::to_string((int)r) + " (dims " + std::to_string(dims[0]) + "," +
                                       std::to_string(dims[1]) + "," + std::to_string(dims[2]) + "," +
                                       std::to_string(dims[3]) + ")",
         __FILE__, __LINE__);
}

void mark_stored(const void* base, size_t bytes, cudaStream_t stream) { mark_stored(base, bytes, 1, bytes, stream); }

void mark_stored(const void* base, size_t bytes, int64_t count, size_t pitch, cudaStream_t stream) {
  // Nothing while the stream is captured into a graph: a mark made then would come before the stores it stands for
  // (they run at each replay), and how the tool takes a capturing stream is undocumented. The engine's graphs write O
  // into buffers it zeroed when it made them, so their replays read nothing initcheck counts as unwritten.
#ifdef FASTGPT_NVTX_MEM
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FASTGPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone || bytes == 0 || count <= 0) return;
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("fastgpt");
  if (pitch == bytes) bytes *= count, count = 1;  // back to back: one range
  std::vector<nvtxMemVirtualRangeDesc_t> ranges(count);
  for (int64_t i = 0; i < count; i++) ranges[i] = {bytes, static_cast<const char*>(base) + i * pitch};
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof batch;
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = count;
  batch.regionDescElementSize = sizeof ranges[0];
  batch.regionDescElements = ranges.data();
  nvtxMemCudaMarkInitialized(domain, stream, 0, &batch);
#else
  (void)base, (void)bytes, (void)count, (void)pitch, (void)stream;
#endif
}

}  // namespace fastgpt::cuda::tma

#endif  // CUDART_VERSION >= 12000
