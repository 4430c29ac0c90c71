// What the engine needs of a device: memory and the kernels, behind one interface, so that the model's order of
// operations (gpt.cpp) and the optimizer (adamw.cpp) are written once for the CPU and the GPU. The CPU backend
// calls csrc/cpu/, the CUDA backend (backend_cuda.cu, built with FASTGPT_WITH_CUDA) calls csrc/cuda/ on its own
// stream. Kernel methods take the CPU kernels' arguments; all pointers are the backend's memory. The storage type
// of the model's activations is a template parameter of the engine (gpt.cpp) and of the kernels, and a DType at
// the virtual boundary between them, so the interface stays one set of functions for every precision.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>

#include "cpu/dtype.h"
#include "cpu/kernels.h"

namespace fastgpt {

// Work recorded by Backend::capture, replayed by launch() with the arguments it was recorded with.
class Graph {
 public:
  virtual ~Graph() = default;
  virtual void launch() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual bool is_cuda() const = 0;
  virtual std::string name() const = 0;
  // Throws std::invalid_argument, naming the device and what it supports, if it cannot run this precision.
  virtual void check_precision(const std::string& precision) const = 0;
  // Matmuls and attention on TF32 tensor cores (fp32 storage): the "tf32" precision. Only a GPU has them.
  virtual void set_tf32(bool on) = 0;
  // The stream (cudaStream_t) the backend queues its work on; nullptr for the CPU. A communicator queues its
  // collectives there, so they are ordered after the kernels that produced their buffers.
  virtual void* stream() const { return nullptr; }

