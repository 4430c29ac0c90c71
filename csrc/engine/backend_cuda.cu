// The CUDA backend: device memory from cudaMalloc and the kernels of csrc/cuda/, all on one stream the backend owns,
// so the engine's work is ordered without host synchronisation; only download(), upload() and the host's gradient
// norm (clip_grad_norm) wait. upload_async stages through pinned memory, so a training step's ids go up unwaited.
// Built only with FASTGPT_WITH_CUDA (backend_cpu.cpp supplies the error otherwise).
#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"
#include "engine/backend.h"

namespace fastgpt {

namespace {

// Runs `body` with S bound to the C++ type of `d` (see backend_cpu.cpp), on this backend's device, its kernels'
// scratch from this backend's workspace.
#define FASTGPT_TYPED(d, ...)                          \
  do {                                                 \
    const cuda::DeviceGuard guard_(device_);           \
    const cuda::WorkspaceScope ws_(workspace_.get());  \
    with_dtype(d, [&](auto tag_) {                     \
      using S = decltype(tag_);                        \
      __VA_ARGS__;                                     \
    });                                                \
  } while (0)


class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    if (device < 0 || device >= cuda::device_count())
      throw std::invalid_argument("device='cuda:" + std::to_string(device) + "': no such CUDA device (" +
                                  std::to_string(cuda::device_count()) + " visible)");
    const cuda::DeviceGuard guard(device_);
    FASTGPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    FASTGPT_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    workspace_ = std::make_unique<cuda::Workspace>(stream_);
  }
  ~CudaBackend() override {
    try {
      const cuda::DeviceGuard guard(device_);
      workspace_.reset();  // freed in the order of its stream, which must still exist
      cudaStreamSynchronize(stream_);
      // The pool keeps what is freed into it (scratch.h: release threshold "never", so that steps allocate nothing);
      // a model going away gives it back to the device, for whatever runs next in the process (torch's rungs of the
      // ladder, a larger model). Other models' live buffers are untouched: only unused pool memory is released.
      cudaMemPool_t pool;
      if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
      (void)cudaGetLastError();
      for (void* p : deferred_) cudaFree(p);
      if (staging_) cudaFreeHost(staging_);
      cudaEventDestroy(staged_);
      cudaStreamDestroy(stream_);
    } catch (...) {  // no throw from a destructor (the guard throws only if the device cannot be queried)
    }
  }
  bool is_cuda() const override { return true; }
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  void check_precision(const std::string& precision) const override {
    int major = 0, minor = 0;
    FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
    FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_));
    const std::string why = cuda::precision_unsupported(major, minor, precision);
    if (!why.empty()) throw std::invalid_argument(cuda::device_name(device_) + ": " + why);
  }
  void set_tf32(bool on) override { tf32_ = on; }
  void* stream() const override { return stream_; }
  int64_t scratch_bytes() const override { return (int64_t)workspace_->capacity(); }

  // Neither may run inside a capture (cudaMalloc and the synchronize before cudaFree would break it, and leave the
  // runtime's last error set): alloc refuses, as the CPU backend's does, and release leaves the free to capture()
  // and breaks the recording, as the CPU backend's does.
  void* alloc(int64_t bytes) override {
    void* p = nullptr;
    const cuda::DeviceGuard guard(device_);
    if (capturing())
      throw std::logic_error("taking memory inside a graph capture: a graph can only replay queued work");
    cudaError_t err = cudaMalloc(&p, bytes > 0 ? bytes : 1);
    if (err == cudaErrorMemoryAllocation) {
      // The stream-ordered pool keeps what the kernels' scratch freed (release threshold "never", scratch.h): give
      // it back to the device once the stream is done with it, and try again.
      (void)cudaGetLastError();
      cudaMemPool_t pool = nullptr;
      FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
      FASTGPT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
      FASTGPT_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
      err = cudaMalloc(&p, bytes > 0 ? bytes : 1);
    }
    FASTGPT_CUDA_CHECK(err);
    FASTGPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return p;
  }
  void release(void* p) override {  // no throw: Buffer's destructor calls it
    try {
      const cuda::DeviceGuard guard(device_);
      if (capturing()) {
        deferred_.push_back(p);
        return;
      }
      cudaStreamSynchronize(stream_);  // a kernel still in flight may read it
      cudaFree(p);
      return;
    } catch (...) {  // the device, the capture query or the list failed
    }
    cudaFree(p);
  }
  void zero(void* p, int64_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    FASTGPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  void copy(void* dst, const void* src, int64_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void upload(void* dst, const void* src, int64_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    // Synchronous: the host buffer (a NumPy array, a token batch) may be freed as soon as this returns.
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void* staging(int64_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    // The staging memory is free once the last copy out of it ran: in a training loop that was a step ago.
    if (staged_pending_) FASTGPT_CUDA_CHECK(cudaEventSynchronize(staged_));
    staged_pending_ = false;
    if (bytes > staging_bytes_ || !staging_) {
      if (staging_) FASTGPT_CUDA_CHECK(cudaFreeHost(staging_));
      staging_ = nullptr;
      staging_bytes_ = 0;
      staging_grows_++;  // a graph's copy out of the old staging memory must not run again
      FASTGPT_CUDA_CHECK(cudaHostAlloc(&staging_, bytes > 0 ? bytes : 1, cudaHostAllocDefault));
      staging_bytes_ = bytes;
    }
    return staging_;
  }
  void copy_staged(void* dst, int64_t bytes) override {
    if (bytes <= 0) return;
    const cuda::DeviceGuard guard(device_);
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, staging_, bytes, cudaMemcpyHostToDevice, stream_));
    // An event last recorded in a capture cannot be waited for outside it: a graph's launch records it instead.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FASTGPT_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    if (status != cudaStreamCaptureStatusNone) return;
    FASTGPT_CUDA_CHECK(cudaEventRecord(staged_, stream_));
    staged_pending_ = true;
  }
  std::unique_ptr<Graph> capture(const std::function<void()>& body) override;
  int64_t generation() const override { return generation_ + staging_grows_ + workspace_->grows(); }
  void download(void* dst, const void* src, int64_t bytes) override {
    const cuda::DeviceGuard guard(device_);
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void adamw_step(float* param, void* lowp, DType dtype, const float* grad, float* m, float* v,
                  const AdamWSegments& seg, float beta1, float beta2, float eps, const StepScalars* s,
                  const RoundKey& key) override {
    const cuda::DeviceGuard guard(device_);
    if (!lowp) return cuda::adamw_step<float>(param, nullptr, grad, m, v, seg, beta1, beta2, eps, s, key, stream_);
    if (dtype == DType::bf16)
      return cuda::adamw_step(param, P<bf16>(lowp), grad, m, v, seg, beta1, beta2, eps, s, key, stream_);
    cuda::adamw_step(param, P<f16>(lowp), grad, m, v, seg, beta1, beta2, eps, s, key, stream_);
  }
  void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                     int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls) override {
    const cuda::DeviceGuard guard(device_);
    cuda::adamw_prepare(s, lr, parts, nparts, losses, nlosses, max_norm, skip, beta1, beta2, ls, stream_);
  }
  void sum_squares_partials(double* partial, const float* x, int64_t n) override {
    const cuda::DeviceGuard guard(device_);
    cuda::sum_squares_partials(partial, x, n, stream_);
  }
  void sum_in_order(double* out, const double* x, int64_t n) override {
    const cuda::DeviceGuard guard(device_);
    cuda::sum_in_order(out, x, n, stream_);
  }
  void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset) override {
    const cuda::DeviceGuard guard(device_);
    cuda::loss_accumulate(acc, losses, n, divisor, reset, stream_);
  }
  void narrow(void* out, DType dtype, const float* in, int64_t n, const RoundKey& key) override {
    const cuda::DeviceGuard guard(device_);
    if (dtype == DType::bf16) return cuda::narrow(P<bf16>(out), in, n, key, stream_);
    cuda::narrow(P<f16>(out), in, n, key, stream_);
  }
  void widen(float* out, const void* in, DType dtype, int64_t n) override {
    const cuda::DeviceGuard guard(device_);
    if (dtype == DType::bf16) return cuda::widen(out, P<bf16>(in), n, stream_);
    cuda::widen(out, P<f16>(in), n, stream_);
  }
  void scale_inplace(float* x, int64_t n, float s) override {
    const cuda::DeviceGuard guard(device_);
    cuda::scale_inplace(x, n, s, stream_);
  }

 protected:
  void encoder_forward_(DType d, void* out, const int32_t* idx, cv* wte, cv* wpe, int B, int T, int C) override {
    FASTGPT_TYPED(d, cuda::encoder_forward(P<S>(out), idx, P<S>(wte), P<S>(wpe), B, T, C, stream_));
  }
  void encoder_backward_(DType d, float* dwte, float* dwpe, cv* dout, const int32_t* idx, int B, int T, int C,
                         int V) override {
    FASTGPT_TYPED(d, cuda::encoder_backward(dwte, dwpe, P<S>(dout), idx, B, T, C, V, stream_));
  }
  void layernorm_forward_(DType d, void* out, float* mean, float* rstd, cv* inp, cv* weight, cv* bias, int64_t N,
                          int C) override {
    FASTGPT_TYPED(d, cuda::layernorm_forward(P<S>(out), mean, rstd, P<S>(inp), P<S>(weight), P<S>(bias), N, C,
                                             stream_));
  }
  void layernorm_backward_(DType d, void* dinp, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                           const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum) override {
    FASTGPT_TYPED(d, cuda::layernorm_backward(P<S>(dinp), dweight, dbias, P<S>(dout), P<S>(inp), P<S>(weight), mean,
                                              rstd, N, C, dinp_sum, stream_));
  }
  void matmul_forward_(DType d, void* out, cv* inp, cv* weight, cv* bias, int64_t N, int C, int OC) override {
    FASTGPT_TYPED(d, cuda::matmul_forward(P<S>(out), P<S>(inp), P<S>(weight), P<S>(bias), N, C, OC, stream_, tf32_));
  }
  void matmul_backward_(DType d, void* dinp, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight, int64_t N,
                        int C, int OC) override {
    FASTGPT_TYPED(d, cuda::matmul_backward(P<S>(dinp), dweight, dbias, P<S>(dout), P<S>(inp), P<S>(weight), N, C, OC,
                                           stream_, tf32_));
  }
  void matmul_forward_gelu_(DType d, void* out, void* pre, cv* inp, cv* weight, cv* bias, int64_t N, int C,
                            int OC) override {
    FASTGPT_TYPED(d, cuda::matmul_forward_gelu(P<S>(out), P<S>(pre), P<S>(inp), P<S>(weight), P<S>(bias), N, C, OC,
                                               stream_, tf32_));
  }
  void matmul_backward_dgelu_(DType d, void* dpre, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                              cv* pre, int64_t N, int C, int OC) override {
    FASTGPT_TYPED(d, cuda::matmul_backward_dgelu(P<S>(dpre), dweight, dbias, P<S>(dout), P<S>(inp), P<S>(weight),
                                                 P<S>(pre), N, C, OC, stream_, tf32_));
  }
  void gelu_forward_(DType d, void* out, cv* inp, int64_t n) override {
    FASTGPT_TYPED(d, cuda::gelu_forward(P<S>(out), P<S>(inp), n, stream_));
  }
  void gelu_backward_(DType d, void* dinp, cv* inp, cv* dout, int64_t n) override {
    FASTGPT_TYPED(d, cuda::gelu_backward(P<S>(dinp), P<S>(inp), P<S>(dout), n, stream_));
  }
  void residual_forward_(DType d, void* out, cv* a, cv* b, int64_t n) override {
    FASTGPT_TYPED(d, cuda::residual_forward(P<S>(out), P<S>(a), P<S>(b), n, stream_));
  }
  void residual_layernorm_forward_(DType d, void* res, void* out, float* mean, float* rstd, cv* a, cv* b, cv* weight,
                                   cv* bias, int64_t N, int C) override {
    FASTGPT_TYPED(d, cuda::residual_layernorm_forward(P<S>(res), P<S>(out), mean, rstd, P<S>(a), P<S>(b),
                                                      P<S>(weight), P<S>(bias), N, C, stream_));
  }
  void attention_forward_(DType d, void* out, float* lse, cv* qkv, int B, int T, int C, int NH,
                          bool causal) override {
    FASTGPT_TYPED(d, cuda::attention_forward(P<S>(out), lse, P<S>(qkv), B, T, C, NH, causal, stream_, f32_math()));
  }
  void attention_backward_(DType d, void* dqkv, cv* dout, cv* qkv, cv* out, const float* lse, int B, int T, int C,
                           int NH, bool causal, float* dbias) override {
    FASTGPT_TYPED(d, cuda::attention_backward(P<S>(dqkv), P<S>(dout), P<S>(qkv), P<S>(out), lse, B, T, C, NH, causal,
                                              dbias, stream_, f32_math()));
  }
  void attention_decode_append_(DType d, void* kcache, void* vcache, cv* qkv, int B, int T, int t0, int Tmax, int C,
                                int NH) override {
    FASTGPT_TYPED(d, cuda::attention_decode_append(P<S>(kcache), P<S>(vcache), P<S>(qkv), B, T, t0, Tmax, C, NH,
                                                    stream_));
  }
  void attention_decode_forward_(DType d, void* out, cv* qkv, cv* kcache, cv* vcache, int B, int T, int t0, int Tmax,
                                 int C, int NH) override {
    FASTGPT_TYPED(d, cuda::attention_decode_forward(P<S>(out), P<S>(qkv), P<S>(kcache), P<S>(vcache), B, T, t0, Tmax,
                                                    C, NH, stream_));
  }
  void cross_entropy_forward_(DType d, float* losses, float* lse, cv* logits, const int32_t* targets, int64_t N,
                              int V) override {
    FASTGPT_TYPED(d, cuda::cross_entropy_forward(losses, lse, P<S>(logits), targets, N, V, stream_));
  }
  void cross_entropy_backward_(DType d, void* dlogits, cv* logits, const float* lse, const int32_t* targets,
                               float dloss, const float* dloss_scale, int64_t N, int V) override {
    FASTGPT_TYPED(d, cuda::cross_entropy_backward(P<S>(dlogits), P<S>(logits), lse, targets, dloss, dloss_scale, N,
                                                  V, stream_));
  }
  void cross_entropy_forward_backward_(DType d, float* losses, void* dlogits, cv* logits, const int32_t* targets,
                                       float dloss, const float* dloss_scale, int64_t N, int V) override {
    FASTGPT_TYPED(d, cuda::cross_entropy_forward_backward(losses, P<S>(dlogits), P<S>(logits), targets, dloss,
                                                          dloss_scale, N, V, stream_));
  }

 private:
  // fp32 attention: TF32 tensor cores, one product per product in the tf32 precision, three (fp32 accuracy) in fp32.
  cuda::F32Math f32_math() const { return tf32_ ? cuda::F32Math::tf32 : cuda::F32Math::tf32x3; }

  int device_;
  cudaStream_t stream_ = nullptr;
  bool tf32_ = false;
  std::unique_ptr<cuda::Workspace> workspace_;  // the kernels' scratch, sized by the first step
  // staging()'s pinned memory (grown only) and the event of the last copy out of it.
  void* staging_ = nullptr;
  int64_t staging_bytes_ = 0, staging_grows_ = 0;
  cudaEvent_t staged_ = nullptr;
  bool staged_pending_ = false;
  std::vector<void*> deferred_;  // released inside a capture: freed by capture() once it has ended

  bool capturing() const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FASTGPT_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    return status != cudaStreamCaptureStatusNone;
  }
};

