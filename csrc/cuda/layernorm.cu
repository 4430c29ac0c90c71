// LayerNorm over the last dimension (eps 1e-5, biased variance), forward and backward; CUDA twin of
// csrc/cpu/layernorm.cpp. One warp per row for everything that reduces across a row (two-pass mean then variance in
// float, warp-shuffle sums; the forward's row is in cuda/layernorm.cuh, shared with residual_layernorm.cu). dinp
// accumulates (+=), as on the CPU: the residual stream sums into it.
// The forward keeps a row in registers (16-byte packs) from its load to its output where C fits
// (layernorm_row_fits): one read of the row instead of three. The older forward, which reads it for each pass, takes
// other widths and runs when set_layernorm_one_pass(false).
// dweight/dbias sum over all rows without atomics: each chunk of kRowsPerChunk rows gets a partial sum in a scratch
// buffer, then the chunks are added in double in the CPU's order: kCombineLanes lanes a channel, lane y taking chunks
// y, y + kCombineLanes, ... in order, then the lanes in order. A chunk's partial is the CPU's: the in-order float sum
// of its parts' sums, a part being kRowsPerPart rows summed in order. The result never depends on launch
// configuration or timing.
// The backward reads each row once (llm.c's layernorm_backward does the same): a block takes chunks in turn, each of
// its warps one part of each, and a lane keeps its columns of the row (16-byte packs) in registers from the row's two
// sums to its dinp, and its columns' part sums beside them; the warps then add their part sums into the chunk's partial
// in turn, through shared memory. A row's dinp is loaded with it, before the row's sums, so that a warp waits on memory
// once a row; on sm_80 and newer, where the shared memory allows, not even that: the rows come through a ring in shared
// memory by cp.async, the next one landing while the warp works on the one before. The two-pass form it replaces (one
// kernel for dinp, a second that reads dout and inp again for the partials: half as much traffic again) is kept for
// rows it cannot take (C not a whole number of packs, over kMaxCols, unaligned views) and, by
// set_layernorm_one_pass(false), for benchmarks and tests; both give the same dweight/dbias bits (fmaf in both).
// dinp_sum (the column sums of dinp after the update: the fused model's residual projections' bias gradients): the
// 16-bit ring kernel's kSum form adds each pack of dinp it stores into its warp's sums in shared memory, which go
// into the chunk's partial as a third row beside dweight/dbias; elsewhere bias_backward (matmul_bias.cu) reads dinp
// again once it is whole. The first saves the model a pass over dinp; the second costs what the unfused model's
// bias gradient costs, and gives its bits.
// Templates over the storage type S (float, bf16, f16): inputs are widened to float as they are loaded, every sum
// is in float (or double for the chunk combine), out is rounded once to S, mean/rstd and dweight/dbias are float,
// and dinp += is read as S, added in float and rounded once.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "cuda/check.h"
#include "cuda/cp_async.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/ops.h"
#include "cuda/scratch.h"
#include "cuda/smem.cuh"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {
constexpr int kRowsPerChunk = 64;  // these two must stay equal to the CPU's for the partial sums to match it
constexpr int kRowsPerPart = 8;
constexpr int kParts = kRowsPerChunk / kRowsPerPart;  // the one-pass kernel's warps per block
constexpr int kWarpsPerBlock = 8;
constexpr int kColThreads = 128;
constexpr int kCombineLanes = 16;  // chunk lanes of the combine: must stay equal to the CPU's
// Columns a combine block: 8, so that GPT-2's 768 make 96 blocks (a warp reads one 32-byte sector of 4 chunks'
// partials). With 32 (a warp's 128 contiguous bytes of one chunk) there were 24 blocks for 132 SMs, each thread
// walking its 64 chunks a few loads at a time: 24 us a call, 25 calls a step, on the H200 (seventh run) for a
// 9.4 MB read.
constexpr int kCombineCols = 8;
constexpr int kMaxCols = kLayerNormMaxPackedCols;  // the one-pass backward's widest row (64 sums per lane)

// Read by every layernorm_forward, residual_layernorm_forward and layernorm_backward (set_layernorm_one_pass).
std::atomic<bool> g_one_pass{true};

template <typename S>
__global__ void layernorm_forward_kernel(S* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                         const S* __restrict__ inp, const S* __restrict__ weight,
                                         const S* __restrict__ bias, int64_t N, int C) {
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;  // whole warp leaves together: the shuffles below see all 32 lanes
  const int lane = threadIdx.x % 32;
  const S* x = inp + n * C;
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += to_float(x[c]);
  layernorm_row(out + n * C, mean + n, rstd + n, x, weight, bias, C, lane, s);
}

