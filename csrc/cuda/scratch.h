// fp32 scratch for the CUDA ops, released on every exit path, exceptions included: one definition for flash
// attention, the engine's attention, the GEMM workspace and fallback, the LayerNorm and bias gradients. An engine
// call takes it from its stream's Workspace (sized once: no allocation in a training step); anything else from the
// stream-ordered pool (cudaMallocAsync on the op's stream).
// Include it after cuda/check.h (and, in flash files, after flash_attention.cuh, which the warp emulator swaps).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cuda/check.h"

namespace fastgpt::cuda {

// Stream-ordered bytes from the current device's default pool. The first call on a device sets that pool's release
// threshold to "never": with the default (0) the pool unmaps freed memory at every synchronize, and every training
// step would map its scratch again. (torch and CuPy keep their own caching allocators, unless torch is told to use
// this pool, PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: then a deleted model's trim, backend_cuda.cu, also
// returns torch's unused cached memory, which costs torch a new reservation, not a wrong result.)
inline void* pool_malloc(size_t bytes, cudaStream_t stream) {
  static std::atomic<uint64_t> configured{0};  // bit d: device d's pool is set up
  int dev = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !((configured.load() >> dev) & 1)) {
    cudaMemPool_t pool;
    FASTGPT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    FASTGPT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    if (dev < 64) configured.fetch_or(uint64_t(1) << dev);
  }
  void* p = nullptr;
  FASTGPT_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
  return p;
}

// The scratch of an engine's stream, held between calls: one device buffer sized by the largest set of scratch
// live at once in the first training step, so that later steps allocate nothing (and a CUDA graph of a step sees
// the same addresses on every replay). Scratch is bump-allocated from it while any is live and it rewinds when none
// is: work on the stream runs in order, so the next kernel may reuse what the last one used. A request that does not
// fit goes to the pool (Scratch does that) and raises the size the buffer takes at its next rewind; the old buffer
// is freed in stream order, after the work queued on it.
class Workspace {
 public:
  explicit Workspace(cudaStream_t stream) : stream_(stream) {}
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    if (base_) cudaFreeAsync(base_, stream_);  // no throw from a destructor
  }
  cudaStream_t stream() const { return stream_; }
  size_t capacity() const { return cap_; }
  // Times the buffer was replaced (a graph may hold the old one), or would have been during a capture.
  int64_t grows() const { return grows_; }
  // bytes from the buffer, or nullptr: the caller takes them from the pool, and tells give() which it was. While
  // the stream is being captured into a graph the buffer never moves (a recorded free and allocation would not have
  // happened); a request that does not fit then counts as a move, so that the recording is dropped (generation).
  void* take(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;  // every piece as aligned as cudaMalloc's
    if (live_ == 0) {
      top_ = peak_ = 0;
      if (want_ > cap_ && want_ < refused_ && !capturing()) grow();
    }
    live_++;
    last_want_ = want_;
    peak_ += bytes;  // what the window would need if everything live came from the buffer
    want_ = want_ > peak_ ? want_ : peak_;
    if (top_ + bytes > cap_) {
      if (capturing()) grows_++;
      return nullptr;
    }
    void* p = base_ + top_;
    top_ += bytes;
    return p;
  }
  void give() { live_--; }
  // The request take() just answered with nullptr could not be had from the pool either (out of memory): it is
  // given back and forgotten, so that the buffer is not grown to a size the device refused (every later rewind
  // would try that size again and fail, whatever the next calls need).
  void refused(size_t bytes) {
    live_--;
    peak_ -= (bytes + 255) / 256 * 256;
    want_ = last_want_;
  }

 private:
  bool capturing() const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FASTGPT_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    return status != cudaStreamCaptureStatusNone;
  }
  // Replaces the buffer by one of want_ bytes. One the pool refuses (out of memory: the window's size in one piece)
  // is not asked for again (refused_): the call goes on, its requests served by the pool one at a time (which may
  // fit where the whole window did not), and the buffer is sized anew, below that size, by what calls need.
  void grow() {
    if (base_) FASTGPT_CUDA_CHECK(cudaFreeAsync(base_, stream_));
    base_ = nullptr;
    cap_ = 0;
    grows_++;
    try {
      base_ = static_cast<char*>(pool_malloc(want_, stream_));
    } catch (...) {  // FASTGPT_CUDA_CHECK cleared the error; a sticky one shows at the next launch check
      refused_ = want_;
      want_ = 0;
      return;
    }
    cap_ = want_;
  }
  cudaStream_t stream_;
  char* base_ = nullptr;
  size_t cap_ = 0, top_ = 0, peak_ = 0, want_ = 0, last_want_ = 0, refused_ = SIZE_MAX;
  int live_ = 0;
  int64_t grows_ = 0;
};

// The workspace of the engine call running on this thread (the CUDA backend sets it around each kernel call); ops
// called from Python have none and take their scratch from the pool.
inline thread_local Workspace* tl_workspace = nullptr;
struct WorkspaceScope {
  Workspace* prev;
  explicit WorkspaceScope(Workspace* w) : prev(tl_workspace) { tl_workspace = w; }
  ~WorkspaceScope() { tl_workspace = prev; }
  WorkspaceScope(const WorkspaceScope&) = delete;
  WorkspaceScope& operator=(const WorkspaceScope&) = delete;
};

// n floats of scratch on `stream` until the end of the scope: from the engine's workspace when the caller runs on
// its stream, else from the pool (returned in stream order).
struct Scratch {
  float* ptr = nullptr;
  cudaStream_t stream;
  Workspace* ws = nullptr;
  bool pooled = false;
  Scratch(size_t n, cudaStream_t s) : stream(s) {
    if (!n) return;
    if (tl_workspace && tl_workspace->stream() == s) {
      ws = tl_workspace;
      ptr = static_cast<float*>(ws->take(n * sizeof(float)));
      if (ptr) return;
    }
    try {
      ptr = static_cast<float*>(pool_malloc(n * sizeof(float), stream));
    } catch (...) {
      if (ws) ws->refused(n * sizeof(float));
      throw;
    }
    pooled = true;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (pooled) cudaFreeAsync(ptr, stream);  // no throw from a destructor
    if (ws) ws->give();
  }
};

}  // namespace fastgpt::cuda
