// The CPU backend: host memory (64-byte aligned, for the vector kernels) and the kernels of csrc/cpu/, each
// instantiated for the storage type the DType names. Runs every precision but tf32 (the CPU has no TF32 units).
// Its graphs record the calls (each with its arguments copied, as a CUDA graph bakes them) and replay them, so the
// CPU tests check that a captured training step takes everything that changes per step from memory.
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#include "engine/backend.h"

namespace fastgpt {

namespace {

// Runs `body` with S bound to the C++ type of `d` (the pointers are cast inside with P<S>), or records it.
#define FASTGPT_TYPED(d, ...)          \
  run([=] {                            \
    with_dtype(d, [&](auto tag_) {     \
      using S = decltype(tag_);        \
      __VA_ARGS__;                     \
    });                                \
  })

class CpuGraph final : public Graph {
 public:
  explicit CpuGraph(std::vector<std::function<void()>> calls) : calls_(std::move(calls)) {}
  void launch() override {
    for (auto& c : calls_) c();
  }

 private:
  std::vector<std::function<void()>> calls_;
};

class CpuBackend final : public Backend {
 public:
  bool is_cuda() const override { return false; }
  std::string name() const override { return "cpu"; }
  void check_precision(const std::string& precision) const override {
    if (precision == "tf32")
      throw std::invalid_argument("precision='tf32' needs a CUDA GPU (TF32 is a tensor-core format; the CPU has "
                                  "none): use 'fp32', 'bf16' or 'fp16' on the CPU");
  }
  void set_tf32(bool on) override {
    if (on) check_precision("tf32");
  }

  void* alloc(int64_t bytes) override {
    no_capture("taking memory");
    const size_t size = ((size_t)bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, size ? size : 64);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, size);
    return p;
  }
  // Never throws: it runs in Buffer's destructor (noexcept; a throw there ends the process). A free inside a capture
  // breaks the recording instead, as it does a CUDA stream capture, and capture() says so when the body returns
  // (or the body's next allocation throws first).
  void release(void* p) override {
    if (recording_ && !broken_) broken_ = "freeing memory";
    std::free(p);
  }
  void zero(void* p, int64_t bytes) override {
    run([=] { std::memset(p, 0, bytes); });
  }
  void copy(void* dst, const void* src, int64_t bytes) override {
    run([=] { std::memcpy(dst, src, bytes); });
  }
  void upload(void* dst, const void* src, int64_t bytes) override {
    no_capture("upload");
    std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, int64_t bytes) override {
    no_capture("download (waiting for the device)");
    std::memcpy(dst, src, bytes);
  }
  void* staging(int64_t bytes) override {
    no_capture("staging");
    if ((int64_t)staging_.size() < bytes) {
      staging_ = std::vector<uint8_t>(bytes);
      generation_++;  // a recorded copy_staged points at the old staging memory
    }
    return staging_.data();
  }
  void copy_staged(void* dst, int64_t bytes) override {
    const uint8_t* src = staging_.data();
    run([=] { std::memcpy(dst, src, bytes); });
  }
  std::unique_ptr<Graph> capture(const std::function<void()>& body) override {
    if (recording_) throw std::logic_error("capture() inside a capture");
    std::vector<std::function<void()>> calls;
    recording_ = &calls;
    broken_ = nullptr;
    try {
      body();
    } catch (...) {
      recording_ = nullptr;
      throw;
    }
    recording_ = nullptr;
    if (broken_) no_capture_error(broken_);
    return std::make_unique<CpuGraph>(std::move(calls));
  }