// The row read once: one warp per row, its packs in registers (layernorm_row_packs). C fits (layernorm_row_fits).
template <typename S>
__global__ void layernorm_forward_one_pass_kernel(S* __restrict__ out, float* __restrict__ mean,
                                                  float* __restrict__ rstd, const S* __restrict__ inp,
                                                  const S* __restrict__ weight, const S* __restrict__ bias, int64_t N,
                                                  int C, RowPack<S> io) {
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;
  const S* x = inp + n * C;
  layernorm_row_packs(out + n * C, mean + n, rstd + n, weight, bias, C, threadIdx.x % 32, io,
                      [&](int c) { return io.load(x + c); });
}

// One element of dinp += r * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dy * w, rounded once to S;
// md and mdn are the row's two means. Both backward kernels' update.
template <typename S>
__device__ __forceinline__ S dinp_add(S dx, float dy, float w, float norm, float md, float mdn, float r) {
  return from_float<S>(to_float(dx) + (dy * w - md - norm * mdn) * r);
}

// The two-pass form's dinp: one warp per row.
template <typename S>
__global__ void layernorm_backward_dinp_kernel(S* __restrict__ dinp, const S* __restrict__ dout,
                                               const S* __restrict__ inp, const S* __restrict__ weight,
                                               const float* __restrict__ mean, const float* __restrict__ rstd,
                                               int64_t N, int C) {
  const int64_t n = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;
  const int lane = threadIdx.x % 32;
  const S* x = inp + n * C;
  const S* dy = dout + n * C;
  const float m = mean[n], r = rstd[n];
  float sd = 0.f, sdn = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float norm = (to_float(x[c]) - m) * r;
    const float dn = to_float(dy[c]) * to_float(weight[c]);
    sd += dn;
    sdn += dn * norm;
  }
  const float md = warp_sum(sd) / C, mdn = warp_sum(sdn) / C;
  S* dx = dinp + n * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (to_float(x[c]) - m) * r;
    dx[c] = dinp_add(dx[c], to_float(dy[c]), to_float(weight[c]), norm, md, mdn, r);
  }
}

// grid: (nchunks, ceil(C / kColThreads)); one thread per (chunk, channel), the chunk's parts in order and each
// part's rows in order. partial layout per chunk: dweight (C) | dbias (C).
template <typename S>
__global__ void layernorm_backward_partial_kernel(float* __restrict__ partial, const S* __restrict__ dout,
                                                  const S* __restrict__ inp, const float* __restrict__ mean,
                                                  const float* __restrict__ rstd, int64_t N, int C) {
  const int64_t ch = blockIdx.x;
  const int c = blockIdx.y * kColThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t n0 = ch * kRowsPerChunk;
  const int64_t n1 = n0 + kRowsPerChunk < N ? n0 + kRowsPerChunk : N;
  float sw = 0.f, sb = 0.f;
  for (int64_t p0 = n0; p0 < n1; p0 += kRowsPerPart) {
    float pw = 0.f, pb = 0.f;
    for (int64_t n = p0; n < p0 + kRowsPerPart && n < n1; n++) {
      const float dy = to_float(dout[n * C + c]);
      const float norm = (to_float(inp[n * C + c]) - mean[n]) * rstd[n];
      pw = fmaf(dy, norm, pw);
      pb += dy;
    }
    sw = p0 == n0 ? pw : sw + pw;
    sb = p0 == n0 ? pb : sb + pb;
  }
  partial[ch * 2 * C + c] = sw;
  partial[ch * 2 * C + C + c] = sb;
}

// Blocks an SM must hold at once (ptxas keeps registers to 65536 / (256 * this)), by a lane's columns (K packs of
// P): as many as each instance held before a row's dinp was loaded with it (ptxas sm_90), so that no instance holds
// fewer; 16-bit rows up to 768 columns (GPT-2 124M's) two, at 128 registers (fp16 took 170 unbound). Spills since
// the ring kernel reads a row's slot twice (ptxas 13.0, sm_90a): bf16 at GPT-2's width none in the register and ring
// forms, 8 bytes stored and 16 loaded with dinp's sums, none of them in the row loop (before: 20 and 32, one load a
// row, the row's rstd). fp16's ring forms up to 44 and 68 (K 2; sm_86 52 and 76), and at K 2 and 3 they still
// spill the part's means and rstds: a load from local memory a row, as bf16's did before (fp16's float conversions
// take more registers).
template <typename S, int K>
constexpr int kOnePassBlocks = sizeof(S) == 2 ? (K == 1 ? 4 : K <= 3 ? 2 : 1) : (K <= 2 ? 3 : K <= 4 ? 2 : 1);

