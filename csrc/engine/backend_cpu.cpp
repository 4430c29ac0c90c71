// The CPU backend: host memory (64-byte aligned, for the vector kernels) and the kernels of csrc/cpu/.
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "engine/backend.h"

namespace fastgpt {

namespace {

class CpuBackend final : public Backend {
 public:
  bool is_cuda() const override { return false; }
  std::string name() const override { return "cpu"; }

  void* alloc(int64_t bytes) override {
    const size_t size = ((size_t)bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, size ? size : 64);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, size);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void zero(void* p, int64_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }
  void upload(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }

  void encoder_forward(float* out, const int32_t* idx, const float* wte, const float* wpe, int B, int T,
                       int C) override {
    cpu::encoder_forward(out, idx, wte, wpe, B, T, C);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* idx, int B, int T, int C,
                        int) override {
    cpu::encoder_backward(dwte, dwpe, dout, idx, B, T, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int64_t N, int C) override {
    cpu::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N, int C) override {
    cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                      int OC) override {
    cpu::matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int C, int OC) override {
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  void gelu_forward(float* out, const float* inp, int64_t n) override { cpu::gelu_forward(out, inp, n); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override {
    cpu::gelu_backward(dinp, inp, dout, n);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t n) override {
    cpu::residual_forward(out, a, b, n);
  }
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                         bool causal) override {
    cpu::attention_forward(out, lse, qkv, B, T, C, NH, causal);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                          int B, int T, int C, int NH, bool causal) override {
    cpu::attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, causal);
  }
  void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                             int V) override {
    cpu::cross_entropy_forward(losses, lse, logits, targets, N, V);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                              float dloss, int64_t N, int V) override {
    cpu::cross_entropy_backward(dlogits, logits, lse, targets, dloss, N, V);
  }
  void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                    const cpu::AdamWHyper& h) override {
    cpu::adamw_update(param, grad, m, v, n, h);
  }
  double sum_squares(const float* x, int64_t n) override { return cpu::sum_squares(x, n); }
  void scale_inplace(float* x, int64_t n, float s) override { cpu::scale_inplace(x, n, s); }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

#ifndef FASTGPT_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw std::runtime_error("device='cuda': this fastgpt was built without CUDA; reinstall where nvcc is on PATH "
                           "(or with FASTGPT_CUDA=ON)");
}
#endif

}  // namespace fastgpt
