// The training step as one engine call: zero the gradients, A micro-batches through forward_backward (the loss
// averaged, the gradients reduced over ranks with the last), the gradients' global norm, and AdamW with the clip
// folded in, skipped on the device when the loss or the norm is not finite. Nothing in it waits for the device (the
// token ids go up in one staged copy; the loss and the norm stay where they were computed until read_step asks),
// so the host queues the next step while the GPU runs this one; it is also the unit a CUDA graph will capture.
// fp16 is the exception: its loss scaler decides on the host, after the backward.
#pragma once
#include <cstdint>

#include "engine/adamw.h"
#include "engine/gpt.h"

namespace fastgpt {

// idx, targets: (A, B, T) host token ids. max_norm: +inf for no clipping. The step is skipped (weights, moments and
// step counter unchanged; counted in skipped_steps) when the loss or the norm is not finite, or, in fp16, when the
// gradients overflowed.
void train_step(GPT& model, AdamW& opt, const int32_t* idx, const int32_t* targets, int A, int B, int T, float lr,
                double max_norm);

struct StepStats {
  double loss;    // mean over the micro-batches of their mean losses, on this rank
  double norm;    // of the gradients before clipping, over all ranks
  bool applied;   // false: skipped
  int64_t step_count, skipped_steps;
};
StepStats read_step(GPT& model, const AdamW& opt);  // of the last train_step; waits for the device

}  // namespace fastgpt