// Rows a warp of the ring kernel has in shared memory or on their way: it works on one while the next lands.
constexpr int kRingSlots = 2;

// Column sums a chunk's partial holds: dweight | dbias, and with kSum the column sums of dinp (dinp_sum).
__host__ __device__ constexpr int sums_of(bool sum) { return sum ? 3 : 2; }

// kSum: a warp's dinp column sums in shared memory take C rounded up to whole stripes of 32 packs (floats), so that
// a lane's pack k sits at the same place whatever C is (sum_slot).
template <typename S>
__host__ __device__ constexpr int64_t sum_stripe_cols(int C) {
  constexpr int kStripe = 32 * Pack<S>::N;
  return ((int64_t)C + kStripe - 1) / kStripe * kStripe;
}

// The 16-byte slots (sum_slot) that the packs of rows of C columns (a multiple of the pack) take: whole stripes,
// then the last one's quarters up to its last pack (as many as C / 4 for float, whose packs are one quarter).
template <typename S>
__host__ __device__ constexpr int64_t sum_slots(int C) {
  constexpr int P = Pack<S>::N;
  const int packs = C / P, full = packs / 32, last = packs % 32;
  return ((int64_t)full * 32 + (last ? 32 : 0)) * (P / 4) - (last ? 32 - last : 0);
}

// The ring kernel's dynamic shared memory for rows of C columns: kParts warps x kRingSlots rows x (inp, dout, dinp),
// the weight (C), the chunk's (2, sum_slots) sums, and with kSum each warp's dinp sums (over whole stripes; added
// across warps straight into the partial, not through the chunk's sums).
template <typename S>
__host__ __device__ constexpr int64_t ring_bytes(int C, bool sum = false) {
  return ((int64_t)kParts * kRingSlots * 3 + 1) * C * (int64_t)sizeof(S) + 2 * sum_slots<S>(C) * 16 +
         (sum ? kParts * sum_stripe_cols<S>(C) * (int64_t)sizeof(float) : 0);
}

// The 16-byte slot (float4) of lane `lane`'s pack k, quarter h (values 4h .. 4h + 3 of the pack), in the chunk's
// dweight/dbias sums (sum_slots of them) and (kSum) each warp's dinp sums (sum_stripe_cols / 4): quarter-major
// within a stripe, so that a warp's 16-byte accesses of one quarter are 32 consecutive slots (no bank conflicts; a
// lane's whole pack, 32 bytes, would be two-way).
template <typename S>
__host__ __device__ constexpr int sum_slot(int k, int h, int lane) {
  return (k * (Pack<S>::N / 4) + h) * 32 + lane;
}

