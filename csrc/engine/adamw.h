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
  // One update with this learning rate from the gradients as they are (clip_grad_norm first to clip). Returns false
  // when the step was skipped (fp16: the gradients held an inf/NaN): parameters, moments and the counter unchanged.
  bool step(float lr);
  // The device step: the global norm of the (reduced) gradients, the clip to max_norm (+inf: none) folded into the
  // update, which is skipped on the device when the norm or *loss (backend memory, or null) is not finite; the
  // gradient buffer is left unclipped (fp16: and scaled; the loss scale is updated on the device). lr: the learning
  // rate in backend memory (the caller checked it). Nothing waits for the device. scalars() says what happened.
  void step_clipped(const float* lr, double max_norm, const double* loss);
  // Throws std::invalid_argument naming lr or max_norm unless lr is finite and >= 0 and max_norm > 0.
  static void check_args(float lr, double max_norm);
  // The step's scalars (norm, applied, counters), read from the device (waits for it).
  StepScalars scalars() const;
  int64_t skipped_steps() const { return scalars().skipped; }
  int64_t step_count() const { return scalars().t; }
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
  void check_fp16_step() const;
  bool unscale();  // fp16: unscales the gradients, updates the loss scale; returns whether the step is skipped
  void update();   // queues the update (as the scalars say) and ZeRO-1's all-gather
  StepScalars* dev_scalars() { return reinterpret_cast<StepScalars*>(scalars_.data()); }

  GPT& model_;
  AdamWConfig cfg_;
  int64_t lo_ = 0, hi_ = 0;  // the part of the flat buffer this optimizer updates
  AdamWSegments segments_;   // [lo, hi) by weight decay
  Buffer<float> m_, v_;  // same layout as the parameters, zero at the start
  Buffer<uint8_t> scalars_;  // one StepScalars, backend memory: the counters live where the update runs
  Buffer<float> lr_;         // step(lr)'s learning rate, staged up
};

}  // namespace fastgpt
