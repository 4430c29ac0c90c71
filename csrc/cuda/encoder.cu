// Token + position embedding, forward and backward; CUDA twin of csrc/cpu/encoder.cpp.
// Forward: one warp per position, lanes over channels (coalesced rows of wte/wpe/out).
// Backward must be deterministic, so no float atomics. dwte: positions with the same token would collide, so each
// thread owns one channel c of one token group g (tokens with idx % G == g) and walks ALL positions in order,
// adding only its group's. Every (token, channel) sum is then done by exactly one thread, in position order, onto
// the existing value: the very sequence of float adds the CPU does, so the result matches it bitwise.
// Cost: every thread scans all B*T token ids (warp-broadcast loads), so this is O(G * C * B*T) cheap work; fine for
// GPT-2 shapes, but a sort-by-token scheme would scale better for very large B*T.
// dwpe: one thread per (t, c) summing over b in order, again the CPU's order.
// Templates over the storage type S (float, bf16, f16): the forward sums in float and rounds once to S (16-byte
// packs along the row when C and the pointers allow, else one element per lane); the gradients dwte/dwpe are always
// float and accumulate (+=) the widened dout.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/ops.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
constexpr int kWarpsPerBlock = 8;
constexpr int kGroups = 128;     // token groups for dwte: more groups = more threads, but more id scanning each
constexpr int kColThreads = 128; // channels per block in the backward kernels

// vec: C is a multiple of Pack<S>::N and every row starts 16-byte aligned, so lanes move whole packs.
template <typename S>
__global__ void encoder_forward_kernel(S* __restrict__ out, const int32_t* __restrict__ idx,
                                       const S* __restrict__ wte, const S* __restrict__ wpe, int64_t BT, int T,
                                       int C, bool vec) {
  constexpr int N = Pack<S>::N;
  const int64_t bt = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (bt >= BT) return;
  const S* tok = wte + (int64_t)idx[bt] * C;
  const S* pos = wpe + (bt % T) * C;
  S* o = out + bt * C;
  if (vec) {
    for (int c = (threadIdx.x % 32) * N; c < C; c += 32 * N) {
      const Pack<S> x = load_pack(tok + c), y = load_pack(pos + c);
      Pack<S> r;
#pragma unroll
      for (int k = 0; k < N; k++) r.v[k] = from_float<S>(to_float(x.v[k]) + to_float(y.v[k]));
      store_pack(o + c, r);
    }
  } else {
    for (int c = threadIdx.x % 32; c < C; c += 32) o[c] = from_float<S>(to_float(tok[c]) + to_float(pos[c]));
  }
}

// grid: (ceil(C / kColThreads), G). All threads of a warp share g, so the group test is warp-uniform.
template <typename S>
__global__ void encoder_backward_wte_kernel(float* __restrict__ dwte, const S* __restrict__ dout,
                                            const int32_t* __restrict__ idx, int64_t BT, int C, int G) {
  const int c = blockIdx.x * kColThreads + threadIdx.x;
  const unsigned g = blockIdx.y;
  if (c >= C) return;
  for (int64_t bt = 0; bt < BT; bt++) {
    const unsigned tok = (unsigned)idx[bt];
    if (tok % (unsigned)G != g) continue;
    dwte[(int64_t)tok * C + c] += to_float(dout[bt * C + c]);
  }
}

// grid: (T, ceil(C / kColThreads)).
template <typename S>
__global__ void encoder_backward_wpe_kernel(float* __restrict__ dwpe, const S* __restrict__ dout, int B, int T,
                                            int C) {
  const int t = blockIdx.x;
  const int c = blockIdx.y * kColThreads + threadIdx.x;
  if (c >= C) return;
  float acc = dwpe[(int64_t)t * C + c];
  for (int b = 0; b < B; b++) acc += to_float(dout[((int64_t)b * T + t) * C + c]);
  dwpe[(int64_t)t * C + c] = acc;
}
}  // namespace

template <typename S>
void encoder_forward(S* out, const int32_t* idx, const S* wte, const S* wpe, int B, int T, int C, Stream stream) {
  const int64_t BT = (int64_t)B * T;
  if (BT <= 0 || C <= 0) return;
  const int64_t blocks = (BT + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const bool vec = C % Pack<S>::N == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe);
  encoder_forward_kernel<S><<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(out, idx, wte, wpe, BT, T, C, vec);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void encoder_backward(float* dwte, float* dwpe, const S* dout, const int32_t* idx, int B, int T, int C, int V,
                      Stream stream) {
  const int64_t BT = (int64_t)B * T;
  if (BT <= 0 || C <= 0) return;
  const int G = std::max(1, std::min(V, kGroups));
  const unsigned col_blocks = (unsigned)((C + kColThreads - 1) / kColThreads);
  encoder_backward_wte_kernel<S><<<dim3(col_blocks, G), kColThreads, 0, stream>>>(dwte, dout, idx, BT, C, G);
  FASTGPT_CUDA_CHECK_LAUNCH();
  encoder_backward_wpe_kernel<S><<<dim3(T, col_blocks), kColThreads, 0, stream>>>(dwpe, dout, B, T, C);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                                                             \
  template void encoder_forward<S>(S*, const int32_t*, const S*, const S*, int, int, int, Stream);         \
  template void encoder_backward<S>(float*, float*, const S*, const int32_t*, int, int, int, int, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