// As many blocks as the SMs hold at once (kOnePassBlocks an SM, launch_one_pass), each taking chunks blockIdx.x,
// blockIdx.x + gridDim.x, ... in turn; in each chunk one warp per part (kParts warps). Lane l's columns are the K
// packs (32 k + l) * P .. + P - 1 (P = Pack<S>::N): each warp-wide load is 512 contiguous bytes. Needs C a multiple
// of P (a pack is in the row or out of it), C <= 32 K P <= kMaxCols and 16-byte aligned rows (one_pass_fits).
// kRing (sm_80 and newer, where ring_bytes fit; layernorm_backward chooses): a lane's packs of a row come by
// cp.async into the warp's ring in shared memory, next row first, so that a row is on its way while the warp works
// on the one before; else they are loaded into registers when the warp reaches the row, and a warp has rows in
// flight only while it waits for them. Both read the same values and add them in the same order: the same bits.
// (The registers hold the part sums, 48 at GPT-2's width, so a second row's packs do not fit beside them: 128 a
// thread at two blocks an SM. The third H200 run's 0.157 ms a call, 2.5 TB/s, where the residual LayerNorm's
// forward, which moves as many bytes, ran at 3.6, came from the wait on each row.)
// Why a block keeps going from chunk to chunk (the seventh H200 run's 0.164 ms a call, 2.44 TB/s, when each chunk
// was a block of its own): a warp's ring runs on across the chunks, the next chunk's first rows on their way while
// the block adds its parts' sums, and a block's fixed costs (the weight's copy, the first rows' wait with nothing
// else in flight, the means' loads) are paid once a block (264 times a call at B 64 on a 132-SM H100 or H200), not
// once a chunk (1024 times). The chunks, their parts and every sum are the same: the same bits.
template <typename S, int K, bool kRing, bool kSum>
__global__ void __launch_bounds__(32 * kParts, kOnePassBlocks<S, K>)
    layernorm_backward_one_pass_kernel(S* __restrict__ dinp, float* __restrict__ partial, const S* __restrict__ dout,
                                       const S* __restrict__ inp, const S* __restrict__ weight,
                                       const float* __restrict__ mean, const float* __restrict__ rstd, int64_t N,
                                       int C) {
  constexpr int P = Pack<S>::N;
  static_assert(!kSum || (kRing && P % 4 == 0), "layernorm_backward_one_pass_kernel: kSum is the ring's, in quarters");
  extern __shared__ __align__(16) unsigned char smem_raw[];  // kRing: ring_bytes(C, kSum)
  __shared__ float4 static_sums[kRing ? 1 : 2 * kMaxCols / 4];
  static_assert(kRowsPerPart % kRingSlots == 0, "a part's rows start at ring slot 0");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // kRing: this warp's slots (kRingSlots, 3, C): inp | dout | dinp of a row
  S* ring = reinterpret_cast<S*>(smem_raw) + (int64_t)warp * kRingSlots * 3 * C;
  // (2, sum_slots) float4: dweight | dbias, the chunk's parts added so far, by sum_slot
  const int64_t slots = sum_slots<S>(C);
  float4* sums = kRing ? reinterpret_cast<float4*>(reinterpret_cast<S*>(smem_raw) +
                                                  (int64_t)kParts * kRingSlots * 3 * C)
                       : static_sums;
  S* sweight = reinterpret_cast<S*>(sums + 2 * slots);  // kRing: (C), the weight
  // kSum: (kParts, sum_stripe_cols / 4) float4, each warp's dinp sums over its part's rows, by sum_slot. In shared
  // memory, not registers: beside the part sums they made ptxas spill (152 bytes at GPT-2's width, 128 registers).
  // They start where the ring kernel's memory without them ends. Addressed from the shared memory's base at each
  // use: a pointer of its own, kept through the row loop, spilled at GPT-2's width (kOnePassBlocks: what spills
  // now).
  const auto wsums = [&] { return reinterpret_cast<float4*>(smem_raw + ring_bytes<S>(C)); };
  const auto wsum = [&](int k, int h) -> float4& {
    return wsums()[warp * (sum_stripe_cols<S>(C) / 4) + sum_slot<S>(k, h, lane)];
  };
  // The step from this warp's part of one of the block's chunks to its part of the next: the launch's constant,
  // read at each use (no register held through the row loop, where the part sums leave none at GPT-2's width).
  const auto step = [] { return (int64_t)gridDim.x * kRowsPerChunk; };
  const int64_t first = (int64_t)blockIdx.x * kRowsPerChunk + warp * kRowsPerPart;  // the first chunk's part
  // Row n (if below N) into ring slot s: this lane's packs, which only it reads back, so its own wait orders them.
  // Every call commits a group, empty past the warp's last row, so that each row's wait is the same.
  const auto fetch = [&](int64_t n, int s) {
    if (n < N) {
      S* b = ring + s * 3 * C;
#pragma unroll
      for (int k = 0; k < K; k++) {
        const int c = (32 * k + lane) * P;
        if (c < C) {
          cp_async16(b + c, inp + n * C + c, true);
          cp_async16(b + C + c, dout + n * C + c, true);
          cp_async16(b + 2 * C + c, dinp + n * C + c, true);
        }
      }
    }
    cp_async_commit();
  };
  // The ring kernel's means and rstds: lane i < kRowsPerPart holds row p0 + i's, so that a row takes its pair from a
  // shuffle, not from a load (a wait on memory a row, where its packs are already in shared memory). The next
  // chunk's are loaded as this chunk's rows are done, on their way while the warps add their sums. (Loaded a chunk
  // ahead, they spent the row loop in registers or in local memory: the ninth H200 run's ncu had them in the upper
  // lanes of the same registers, spilled, and every row's shuffle waiting on the spill's load behind the ring's
  // copies, 10% of the kernel's stall samples; in registers of their own they were spilled at the chunk's end, the
  // spill's store waiting on their load.)
  float part_mean = 0.f, part_rstd = 0.f;
  const auto stats = [&](int64_t p) {
    const int64_t n = p + lane;
    if (lane < kRowsPerPart && n < N) part_mean = mean[n], part_rstd = rstd[n];
  };
  // The weight: in registers, loaded at each chunk's start (kept through the parts' sums, it made the register
  // kernel spill at GPT-2's width), or (kRing) in shared memory, read with each row's packs (kept in registers beside
  // the ring's addressing, it made the fp16 ring kernel spill there: 20 bytes at 128 registers).
  Pack<S> w[K];
  // A part's column sums v (pw or pb) into the chunk's `to` (first: part 0's, whose sums are the chunk's so far), by
  // sum_slot. (All of a turn's loads before its adds, in registers, made ptxas spill in the row loop.)
  constexpr int Q = P / 4;  // 16-byte quarters of a pack
  const auto add_part = [&](float4* to, const float(&v)[K][P], bool first) {
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
      for (int h = 0; h < Q; h++)
        if ((32 * k + lane) * P < C) {
          const float* x = v[k] + 4 * h;
          const float4 a = first ? make_float4(0.f, 0.f, 0.f, 0.f) : to[sum_slot<S>(k, h, lane)];
          to[sum_slot<S>(k, h, lane)] = first ? make_float4(x[0], x[1], x[2], x[3])
                                              : make_float4(a.x + x[0], a.y + x[1], a.z + x[2], a.w + x[3]);
        }
  };
  if constexpr (kRing) {
    // The first rows on their way, the first chunk's means and rstds, the block's copy of the weight.
    for (int s = 0; s < kRingSlots; s++) fetch(first + s, s);
    stats(first);
    for (int c = threadIdx.x * P; c < C; c += blockDim.x * P) store_pack(sweight + c, load_pack(weight + c));
    __syncthreads();
  }
  // p0: this warp's part of the chunk (p0 - warp * kRowsPerPart) / kRowsPerChunk, which is in the batch while its
  // first row is.
  for (int64_t p0 = first; p0 - warp * kRowsPerPart < N; p0 += step()) {
    const int64_t p1 = p0 + kRowsPerPart < N ? p0 + kRowsPerPart : N;
    float pw[K][P], pb[K][P];  // this part's sums, by column
#pragma unroll
    for (int k = 0; k < K; k++) {
      if (!kRing && (32 * k + lane) * P < C) w[k] = load_pack(weight + (32 * k + lane) * P);
#pragma unroll
      for (int e = 0; e < P; e++) pw[k][e] = pb[k][e] = 0.f;
      if constexpr (kSum) {  // this lane's slots only, which only it touches until the chunk's end
        if ((32 * k + lane) * P < C)
#pragma unroll
          for (int h = 0; h < P / 4; h++) wsum(k, h) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    for (int i = 0; p0 + i < p1; i++) {  // a warp past N has no rows: it only takes its turns below
      const int64_t n = p0 + i;
      const int slot = i % kRingSlots;
      S* dx = dinp + n * C;
      // The row (and its weight) from the ring slot, or from memory with its dinp so far, all before the row's sums:
      // one wait on memory a row, not two. The ring kernel reads the slot again for the update below (the fence):
      // kept in registers from here, the packs beside the part sums made ptxas spill at GPT-2's width.
      Pack<S> xv[K], gv[K], dv[K];
      const S* b = ring + slot * 3 * C;  // kRing: the slot's (3, C): inp | dout | dinp
      const auto load_row = [&](bool with_dinp) {
#pragma unroll
        for (int k = 0; k < K; k++) {
          const int c = (32 * k + lane) * P;
          if (c < C) {
            xv[k] = load_pack(kRing ? b + c : inp + n * C + c);
            gv[k] = load_pack(kRing ? b + C + c : dout + n * C + c);
            if (with_dinp) dv[k] = load_pack(kRing ? b + 2 * C + c : dx + c);
            if constexpr (kRing) w[k] = load_pack(sweight + c);
          }
        }
      };
      if constexpr (kRing) cp_async_wait<kRingSlots - 1>();  // row n's group; the newer ones may still be on their way
      load_row(!kRing);
      const float m = kRing ? __shfl_sync(0xffffffffu, part_mean, i) : mean[n];
      const float r = kRing ? __shfl_sync(0xffffffffu, part_rstd, i) : rstd[n];
      float sd = 0.f, sdn = 0.f;
#pragma unroll
      for (int k = 0; k < K; k++)
        if ((32 * k + lane) * P < C) {
#pragma unroll
          for (int e = 0; e < P; e++) {
            const float norm = (to_float(xv[k].v[e]) - m) * r;
            const float dn = to_float(gv[k].v[e]) * to_float(w[k].v[e]);
            sd += dn;
            sdn += dn * norm;
          }
        }
      const float md = warp_sum(sd) / C, mdn = warp_sum(sdn) / C;
      if constexpr (kRing) {
        compiler_fence();
        load_row(true);
      }
#pragma unroll
      for (int k = 0; k < K; k++) {
        const int c = (32 * k + lane) * P;
        if (c < C) {
          Pack<S>& d = dv[k];
#pragma unroll
          for (int e = 0; e < P; e++) {
            const float norm = (to_float(xv[k].v[e]) - m) * r, g = to_float(gv[k].v[e]);
            d.v[e] = dinp_add(d.v[e], g, to_float(w[k].v[e]), norm, md, mdn, r);
            pw[k][e] = fmaf(g, norm, pw[k][e]);
            pb[k][e] += g;
          }
          store_pack(dx + c, d);
          if constexpr (kSum) {  // the dinp just stored, as stored (rounded to S), into the part's column sums
#pragma unroll
            for (int h = 0; h < P / 4; h++) {
              float4 a = wsum(k, h);
              a.x += to_float(d.v[4 * h]), a.y += to_float(d.v[4 * h + 1]);
              a.z += to_float(d.v[4 * h + 2]), a.w += to_float(d.v[4 * h + 3]);
              wsum(k, h) = a;
            }
          }
        }
      }
      // The slot's reads are behind the stores that use their values; the compiler may not sink them below the
      // refill: the row kRingSlots on in the part, or past its end the next chunk's (only the last chunk, its
      // block's last, can be short, so this warp has no rows between).
      if constexpr (kRing) {
        compiler_fence();
        const int ahead = i + kRingSlots;
        fetch(ahead < kRowsPerPart ? n + kRingSlots : p0 + step() + ahead - kRowsPerPart, slot);
      }
    }
    if constexpr (kRing) stats(p0 + step());  // the next chunk's part, if any
    // The parts' sums into the chunk's, part 0 first: the partial kernel's order, one warp at a time, the other
    // warps waiting at the barrier. A turn a 16-byte slot at a time (a load, four adds, a store): one float at a
    // time, ptxas kept two loads on their way, and the waits of the eight turns were a third of the ninth H200 run's
    // stall samples (ncu, the ring kernel with dinp's sums at GPT-2's width; 15% in the tenth, 151.7 -> 113.7 us).
    for (int t = 0; t < kParts; t++) {
      if (warp == t && p0 < N) {
        add_part(sums, pw, t == 0);
        add_part(sums + slots, pb, t == 0);
      }
      __syncthreads();
    }
    const int64_t c0 = p0 - warp * kRowsPerPart;  // the chunk's first row
    float* out = partial + c0 / kRowsPerChunk * sums_of(kSum) * C;
    // dweight | dbias from their slots into the partial's columns, 4 columns a thread: slot s is lane s % 32's pack
    // s / (32 Q), quarter s / 32 % Q.
    for (int i = threadIdx.x; i < 2 * slots; i += blockDim.x) {
      const int s = (int)(i % slots);
      const int c = (32 * (s / (32 * Q)) + s % 32) * P + 4 * (s / 32 % Q);
      if (c < C) *reinterpret_cast<float4*>(out + i / slots * C + c) = sums[i];
    }
    if constexpr (kSum) {  // the parts' dinp sums in the same order (the last barrier above made every warp's visible)
      const float* ws = reinterpret_cast<const float*>(wsums());
      for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const int k = c / (32 * P), l = c % (32 * P) / P, e = c % P;
        const int at = sum_slot<S>(k, e / 4, l) * 4 + e % 4;
        float t = ws[at];
        for (int w = 1; w < kParts && c0 + w * kRowsPerPart < N; w++) t += ws[w * sum_stripe_cols<S>(C) + at];
        out[2 * C + c] = t;
      }
    }
    __syncthreads();  // every thread's reads of the sums above before the next chunk writes them
  }
}

// grid: ceil(C / kCombineCols); block: kCombineCols columns x kCombineLanes chunk lanes. Chunk lane y sums chunks
// y, y + kCombineLanes, ... in order in double, and the lanes' sums are then added in order, lane 0 first: the
// CPU's order (cpu/layernorm.cpp). The kernel this replaces gave a column one thread, which walked all 1024 chunks
// of a 64k-row batch in 6 blocks at C 768: a few hundred waits on the L2 in a row, an estimated 0.05-0.1 ms a call
// at 25 calls a step (not measured on its own: the 2026-11-26 profile lists only each variant's 15 largest kernels).
// dinp_sum (or nullptr): the partials' third row (the one-pass kernel's kSum), added the same way.
__global__ void __launch_bounds__(kCombineCols * kCombineLanes)
    layernorm_backward_combine_kernel(float* __restrict__ dweight, float* __restrict__ dbias,
                                      float* __restrict__ dinp_sum, const float* __restrict__ partial,
                                      int64_t nchunks, int C) {
  // (3, kCombineLanes, kCombineCols): dweight | dbias | dinp_sum
  __shared__ double lanes[3 * kCombineLanes * kCombineCols];
  const int tx = threadIdx.x % kCombineCols, ty = threadIdx.x / kCombineCols;
  const int c = blockIdx.x * kCombineCols + tx;
  const int64_t stride = (int64_t)sums_of(dinp_sum != nullptr) * C;
  double w = 0.0, b = 0.0, r = 0.0;
  // kAhead of the lane's chunks at a time, all loaded before the first is added: left to itself ptxas kept about ten
  // loads on their way, so a lane's 64 chunks (GPT-2 at B 64) were some twenty waits on the L2 in a row. Past the
  // last chunk a lane adds +0.0, which changes no sum here (a sum from +0.0 is never -0.0): the same bits as adding
  // only the chunks there are, in the same order.
  constexpr int kAhead = 16;
  if (c < C)
    for (int64_t ch0 = ty; ch0 < nchunks; ch0 += kAhead * kCombineLanes) {
      float pw[kAhead], pb[kAhead], pr[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; u++) {
        const int64_t ch = ch0 + u * kCombineLanes;
        const bool in = ch < nchunks;
        const float* row = partial + (in ? ch : ch0) * stride;  // a chunk there is, so that every load may go
        const float vw = row[c], vb = row[C + c], vr = dinp_sum ? row[2 * C + c] : 0.f;
        pw[u] = in ? vw : 0.f;
        pb[u] = in ? vb : 0.f;
        pr[u] = in ? vr : 0.f;
      }
      compiler_fence();  // every load above before any add below (the compiler interleaved them)
#pragma unroll
      for (int u = 0; u < kAhead; u++) {
        w += pw[u];
        b += pb[u];
        r += pr[u];
      }
    }
  lanes[ty * kCombineCols + tx] = w;
  lanes[(kCombineLanes + ty) * kCombineCols + tx] = b;
  lanes[(2 * kCombineLanes + ty) * kCombineCols + tx] = r;
  __syncthreads();
  if (ty != 0 || c >= C) return;
  double tw = 0.0, tb = 0.0, tr = 0.0;
  for (int y = 0; y < kCombineLanes; y++) {
    tw += lanes[y * kCombineCols + tx];
    tb += lanes[(kCombineLanes + y) * kCombineCols + tx];
    tr += lanes[(2 * kCombineLanes + y) * kCombineCols + tx];
  }
  dweight[c] += (float)tw;
  dbias[c] += (float)tb;
  if (dinp_sum) dinp_sum[c] += (float)tr;
}

// The most dynamic shared memory the ring kernel of (S, K) may take on the current device: what lets
// kOnePassBlocks<S, K> of its blocks share an SM (smem_for_blocks, with room for the 4-byte static array), and no
// more than its widest rows need; 0 before sm_80 (no cp.async). bf16 at C 768: 79.5 KB of the 112.9 allowed on
// sm_90, 80.9 on sm_80; sm_86 and sm_89 (100 KB an SM) keep the register kernel there.
template <typename S, int K>
int64_t ring_cap(bool sum) {
  int device = 0, major = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 8) return 0;
  return std::min<int64_t>(smem_for_blocks(kOnePassBlocks<S, K>, 64), ring_bytes<S>(32 * K * Pack<S>::N, sum));
}

