// The training step as one engine call (see train_step.h).
#include "engine/train_step.h"

namespace fastgpt {

void train_step(GPT& model, AdamW& opt, const int32_t* idx, const int32_t* targets, int A, int B, int T, float lr,
                double max_norm) {
  AdamW::check_args(lr, max_norm);  // before anything changes
  model.zero_grad();
  model.forward_backward_steps(idx, targets, A, B, T);
  opt.step_clipped(lr, max_norm, model.step_loss());
}

StepStats read_step(GPT& model, const AdamW& opt) {
  const StepScalars s = opt.scalars();
  return {model.step_loss_value(), s.norm, s.applied != 0, s.t, s.skipped};
}

}  // namespace fastgpt
