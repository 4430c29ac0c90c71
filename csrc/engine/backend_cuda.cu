// The CUDA backend: device memory from cudaMalloc and the kernels of csrc/cuda/, all on one stream the backend owns,
// so the engine's work is ordered without host synchronisation; only download() and the gradient norm wait.
// Built only with FASTGPT_WITH_CUDA (backend_cpu.cpp supplies the error otherwise).
#include <cuda_runtime.h>

#include <stdexcept>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "engine/backend.h"

namespace fastgpt {

namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    if (device < 0 || device >= cuda::device_count())
      throw std::runtime_error("device='cuda:" + std::to_string(device) + "': no such CUDA device (" +
                               std::to_string(cuda::device_count()) + " visible)");
    FASTGPT_CUDA_CHECK(cudaSetDevice(device_));
    FASTGPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  bool is_cuda() const override { return true; }
  std::string name() const override { return "cuda:" + std::to_string(device_); }

  void* alloc(int64_t bytes) override {
    void* p = nullptr;
    select();
    FASTGPT_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    FASTGPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return p;
  }
  void release(void* p) override {
    select();
    cudaStreamSynchronize(stream_);  // a kernel still in flight may read it
    cudaFree(p);                     // no throw from a destructor path
  }
  void zero(void* p, int64_t bytes) override { FASTGPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_)); }
  void copy(void* dst, const void* src, int64_t bytes) override {
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void upload(void* dst, const void* src, int64_t bytes) override {
    select();
    // Synchronous: the host buffer (a NumPy array, a token batch) may be freed as soon as this returns.
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download(void* dst, const void* src, int64_t bytes) override {
    select();
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void encoder_forward(float* out, const int32_t* idx, const float* wte, const float* wpe, int B, int T,
                       int C) override {
    select();
    cuda::encoder_forward(out, idx, wte, wpe, B, T, C, stream_);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* idx, int B, int T, int C,
                        int V) override {
    select();
    cuda::encoder_backward(dwte, dwpe, dout, idx, B, T, C, V, stream_);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int64_t N, int C) override {
    select();
    cuda::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, stream_);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N, int C) override {
    select();
    cuda::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, stream_);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                      int OC) override {
    select();
    cuda::matmul_forward(out, inp, weight, bias, N, C, OC, stream_);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int C, int OC) override {
    select();
    cuda::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, stream_);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) override {
    select();
    cuda::gelu_forward(out, inp, n, stream_);
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    select();
    cuda::gelu_backward(dinp, inp, dout, n, stream_);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) override {
    select();
    cuda::residual_forward(out, a, b, n, stream_);
  }
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                         bool causal) override {
    select();
    cuda::attention_forward(out, lse, qkv, B, T, C, NH, causal, stream_);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                          int B, int T, int C, int NH, bool causal) override {
    select();
    cuda::attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, causal, stream_);
  }
  void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                             int V) override {
    select();
    cuda::cross_entropy_forward(losses, lse, logits, targets, N, V, stream_);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                              float dloss, int64_t N, int V) override {
    select();
    cuda::cross_entropy_backward(dlogits, logits, lse, targets, dloss, N, V, stream_);
  }
  void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                    const cpu::AdamWHyper& h) override {
    select();
    cuda::adamw_update(param, grad, m, v, n, h, stream_);
  }
  double sum_squares(const float* x, int64_t n) override {
    select();
    return cuda::sum_squares(x, n, stream_);
  }
  void scale_inplace(float* x, int64_t n, float s) override {
    select();
    cuda::scale_inplace(x, n, s, stream_);
  }

 private:
  // The calling thread may have another device current (torch, another model): make ours current first.
  void select() { FASTGPT_CUDA_CHECK(cudaSetDevice(device_)); }

  int device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace fastgpt
