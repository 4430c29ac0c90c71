// The training step as one engine call, eager or replayed from a graph (see train_step.h).
#include "engine/train_step.h"

#include <cstring>
#include <exception>

namespace fastgpt {

bool TrainStep::graph_eligible() const { return model_.comm() == nullptr; }

const int32_t* TrainStep::ids() const { return reinterpret_cast<const int32_t*>(inputs_.data() + kHeader); }

const int32_t* TrainStep::tgts(const Shape& s) const { return ids() + (int64_t)s.A * s.B * s.T; }

void TrainStep::run(const int32_t* idx, const int32_t* targets, int A, int B, int T, float lr, double max_norm,
                    bool graph) {
  AdamW::check_args(lr, max_norm);  // before anything changes
  model_.check_steps(idx, targets, A, B, T);
  const Shape shape{A, B, T, max_norm};
  const int64_t n = (int64_t)A * B * T, bytes = kHeader + 2 * n * (int64_t)sizeof(int32_t);
  Backend& be = model_.backend();
  if (inputs_.size() < bytes) {
    inputs_ = Buffer<uint8_t>();
    inputs_ = Buffer<uint8_t>(&be, bytes);
  }
  // Waits only for the last step's copy out of the staging memory.
  uint8_t* staged = static_cast<uint8_t*>(be.staging(bytes));
  std::memcpy(staged, &lr, sizeof lr);
  std::memcpy(staged + kHeader, idx, n * sizeof(int32_t));
  std::memcpy(staged + kHeader + n * sizeof(int32_t), targets, n * sizeof(int32_t));
  if (graph && graph_eligible()) {
    const bool replayable = graph_ && graph_shape_ == shape && graph_generation_ == be.generation();
    const bool failed_here = failed_shape_ == shape && failed_generation_ == be.generation();
    if (!replayable && !failed_here && eager_shape_ == shape && eager_generation_ == be.generation()) {
      // An eager step of this shape came last and nothing was taken or freed since: every buffer, plan and scratch
      // the step needs exists. Recorded unless recording it took or freed memory (then this step runs eagerly).
      // A recording that fails (a call the device cannot record) leaves this shape eager until memory changes;
      // the reason is kept for capture_error().
      graph_.reset();
      const int64_t generation = be.generation();
      std::unique_ptr<Graph> g;
      try {
        g = be.capture([&] { body(shape); });
      } catch (const std::exception& e) {
        capture_error_ = e.what();
        failed_shape_ = shape;
        failed_generation_ = be.generation();
      }
      if (g && be.generation() == generation) {
        graph_ = std::move(g);
        graph_shape_ = shape;
        graph_generation_ = generation;
        captures_++;
      }
    }
    if (graph_ && graph_shape_ == shape && graph_generation_ == be.generation()) {
      graph_->launch();
      model_.steps_replayed(ids(), tgts(shape), A, B, T);
      if (model_.loss_scaling()) model_.mark_stepped();  // as step_clipped does
      replays_++;
      return;
    }
  }
  body(shape);
  eager_shape_ = shape;
  eager_generation_ = be.generation();
}

void TrainStep::body(const Shape& s) {
  const int64_t bytes = kHeader + 2 * (int64_t)s.A * s.B * s.T * (int64_t)sizeof(int32_t);
  model_.backend().copy_staged(inputs_.data(), bytes);
  model_.zero_grad();
  model_.forward_backward_steps(ids(), tgts(s), s.A, s.B, s.T);
  opt_.step_clipped(reinterpret_cast<const float*>(inputs_.data()), s.max_norm, model_.step_loss());
}

StepStats TrainStep::stats() {
  const StepScalars s = opt_.scalars();
  return {model_.step_loss_value(), s.norm, s.applied != 0, s.t, s.skipped};
}

}  // namespace fastgpt