// The ring kernel with dinp's sums, the ring kernel, or the register kernel, by what fits. -> whether the partials
// hold dinp's sums (sum asked, 16-bit rows, the kSum ring's shared memory fits: bf16 at C 768 takes 103.5 KB of the
// 112.9 allowed on sm_90; sm_80's 80.9 leaves it to bias_backward).
template <typename S, int K>
bool launch_one_pass(S* dinp, float* partial, const S* dout, const S* inp, const S* weight, const float* mean,
                     const float* rstd, int64_t N, int C, int64_t nchunks, bool sum, Stream stream) {
  // One launch a form (the ring kernels' caps are their own: the same on every call, so that no call lowers one
  // under another's launch, another thread's or one a graph recorded). As many blocks as the SMs hold at once, each
  // taking every grid-th chunk.
  const unsigned grid = (unsigned)std::min<int64_t>(nchunks, (int64_t)sm_count() * kOnePassBlocks<S, K>);
  const auto ring = [&](auto* kernel, bool with_sum) {
    const int64_t bytes = ring_bytes<S>(C, with_sum), cap = ring_cap<S, K>(with_sum);
    if (bytes > cap) return false;
    FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cap));
    const size_t smem = (size_t)bytes;  // (one-line launches: the warp emulator rewrites them)
    kernel<<<grid, 32 * kParts, smem, stream>>>(dinp, partial, dout, inp, weight, mean, rstd, N, C);
    FASTGPT_CUDA_CHECK_LAUNCH();
    return true;
  };
  if constexpr (sizeof(S) == 2) {
    if (sum && ring(layernorm_backward_one_pass_kernel<S, K, true, true>, true)) return true;
  }
  if (ring(layernorm_backward_one_pass_kernel<S, K, true, false>, false)) return false;
  auto* kernel = layernorm_backward_one_pass_kernel<S, K, false, false>;
  kernel<<<grid, 32 * kParts, 0, stream>>>(dinp, partial, dout, inp, weight, mean, rstd, N, C);
  FASTGPT_CUDA_CHECK_LAUNCH();
  return false;
}
}  // namespace

