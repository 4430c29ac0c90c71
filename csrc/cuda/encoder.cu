// Token + position embedding, forward and backward; CUDA twin of csrc/cpu/encoder.cpp.
// Forward: one warp per position, lanes over channels (coalesced rows of wte/wpe/out).
// Backward must be deterministic, so no float atomics, and it gives the CPU's bits: dwte in the order of
// cpu/kernels.h (each token's rows in position order, a long run cut into pieces of kPiece sorted indices). The
// positions are sorted by token, stably (encoder_sort.cu, CUB's radix sort), so each token's positions form a run in
// position order; the warp that owns a piece of a run (its first sorted index: the run's start, or a multiple of
// kPiece) adds the piece's rows in registers, lanes over channels, with many rows' loads in flight before their adds:
// those of all the short runs starting in its 32 indices (random ids give runs of one or two), or of 32 rows of a
// long piece at a time. A piece mid-run goes to a partial row, which a second kernel adds onto the token's row in
// turn. (GPT-2's "\n" is 12% of Tiny Shakespeare's tokens, 7,300 to 7,700 of a 65,536-token batch: as one warp's
// chain of 32-row chunks it took 0.97 ms of the eighth run's H200 step, against 0.17 on random tokens; in pieces of
// 256 it is about 30 chains side by side. The kernel before that had every thread scan every token id and add in
// place in global memory, a chain of dependent read-modify-writes as long as that run.)
// dwpe: one thread per (t, c) summing over b in order, again the CPU's order.
// Templates over the storage type S (float, bf16, f16): the forward sums in float and rounds once to S (16-byte
// packs along the row when C and the pointers allow, else one element per lane); the gradients dwte/dwpe are always
// float and accumulate (+=) the widened dout.
#include <cstdint>

#include "cuda/check.h"
#include "cuda/encoder.h"
#include "cuda/ops.h"
#include "cuda/scratch.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
constexpr int kWarpsPerBlock = 8;
constexpr int kWteWarps = 4;  // dwte's warps per block
constexpr int kSpan = 16;     // dwte: a warp's indices whose loads are in flight at once (2 + E registers each)
constexpr int kColThreads = 128;  // channels per block in dwpe's kernel and the pieces' kernel
constexpr int kPiece = cpu::kEncoderPiece;  // sorted indices a piece (dwte's order: cpu/kernels.h)
static_assert(kPiece % 32 == 0, "a piece starts on a warp's window");

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

// E elements of a row per lane, loaded and stored as one: 4 bytes of dout (two 16-bit values, or one float) and
// 4 E of dwte, when C and the pointers allow, else one.
template <typename S, int E>
struct alignas(sizeof(S) * E) Elems {
  S v[E];
};

// The next 32 sorted indices' ids and positions, one per lane (-1 and 0 past BT): a chunk's loads, issued early.
struct Chunk {
  int tok, pos;
};
__device__ __forceinline__ Chunk load_chunk(const int32_t* __restrict__ tok_sorted,
                                            const int32_t* __restrict__ pos_sorted, int64_t j, int64_t BT) {
  return j < BT ? Chunk{tok_sorted[j], pos_sorted[j]} : Chunk{-1, 0};
}

