// Softmax cross-entropy over the vocabulary, forward and backward, never storing the probabilities; CUDA twin of
// csrc/cpu/cross_entropy.cpp. One block per row, in two passes over it. Pass one (row_lse) keeps a running
// (max, sum of exp) per thread, merged across the block into lse = max + log(sum): the forward keeps lse for the
// backward. Pass two (row_grad) rebuilds each probability from lse and writes the gradient. forward_backward (the
// training step's chunked classifier) runs both passes in one kernel, reading the logits from memory once where two
// blocks' rows fit in an SM's shared memory (pass one keeps what it loads there: 100.6 KB at V 50304 in 16 bits on
// sm_90), else twice (which ran at 2 TB/s, reads and writes, in an H200's training step).
// Memory-bound, so a row is walked in units of one 16-byte pack (N = 8 16-bit logits or 4 float), the V % N logits
// past the last whole pack a unit each: thread i takes units i, i + blockDim.x, ... in both passes, kBatch of them
// loaded before the first is used (one wait on memory a batch, not a unit). Where V is a whole number of packs and
// the rows are 16-byte aligned the units move as 128-bit loads and stores; otherwise as single elements, in the same
// order (PackIO), so every result depends on V alone, never on alignment or on where pass two reads. The kept row's
// 16-byte units go to shared memory by cp.async (sm_80+), every unit of the thread asked for before the first is
// used (row_lse_async): the whole row is on its way at once, where loads through registers had a thread's kBatch
// units in flight, 32 KB a block (the step's kernel moved 2.6 TB/s on an H200, a copy 4.1).
// forward and forward_backward share pass one, so their losses are the same bits, and backward from forward's lse
// gives forward_backward's gradient bits.
// Every exponential is fast_exp (one multiply and ex2.approx): with expf's eight instructions an element, the
// 16-bit kernels ran out of issue slots long before memory ran out of bandwidth (1.9 TB/s of reads and writes in
// an H100's training step, against 3.0 TB/s copies and the fp32 kernel's 3.1 with two reads a row: the same
// instructions an element at half the elements a byte). The CPU reference's expf differs in the last bits.
// dlogits may alias logits (written in place), so no __restrict__ there: a thread writes only the units it read.
// Templates over the storage type S (float, bf16, f16) of the logits: widened as loaded, all arithmetic in float,
// losses and lse float. The gradient is (p - onehot) * dloss rounded once to S, as the CPU writes it: in 16 bits
// p - 1 at the target is formed before rounding (not p rounded, then - 1).
#include <cmath>

#include "cuda/check.h"
#include "cuda/cp_async.cuh"
#include "cuda/fast_exp.cuh"
#include "cuda/ops.h"
#include "cuda/smem.cuh"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
constexpr int kThreads = 512;  // a multiple of 32 (the block reduction assumes full warps), at least a pack
constexpr int kBatch = 4;      // units a thread loads before it uses the first

// (max, sum of exp(x - max)) over a part of a row; an empty part, or one of -inf logits only, is (-inf, 0).
struct MaxSum {
  float m, s;
};

// Adds W logits: one rescale for all of them (by their max), then their exps in order. While every logit seen is
// -inf, the exps are taken against 0 instead of the max (exp(-inf - -inf) is NaN): each adds 0, and a NaN still
// adds NaN (fmaxf passes over a NaN, so the max alone would drop it).
template <int W>
__device__ __forceinline__ void add(MaxSum& a, const float (&v)[W]) {
  float m = v[0];
#pragma unroll
  for (int k = 1; k < W; k++) m = fmaxf(m, v[k]);
  if (m > a.m) {
    a.s *= fast_exp(a.m - m);
    a.m = m;
  }
  const float ref = a.m == -INFINITY ? 0.f : a.m;
#pragma unroll
  for (int k = 0; k < W; k++) a.s += fast_exp(v[k] - ref);
}

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};  // both sums are 0 (or NaN): exp(-inf - -inf) would be NaN
  // Both products rounded, then added: a + b == b + a, so both lanes of a shuffle pair end with the same bits, and
  // so every lane of the block. Written a.s * ea + b.s * eb, nvcc makes it one FMA, fma(a.s, ea, b.s * eb), which
  // rounds the partner's product only: lanes then differ in lse's last bit, and forward's loss (thread 0's lse)
  // differed from forward_backward's (the target's thread) on an H200 (2026-11-26).
  return {m, __fadd_rn(__fmul_rn(a.s, fast_exp(a.m - m)), __fmul_rn(b.s, fast_exp(b.m - m)))};
}

