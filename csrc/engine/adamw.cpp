// AdamW step over the flat parameter buffer (see adamw.h): one adamw_step launch over this optimizer's range,
// weight decay switching by segment, its scalars (clip factor, step counter, skip) prepared on the device.
#include "engine/adamw.h"

#include <algorithm>
#include <cmath>
#include <limits>
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
  // The tensors inside [lo, hi) (ZeRO-1's padding is never updated), neighbours of equal decay merged.
  segments_.begin = lo_;
  for (const ParamTensor& t : model_.tensors()) {
    const int64_t a = std::max(t.offset, lo_), b = std::min(t.offset + t.numel, hi_);
    if (a >= b) continue;
    const float wd = t.decay ? cfg_.weight_decay : 0.f;
    AdamWSegments& s = segments_;
    if (s.n > 0 && s.weight_decay[s.n - 1] == wd && s.end[s.n - 1] == a) {
      s.end[s.n - 1] = b;
      continue;
    }
    if (s.n == AdamWSegments::kMax)
      throw std::logic_error("AdamW: more weight-decay segments than AdamWSegments::kMax");
    if (s.n == 0) s.begin = a;
    s.end[s.n] = b;
    s.weight_decay[s.n++] = wd;
  }
  Backend* be = &model.backend();
  m_ = Buffer<float>(be, hi_ - lo_);
  v_ = Buffer<float>(be, hi_ - lo_);
  scalars_ = Buffer<uint8_t>(be, sizeof(StepScalars));  // zeroed: t = skipped = 0
  lr_ = Buffer<float>(be, 1);
}

StepScalars AdamW::scalars() const {
  StepScalars s;
  model_.backend().download(&s, scalars_.data(), sizeof s);
  return s;
}

void AdamW::load_state(const float* m, const float* v, int64_t step_count, int64_t skipped_steps) {
  if (step_count < 0 || skipped_steps < 0) throw std::invalid_argument("step_count and skipped_steps must be >= 0");
  Backend& be = model_.backend();
  be.upload(m_.data(), m, size() * (int64_t)sizeof(float));
  be.upload(v_.data(), v, size() * (int64_t)sizeof(float));
  StepScalars s;
  s.t = step_count;
  s.skipped = skipped_steps;
  be.upload(scalars_.data(), &s, sizeof s);
}

void AdamW::check_args(float lr, double max_norm) {
  if (!(std::isfinite(lr) && lr >= 0.f)) throw std::invalid_argument("lr must be a finite number >= 0");
  if (!(max_norm > 0.0)) throw std::invalid_argument("max_norm must be > 0, got " + std::to_string(max_norm));
}

void AdamW::check_fp16_step() const {
  if (model_.loss_scaling() && model_.stepped())
    throw std::logic_error("step() was already taken on these gradients: with fp16 loss scaling each step needs a "
                           "new backward() (after zero_grad())");
}

bool AdamW::unscale() {
  const bool found_inf = model_.unscale_grads();  // reduces first, if a backward left that to the step
  model_.update_loss_scale(found_inf);
  if (model_.loss_scaling()) model_.mark_stepped();
  return found_inf;
}

void AdamW::update() {
  model_.weights_changed();  // also when the device skips the update (fp16 overflow): the host cannot tell
  const DType st = model_.storage();
  void* lowp = st == DType::f32 ? nullptr : model_.compute_params();
  const RoundKey key{st == DType::bf16, model_.seed(), 0, 0};  // the step comes from the scalars
  model_.backend().adamw_step(model_.params(), lowp, st, model_.grads(), m_.data(), v_.data(), segments_, cfg_.beta1,
                              cfg_.beta2, cfg_.eps, dev_scalars(), key);
  if (model_.zero_stage() == 1) {  // every rank updated its shard: now everyone gets all of them
    Comm& c = model_.bound_comm();
    c.all_gather(model_.params(), model_.shard_size() * (int64_t)sizeof(float));
    if (lowp) c.all_gather(lowp, model_.shard_size() * dtype_size(st));
  }
}

bool AdamW::step(float lr) {
  check_args(lr, 1.0);
  check_fp16_step();
  const bool skip = unscale();
  Backend& be = model_.backend();
  be.upload_async(lr_.data(), &lr, sizeof(float));
  be.adamw_prepare(dev_scalars(), lr_.data(), nullptr, 0, nullptr, 0, std::numeric_limits<double>::infinity(), skip,
                   cfg_.beta1, cfg_.beta2, nullptr);
  if (skip) return false;  // nothing to update or gather
  update();
  return true;
}

void AdamW::step_clipped(const float* lr, double max_norm, const double* loss) {
  check_fp16_step();
  if (!(max_norm > 0.0)) throw std::invalid_argument("max_norm must be > 0, got " + std::to_string(max_norm));
  model_.sync_grads();
  // Each rank's part of the reduced gradients in fixed chunks, data parallel ranks' parts and losses all-reduced:
  // the same bits as clip_grad_norm's norm, and every rank skips, or steps, together. fp16: the gradients still
  // carry the loss scale, which adamw_prepare divides out of the norm and the update and updates on the device.
  const GPT::NormParts p = model_.queue_grad_sumsq(loss);
  model_.backend().adamw_prepare(dev_scalars(), lr, p.parts, p.nparts, p.losses, p.nlosses, max_norm, false,
                                 cfg_.beta1, cfg_.beta2, model_.loss_scale_ptr());
  update();  // skipped on the device when the scalars say so (ZeRO-1 then gathers the unchanged weights)
  if (model_.loss_scaling()) model_.mark_stepped();
}

}  // namespace fastgpt