// grid: (ceil(BT / (32 * kWteWarps)), ceil(C / (32 * E))). A warp owns the runs that start among its 32
// sorted indices (its window; rows before its first run's start belong to a run some window before) and its
// block's 32 * E channels; lanes past C keep to the shuffles. The window goes kSpan indices at a time: their dout
// rows and, for each run starting there, the token's dwte row (the value its sum starts from) are all loaded
// before the first add, so a warp waits on memory three times for its window (ids and positions, then each half),
// where it waited twice for each run (about 18 runs a window with random ids at B 64 x T 1024: the H200's 0.71 ms
// for a step's 0.35 GB was that chain, not bandwidth). The last run may go on past the window: it is added 32
// rows at a time, each chunk's ids and positions loaded while the chunk before is loaded and added, and its end
// found from those ids (no scan of the run's ids beforehand).
template <typename S, int E>
__global__ void __launch_bounds__(kWteWarps * 32)
    encoder_backward_wte_kernel(float* __restrict__ dwte, float* __restrict__ partial, const S* __restrict__ dout,
                                const int32_t* __restrict__ tok_sorted, const int32_t* __restrict__ pos_sorted,
                                int64_t BT, int C) {
  const int lane = threadIdx.x % 32;
  const int64_t i0 = ((int64_t)blockIdx.x * kWteWarps + threadIdx.x / 32) * 32;
  if (i0 >= BT) return;
  const Chunk w = load_chunk(tok_sorted, pos_sorted, i0 + lane, BT);
  const int before = i0 + lane > 0 && i0 + lane < BT ? tok_sorted[i0 + lane - 1] : -1;
  // A window on a piece's first index (kPiece: cpu/kernels.h) starts a piece there, mid-run or not; mid-run (cont),
  // its sum starts from +0 and goes to partial's row for the piece, never to dwte, which the run's first piece's
  // warp writes meanwhile.
  const bool piece_start = i0 % kPiece == 0;
  const bool cont = piece_start && __shfl_sync(0xffffffffu, (int)(before == w.tok), 0) != 0;
  const unsigned heads =
      __ballot_sync(0xffffffffu, w.tok >= 0 && (i0 + lane == 0 || before != w.tok || (lane == 0 && piece_start)));
  if (!heads) return;  // the whole window is the middle of a run that started before it
  const unsigned rows = __ballot_sync(0xffffffffu, w.tok >= 0);
  const int h0 = __ffs(heads) - 1;
  // The first chunk past the window, in case the last run reaches it (its ids say whether).
  Chunk next = i0 + 32 < BT && (rows >> 31) ? load_chunk(tok_sorted, pos_sorted, i0 + 32 + lane, BT) : Chunk{-1, 0};
  const int c = (blockIdx.y * 32 + lane) * E;
  const bool mine = c < C;
  auto dout_at = [&](int p) { return *reinterpret_cast<const Elems<S, E>*>(dout + (int64_t)p * C + c); };
  auto dwte_at = [&](int t) { return reinterpret_cast<Elems<float, E>*>(dwte + (int64_t)t * C + c); };
  // Where the run being added goes: its token's row, or (a piece mid-run) the piece's partial row.
  auto out_at = [&](int t, bool to_partial) {
    return to_partial ? reinterpret_cast<Elems<float, E>*>(partial + (i0 / kPiece) * C + c) : dwte_at(t);
  };
  Elems<S, E> x[32];      // rows of dout
  Elems<float, E> start[kSpan];  // at each run's first index: that token's dwte row as it was (+0 mid-run)
  Elems<float, E> acc;
  int tok = -1;  // the run being added
  bool to_partial = false;
  for (int k0 = 0; k0 < 32; k0 += kSpan) {
#pragma unroll
    for (int k = 0; k < kSpan; k++) {
      const int pk = __shfl_sync(0xffffffffu, w.pos, k0 + k), tk = __shfl_sync(0xffffffffu, w.tok, k0 + k);
      if (k0 + k >= h0 && ((rows >> (k0 + k)) & 1) && mine) x[k] = dout_at(pk);
      if (((heads >> (k0 + k)) & 1) && mine) {
        if (k0 + k == 0 && cont) {
#pragma unroll
          for (int e = 0; e < E; e++) start[k].v[e] = 0.0f;
        } else {
          start[k] = *dwte_at(tk);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kSpan; k++) {
      if (k0 + k < h0 || !((rows >> (k0 + k)) & 1)) continue;  // warp-uniform
      if ((heads >> (k0 + k)) & 1) {
        if (tok >= 0 && mine) *out_at(tok, to_partial) = acc;
        tok = __shfl_sync(0xffffffffu, w.tok, k0 + k);
        to_partial = k0 + k == 0 && cont;
        acc = start[k];
      }
      if (mine)
#pragma unroll
        for (int e = 0; e < E; e++) acc.v[e] += to_float(x[k].v[e]);
    }
  }
  // The last run past the window, a chunk of up to 32 rows at a time, up to the next piece's first index.
  for (int64_t j0 = i0 + 32; (rows >> 31) && j0 < BT && j0 % kPiece != 0; j0 += 32) {
    const Chunk cur = next;
    const unsigned ends = __ballot_sync(0xffffffffu, cur.tok != tok);
    const int n = ends ? __ffs(ends) - 1 : 32;
    if (n == 0) break;
    if (n == 32) next = load_chunk(tok_sorted, pos_sorted, j0 + 32 + lane, BT);
#pragma unroll
    for (int k = 0; k < 32; k++) {
      const int pk = __shfl_sync(0xffffffffu, cur.pos, k);
      if (k < n && mine) x[k] = dout_at(pk);
    }
#pragma unroll
    for (int k = 0; k < 32; k++)
      if (k < n && mine)
#pragma unroll
        for (int e = 0; e < E; e++) acc.v[e] += to_float(x[k].v[e]);
    if (n < 32) break;
  }
  if (mine) *out_at(tok, to_partial) = acc;
}

// The pieces after a run's first (cpu/kernels.h): each added in turn onto the row that the run's first piece's warp
// left in dwte. grid: (pieces - 1, ceil(C / kColThreads)); block x for piece p = x + 1, which does the work only if
// it is its run's first piece mid-run.
__global__ void encoder_backward_pieces_kernel(float* __restrict__ dwte, const float* __restrict__ partial,
                                               const int32_t* __restrict__ tok_sorted, int64_t BT, int C) {
  const int64_t p = (int64_t)blockIdx.x + 1, i = p * kPiece;
  const int c = blockIdx.y * kColThreads + threadIdx.x;
  const int t = tok_sorted[i];
  if (c >= C || tok_sorted[i - 1] != t) return;  // piece p starts a run
  if (p >= 2 && tok_sorted[i - kPiece] == t && tok_sorted[i - kPiece - 1] == t) return;  // not the run's second piece
  float acc = dwte[(int64_t)t * C + c];
  for (int64_t q = p; q * kPiece < BT && tok_sorted[q * kPiece] == t; q++) acc += partial[q * C + c];
  dwte[(int64_t)t * C + c] = acc;
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
  const size_t sort_bytes = sort_positions_scratch_bytes(BT, V);
  const size_t ids_bytes = ((size_t)BT * 2 * sizeof(int32_t) + 255) / 256 * 256;  // keeps the sort's part aligned
  const int64_t pieces = (BT + kPiece - 1) / kPiece;
  const size_t partial_at = (ids_bytes + sort_bytes + 255) / 256 * 256;
  const size_t partial_bytes = pieces > 1 ? (size_t)pieces * C * sizeof(float) : 0;
  Scratch scratch((partial_at + partial_bytes + sizeof(float) - 1) / sizeof(float), stream);
  int32_t* tok_sorted = reinterpret_cast<int32_t*>(scratch.ptr);  // (BT)
  int32_t* pos_sorted = tok_sorted + BT;                           // (BT)
  float* partial = reinterpret_cast<float*>(reinterpret_cast<char*>(scratch.ptr) + partial_at);  // (pieces, C)
  sort_positions_by_token(tok_sorted, pos_sorted, reinterpret_cast<char*>(scratch.ptr) + ids_bytes, sort_bytes, idx,
                          BT, V, stream);
  const unsigned run_blocks = (unsigned)((BT + 32 * kWteWarps - 1) / (32 * kWteWarps));
  constexpr int E = 4 / (int)sizeof(S);  // 2 for 16-bit S (a lane reads 4 bytes of a row), 1 for float
  constexpr int block = kWteWarps * 32;
  const bool wide = reinterpret_cast<uintptr_t>(dout) % 4 == 0 && reinterpret_cast<uintptr_t>(dwte) % (4 * E) == 0;
  if (C % E == 0 && wide) {
    const dim3 grid(run_blocks, (unsigned)((C + 32 * E - 1) / (32 * E)));
    encoder_backward_wte_kernel<S, E><<<grid, block, 0, stream>>>(dwte, partial, dout, tok_sorted, pos_sorted, BT, C);
  } else {
    const dim3 grid(run_blocks, (unsigned)((C + 31) / 32));
    encoder_backward_wte_kernel<S, 1><<<grid, block, 0, stream>>>(dwte, partial, dout, tok_sorted, pos_sorted, BT, C);
  }
  FASTGPT_CUDA_CHECK_LAUNCH();
  const unsigned col_blocks = (unsigned)((C + kColThreads - 1) / kColThreads);
  if (pieces > 1) {
    const dim3 grid((unsigned)(pieces - 1), col_blocks);
    encoder_backward_pieces_kernel<<<grid, kColThreads, 0, stream>>>(dwte, partial, tok_sorted, BT, C);
    FASTGPT_CUDA_CHECK_LAUNCH();
  }
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
