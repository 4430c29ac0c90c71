// The GPT-2 model engine: one contiguous parameter buffer with named views (llm.c's layout), one gradient buffer
// of the same layout, the activations of the last forward, and forward/backward composed from the kernels.
// This is the only place that knows the order of operations in a block; kernels know nothing of the model, and
// nothing here knows Python (the binding in csrc/binding.cpp wraps it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

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
  GPT(const GPTConfig& cfg, uint64_t seed);

  const GPTConfig& config() const { return cfg_; }
  int64_t num_parameters() const { return (int64_t)params_.size(); }
  float* params() { return params_.data(); }
  float* grads() { return grads_.data(); }
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  std::vector<NamedView> named_views() const;

  // Runs the model on idx (B, T). With targets, returns the mean cross-entropy loss and keeps what backward needs;
  // without, returns NaN. last_only computes logits for the last position of each row only (sampling).
  float forward(const int32_t* idx, const int32_t* targets, int B, int T, bool last_only = false);
  // Logits of the last forward: (B, T, V), or (B, 1, V) after last_only. Overwritten by backward.
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
  std::vector<ParamTensor> tensors_;
  std::vector<float> params_, grads_;

  // Activations of the last forward, sized for the largest (B, T) seen. Per-layer ones are stacked (L, B, T, ...).
  int64_t act_bt_ = 0;
  int B_ = 0, T_ = 0;
  bool have_targets_ = false, last_only_ = false, logits_valid_ = false;
  std::vector<int32_t> idx_, targets_;  // (B, T)
  std::vector<float> encoded_;          // (B, T, C)
  std::vector<float> ln1_, ln1_mean_, ln1_rstd_;  // (L, B, T, C), (L, B, T) x2
  std::vector<float> qkv_;              // (L, B, T, 3C)
  std::vector<float> atty_, att_lse_;   // (L, B, T, C), (L, B, NH, T)
  std::vector<float> residual2_;        // (L, B, T, C)
  std::vector<float> ln2_, ln2_mean_, ln2_rstd_;
  std::vector<float> fch_, fch_gelu_;   // (L, B, T, 4C)
  std::vector<float> residual3_;        // (L, B, T, C)
  std::vector<float> lnf_, lnf_mean_, lnf_rstd_, last_rows_;
  std::vector<float> logits_;           // (B, T, V); backward writes dlogits over it
  std::vector<float> losses_, ce_lse_;  // (B, T)
  // Backward scratch, reused across layers.
  std::vector<float> dresidual_, dbtc_, dbt4c_, dqkv_;
};

}  // namespace fastgpt
