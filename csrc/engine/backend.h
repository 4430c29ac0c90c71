// What the engine needs of a device: memory and the kernels, behind one interface, so that the model's order of
// operations (gpt.cpp) and the optimizer (adamw.cpp) are written once for the CPU and the GPU. The CPU backend
// calls csrc/cpu/, the CUDA backend (backend_cuda.cu, built with FASTGPT_WITH_CUDA) calls csrc/cuda/ on its own
// stream. Kernel methods take the CPU kernels' arguments; all pointers are the backend's memory.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "cpu/kernels.h"

namespace fastgpt {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual bool is_cuda() const = 0;
  virtual std::string name() const = 0;

  // ---- memory (bytes); alloc returns zeroed memory
  virtual void* alloc(int64_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void zero(void* p, int64_t bytes) = 0;
  virtual void copy(void* dst, const void* src, int64_t bytes) = 0;  // within the device
  virtual void upload(void* dst, const void* host_src, int64_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, int64_t bytes) = 0;  // waits for the device

  // ---- kernels (see csrc/cpu/kernels.h for the contract of each)
  virtual void encoder_forward(float* out, const int32_t* idx, const float* wte, const float* wpe, int B, int T,
                               int C) = 0;
  virtual void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* idx, int B, int T, int C,
                                int V) = 0;
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                 const float* bias, int64_t N, int C) = 0;
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                  const float* weight, const float* mean, const float* rstd, int64_t N, int C) = 0;
  virtual void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                              int OC) = 0;
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, int64_t N, int C, int OC) = 0;
  virtual void gelu_forward(float* out, const float* inp, int64_t n) = 0;
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) = 0;
  virtual void residual_forward(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                                 bool causal) = 0;
  virtual void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                  const float* lse, int B, int T, int C, int NH, bool causal) = 0;
  virtual void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                                     int64_t N, int V) = 0;
  virtual void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                                      const int32_t* targets, float dloss, int64_t N, int V) = 0;
  virtual void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                            const cpu::AdamWHyper& h) = 0;
  virtual double sum_squares(const float* x, int64_t n) = 0;  // deterministic; waits for the device
  virtual void scale_inplace(float* x, int64_t n, float s) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// Throws std::runtime_error when fastgpt was built without CUDA or the device cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device);

// Memory of one backend, freed with it: the engine's buffers.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend* be, int64_t n) : be_(be), n_(n), p_(n ? static_cast<T*>(be->alloc(n * sizeof(T))) : nullptr) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(be_, o.be_);
    std::swap(n_, o.n_);
    std::swap(p_, o.p_);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (p_) be_->release(p_);
  }
  T* data() const { return p_; }
  int64_t size() const { return n_; }

 private:
  Backend* be_ = nullptr;
  int64_t n_ = 0;
  T* p_ = nullptr;
};

}  // namespace fastgpt
