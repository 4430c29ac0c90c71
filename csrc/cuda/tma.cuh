// Hopper's tensor memory accelerator (TMA, sm_90a) as the warp-specialised flash attention kernels use it: one
// thread asks for a whole (rows, 64) box of 16-bit elements, and the copy engine moves it from global into shared
// memory in the 128-byte swizzled layout wgmma reads (flash_attention_sm90.cuh: 16-byte chunk j of row r at chunk
// j ^ (r % 8), from the address bits, as wgmma's), fills the rows past the tensor's end with zeros, and counts its
// bytes on an mbarrier that the consumers wait on ("complete_tx"). Why, over cp.async: no address arithmetic or
// issue slots in the copier (one instruction per box instead of 8 per thread per tile), its registers free for the
// consumers (setmaxnreg), and the data written by the async proxy that wgmma reads through (no fence.proxy.async).
// A map (a 128-byte CUtensorMap, encoded on the host by the driver's cuTensorMapEncodeTiled: tma.cu) describes a
// whole (B, H, T, d) tensor; the kernel names a box by its coordinates. The other way, the fused backward has the
// copy engine store or add its dQ parts to global memory (bulk copies, not tensor ones: the parts are contiguous), and
// the warp-specialised forward has it store O, box by box (tensor stores, which leave out the rows past T).
// Written from the PTX ISA (cp.async.bulk[.tensor], cp.reduce.async.bulk, mbarrier.expect_tx) and cuda.h's
// documentation of the encoder; the instructions are held to CUTLASS's where it has them (tests/warp_emu/cute_ptx.cu),
// and tests/warp_emu swaps the PTX part (and the encoder) for its own.
#pragma once
#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "cpu/kernels.h"
#include "cuda/wgmma.cuh"

