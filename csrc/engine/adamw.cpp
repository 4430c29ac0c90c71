// AdamW step over the flat parameter buffer (see adamw.h).
#include "engine/adamw.h"

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

AdamW::AdamW(GPT& model, const AdamWConfig& cfg)
    : model_(model),
      cfg_(cfg),
      m_(&model.backend(), model.num_parameters()),
      v_(&model.backend(), model.num_parameters()) {
  cfg_.validate();
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
    h.weight_decay = t.decay ? cfg_.weight_decay : 0.f;
    key.offset = (uint64_t)t.offset;
    model_.backend().adamw_update(model_.params() + t.offset, lowp ? lowp + t.offset * dtype_size(st) : nullptr, st,
                                  model_.grads() + t.offset, m_.data() + t.offset, v_.data() + t.offset, t.numel, h,
                                  key);
  }
  return true;
}

}  // namespace fastgpt
