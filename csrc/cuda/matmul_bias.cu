// A linear layer's bias gradient on the GPU: dbias (OC) += the column sums of dout (N, OC, row stride ld), the part of
// matmul_backward (matmul.cu) that cuBLASLt does not do. Its own file so that the warp emulator (tests/warp_emu),
// which has no cuBLASLt, runs these kernels beside their reference.
// Deterministic without atomics, and the order of every sum depends on N alone (never on the GPU or the launch):
// pass 1 gives each chunk of kRowChunk rows its column sums, row lane y of a column summing rows y, y + kLanes, ...
// of the chunk in order and the lanes then added in order; pass 2 adds the chunks' sums per column the same way
// (chunk lane y takes chunks y, y + kLanes, ...; the lanes in order) and that total to dbias. One chunk: pass 1 adds
// straight into dbias.
// A thread loads 16 bytes of a row at a time (8 16-bit values or 4 floats: Pack), as a copy does, where each row is
// 16-byte aligned; the scalar form (one value a load) takes other views, in the same order. On an H200 the kernel
// this replaces (one 2-byte value a load) and cuBLASLt's own bias-gradient kernel (BGRADB's, a second pass as well)
// both read about 2.3 TB/s, half the memory's rate (BENCHMARKS.md, 2026-11-26). Every sum is fp32; 16-bit values are
// widened as loaded.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/scratch.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {

constexpr int kVecs = 32;       // column threads per block: 32 packs (512 bytes) of a row per warp
constexpr int kLanes = 8;       // row lanes per block, one warp each
constexpr int kRowChunk = 512;  // rows per pass-1 sum
constexpr int kThreads = kVecs * kLanes;
constexpr int kMaxCols = kVecs * 8;  // a block's columns at most: 8 per thread (16-bit packs)

// Column c's total over a block's kLanes lanes (sums: kLanes rows of width floats), lane 0 first, from 0.f.
__device__ __forceinline__ float lanes_in_order(const float* sums, int width, int c) {
  float t = 0.f;
  for (int y = 0; y < kLanes; y++) t += sums[y * width + c];
  return t;
}

// Pass 1: block (chunk, column block) of kVecs x kLanes threads (thread tid: column thread tid % kVecs, row lane
// tid / kVecs), V columns per thread (Pack<S>::N, or 1 where rows are not 16-byte aligned). Writes the chunk's
// column sums to partial (nchunks, OC), or with one chunk adds them to dbias.
template <typename S, int V>
__global__ void __launch_bounds__(kThreads) bias_partial_kernel(float* partial, float* dbias, const S* dout,
                                                                int64_t N, int OC, int64_t ld, int nchunks) {
  __shared__ float4 sums4[kLanes * kMaxCols / 4];  // (kLanes, kVecs * V) floats; float4 for 16-byte alignment
  float* sums = reinterpret_cast<float*>(sums4);
  static_assert(V == 1 || V % 4 == 0, "bias_partial_kernel: one value or whole packs per thread");
  constexpr int kWidth = kVecs * V;
  const int tid = threadIdx.x, tx = tid % kVecs, ty = tid / kVecs;
  const int64_t chunk = blockIdx.x;
  const int64_t r0 = chunk * kRowChunk, r1 = r0 + kRowChunk < N ? r0 + kRowChunk : N;
  const int ncb = (OC + kWidth - 1) / kWidth;
  for (int cb = blockIdx.y; cb < ncb; cb += gridDim.y) {
    const int col = cb * kWidth + tx * V;  // this thread's first column
    float s[V];
    for (int j = 0; j < V; j++) s[j] = 0.f;
    if (col < OC) {  // V > 1: OC is a multiple of V, so the whole pack is inside
      const S* p = dout + col;
#pragma unroll 4
      for (int64_t r = r0 + ty; r < r1; r += kLanes) {
        if constexpr (V == 1) {
          s[0] += to_float(p[r * ld]);
        } else {
          const Pack<S> x = load_pack(p + r * ld);
          for (int j = 0; j < V; j++) s[j] += to_float(x.v[j]);
        }
      }
    }
    if constexpr (V % 4 == 0) {  // 16-byte stores (16-bit packs: two a thread, 32 bytes apart, two-way conflicts)
      for (int j = 0; j < V; j += 4)
        sums4[(ty * kWidth + tx * V + j) / 4] = make_float4(s[j], s[j + 1], s[j + 2], s[j + 3]);
    } else {
      sums[ty * kWidth + tx] = s[0];
    }
    __syncthreads();
    for (int c = tid; c < kWidth; c += kThreads) {
      const int oc = cb * kWidth + c;
      if (oc >= OC) continue;
      const float t = lanes_in_order(sums, kWidth, c);
      if (nchunks == 1)
        dbias[oc] += t;
      else
        partial[chunk * OC + oc] = t;
    }
    __syncthreads();  // sums is reused by the next column block
  }
}