// Every thread of the block gets the row's (max, sum). Must be reached by all threads of the block, once a kernel.
__device__ MaxSum block_reduce(MaxSum v) {
  __shared__ float pm[32];
  __shared__ float ps[32];
  for (int off = 16; off > 0; off >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)});
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) {
    pm[warp] = v.m;
    ps[warp] = v.s;
  }
  __syncthreads();
  v = lane < nwarps ? MaxSum{pm[lane], ps[lane]} : MaxSum{-INFINITY, 0.f};
  for (int off = 16; off > 0; off >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)});
  return v;
}

// Widened values of one unit.
template <typename S>
__device__ __forceinline__ void widen(float (&v)[Pack<S>::N], const Pack<S>& p) {
#pragma unroll
  for (int k = 0; k < Pack<S>::N; k++) v[k] = to_float(p.v[k]);
}

// Pass one of a kept row in 16-byte units (x and keep 16-byte aligned, V whole units): the thread's units u = tid,
// tid + threads, ... copied to keep by cp.async, kBatch to a group, kGroups groups asked for before the first add
// (so a row of up to kGroups * kBatch units a thread is on its way whole) and one more after each group added (the
// kGroups - 1 after a group are in flight while it is added), then added from keep in the order of the register
// path (unit by unit, k ascending): the same bits. Every unit the thread copies it waits for (groups past its last
// unit are empty), so pass two reads only landed values, its own.
template <typename S>
__device__ __forceinline__ void row_lse_async(MaxSum& a, const S* x, S* keep, int units) {
  constexpr int N = Pack<S>::N;
  constexpr int kGroups = 4;  // in flight: 16 units a thread, rows up to 131 KB whole at 512 threads
  const int tid = threadIdx.x, threads = blockDim.x;
  const int mine = tid < units ? (units - 1 - tid) / threads + 1 : 0;  // units tid + k threads, k < mine
  const auto issue = [&](int g) {
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      const int k = g * kBatch + b, u = tid + k * threads;
      if (k < mine) cp_async16(keep + u * N, x + u * N, true);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int g = 0; g < kGroups; g++) issue(g);
  for (int g = 0; g * kBatch < mine; g++) {
    cp_async_wait<kGroups - 1>();  // group g has landed: only the kGroups - 1 after it may be on their way
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      const int k = g * kBatch + b, u = tid + k * threads;
      if (k >= mine) break;
      float v[N];
      widen(v, load_pack(keep + u * N));
      add(a, v);
    }
    issue(g + kGroups);
  }
}

// Pass one: the row's lse (every thread gets it). keep (shared memory, 16-byte aligned; kKeep only): where the
// row's values go as they are loaded, each thread's own units, for its pass two. A template flag, not a null test:
// ptxas tested the generic pointer in every trip of the loop (the shared window's base read and compared: eight
// instructions a batch).
template <bool kKeep, typename S>
__device__ float row_lse(const S* x, int V, PackIO<S> io, S* keep) {
  constexpr int N = Pack<S>::N;
  const int units = V / N, tid = threadIdx.x, threads = blockDim.x;
  MaxSum a{-INFINITY, 0.f};
  if constexpr (kKeep && kCpAsync) {  // (sm_75: the register path below)
    if (io.vec) {  // whole units, no tail
      row_lse_async(a, x, keep, units);
      a = block_reduce(a);
      return a.m + logf(a.s);
    }
  }
  auto use = [&](int u, const Pack<S>& p) {
    float v[N];
    widen(v, p);
    add(a, v);
    if constexpr (kKeep) store_pack(keep + u * N, p);
  };
  int u = tid;
  for (; u + (kBatch - 1) * threads < units; u += kBatch * threads) {
    Pack<S> p[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; b++) p[b] = io.load(x + (u + b * threads) * N);
#pragma unroll
    for (int b = 0; b < kBatch; b++) use(u + b * threads, p[b]);
  }
  for (; u < units; u += threads) use(u, io.load(x + u * N));
  for (int j = units * N + tid; j < V; j += threads) {
    const S s = x[j];
    const float v[1] = {to_float(s)};
    add(a, v);
    if constexpr (kKeep) keep[j] = s;
  }
  a = block_reduce(a);
  return a.m + logf(a.s);
}