  // ---- memory (bytes); alloc returns zeroed memory
  virtual void* alloc(int64_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void zero(void* p, int64_t bytes) = 0;
  virtual void copy(void* dst, const void* src, int64_t bytes) = 0;  // within the device
  virtual void upload(void* dst, const void* host_src, int64_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, int64_t bytes) = 0;  // waits for the device
  // As upload, without waiting for the work already queued: staging() hands out the backend's host staging memory
  // (pinned on a GPU), at least `bytes` of it, once the last copy out of it has run; the caller writes there what
  // copy_staged() then queues to dst. A graph records copy_staged: each launch copies whatever was staged last.
  virtual void* staging(int64_t bytes) = 0;
  virtual void copy_staged(void* dst, int64_t bytes) = 0;
  void upload_async(void* dst, const void* host_src, int64_t bytes) {
    std::memcpy(staging(bytes), host_src, bytes);
    copy_staged(dst, bytes);
  }
  // Runs `body` without running its work: what it queues on this backend is recorded as a Graph, replayed by
  // launch() with the same pointers and scalars (a CUDA graph on a GPU; on the CPU a recording of the calls, which
  // holds the engine to the same rule: what changes from one launch to the next must come through memory). The body
  // must not wait for the device (download, upload); the CPU refuses it, and memory taken or freed in the body.
  virtual std::unique_ptr<Graph> capture(const std::function<void()>& body) = 0;
  // Changes whenever memory a graph may have recorded is taken or freed (Buffers, staging, scratch): a graph
  // recorded at another generation may point at freed memory.
  virtual int64_t generation() const { return generation_; }
  int64_t bytes_in_use() const { return bytes_in_use_; }  // held by Buffers of this backend
  // Held between calls for the kernels' scratch (a GPU's workspace, sized by the largest need seen; not Buffers).
  virtual int64_t scratch_bytes() const { return 0; }

  // ---- kernels (see csrc/cpu/kernels.h for the contract of each), typed: S is the storage type of activations and
  // compute weights (float, bf16, f16); parameter gradients and statistics are float. Each forwards to the
  // type-erased virtual below it, which a backend implements once with a switch on the DType.
  template <typename S>
  void encoder_forward(S* out, const int32_t* idx, const S* wte, const S* wpe, int B, int T, int C) {
    encoder_forward_(dt<S>(), out, idx, wte, wpe, B, T, C);
  }
  template <typename S>
  void encoder_backward(float* dwte, float* dwpe, const S* dout, const int32_t* idx, int B, int T, int C, int V) {
    encoder_backward_(dt<S>(), dwte, dwpe, dout, idx, B, T, C, V);
  }
  template <typename S>
  void layernorm_forward(S* out, float* mean, float* rstd, const S* inp, const S* weight, const S* bias, int64_t N,
                         int C) {
    layernorm_forward_(dt<S>(), out, mean, rstd, inp, weight, bias, N, C);
  }
  template <typename S>
  void layernorm_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                          const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum = nullptr) {
    layernorm_backward_(dt<S>(), dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, dinp_sum);
  }
  template <typename S>
  void matmul_forward(S* out, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC) {
    matmul_forward_(dt<S>(), out, inp, weight, bias, N, C, OC);
  }
  template <typename S>
  void matmul_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                       int64_t N, int C, int OC) {
    matmul_backward_(dt<S>(), dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  // The MLP's GELU fused into the products around it (kernels.h: matmul_forward_gelu, matmul_backward_dgelu).
  template <typename S>
  void matmul_forward_gelu(S* out, S* pre, const S* inp, const S* weight, const S* bias, int64_t N, int C, int OC) {
    matmul_forward_gelu_(dt<S>(), out, pre, inp, weight, bias, N, C, OC);
  }
  template <typename S>
  void matmul_backward_dgelu(S* dpre, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                             const S* pre, int64_t N, int C, int OC) {
    matmul_backward_dgelu_(dt<S>(), dpre, dweight, dbias, dout, inp, weight, pre, N, C, OC);
  }
  template <typename S>
  void gelu_forward(S* out, const S* inp, int64_t n) {
    gelu_forward_(dt<S>(), out, inp, n);
  }
  template <typename S>
  void gelu_backward(S* dinp, const S* inp, const S* dout, int64_t n) {
    gelu_backward_(dt<S>(), dinp, inp, dout, n);
  }
  template <typename S>
  void residual_forward(S* out, const S* a, const S* b, int64_t n) {
    residual_forward_(dt<S>(), out, a, b, n);
  }
  // res = a + b (res may alias a or b), out = layernorm(res): the residual add and the LayerNorm after it.
  template <typename S>
  void residual_layernorm_forward(S* res, S* out, float* mean, float* rstd, const S* a, const S* b, const S* weight,
                                  const S* bias, int64_t N, int C) {
    residual_layernorm_forward_(dt<S>(), res, out, mean, rstd, a, b, weight, bias, N, C);
  }
  template <typename S>
  void attention_forward(S* out, float* lse, const S* qkv, int B, int T, int C, int NH, bool causal) {
    attention_forward_(dt<S>(), out, lse, qkv, B, T, C, NH, causal);
  }
  // dbias (3C), or nullptr: += the column sums of dqkv, the qkv projection's bias gradient (the fused model's;
  // on an H100/H200 partly from the attention kernel itself, attention.cu).
  template <typename S>
  void attention_backward(S* dqkv, const S* dout, const S* qkv, const S* out, const float* lse, int B, int T, int C,
                          int NH, bool causal, float* dbias = nullptr) {
    attention_backward_(dt<S>(), dqkv, dout, qkv, out, lse, B, T, C, NH, causal, dbias);
  }
  // Generation (attention_decode.cpp): the k/v of T new positions into a layer's cache, then their attention.
  template <typename S>
  void attention_decode_append(S* kcache, S* vcache, const S* qkv, int B, int T, int t0, int Tmax, int C, int NH) {
    attention_decode_append_(dt<S>(), kcache, vcache, qkv, B, T, t0, Tmax, C, NH);
  }
  template <typename S>
  void attention_decode_forward(S* out, const S* qkv, const S* kcache, const S* vcache, int B, int T, int t0,
                                int Tmax, int C, int NH) {
    attention_decode_forward_(dt<S>(), out, qkv, kcache, vcache, B, T, t0, Tmax, C, NH);
  }
  template <typename S>
  void cross_entropy_forward(float* losses, float* lse, const S* logits, const int32_t* targets, int64_t N, int V) {
    cross_entropy_forward_(dt<S>(), losses, lse, logits, targets, N, V);
  }
  template <typename S>
  void cross_entropy_backward(S* dlogits, const S* logits, const float* lse, const int32_t* targets, float dloss,
                              const float* dloss_scale, int64_t N, int V) {
    cross_entropy_backward_(dt<S>(), dlogits, logits, lse, targets, dloss, dloss_scale, N, V);
  }
  template <typename S>
  void cross_entropy_forward_backward(float* losses, S* dlogits, const S* logits, const int32_t* targets, float dloss,
                                      const float* dloss_scale, int64_t N, int V) {
    cross_entropy_forward_backward_(dt<S>(), losses, dlogits, logits, targets, dloss, dloss_scale, N, V);
  }
  // AdamW on fp32 masters over the flat indices of seg (cpu/kernels.h: adamw_step), its scalars read from s in this
  // backend's memory; with lowp (a 16-bit copy, bf16 or f16), also writes the compute weights.
  virtual void adamw_step(float* param, void* lowp, DType lowp_dtype, const float* grad, float* m, float* v,
                          const AdamWSegments& seg, float beta1, float beta2, float eps, const StepScalars* s,
                          const RoundKey& key) = 0;
  // The step's scalars, where s lives (cpu/adamw.h); lr, parts, losses, ls: this backend's memory.
  virtual void adamw_prepare(StepScalars* s, const float* lr, const double* parts, int nparts, const double* losses,
                             int nlosses, double max_norm, bool skip, float beta1, float beta2, LossScale* ls) = 0;
  // Sums of squares without the host: partial (ceil(n / cpu::kSumChunk)) and their in-order total.
  virtual void sum_squares_partials(double* partial, const float* x, int64_t n) = 0;
  virtual void sum_in_order(double* out, const double* x, int64_t n) = 0;
  virtual void loss_accumulate(double* acc, const float* losses, int64_t n, double divisor, bool reset) = 0;
  // Masters to compute weights as `key` says, and 16-bit memory widened to float: dtype bf16 or f16 only.
  virtual void narrow(void* out, DType dtype, const float* in, int64_t n, const RoundKey& key) = 0;
  virtual void widen(float* out, const void* in, DType dtype, int64_t n) = 0;
  virtual void scale_inplace(float* x, int64_t n, float s) = 0;

 protected:
  int64_t generation_ = 0;  // see generation(); Buffers count here, backends add their own memory's changes
  template <typename S>
  static constexpr DType dt() {
    return std::is_same_v<S, float> ? DType::f32 : std::is_same_v<S, bf16> ? DType::bf16 : DType::f16;
  }
  using cv = const void;
  // A type-erased pointer as the storage type the DType named.
  template <typename S>
  static S* P(void* p) {
    return static_cast<S*>(p);
  }
  template <typename S>
  static const S* P(const void* p) {
    return static_cast<const S*>(p);
  }
  virtual void encoder_forward_(DType, void* out, const int32_t* idx, cv* wte, cv* wpe, int B, int T, int C) = 0;
  virtual void encoder_backward_(DType, float* dwte, float* dwpe, cv* dout, const int32_t* idx, int B, int T, int C,
                                 int V) = 0;
  virtual void layernorm_forward_(DType, void* out, float* mean, float* rstd, cv* inp, cv* weight, cv* bias,
                                  int64_t N, int C) = 0;
  // dinp_sum (C) or nullptr: += the column sums of dinp after the update (kernels.h, cuda/ops.h)
  virtual void layernorm_backward_(DType, void* dinp, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                                   const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum) = 0;
  virtual void matmul_forward_(DType, void* out, cv* inp, cv* weight, cv* bias, int64_t N, int C, int OC) = 0;
  virtual void matmul_backward_(DType, void* dinp, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                                int64_t N, int C, int OC) = 0;
  virtual void matmul_forward_gelu_(DType, void* out, void* pre, cv* inp, cv* weight, cv* bias, int64_t N, int C,
                                    int OC) = 0;
  virtual void matmul_backward_dgelu_(DType, void* dpre, float* dweight, float* dbias, cv* dout, cv* inp, cv* weight,
                                      cv* pre, int64_t N, int C, int OC) = 0;
  virtual void gelu_forward_(DType, void* out, cv* inp, int64_t n) = 0;
  virtual void gelu_backward_(DType, void* dinp, cv* inp, cv* dout, int64_t n) = 0;
  virtual void residual_forward_(DType, void* out, cv* a, cv* b, int64_t n) = 0;
  virtual void residual_layernorm_forward_(DType, void* res, void* out, float* mean, float* rstd, cv* a, cv* b,
                                           cv* weight, cv* bias, int64_t N, int C) = 0;
  virtual void attention_forward_(DType, void* out, float* lse, cv* qkv, int B, int T, int C, int NH,
                                  bool causal) = 0;
  virtual void attention_backward_(DType, void* dqkv, cv* dout, cv* qkv, cv* out, const float* lse, int B, int T,
                                   int C, int NH, bool causal, float* dbias) = 0;
  virtual void attention_decode_append_(DType, void* kcache, void* vcache, cv* qkv, int B, int T, int t0, int Tmax,
                                       int C, int NH) = 0;
  virtual void attention_decode_forward_(DType, void* out, cv* qkv, cv* kcache, cv* vcache, int B, int T, int t0,
                                        int Tmax, int C, int NH) = 0;
  virtual void cross_entropy_forward_(DType, float* losses, float* lse, cv* logits, const int32_t* targets,
                                      int64_t N, int V) = 0;
  virtual void cross_entropy_backward_(DType, void* dlogits, cv* logits, const float* lse, const int32_t* targets,
                                       float dloss, const float* dloss_scale, int64_t N, int V) = 0;
  virtual void cross_entropy_forward_backward_(DType, float* losses, void* dlogits, cv* logits,
                                               const int32_t* targets, float dloss, const float* dloss_scale,
                                               int64_t N, int V) = 0;

 private:
  template <typename T>
  friend class Buffer;
  int64_t bytes_in_use_ = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// Throws std::runtime_error when fastgpt was built without CUDA or the device cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device);

// Memory of one backend, freed with it: the engine's buffers.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend* be, int64_t n) : be_(be), n_(n), p_(n ? static_cast<T*>(be->alloc(n * sizeof(T))) : nullptr) {
    be_->bytes_in_use_ += n * (int64_t)sizeof(T);
    be_->generation_++;
  }
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
    if (be_) {
      be_->bytes_in_use_ -= n_ * (int64_t)sizeof(T);
      be_->generation_++;
    }
  }
  T* data() const { return p_; }
  int64_t size() const { return n_; }

 private:
  Backend* be_ = nullptr;
  int64_t n_ = 0;
  T* p_ = nullptr;
};

}  // namespace fastgpt
