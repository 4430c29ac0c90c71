// AdamW over the model's whole parameter buffer: moment buffers m and v share the parameter layout, so one step is
// one pass over three flat buffers, split only where weight decay switches on and off (2-D weights decay;
// biases and LayerNorm parameters do not, as in build-nanogpt's optimizer groups). In bf16/fp16 the update also
// rewrites the model's 16-bit compute weights from the new fp32 masters in the same pass (bf16: stochastic
// rounding keyed by the model's seed, the step and the element index); in fp16 it applies the loss scaler's rules.
//
// ZeRO-1 (zero_stage=1, a data-parallel model): each rank keeps the moments of its shard of the flat buffer only
// (8 bytes per parameter become 8/world_size), updates that shard from its reduce-scattered gradients, then
// all-gathers the weights (the fp32 masters, and the 16-bit compute weights written in the same pass). The update
// of each element is the same arithmetic on the same reduced gradient as plain data parallel, so the weights are
// the same bits. The fp32 masters stay whole on every rank: state_dict(), checkpoints and (in fp32) the kernels
// read them.
#pragma once
#include "engine/gpt.h"

namespace fastgpt {

struct AdamWConfig {
  float lr = 6e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  void validate() const;  // throws std::invalid_argument naming the bad field
};

class AdamW {
 public:
  AdamW(GPT& model, const AdamWConfig& cfg, int zero_stage = 0);
  // One update with this learning rate; the step counter advances first (torch's rule). Returns false when the
  // step was skipped (fp16: the gradients held an inf/NaN): parameters, moments and the counter are unchanged.
  bool step(float lr);
  int64_t skipped_steps() const { return skipped_; }
  int64_t step_count() const { return t_; }
  int64_t size() const { return m_.size(); }  // of each moment buffer: the parameters, or this rank's shard
  int zero_stage() const { return model_.zero_stage(); }
  int64_t moments_begin() const { return lo_; }  // flat index of m()[0]
  Backend& backend() { return model_.backend(); }
  float* m() { return m_.data(); }  // backend memory, parameter layout
  float* v() { return v_.data(); }
  const AdamWConfig& config() const { return cfg_; }
  // Resuming: moments (host, size() floats each, this optimizer's part of the layout), the step counter (bf16's
  // stochastic rounding is keyed by it too) and the count of skipped steps.
  void load_state(const float* m, const float* v, int64_t step_count, int64_t skipped_steps);

 private:
  GPT& model_;
  AdamWConfig cfg_;
  int64_t t_ = 0, skipped_ = 0;
  int64_t lo_ = 0, hi_ = 0;  // the part of the flat buffer this optimizer updates
  Buffer<float> m_, v_;  // same layout as the parameters, zero at the start
};

}  // namespace fastgpt