// g = (exp(v - l) - onehot) * dloss for one unit; kt: the target's place in it (anything outside [0, W) for none).
// The loss, where wanted, by the thread that holds the target, from its own read (dx may be x).
template <int W>
__device__ __forceinline__ void unit_grad(float (&g)[W], const float (&v)[W], float l, int kt, float dloss,
                                          float* loss) {
  if ((unsigned)kt < (unsigned)W) {  // one unit of the row: its selects stay out of the other units' loop
#pragma unroll
    for (int k = 0; k < W; k++) {
      const float p = fast_exp(v[k] - l);
      g[k] = __fmul_rn(k == kt ? __fsub_rn(p, 1.f) : p, dloss);
      if (k == kt && loss) *loss = l - v[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < W; k++) g[k] = __fmul_rn(fast_exp(v[k] - l), dloss);
  }
}

// Pass two: this thread's units of dx from x (read through in: memory, or the shared copy pass one kept) and lse,
// the tail first and then the packs from the last down: the units pass one read last are the likeliest to be still
// in L2. (The order cannot change a bit: each element is its own.)
template <typename S>
__device__ void row_grad(S* dx, PackIO<S> out, const S* x, PackIO<S> in, float l, int t, float dloss, int V,
                         float* loss) {
  constexpr int N = Pack<S>::N;
  const int units = V / N, tid = threadIdx.x, threads = blockDim.x;
  for (int j = units * N + tid; j < V; j += threads) {
    const float v[1] = {to_float(x[j])};
    float g[1];
    unit_grad(g, v, l, t - j, dloss, loss);
    dx[j] = from_float<S>(g[0]);
  }
  if (tid >= units) return;
  auto write = [&](int u, const Pack<S>& p) {
    float v[N], g[N];
    widen(v, p);
    unit_grad(g, v, l, t - u * N, dloss, loss);
    Pack<S> o;
#pragma unroll
    for (int k = 0; k < N; k++) o.v[k] = from_float<S>(g[k]);
    out.store(dx + u * N, o);
  };
  int u = tid + (units - 1 - tid) / threads * threads;  // the thread's last unit, then down
  for (; u - (kBatch - 1) * threads >= 0; u -= kBatch * threads) {
    Pack<S> p[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; b++) p[b] = in.load(x + (u - b * threads) * N);
#pragma unroll
    for (int b = 0; b < kBatch; b++) write(u - b * threads, p[b]);
  }
  for (; u >= 0; u -= threads) write(u, in.load(x + u * N));
}

template <typename S>
__global__ void cross_entropy_forward_kernel(float* __restrict__ losses, float* __restrict__ lse,
                                             const S* __restrict__ logits, const int32_t* __restrict__ targets,
                                             int V, PackIO<S> io) {
  const int64_t n = blockIdx.x;
  const S* x = logits + n * V;
  const float l = row_lse<false>(x, V, io, (S*)nullptr);
  if (threadIdx.x == 0) {
    lse[n] = l;
    losses[n] = l - to_float(x[targets[n]]);
  }
}

template <typename S>
__global__ void cross_entropy_backward_kernel(S* dlogits, const S* logits, const float* __restrict__ lse,
                                              const int32_t* __restrict__ targets, float dloss,
                                              const float* __restrict__ dloss_scale, int V, PackIO<S> io) {
  if (dloss_scale) dloss = __fmul_rn(dloss, *dloss_scale);
  const int64_t n = blockIdx.x;
  row_grad(dlogits + n * V, io, logits + n * V, io, lse[n], targets[n], dloss, V, (float*)nullptr);
}

// Both passes, the row read from memory twice (a row larger than shared memory).
template <typename S>
__global__ void cross_entropy_forward_backward_kernel(float* __restrict__ losses, S* dlogits, const S* logits,
                                                      const int32_t* __restrict__ targets, float dloss,
                                                      const float* __restrict__ dloss_scale, int V, PackIO<S> io) {
  if (dloss_scale) dloss = __fmul_rn(dloss, *dloss_scale);
  const int64_t n = blockIdx.x;
  const S* x = logits + n * V;
  const float l = row_lse<false>(x, V, io, (S*)nullptr);
  row_grad(dlogits + n * V, io, x, io, l, targets[n], dloss, V, losses + n);
}

// Both passes, the row read once: pass two reads the copy pass one kept in shared memory (V values of S). Each
// thread reads back only the units it stored or copied (and waited for), so no barrier is needed between the passes.
// Two blocks an SM (row_copy_limit), so at most 64 registers a thread: unbounded, the f16 form took 62, and one
// more than 64 would halve the SM's rows. (ptxas then takes all 64: no loss where the row copy allows two blocks
// anyway, V 50304 in 16 bits; a row small enough for three blocks gets two.)
template <typename S>
__global__ void __launch_bounds__(kThreads, 2)
    cross_entropy_forward_backward_smem_kernel(float* __restrict__ losses, S* dlogits, const S* logits,
                                               const int32_t* __restrict__ targets, float dloss,
                                               const float* __restrict__ dloss_scale, int V, PackIO<S> io) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* row = reinterpret_cast<S*>(smem_raw);  // (V)
  if (dloss_scale) dloss = __fmul_rn(dloss, *dloss_scale);
  const int64_t n = blockIdx.x;
  const float l = row_lse<true>(logits + n * V, V, io, row);
  row_grad(dlogits + n * V, io, (const S*)row, PackIO<S>{true}, l, targets[n], dloss, V, losses + n);
}