// Pass 2: block (column block) of kVecs columns x kLanes chunk lanes, numbered as pass 1's; adds the total to
// dbias. With nchunks 1 it adds sums made elsewhere (the BGRADB epilogue's) to dbias as they are.
__global__ void __launch_bounds__(kThreads) bias_final_kernel(float* dbias, const float* partial, int OC,
                                                              int nchunks) {
  __shared__ float sums[kLanes * kVecs];
  const int tx = threadIdx.x % kVecs, ty = threadIdx.x / kVecs;
  const int64_t col = blockIdx.x * (int64_t)kVecs + tx;
  float s = 0.f;
  if (col < OC)
    for (int c = ty; c < nchunks; c += kLanes) s += partial[(int64_t)c * OC + col];
  sums[ty * kVecs + tx] = s;
  __syncthreads();
  if (ty == 0 && col < OC) dbias[col] += nchunks == 1 ? s : lanes_in_order(sums, kVecs, tx);
}

}  // namespace

template <typename S>
void bias_backward(float* dbias, const S* dout, int64_t N, int OC, Stream stream, int64_t ld) {
  if (N <= 0 || OC <= 0) return;
  if (ld == 0) ld = OC;
  if (ld < OC) throw std::invalid_argument("bias_backward: row stride below the columns, got " + std::to_string(ld));
  const int64_t nchunks = (N + kRowChunk - 1) / kRowChunk;
  if (nchunks > INT32_MAX) throw std::invalid_argument("bias_backward: N too large, got " + std::to_string(N));
  Scratch scratch(nchunks > 1 ? (size_t)nchunks * OC : 0, stream);  // one chunk writes dbias directly
  constexpr int kPack = Pack<S>::N;
  const bool packed = OC % kPack == 0 && ld % kPack == 0 && reinterpret_cast<uintptr_t>(dout) % 16 == 0;
  const int width = kVecs * (packed ? kPack : 1);
  const int ncb = (OC + width - 1) / width;
  const dim3 grid((unsigned)nchunks, (unsigned)std::min(ncb, 65535)), block(kThreads);
  if (packed)
    bias_partial_kernel<S, kPack><<<grid, block, 0, stream>>>(scratch.ptr, dbias, dout, N, OC, ld, (int)nchunks);
  else
    bias_partial_kernel<S, 1><<<grid, block, 0, stream>>>(scratch.ptr, dbias, dout, N, OC, ld, (int)nchunks);
  FASTGPT_CUDA_CHECK_LAUNCH();
  if (nchunks > 1) {
    const unsigned blocks = (unsigned)((OC + kVecs - 1) / kVecs);
    bias_final_kernel<<<blocks, block, 0, stream>>>(dbias, scratch.ptr, OC, (int)nchunks);
    FASTGPT_CUDA_CHECK_LAUNCH();
  }
}

void bias_add(float* dbias, const float* sums, int OC, Stream stream) {
  if (OC <= 0) return;
  bias_final_kernel<<<(unsigned)((OC + kVecs - 1) / kVecs), kThreads, 0, stream>>>(dbias, sums, OC, 1);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template void bias_backward<float>(float*, const float*, int64_t, int, Stream, int64_t);
template void bias_backward<bf16>(float*, const bf16*, int64_t, int, Stream, int64_t);
template void bias_backward<f16>(float*, const f16*, int64_t, int, Stream, int64_t);

}  // namespace fastgpt::cuda
