// AdamW step over the flat parameter buffer (see adamw.h).
#include "engine/adamw.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>


namespace fastgpt {

void AdamWConfig::validate() const {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(std::isfinite(lr) && lr >= 0.f, "lr must be a finite number >= 0, got " + std::to_string(lr));
  need(beta1 >= 0.f && beta1 < 1.f, "betas[0] must be in [0, 1), got " + std::to_string(beta1));
  need(beta2 >= 0.f && beta2 < 1.f, "betas[1] must be in [0, 1), got " + std::to_string(beta2));
  need(eps > 0.f, "eps must be > 0, got " + std::to_string(eps));
  need(std::isfinite(weight_decay) && weight_decay >= 0.f,
       "weight_decay must be a finite number >= 0, got " + std::to_string(weight_decay));
}

AdamW::AdamW(GPT& model, const AdamWConfig& cfg, int zero_stage) : model_(model), cfg_(cfg) {
  cfg_.validate();
  model_.set_zero_stage(zero_stage);
  lo_ = zero_stage == 1 ? model.shard_begin() : 0;
  hi_ = zero_stage == 1 ? lo_ + model.shard_size() : model.num_parameters();
  m_ = Buffer<float>(&model.backend(), hi_ - lo_);
  v_ = Buffer<float>(&model.backend(), hi_ - lo_);
}

void AdamW::load_state(const float* m, const float* v, int64_t step_count, int64_t skipped_steps) {
  if (step_count < 0 || skipped_steps < 0) throw std::invalid_argument("step_count and skipped_steps must be >= 0");
  model_.backend().upload(m_.data(), m, size() * (int64_t)sizeof(float));
  model_.backend().upload(v_.data(), v, size() * (int64_t)sizeof(float));
  t_ = step_count;
  skipped_ = skipped_steps;
}

bool AdamW::step(float lr) {
  if (!(std::isfinite(lr) && lr >= 0.f)) throw std::invalid_argument("lr must be a finite number >= 0");
  if (model_.scaler().enabled && model_.stepped())
    throw std::logic_error("step() was already taken on these gradients: with fp16 loss scaling each step needs a "
                           "new backward() (after zero_grad())");
  const bool found_inf = model_.unscale_grads();
  model_.scaler().update(found_inf);
  if (model_.scaler().enabled) model_.mark_stepped();
  if (found_inf) {
    skipped_++;
    return false;
  }
  t_++;
  cpu::AdamWHyper h = cpu::adamw_hyper(lr, cfg_.beta1, cfg_.beta2, cfg_.eps, 0.f, t_);
  const DType st = model_.storage();
  uint8_t* lowp = st == DType::f32 ? nullptr : static_cast<uint8_t*>(model_.compute_params());
  RoundKey key{st == DType::bf16, model_.seed(), (uint64_t)t_, 0};
  for (const ParamTensor& t : model_.tensors()) {
    const int64_t a = std::max(t.offset, lo_), b = std::min(t.offset + t.numel, hi_);  // this tensor in [lo, hi)
    if (a >= b) continue;
    h.weight_decay = t.decay ? cfg_.weight_decay : 0.f;
    key.offset = (uint64_t)a;
    model_.backend().adamw_update(model_.params() + a, lowp ? lowp + a * dtype_size(st) : nullptr, st,
                                  model_.grads() + a, m_.data() + (a - lo_), v_.data() + (a - lo_), b - a, h, key);
  }
  if (model_.zero_stage() == 1) {  // every rank updated its shard: now everyone gets all of them
    Comm& c = model_.bound_comm();
    c.all_gather(model_.params(), model_.shard_size() * (int64_t)sizeof(float));
    if (lowp) c.all_gather(lowp, model_.shard_size() * dtype_size(st));
  }
  return true;
}

}  // namespace fastgpt
