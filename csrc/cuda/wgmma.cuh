// Hopper's warpgroup matrix multiply (wgmma, sm_90a) as the sm90 flash attention kernel uses it: 128 threads (a
// warpgroup) multiply a 64 x 16 A by a 16 x N B into 64 x N fp32 accumulators, asynchronously; B (and A, or A from
// registers) are read from shared memory through a matrix descriptor. Written from the PTX ISA ("Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate"):
// - Accumulators: warp w of the warpgroup holds rows 16w..16w+15, and its N / 2 registers per lane are the N / 8
//   tiles of mma.m16n8's accumulator one after the other (register 4t + e: rows g, g, g+8, g+8 and columns
//   8t + 2c, 8t + 2c + 1; g = lane / 4, c = lane % 4), so the mma.sync kernels' softmax code reads them unchanged.
// - An A operand in registers has mma.m16n8k16's A layout per warp (flash_attention.cuh's a_from_acc).
// - Shared-memory operands here are all in the 128-byte swizzled layout: rows of 128 bytes (64 elements), 16-byte
//   chunk j of row r stored at chunk j ^ (r % 8) of its row, every 8-row group (1024 bytes) 1024-byte aligned (the
//   swizzle is taken from address bits 7-9). K-major operands (Q, K: the reduction runs along a row) step 16 elements
//   along K by adding 32 bytes to the start address; the stride byte offset (SBO) is 1024, the distance between
//   8-row groups. An MN-major B (V: the reduction runs down the rows) reads 8 consecutive rows as the K of one core
//   block, SBO apart (1024), and the next 64 columns LBO bytes on.
// The PTX part is swapped for a host emulation by tests/warp_emu/run.sh (between the two "----" lines).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fastgpt::cuda::wgmma {

// The 64-bit shared-memory matrix descriptor: start address, leading and stride byte offsets (all in 16-byte units,
// 14 bits each, at bits 0, 16, 32), the 128-byte swizzle (mode 1 at bits 62-63); base offset 0 (aligned groups).
__host__ __device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFF) << 16 |
         (uint64_t)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}
// The descriptor of the operand `bytes` (a non-negative multiple of 16) on from the one d describes: d's start address
// field plus bytes / 16, one 32-bit add with the rest of d kept. desc() keeps an address's low 18 bits, and those of a
// CTA's shared memory (at most 227 KB past the 1 KB the system reserves) stay below 2^18, so the sum stays inside the
// field: the descriptor desc() gives of the address plus bytes. The flash kernels step through a tile by constant
// offsets: as desc(tile + offset), each wgmma's descriptor was its own chain (add, mask, shift, or, and a move: five
// uniform instructions before every wgmma of a step, in the issue sequence the other warpgroups wait on); as
// desc_add(base, offset) the base is worked out once a tile and each wgmma adds an immediate to it.
__host__ __device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t bytes) {
  return (d & ~0xFFFFFFFFull) | (uint32_t)((uint32_t)d + (bytes >> 4));
}

// x, which every lane of the warp holds alike (a warpgroup's or a warp's index), as a value ptxas knows to be so: lane
// 0's, broadcast (CUTLASS's canonical_warp_group_idx does the same). What is worked out from it then lives in
// uniform registers and runs on the uniform datapath, once a warp: a warpgroup's rows and buffers, wgmma descriptors,
// mbarrier addresses, branches. Worked out from threadIdx itself, ptxas keeps them per thread: in the seventh GPU
// run's ncu report the Hopper forward issued 1.45x the vector ALU instructions of cuDNN's and left the uniform
// datapath idle (0.1% against cuDNN's 1.7%), each wgmma's descriptor a chain of integer ops and an R2UR. All 32 lanes
// must call it together.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// ---- PTX (the emulator's begins here)