  void adamw_step(float* param, void* lowp, DType dtype, const float* grad, float* m, float* v,
                  const AdamWSegments& seg, float beta1, float beta2, float eps, const StepScalars* s,
                  const RoundKey& key) override {
    run([=] {
      if (!lowp) return cpu::adamw_step<float>(param, nullptr, grad, m, v, seg, beta1, beta2, eps, s, key);
      if (dtype == DType::bf16)
        return cpu::adamw_step(param, P<bf16>(lowp), grad, m, v, seg, beta1, beta2, eps, s, key);
      cpu::adamw_step(param, P<f16>(lowp), grad, m, v, seg, beta1, beta2, eps, s, key);
    });
  }
  void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                     int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls) override {
    run([=] { cpu::adamw_prepare(s, lr, parts, nparts, losses, nlosses, max_norm, skip, beta1, beta2, ls); });
  }
  void sum_squares_partials(double* partial, const float* x, int64_t n) override {
    run([=] { cpu::sum_squares_partials(partial, x, n); });
  }
  void sum_in_order(double* out, const double* x, int64_t n) override {
    run([=] { cpu::sum_in_order(out, x, n); });
  }
  void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset) override {
    run([=] { cpu::loss_accumulate(acc, losses, n, divisor, reset); });
  }
  void narrow(void* out, DType dtype, const float* in, int64_t n, const RoundKey& key) override {
    run([=] {
      if (dtype == DType::bf16) return cpu::narrow(P<bf16>(out), in, n, key);
      cpu::narrow(P<f16>(out), in, n, key);
    });
  }
  void widen(float* out, const void* in, DType dtype, int64_t n) override {
    run([=] {
      if (dtype == DType::bf16) return cpu::widen(out, P<bf16>(in), n);
      cpu::widen(out, P<f16>(in), n);
    });
  }
  void scale_inplace(float* x, int64_t n, float s) override {
    run([=] { cpu::scale_inplace(x, n, s); });
  }

 protected:
  void encoder_forward_(DType d, void* out, const int32_t* idx, cv* wte, cv* wpe, int B, int T, int C) override {
    FASTGPT_TYPED(d, cpu::encoder_forward(P<S>(out), idx, P<S>(wte), P<S>(wpe), B, T, C));
  }
  void encoder_backward_(DType d, float* dwte, float* dwpe, cv* dout, const int32_t* idx, int B, int T, int C,
                         int) override {
    FASTGPT_TYPED(d, cpu::encoder_backward(dwte, dwpe, P<S>(dout), idx, B, T, C));
  }
  void layernorm_forward_(DType d, void* out, float* mean, float* rstd, cv* inp, cv* weight, cv* bias, int64_t N,
                          int C) override {
    FASTGPT_TYPED(d, cpu::layernorm_forward(P<S>(out), mean, rstd, P<S>(inp), P<S>(weight), P<S>(bias), N, C));
  }
  void layernorm_backward_(DType d, void* dinp, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                           const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum) override {
    FASTGPT_TYPED(d, cpu::layernorm_backward(P<S>(dinp), dweight, dbias, P<S>(dout), P<S>(inp), P<S>(weight), mean,
                                             rstd, N, C, dinp_sum));
  }
  void matmul_forward_(DType d, void* out, cv* inp, cv* weight, cv* bias, int64_t N, int C, int OC) override {
    FASTGPT_TYPED(d, cpu::matmul_forward(P<S>(out), P<S>(inp), P<S>(weight), P<S>(bias), N, C, OC));
  }
  void matmul_backward_(DType d, void* dinp, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight, int64_t N,
                        int C, int OC) override {
    FASTGPT_TYPED(d, cpu::matmul_backward(P<S>(dinp), dweight, dbias, P<S>(dout), P<S>(inp), P<S>(weight), N, C, OC));
  }
  void matmul_forward_gelu_(DType d, void* out, void* pre, cv* inp, cv* weight, cv* bias, int64_t N, int C,
                            int OC) override {
    FASTGPT_TYPED(d, cpu::matmul_forward_gelu(P<S>(out), P<S>(pre), P<S>(inp), P<S>(weight), P<S>(bias), N, C, OC));
  }
  void matmul_backward_dgelu_(DType d, void* dpre, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                              cv* pre, int64_t N, int C, int OC) override {
    FASTGPT_TYPED(d, cpu::matmul_backward_dgelu(P<S>(dpre), dweight, dbias, P<S>(dout), P<S>(inp), P<S>(weight),
                                                P<S>(pre), N, C, OC));
  }
  void gelu_forward_(DType d, void* out, cv* inp, int64_t n) override {
    FASTGPT_TYPED(d, cpu::gelu_forward(P<S>(out), P<S>(inp), n));
  }
  void gelu_backward_(DType d, void* dinp, cv* inp, cv* dout, int64_t n) override {
    FASTGPT_TYPED(d, cpu::gelu_backward(P<S>(dinp), P<S>(inp), P<S>(dout), n));
  }
  void residual_forward_(DType d, void* out, cv* a, cv* b, int64_t n) override {
    FASTGPT_TYPED(d, cpu::residual_forward(P<S>(out), P<S>(a), P<S>(b), n));
  }
  void residual_layernorm_forward_(DType d, void* res, void* out, float* mean, float* rstd, cv* a, cv* b, cv* weight,
                                   cv* bias, int64_t N, int C) override {
    FASTGPT_TYPED(d, cpu::residual_layernorm_forward(P<S>(res), P<S>(out), mean, rstd, P<S>(a), P<S>(b),
                                                     P<S>(weight), P<S>(bias), N, C));
  }
  void attention_forward_(DType d, void* out, float* lse, cv* qkv, int B, int T, int C, int NH,
                          bool causal) override {
    FASTGPT_TYPED(d, cpu::attention_forward(P<S>(out), lse, P<S>(qkv), B, T, C, NH, causal));
  }
  void attention_backward_(DType d, void* dqkv, cv* dout, cv* qkv, cv* out, const float* lse, int B, int T, int C,
                           int NH, bool causal, float* dbias) override {
    FASTGPT_TYPED(d, cpu::attention_backward(P<S>(dqkv), P<S>(dout), P<S>(qkv), P<S>(out), lse, B, T, C, NH, causal,
                                             dbias));
  }
  void attention_decode_append_(DType d, void* kcache, void* vcache, cv* qkv, int B, int T, int t0, int Tmax, int C,
                                int NH) override {
    FASTGPT_TYPED(d, cpu::attention_decode_append(P<S>(kcache), P<S>(vcache), P<S>(qkv), B, T, t0, Tmax, C, NH));
  }
  void attention_decode_forward_(DType d, void* out, cv* qkv, cv* kcache, cv* vcache, int B, int T, int t0, int Tmax,
                                 int C, int NH) override {
    FASTGPT_TYPED(d, cpu::attention_decode_forward(P<S>(out), P<S>(qkv), P<S>(kcache), P<S>(vcache), B, T, t0, Tmax,
                                                   C, NH));
  }
  void cross_entropy_forward_(DType d, float* losses, float* lse, cv* logits, const int32_t* targets, int64_t N,
                              int V) override {
    FASTGPT_TYPED(d, cpu::cross_entropy_forward(losses, lse, P<S>(logits), targets, N, V));
  }
  void cross_entropy_backward_(DType d, void* dlogits, cv* logits, const float* lse, const int32_t* targets,
                               float dloss, const float* dloss_scale, int64_t N, int V) override {
    FASTGPT_TYPED(d, cpu::cross_entropy_backward(P<S>(dlogits), P<S>(logits), lse, targets, dloss, dloss_scale, N, V));
  }
  void cross_entropy_forward_backward_(DType d, float* losses, void* dlogits, cv* logits, const int32_t* targets,
                                       float dloss, const float* dloss_scale, int64_t N, int V) override {
    FASTGPT_TYPED(d, cpu::cross_entropy_forward_backward(losses, P<S>(dlogits), P<S>(logits), targets, dloss,
                                                         dloss_scale, N, V));
  }

 private:
  // The work of a call: run now, or recorded (its arguments copied) while a capture is on.
  template <typename F>
  void run(F&& f) {
    if (recording_)
      recording_->emplace_back(std::forward<F>(f));
    else
      f();
  }
  [[noreturn]] static void no_capture_error(const char* what) {
    throw std::logic_error(std::string(what) + " inside a graph capture: a graph can only replay queued work");
  }
  void no_capture(const char* what) const {
    if (recording_) no_capture_error(what);
  }
  std::vector<std::function<void()>>* recording_ = nullptr;
  const char* broken_ = nullptr;  // what broke the current recording without throwing (release)
  std::vector<uint8_t> staging_;
};

#undef FASTGPT_TYPED

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

#ifndef FASTGPT_WITH_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw std::runtime_error("device='cuda': this fastgpt was built without CUDA; reinstall where nvcc is on PATH "
                           "(or with FASTGPT_CUDA=ON)");
}
#endif

}  // namespace fastgpt
