// The training step as one engine call: zero the gradients, A micro-batches through forward_backward (the loss
// averaged, the gradients reduced over ranks with the last), the gradients' global norm, and AdamW with the clip
// folded in, skipped on the device when the loss or the norm is not finite. Nothing in it waits for the device: the
// step's inputs (the learning rate and the token ids) go up in one staged copy, the loss and the norm stay where they
// were computed until stats() asks, so the host queues the next step while the GPU runs this one.
//
// With graph=true the step is recorded once (Backend::capture: a CUDA graph on a GPU) and replayed: each launch
// copies that step's staged inputs, so one launch replaces the whole step's launches. A step is recorded when the
// step before it ran eagerly with the same shape (A, B, T, max_norm) and no memory was taken or freed since (that
// step sized every buffer, plan and scratch), and replayed while the shape holds and no memory it recorded was freed
// or moved (Backend::generation); anything else runs eagerly, as does a shape whose recording failed (the error is
// kept). Data parallel models always run eagerly (the host takes part in their reductions); fp16's loss scale is
// read and updated in device memory, so its steps are recorded too.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "engine/adamw.h"
#include "engine/gpt.h"

namespace fastgpt {

struct StepStats {
  double loss;    // mean over the micro-batches of their mean losses, on this rank
  double norm;    // of the gradients before clipping, over all ranks
  bool applied;   // false: skipped
  int64_t step_count, skipped_steps;
};

class TrainStep {
 public:
  TrainStep(GPT& model, AdamW& opt) : model_(model), opt_(opt) {}
  // idx, targets: (A, B, T) host token ids. max_norm: +inf for no clipping. The step is skipped (weights, moments
  // and step counter unchanged; counted in skipped_steps) when the loss or the norm is not finite, or, in fp16, when
  // the gradients overflowed.
  void run(const int32_t* idx, const int32_t* targets, int A, int B, int T, float lr, double max_norm, bool graph);
  StepStats stats();  // of the last step; waits for the device
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  bool graph_eligible() const;  // the model's step can be recorded (no communicator)
  const std::string& capture_error() const { return capture_error_; }  // why the last failed recording failed

 private:
  struct Shape {
    int A = 0, B = 0, T = 0;
    double max_norm = 0.0;
    bool operator==(const Shape& o) const { return A == o.A && B == o.B && T == o.T && max_norm == o.max_norm; }
  };
  void body(const Shape& s);  // the step from the staged inputs on: what a graph records
  const int32_t* ids() const;
  const int32_t* tgts(const Shape& s) const;

  GPT& model_;
  AdamW& opt_;
  static constexpr int64_t kHeader = 16;  // bytes before the ids: the learning rate (a float), padding
  Buffer<uint8_t> inputs_;  // [lr | idx | targets], the device copy of what run() staged
  std::unique_ptr<Graph> graph_;
  Shape graph_shape_, eager_shape_;  // of the recorded step; of the last eager step
  int64_t graph_generation_ = -1, eager_generation_ = -1;  // Backend::generation() when they ran
  Shape failed_shape_;  // a recording failed for this shape at this generation: not tried again there
  int64_t failed_generation_ = -1;
  std::string capture_error_;
  int64_t captures_ = 0, replays_ = 0;
};

}  // namespace fastgpt
