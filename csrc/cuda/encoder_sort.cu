// The embedding backward's first half: the positions 0..n-1 sorted by their token ids, stably (equal ids keep their
// positions ascending), so that encoder.cu can add each token's rows of dout in position order, the CPU's order.
// CUB's radix sort (shipped with the toolkit) over only the key bits V needs: 16 for GPT-2's 50304 rows, two passes.
// Its own file because the warp emulator (tests/warp_emu), which runs encoder.cu on the CPU, cannot compile CUB;
// it links a std::stable_sort in place of these two functions.
#include <climits>
#include <stdexcept>
#include <string>

#include <cub/device/device_radix_sort.cuh>

#include "cuda/check.h"
#include "cuda/encoder.h"

namespace fastgpt::cuda {

namespace {
int key_bits(int V) {  // bits of the largest id, V - 1
  int bits = 1;
  while (bits < 31 && (1u << bits) < (unsigned)V) bits++;
  return bits;
}

__global__ void positions_kernel(int32_t* pos, int n) {  // 0, 1, ..., n - 1: the values the sort carries
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) pos[i] = i;
}

constexpr size_t kAlign = 256;  // CUB's temporary storage starts as aligned as cudaMalloc's
size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

size_t cub_bytes(int n, int V) {
  size_t bytes = 0;
  FASTGPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, (const uint32_t*)nullptr, (uint32_t*)nullptr,
                                                     (const int32_t*)nullptr, (int32_t*)nullptr, n, 0, key_bits(V)));
  return bytes;
}
}  // namespace

size_t sort_positions_scratch_bytes(int64_t n, int V) {
  if (n > INT_MAX) throw std::invalid_argument("embedding backward: B*T must be < 2^31, got " + std::to_string(n));
  return round_up((size_t)n * sizeof(int32_t)) + cub_bytes((int)n, V);
}

void sort_positions_by_token(int32_t* tok_sorted, int32_t* pos_sorted, void* scratch, size_t scratch_bytes,
                             const int32_t* idx, int64_t n, int V, Stream stream) {
  if (n <= 0) return;
  int32_t* pos = static_cast<int32_t*>(scratch);  // (n)
  void* temp = static_cast<char*>(scratch) + round_up((size_t)n * sizeof(int32_t));
  size_t temp_bytes = scratch_bytes - round_up((size_t)n * sizeof(int32_t));
  positions_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(pos, (int)n);
  FASTGPT_CUDA_CHECK_LAUNCH();
  // Ids are in [0, V) (the caller checks), so unsigned keys over their low key_bits(V) bits sort them.
  FASTGPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, reinterpret_cast<const uint32_t*>(idx),
                                                     reinterpret_cast<uint32_t*>(tok_sorted), pos, pos_sorted, (int)n,
                                                     0, key_bits(V), stream));
}

}  // namespace fastgpt::cuda