// The largest row copy (bytes) with which two blocks fit on an SM (smem_for_blocks), with 1 KB for each block's
// static arrays (256 bytes). One block an SM would leave the SM's loads idle while its block reduces and writes;
// untried on a GPU, so rows that need it (fp32 at V 50304, 201 KB; 16 bits on sm_80) keep the two-read kernel:
// 57,344 16-bit logits on sm_90.
int64_t row_copy_limit() { return smem_for_blocks(2, 1024); }

// 16-byte units: V a whole number of packs, so every row starts where the first does, and both bases aligned.
template <typename S>
PackIO<S> units_of(int V, const S* logits, const void* dlogits) {
  return PackIO<S>{V % Pack<S>::N == 0 && aligned16(logits) && aligned16(dlogits)};
}
}  // namespace

template <typename S>
void cross_entropy_forward(float* losses, float* lse, const S* logits, const int32_t* targets, int64_t N, int V,
                           Stream stream) {
  if (N <= 0 || V <= 0) return;
  const PackIO<S> io = units_of(V, logits, nullptr);
  auto* kernel = cross_entropy_forward_kernel<S>;  // (a launch on one line: tests/warp_emu rewrites it)
  kernel<<<(unsigned)N, kThreads, 0, stream>>>(losses, lse, logits, targets, V, io);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void cross_entropy_backward(S* dlogits, const S* logits, const float* lse, const int32_t* targets, float dloss,
                            const float* dloss_scale, int64_t N, int V, Stream stream) {
  if (N <= 0 || V <= 0) return;
  const PackIO<S> io = units_of(V, logits, dlogits);
  auto* kernel = cross_entropy_backward_kernel<S>;  // (a launch on one line: tests/warp_emu rewrites it)
  kernel<<<(unsigned)N, kThreads, 0, stream>>>(dlogits, logits, lse, targets, dloss, dloss_scale, V, io);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
void cross_entropy_forward_backward(float* losses, S* dlogits, const S* logits, const int32_t* targets, float dloss,
                                    const float* dloss_scale, int64_t N, int V, Stream stream) {
  if (N <= 0 || V <= 0) return;
  const PackIO<S> io = units_of(V, logits, dlogits);
  const int64_t bytes = ((int64_t)V * (int64_t)sizeof(S) + 15) / 16 * 16, limit = row_copy_limit();  // whole packs
  const bool keep = bytes <= limit;
  auto* kernel = keep ? cross_entropy_forward_backward_smem_kernel<S> : cross_entropy_forward_backward_kernel<S>;
  const size_t smem = keep ? (size_t)bytes : 0;
  // The kernel's cap, not this launch's size: the same for every call, so no call lowers it under another's launch
  // (another thread's, or one a graph recorded).
  if (keep) FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)limit));
  kernel<<<(unsigned)N, kThreads, smem, stream>>>(losses, dlogits, logits, targets, dloss, dloss_scale, V, io);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

#define FASTGPT_INSTANTIATE(S)                                                                                 \
  template void cross_entropy_forward<S>(float*, float*, const S*, const int32_t*, int64_t, int, Stream);      \
  template void cross_entropy_backward<S>(S*, const S*, const float*, const int32_t*, float, const float*, int64_t, \
                                         int, Stream);                                                        \
  template void cross_entropy_forward_backward<S>(float*, S*, const S*, const int32_t*, float, const float*,  \
                                                  int64_t, int, Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