// (wgmma is an sm_90a instruction: the file that uses it is compiled for sm_90a only, see CMakeLists.txt; any other
// device pass gets a trap, and the dispatch never launches it there.)
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FASTGPT_SM90A_ASM(...) __trap()
#else
#define FASTGPT_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#endif

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Orders this thread's earlier register writes (accumulators, A fragments) before the wgmma that follow.
__device__ __forceinline__ void fence() { FASTGPT_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { FASTGPT_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Until at most N committed groups are pending: their accumulators may be read, their operands reused.
template <int N>
__device__ __forceinline__ void wait() {
  FASTGPT_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async, stores) becomes visible to wgmma's reads (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  FASTGPT_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins a register to this point: the compiler may neither read an accumulator before the wait_group that ends its
// wgmma (the asm that wrote it looks finished to the compiler) nor reuse an A fragment's register before it.
__device__ __forceinline__ void keep(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void keep(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
// A value the compiler must take as made here, each time: what is computed from it cannot be hoisted out of a loop
// (and kept live across it). No memory clobber: nothing else is ordered.
__device__ __forceinline__ void opaque(int& x) { asm volatile("" : "+r"(x)); }
// Ends ptxas's basic block here, with a branch on x: what comes before it in the source (x's arithmetic included)
// stays before it in the SASS, what comes after stays after (ptxas 13.0 moves no instruction across the branch;
// no rule makes it so, which is why a test reads the SASS). ptxas schedules a block's instructions freely around
// wgmma's issues and waits: it hoisted a wgmma.wait_group above independent arithmetic (waiting early is never
// wrong), which put the forwards' softmax of block j after the wait for P_{j-1} V_{j-1}, the product it was
// written to overlap (the SASS had none of the block's exponentials between the two waits), and hoisted O's
// rescale above the issue of S_j (which then waited for 32 multiplies). x is a sum of softmax sums or factors, never below -1 (a NaN compares false), so the
// trap is never reached. tests/test_flash_attention.py reads the order in the SASS.
__device__ __forceinline__ void settle(float x) {
  if (x < -1.f) __trap();
}

#define FASTGPT_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FASTGPT_WGMMA_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FASTGPT_WGMMA_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define FASTGPT_F8(d, i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define FASTGPT_F16(d) FASTGPT_F8(d, 0), FASTGPT_F8(d, 8)
#define FASTGPT_F32(d) FASTGPT_F16(d), FASTGPT_F8(d, 16), FASTGPT_F8(d, 24)
#define FASTGPT_F64(d) FASTGPT_F32(d), FASTGPT_F8(d, 32), FASTGPT_F8(d, 40), FASTGPT_F8(d, 48), FASTGPT_F8(d, 56)

// d (64 x N) = A B (+ d if accumulate): ss takes A (K-major) and B (K-major) from shared memory; rs takes A from
// registers (4 per lane) and an MN-major B (transposed: imm-trans-b 1); ss_amn (N = 32: the fused backward's dQ,
// flash_attention_bwd_sm90a.cu) an MN-major A (imm-trans-a 1) and a K-major B from shared memory; ss_mn (N = 64: the
// 128-query warp-specialised backward's dQ = dS K, flash_attention_bwd_ws_sm90a.cu) both MN-major. The scale-d
// predicate is set from `accumulate`; A and B are not negated or scaled.
template <typename E, int N>
struct Mma;

// One wgmma with both operands from descriptors (SS) or A from registers (RS), as inline PTX: N is the shape's n,
// DREGS/DOUT the accumulator list and its operands, the rest the operand numbers (after the N / 2 accumulators) and
// the transpose immediates. (nvcc's inline PTX takes no named operands, so the numbers are spelled out.)
#define FASTGPT_WGMMA_SS(N, T, DREGS, DOUT, A, B, ACC, TRANS)                                                     \
  FASTGPT_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC ", 0;\n"                                           \
                    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." T "." T " " DREGS ", %" A ", %" B            \
                    ", p, 1, 1, " TRANS ";\n}\n"                                                                  \
                    : DOUT(d)                                                                                     \
                    : "l"(a), "l"(b), "r"(accumulate))
#define FASTGPT_WGMMA_RS(N, T, DREGS, DOUT, A, B, ACC)                                                            \
  FASTGPT_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" ACC ", 0;\n"                                           \
                    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." T "." T " " DREGS ", " A ", %" B             \
                    ", p, 1, 1, 1;\n}\n"                                                                          \
                    : DOUT(d)                                                                                     \
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))

#define FASTGPT_WGMMA_DEFINE(E, T)                                                                                \
  template <>                                                                                                     \
  struct Mma<E, 64> {                                                                                             \
    static __device__ __forceinline__ void ss(float* d, uint64_t a, uint64_t b, int accumulate) {                 \
      FASTGPT_WGMMA_SS("64", T, FASTGPT_WGMMA_D32, FASTGPT_F32, "32", "33", "34", "0, 0");                        \
    }                                                                                                             \
    static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t b, int accumulate) {          \
      FASTGPT_WGMMA_RS("64", T, FASTGPT_WGMMA_D32, FASTGPT_F32, "{%32, %33, %34, %35}", "36", "37");              \
    }                                                                                                             \
    static __device__ __forceinline__ void ss_mn(float* d, uint64_t a, uint64_t b, int accumulate) {              \
      FASTGPT_WGMMA_SS("64", T, FASTGPT_WGMMA_D32, FASTGPT_F32, "32", "33", "34", "1, 1");                        \
    }                                                                                                             \
  };                                                                                                              \
  template <>                                                                                                     \
  struct Mma<E, 128> {                                                                                            \
    static __device__ __forceinline__ void ss(float* d, uint64_t a, uint64_t b, int accumulate) {                 \
      FASTGPT_WGMMA_SS("128", T, FASTGPT_WGMMA_D64, FASTGPT_F64, "64", "65", "66", "0, 0");                       \
    }                                                                                                             \
    static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t b, int accumulate) {          \
      FASTGPT_WGMMA_RS("128", T, FASTGPT_WGMMA_D64, FASTGPT_F64, "{%64, %65, %66, %67}", "68", "69");             \
    }                                                                                                             \
  };                                                                                                              \
  template <>                                                                                                     \
  struct Mma<E, 32> {                                                                                             \
    static __device__ __forceinline__ void ss_amn(float* d, uint64_t a, uint64_t b, int accumulate) {             \
      FASTGPT_WGMMA_SS("32", T, FASTGPT_WGMMA_D16, FASTGPT_F16, "16", "17", "18", "1, 0");                        \
    }                                                                                                             \
  };