template <typename S>
void layernorm_forward(S* out, float* mean, float* rstd, const S* inp, const S* weight, const S* bias, int64_t N,
                       int C, Stream stream) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (g_one_pass.load() && layernorm_row_fits<S>(C)) {
    const RowPack<S> io{{aligned16(out) && aligned16(inp) && aligned16(weight) && aligned16(bias)}};
    auto* kernel = layernorm_forward_one_pass_kernel<S>;  // one-line launch: the warp emulator rewrites it
    kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C, io);
  } else {
    auto* kernel = layernorm_forward_kernel<S>;
    kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  }
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename S>
bool layernorm_one_pass_fits(const S* dinp, const S* dout, const S* inp, const S* weight, int C) {
  return layernorm_row_fits<S>(C) && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight);
}

bool layernorm_one_pass() { return g_one_pass.load(); }
bool set_layernorm_one_pass(bool on) { return g_one_pass.exchange(on); }

template <typename S>
void layernorm_backward(S* dinp, float* dweight, float* dbias, const S* dout, const S* inp, const S* weight,
                        const float* mean, const float* rstd, int64_t N, int C, float* dinp_sum, Stream stream) {
  if (N <= 0 || C <= 0) return;
  const int64_t nchunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  const unsigned col_blocks = (unsigned)((C + kColThreads - 1) / kColThreads);
  const bool one_pass = g_one_pass.load() && layernorm_one_pass_fits(dinp, dout, inp, weight, C);
  // Scratch until the combine kernel has been queued: no sync. Room for dinp's sums only where a kernel may make
  // them (16-bit rows, one pass).
  const bool may_sum = dinp_sum && sizeof(S) == 2 && one_pass;
  Scratch scratch((size_t)nchunks * sums_of(may_sum) * C, stream);
  float* partial = scratch.ptr;
  bool summed = false;
  if (one_pass) {
    // Packs per lane, rounded up to a multiple of u: four instances per type, the same widths (256 to 1024
    // columns) for float, whose packs hold 4 values, as for the 16-bit types (8).
    constexpr int P = Pack<S>::N, u = 8 / P;
    const int k = ((C + 32 * P - 1) / (32 * P) + u - 1) / u;
    auto* launch = k == 1 ? launch_one_pass<S, u> : k == 2 ? launch_one_pass<S, 2 * u>
                 : k == 3 ? launch_one_pass<S, 3 * u> : launch_one_pass<S, 4 * u>;
    summed = launch(dinp, partial, dout, inp, weight, mean, rstd, N, C, nchunks, may_sum, stream);
  } else {
    const int64_t blocks = (N + kWarpsPerBlock - 1) / kWarpsPerBlock;
    auto* dinp_kernel = layernorm_backward_dinp_kernel<S>;
    dinp_kernel<<<(unsigned)blocks, kWarpsPerBlock * 32, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    FASTGPT_CUDA_CHECK_LAUNCH();
    const dim3 grid((unsigned)nchunks, col_blocks);
    auto* partial_kernel = layernorm_backward_partial_kernel<S>;
    partial_kernel<<<grid, kColThreads, 0, stream>>>(partial, dout, inp, mean, rstd, N, C);
    FASTGPT_CUDA_CHECK_LAUNCH();
  }
  const unsigned combine_blocks = (unsigned)((C + kCombineCols - 1) / kCombineCols);
  auto* combine = layernorm_backward_combine_kernel;
  float* sums = summed ? dinp_sum : nullptr;
  combine<<<combine_blocks, kCombineCols * kCombineLanes, 0, stream>>>(dweight, dbias, sums, partial, nchunks, C);
  FASTGPT_CUDA_CHECK_LAUNCH();
  // Elsewhere (fp32, whose fused model keeps the unfused one's bits; two passes; no room) the linear layer's own
  // column sums, once dinp is whole.
  if (dinp_sum && !summed) bias_backward(dinp_sum, (const S*)dinp, N, C, stream);
}

#define FASTGPT_INSTANTIATE(S)                                                                               \
  template void layernorm_forward<S>(S*, float*, float*, const S*, const S*, const S*, int64_t, int, Stream); \
  template void layernorm_backward<S>(S*, float*, float*, const S*, const S*, const S*, const float*,         \
                                      const float*, int64_t, int, float*, Stream);                            \
  template bool layernorm_one_pass_fits<S>(const S*, const S*, const S*, const S*, int);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
