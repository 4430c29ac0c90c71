// AdamW over the model's whole parameter buffer: moment buffers m and v share the parameter layout, so one step is
// one pass over three flat buffers, split only where weight decay switches on and off (2-D weights decay;
// biases and LayerNorm parameters do not, as in build-nanogpt's optimizer groups). In bf16/fp16 the update also
// rewrites the model's 16-bit compute weights from the new fp32 masters in the same pass (bf16: stochastic
// rounding keyed by the model's seed, the step and the element index); in fp16 it applies the loss scaler's rules.
#pragma once
#include "engine/gpt.h"

namespace fastgpt {

struct AdamWConfig {
  float lr = 6e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  void validate() const;  // throws std::invalid_argument naming the bad field
};

class AdamW {
 public:
  AdamW(GPT& model, const AdamWConfig& cfg);
  // One update with this learning rate; the step counter advances first (torch's rule). Returns false when the
  // step was skipped (fp16: the gradients held an inf/NaN): parameters, moments and the counter are unchanged.
  bool step(float lr);
  int64_t skipped_steps() const { return skipped_; }
  int64_t step_count() const { return t_; }
  int64_t size() const { return m_.size(); }
  Backend& backend() { return model_.backend(); }
  float* m() { return m_.data(); }  // backend memory, parameter layout
  float* v() { return v_.data(); }
  const AdamWConfig& config() const { return cfg_; }

 private:
  GPT& model_;
  AdamWConfig cfg_;
  int64_t t_ = 0, skipped_ = 0;
  Buffer<float> m_, v_;  // same layout as the parameters, zero at the start
};

}  // namespace fastgpt