#undef FASTGPT_TYPED

// A captured stream: the executable graph, launched on the backend's stream.
class CudaGraph final : public Graph {
 public:
  // staged, pending: the backend's staging event and its flag (the backend outlives its graphs' owners).
  CudaGraph(cudaGraph_t graph, cudaGraphExec_t exec, cudaStream_t stream, int device, cudaEvent_t staged,
            bool* pending)
      : graph_(graph), exec_(exec), stream_(stream), device_(device), staged_(staged), pending_(pending) {}
  ~CudaGraph() override {
    try {
      const cuda::DeviceGuard guard(device_);
      if (exec_) cudaGraphExecDestroy(exec_);
      cudaGraphDestroy(graph_);
    } catch (...) {  // no throw from a destructor
    }
  }
  void launch() override {
    const cuda::DeviceGuard guard(device_);
    FASTGPT_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    // The next staging() waits for this launch, which copies out of the staging memory: recorded after the whole
    // graph (a bubble of one host copy per step; copy_staged records nothing while captured).
    FASTGPT_CUDA_CHECK(cudaEventRecord(staged_, stream_));
    *pending_ = true;
  }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  int device_;
  cudaEvent_t staged_;
  bool* pending_;
};

// A recording that fails throws, and leaves no trace for the eager step that follows (TrainStep's fallback): the
// capture ended, the memory released inside it freed, and the runtime's last error cleared (a refused call, or
// EndCapture's "invalidated", would otherwise fail that step's first launch check).
std::unique_ptr<Graph> CudaBackend::capture(const std::function<void()>& body) {
  const cuda::DeviceGuard guard(device_);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const auto free_deferred = [&] {
    if (deferred_.empty()) return;
    cudaStreamSynchronize(stream_);  // the kernels queued before the capture may still read them
    for (void* p : deferred_) cudaFree(p);
    deferred_.clear();
  };
  try {
    // Thread-local mode: only this thread's unsafe calls (a synchronize, a plain cudaMalloc) break the capture.
    FASTGPT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);  // ends the capture; what it holds is dropped
      throw;
    }
    FASTGPT_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (!deferred_.empty())
      throw std::logic_error("freeing memory inside a graph capture: a graph can only replay queued work");
    FASTGPT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  } catch (...) {
    if (graph) cudaGraphDestroy(graph);
    free_deferred();
    (void)cudaGetLastError();
    throw;
  }
  return std::make_unique<CudaGraph>(graph, exec, stream_, device_, staged_, &staged_pending_);
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace fastgpt
