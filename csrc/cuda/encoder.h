// The sort behind the embedding backward (encoder_sort.cu), declared apart from ops.h: encoder.cu calls it, and the
// warp emulator links its own in its place. Plain C++, no CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/ops.h"  // Stream

namespace fastgpt::cuda {

// Bytes of device scratch sort_positions_by_token needs for n positions of ids in [0, V); n must be < 2^31
// (std::invalid_argument otherwise).
size_t sort_positions_scratch_bytes(int64_t n, int V);
// tok_sorted (n) = idx sorted ascending, pos_sorted (n) = the position each came from: for equal ids the positions
// ascend (a stable sort). scratch: scratch_bytes = sort_positions_scratch_bytes(n, V) bytes, 256-byte aligned.
void sort_positions_by_token(int32_t* tok_sorted, int32_t* pos_sorted, void* scratch, size_t scratch_bytes,
                             const int32_t* idx, int64_t n, int V, Stream stream);

}  // namespace fastgpt::cuda