namespace fastgpt::cuda::tma {

// A map of one (B, H, T, d) tensor of 16-bit elements for boxes of `rows` x 64 elements. The encoder documents its
// dimensions as nested by stride (each stride at least the extent of the dimension before), so T, H and B take the
// order of their strides; slot_t/h/b name the coordinate (1-3, after the column) that carries each.
struct HeadsMap {
  CUtensorMap map;
  int slot_t, slot_h, slot_b;
};

// ---- PTX (the emulator's begins here)

// cuTensorMapEncodeTiled for a rank-4 tensor of 16-bit elements (dims innermost first, strides in bytes of the
// outer three), boxes `box`, the 128-byte swizzle, zeros outside the tensor; throws with the driver's code (tma.cu).
void encode(CUtensorMap* map, const void* base, const uint64_t (&dims)[4], const uint64_t (&strides)[3],
            const uint32_t (&box)[4]);
// Tells compute-sanitizer's initcheck that the `bytes` at `base` are written by the tensor stores or bulk copies of a
// kernel on `stream` (tma.cu; NVTX's memory API, a no-op without a tool attached): marked after its launch, or before
// it where the kernel reads them back itself. initcheck does not count TMA stores as writes (the 2026-11-26 H200
// run's scripts/initcheck_tma.py probe), so it reported every later read of the forward's O as uninitialised; nor
// the bulk copies to global memory (store, reduce_add: the 2026-11-26 H100 run reported the fused
// backward's reads of its dQ sums). The range must be exactly what the stores cover: a wider one would hide real gaps
// from the tool. A tile the kernel failed to store inside that range is hidden from initcheck too: the warp emulator
// checks that the stores cover it. Not marked: a kernel captured into a graph (tma.cu), so a graph of torch's (its
// allocator's O, never zeroed) replayed under initcheck would still be reported.
void mark_stored(const void* base, size_t bytes, cudaStream_t stream);
// The same for `count` ranges of `bytes`, each `pitch` bytes after the one before (a range per head), in one mark.
void mark_stored(const void* base, size_t bytes, int64_t count, size_t pitch, cudaStream_t stream);

// Fetches the map into the tensor-map cache ahead of the first copy that uses it.
__device__ __forceinline__ void prefetch(const CUtensorMap* map) {
  FASTGPT_SM90A_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// This thread's arrival on the mbarrier at shared address `bar`, which from now on also waits for `bytes` more
// bytes of copies to land (the phase completes when both its arrivals and its bytes are in).
__device__ __forceinline__ void arrive_expect(uint32_t bar, uint32_t bytes) {
  FASTGPT_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Declares `bytes` more bytes of copies for the current phase of the mbarrier at `bar`, without arriving (the
// arrivals come from threads that also store into the buffer).
__device__ __forceinline__ void expect(uint32_t bar, uint32_t bytes) {
  FASTGPT_SM90A_ASM("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box at coordinates (c0, c1, c2, c3) of `map` into shared memory at `dst` (1024-byte aligned), its bytes
// counted on `bar`. The L2 hint is CUTLASS's default (evict normal).
__device__ __forceinline__ void load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                     int c3) {
  FASTGPT_SM90A_ASM(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "l"(0x1000000000000000ull)
      : "memory");
}

// `bytes` (a multiple of 16) of global memory at `src` (16-byte aligned) into shared memory at `dst` (16-byte
// aligned) as they are, counted on the mbarrier at `bar` (the caller declares them first: arrive_expect): the 128-query
// fused backward's last turn brings a finished dQ sum back into its part's buffer. A bulk copy, not a tensor one: the
// sum is contiguous. After an acquire of the sum (or the bulk group that wrote it), fence_global first.
__device__ __forceinline__ void load_bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  FASTGPT_SM90A_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                    ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                    : "memory");
}

// Bulk copies from shared to global memory (the fused backward's dQ sums, one per query step): `bytes` (a multiple of
// 16) at shared address `src` stored at `dst`, or added to the fp32 values there (the adds made in L2, each rounded to
// nearest even; the PTX ISA has this f32 add keep subnormals). The source must be behind its writers'
// fence.proxy.async (the copy engine reads it through the async proxy). No L2 hint: a sum is read by the next turn
// and then dead, and the sums of a whole backward (50 MB for GPT-2 at B 16) would crowd an "evict last" L2. Completion
// is by bulk group: commit() closes one, wait_read<N>() returns once all but the newest N groups have read their
// source (it may be overwritten), wait<N>() once they have also written (visible to this thread: the completion
// implies a proxy fence).
__device__ __forceinline__ void store(void* dst, uint32_t src, uint32_t bytes) {
  FASTGPT_SM90A_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
                    : "memory");
}
__device__ __forceinline__ void reduce_add(float* dst, uint32_t src, uint32_t bytes) {
  FASTGPT_SM90A_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                    "r"(bytes)
                    : "memory");
}
// The box at coordinates (c0, c1, c2, c3) of `map` from shared memory at `src` (1024-byte aligned, in the 128-byte
// swizzle, behind its writers' fence.proxy.async) to global memory; elements outside the tensor are not written (the
// forward's O rows past T). A tensor store, completed by bulk group as store's.
__device__ __forceinline__ void store_box(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  FASTGPT_SM90A_ASM("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                        reinterpret_cast<uint64_t>(map)),
                    "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                    : "memory");
}
__device__ __forceinline__ void commit() { FASTGPT_SM90A_ASM("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_read() {
  FASTGPT_SM90A_ASM("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  FASTGPT_SM90A_ASM("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy view of global memory (what an acquire just made visible: another CTA's sums)
// before its later async-proxy accesses (a bulk add to those sums), as the PTX memory model asks across proxies.
__device__ __forceinline__ void fence_global() { FASTGPT_SM90A_ASM("fence.proxy.async.global;\n" ::: "memory"); }

// ---- end of PTX

// The map of a (B, H, T, d) tensor (d 64 or 128) at `base` with element strides `s`, for boxes of `rows` rows;
// false where its strides do not nest (a view such as a head dimension of stride 0, which the encoder's documented
// layout cannot describe): the caller then takes a kernel without TMA. Size-1 dimensions go last (their stride is
// free), and the strides must be multiples of 16 bytes (the flash dispatch requires multiples of 8 elements).
// dense, where given: the bytes the tensor fills when its elements leave no gaps (some order of its dimensions is
// row-major), else 0: what mark_stored may be told a store of the whole tensor wrote.
inline bool make_heads_map(HeadsMap& m, const void* base, int B, int H, int T, int d, const cpu::HeadStrides& s,
                           int rows, size_t* dense = nullptr) {
  struct Dim {
    uint64_t n;
    int64_t stride;  // elements
    int* slot;
  } dims[3] = {{(uint64_t)T, s.st, &m.slot_t}, {(uint64_t)H, s.sh, &m.slot_h}, {(uint64_t)B, s.sb, &m.slot_b}};
  std::stable_sort(dims, dims + 3, [](const Dim& a, const Dim& b) {
    return (a.n == 1) != (b.n == 1) ? b.n == 1 : a.stride < b.stride;
  });
  uint64_t gdims[4] = {(uint64_t)d, 0, 0, 0}, strides[3];
  uint64_t extent = (uint64_t)d * 2;  // bytes spanned by the dimensions so far
  bool gapless = true;
  for (int i = 0; i < 3; i++) {
    const uint64_t stride = dims[i].n == 1 ? extent : (uint64_t)dims[i].stride * 2;
    if (dims[i].stride < 0 || stride < extent || stride % 16 || stride >= (1ull << 40)) return false;
    gapless = gapless && stride == extent;
    gdims[i + 1] = dims[i].n, strides[i] = stride, *dims[i].slot = i + 1;
    extent = stride * dims[i].n;
  }
  if (dense) *dense = gapless ? extent : 0;
  uint32_t box[4] = {64, 1, 1, 1};  // 64 columns, `rows` along T's slot, one head of one batch row
  box[m.slot_t] = (uint32_t)rows;
  encode(&m.map, base, gdims, strides, box);
  return true;
}

// The coordinate in slot 1-3 of `m` of rows from `row` of head (b, h).
__device__ __forceinline__ int coord(const HeadsMap& m, int slot, int row, int h, int b) {
  return slot == m.slot_t ? row : slot == m.slot_h ? h : b;
}

// A tile of ROWS x D (rows [row, row + ROWS) of head (b, h)) into the swizzled tile at shared address `dst`: one
// box per 64-column block, each block's rows ROWS * 128 bytes after the one before (the tile layout of
// flash_attention_sm90.cuh). Counts tile_bytes<ROWS, D> on `bar`; the caller declares them first (arrive_expect).
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const HeadsMap& m, uint32_t bar, int row, int h, int b) {
  const int c1 = coord(m, 1, row, h, b), c2 = coord(m, 2, row, h, b), c3 = coord(m, 3, row, h, b);
#pragma unroll
  for (int cb = 0; cb < D / 64; cb++) load(dst + cb * ROWS * 128, &m.map, bar, cb * 64, c1, c2, c3);
}

// The other way: the map's box of rows (rows [row, row + box) of head (b, h), D wide) from shared memory at `src`,
// whose 64-column blocks are `block_bytes` apart (a tile of block_bytes / 128 rows of which the box is a slice), to
// global memory by D / 64 tensor stores, rows past T left out; the caller commits the bulk group.
template <int D>
__device__ __forceinline__ void store_tile(uint32_t src, int block_bytes, const HeadsMap& m, int row, int h, int b) {
  const int c1 = coord(m, 1, row, h, b), c2 = coord(m, 2, row, h, b), c3 = coord(m, 3, row, h, b);
#pragma unroll
  for (int cb = 0; cb < D / 64; cb++) store_box(&m.map, src + cb * block_bytes, cb * 64, c1, c2, c3);
}

}  // namespace fastgpt::cuda::tma