FASTGPT_WGMMA_DEFINE(__nv_bfloat16, "bf16")
FASTGPT_WGMMA_DEFINE(__half, "f16")
#undef FASTGPT_WGMMA_DEFINE
#undef FASTGPT_WGMMA_SS
#undef FASTGPT_WGMMA_RS

// Two bf16/fp16 values stored into a tile that wgmma then reads (the fused backward's dS^T): an ordinary shared
// store (generic proxy), so a fence_proxy_async and a barrier must come between it and the wgmma.
__device__ __forceinline__ void st_shared_b32(void* p, uint32_t v) { *static_cast<uint32_t*>(p) = v; }
// Ordinary shared loads and stores, named so that the emulator can check their ordering (the backward's staged lse
// and delta, the warp-specialised backward's dQ parts and tile numbers, the K^T copy's reads of K): the hardware
// needs only the barriers between them.
__device__ __forceinline__ float ld_shared_f32(const float* p) { return *p; }
__device__ __forceinline__ uint32_t ld_shared_b32(const void* p) { return *static_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint16_t ld_shared_u16(const void* p) { return *static_cast<const uint16_t*>(p); }
__device__ __forceinline__ void st_shared_f32(float* p, float v) { *p = v; }
__device__ __forceinline__ float4 ld_shared_v4(const float4* p) { return *p; }
__device__ __forceinline__ void st_shared_v4(float4* p, float4 v) { *p = v; }

// A spin-wait's limit: one that outlasts 60 s (a whole kernel takes milliseconds) traps, so that a broken protocol
// ends as a launch error, not a hung process. stuck_since(t0) traps once the global timer is 60 s past t0.
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stuck_since(uint64_t t0) {
  if (globaltimer() - t0 > 60000000000ull) __trap();
}

// The fused backward's ordered dQ sums across CTAs (flash_attention_bwd_sm90a.cu), as CUTLASS's barrier.h: one
// thread waits until a counter in global memory reaches `want` (acquire: the sums released before are visible to
// the CTA after its next barrier), and one thread adds one to it after a barrier (release, cumulative: every
// thread's sums before that barrier go with it). The wait has the 60 s limit.
__device__ __forceinline__ void wait_count(const int* counter, int want) {
  const uint64_t t0 = globaltimer();
  for (;;) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    if (v == want) return;
    stuck_since(t0);
  }
}
__device__ __forceinline__ void add_count(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// The warp-specialised forward's synchronisation (flash_attention_ws_sm90a.cu), from the PTX ISA:
// - mbarrier: a 64-bit object in shared memory that completes a phase when `count` arrivals have come; a waiter
//   names the parity of the phase it waits for (the phases alternate 0, 1, 0, ...). Arrive releases and a
//   completed wait acquires, at CTA scope. The wait has the 60 s limit.
// - Named barriers 1-15 (0 is __syncthreads): bar_sync waits until `count` threads have arrived or synced on `id`,
//   bar_arrive counts this thread without waiting; count is a multiple of 32.
// - setmaxnreg: the warpgroup gives registers back (dec) or takes them (inc) from the CTA's pool, so that a
//   producer warpgroup that only copies can lend its share to the warpgroups that multiply.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  FASTGPT_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  FASTGPT_SM90A_ASM("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// mbar_arrive where `arrive` (one lane of a warp, say): a predicated arrive, where `if (arrive) mbar_arrive(bar)`
// was a divergent branch around it (the seventh GPU run's ncu: the forward's warps took 48x cuDNN's divergent branch
// targets, its per-warp arrivals on the empty barriers at each step among them). ptxas may still branch around it
// where the arrive ends a path (the forward's last P V of a tile).
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool arrive) {
  FASTGPT_SM90A_ASM("{\n.reg .pred p;\n.reg .b64 state;\nsetp.ne.b32 p, %1, 0;\n"
                    "@p mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar), "r"((uint32_t)arrive)
                    : "memory");
}
// `count` arrivals at once, by one thread (sm_90): its release covers only its own accesses, as any arrive's.
__device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t count) {
  FASTGPT_SM90A_ASM("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar), "r"(count)
                    : "memory");
}
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  FASTGPT_SM90A_ASM(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// kLimit false spins without the limit: in the warp-specialised backward's consumers, a reachable trap made ptxas
// hold their code to the launch's 168 registers, not setmaxnreg's (they spilled; the forward's were not held, for
// reasons unknown).
template <bool kLimit = true>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_test(bar, parity)) return;
  if constexpr (kLimit) {
    const uint64_t t0 = globaltimer();
    while (!mbar_test(bar, parity)) stuck_since(t0);
  } else {
    while (!mbar_test(bar, parity)) {
    }
  }
}
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_dec() {
  FASTGPT_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  FASTGPT_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- end of PTX

// keep() on every register of an accumulator or fragment array.
template <typename T, int N, int M>
__device__ __forceinline__ void keep(T (&a)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int j = 0; j < M; j++) keep(a[i][j]);
}

}  // namespace fastgpt::cuda::wgmma
