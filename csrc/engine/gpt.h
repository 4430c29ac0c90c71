// The GPT-2 model engine: one contiguous parameter buffer with named views (llm.c's layout), one gradient buffer
// of the same layout, the activations of the last forward, and forward/backward composed from the kernels of a
// Backend (CPU or CUDA). This is the only place that knows the order of operations in a block; kernels know
// nothing of the model, and nothing here knows Python (the binding in csrc/binding.cpp wraps it).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"

namespace fastgpt {

struct GPTConfig {
  int block_size = 1024;  // max sequence length
  int vocab_size = 50257;
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  void validate() const;  // throws std::invalid_argument naming the bad field
};

// One parameter tensor in the flat buffer. Per-layer tensors are stacked: layer l's slice starts at
// offset + l * numel / n_layer. `decay` marks the 2-D weights that AdamW decays (build-nanogpt's groups).
struct ParamTensor {
  std::string name;            // build-nanogpt name, "{l}" standing for the layer: "transformer.h.{l}.ln_1.weight"
  std::vector<int64_t> shape;  // one layer's shape, nn.Linear (out, in) for weights
  int64_t offset;              // into the flat buffer, in floats
  int64_t numel;               // all layers together
  bool per_layer;
  bool decay;
  float init_std;              // 0: constant init (init_value)
  float init_value;
};

// A named view of one array: what state_dict() hands out, one entry per layer for stacked tensors.
struct NamedView {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset;
};

class GPT {
 public:
  GPT(const GPTConfig& cfg, uint64_t seed, std::unique_ptr<Backend> backend);

  const GPTConfig& config() const { return cfg_; }
  Backend& backend() { return *be_; }
  int64_t num_parameters() const { return params_.size(); }
  float* params() { return params_.data(); }  // backend memory (device memory for CUDA)
  float* grads() { return grads_.data(); }
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  std::vector<NamedView> named_views() const;

  // Runs the model on idx (B, T), host token ids. With targets, returns the mean cross-entropy loss and keeps what
  // backward needs; without, returns NaN. last_only computes logits for the last position of each row only.
  float forward(const int32_t* idx, const int32_t* targets, int B, int T, bool last_only = false);
  // Logits of the last forward, in backend memory: (B, T, V), or (B, 1, V) after last_only. Backward overwrites them.
  const float* logits() const { return logits_.data(); }
  bool logits_valid() const { return logits_valid_; }
  int last_B() const { return B_; }
  int last_T() const { return last_only_ ? 1 : T_; }  // rows of logits per sequence
  // Adds d(grad_scale * mean loss)/d(params) to the gradient buffer.
  void backward(float grad_scale);
  void zero_grad();
  // Global L2 norm of the gradients; if above max_norm, scales them by max_norm / (norm + 1e-6) (torch's rule).
  double clip_grad_norm(double max_norm);

 private:
  void init_params(uint64_t seed);
  void ensure_activations(int B, int T);
  const float* P(int i, int l = 0) const;  // parameter tensor i (its layer l slice)
  float* G(int i, int l = 0);               // gradient tensor i

  GPTConfig cfg_;
  std::unique_ptr<Backend> be_;
  std::vector<ParamTensor> tensors_;
  Buffer<float> params_, grads_;

  // Activations of the last forward, sized for the largest (B, T) seen. Per-layer ones are stacked (L, B, T, ...).
  int64_t act_bt_ = 0;
  int B_ = 0, T_ = 0;
  bool have_targets_ = false, last_only_ = false, logits_valid_ = false;
  Buffer<int32_t> idx_, targets_;   // (B, T)
  Buffer<float> encoded_;           // (B, T, C)
  Buffer<float> ln1_, ln1_mean_, ln1_rstd_;  // (L, B, T, C), (L, B, T) x2
  Buffer<float> qkv_;               // (L, B, T, 3C)
  Buffer<float> atty_, att_lse_;    // (L, B, T, C), (L, B, NH, T)
  Buffer<float> residual2_;         // (L, B, T, C)
  Buffer<float> ln2_, ln2_mean_, ln2_rstd_;
  Buffer<float> fch_, fch_gelu_;    // (L, B, T, 4C)
  Buffer<float> residual3_;         // (L, B, T, C)
  Buffer<float> lnf_, lnf_mean_, lnf_rstd_, last_rows_;
  Buffer<float> logits_;            // (B, T, V); backward writes dlogits over it
  Buffer<float> losses_, ce_lse_;   // (B, T)
  std::vector<float> host_losses_;  // (B, T)
  // Backward scratch, reused across layers.
  Buffer<float> dresidual_, dbtc_, dbt4c_, dqkv_;
};

}  // namespace fastgpt
