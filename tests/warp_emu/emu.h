// Host emulation of the CUDA features the flash kernels use: one fiber (a coroutine with its own stack) per CUDA
// thread, barriers for __syncthreads and for warp collectives (ldmatrix, mma, shfl), cp.async eager or lazy; for
// Hopper, wgmma, mbarriers (with TMA's transaction bytes), TMA tile copies and named barriers. Shared memory that wgmma
// reads, and the ordinary loads and stores made through wgmma.cuh's ld_shared_*/st_shared_*, are checked for races by
// vector clocks: every barrier (CTA-wide, named, mbarrier) carries what its arrivals had seen to those who wait on it,
// and a read or write of a 16-byte chunk that no chain of barriers orders after the last conflicting access (the
// chunk's last write; every load of it since) is an error, whichever order the threads happened to run in.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>
#include <sys/mman.h>
// The fibers' context switch: our own on x86-64, ucontext's elsewhere, with -DEMU_UCONTEXT (to run that path here),
// and where the compiler marks code for CET shadow stacks (which a `ret` into a fresh stack would fault).
#if defined(__x86_64__) && !defined(EMU_UCONTEXT) && !(defined(__CET__) && (__CET__ & 2))
#define EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
using std::max;
using std::min;

#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__

namespace emu {
inline int g_lazy_cp = 0;  // 0: cp.async copies at issue, 1: at wait_group (latest legal moment)
[[noreturn]] inline void die(const char* m) { fprintf(stderr, "EMU FATAL: %s\n", m); fflush(stderr); abort(); }
// ---- Fibers. A block's CUDA threads run on the calling OS thread, each on its own stack, one at a time: a thread
// runs until it waits (a barrier, a warp collective, an mbarrier or named barrier), then the next ready one runs, in
// the order they became ready. Until 2026-11-27 each CUDA thread was an OS thread: every warp collective then woke
// 32 of them on a machine of two cores, and the kernel's scheduling was most of the emulator's time. The race check
// never relied on the OS's interleaving (vector clocks), and a wait that nothing can end is found the moment no thread
// is ready, and reported with what each thread waits for.
constexpr int kMaxThreads = 1024;     // a block's
constexpr int kHost = kMaxThreads;    // the host's slot: code outside a kernel
constexpr size_t kStack = 1u << 20;   // a fiber's stack (reserved; kernels use ~6 KB), a guard page below
inline int g_fid = kHost;             // the running CUDA thread (its threadIdx.x), or kHost
// A variable with one instance per CUDA thread and one for the host: what `thread_local` was with OS threads.
// emu.h's per-thread state is declared with it and read through a macro of the old name (tl_clock, ...).
template <class T>
struct PerThread {
  std::unique_ptr<T[]> v{new T[kMaxThreads + 1]()};
  T& operator[](int i) { return v[i]; }
};
struct Fiber {
#if defined(EMU_ASM_SWITCH)
  void* sp = nullptr;  // its stack pointer while it does not run (ctx_switch saved its registers there)
#else
  ucontext_t uc;
#endif
  char* stack = nullptr;
  // While it waits, for the report of a deadlock: what for, and that barrier's arrivals and count.
  const char* what = nullptr;
  int id = -1;
  const int* arrived = nullptr;
  const int* count = nullptr;
};
inline Fiber g_fibers[kMaxThreads + 1];
#if defined(EMU_ASM_SWITCH)
// Saves the callee-saved registers and the SSE and x87 control words on this stack, stores the stack pointer in
// *from and goes on from the stack pointer `to` (saved there by an earlier switch, or prepared by ctx_start): the
// System V ABI lets a call change every other register. ucontext's swapcontext does the same and also a system call
// (the signal mask) each time, which would cost much of what the fibers save.
__attribute__((naked, noinline)) inline void ctx_jump(void** /*from: rdi*/, void* /*to: rsi*/) {
  asm("pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
      "subq $8, %rsp\n\tstmxcsr (%rsp)\n\tfnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\tfldcw 4(%rsp)\n\taddq $8, %rsp\n\t"
      "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\tret");
}
inline void ctx_switch(Fiber& from, Fiber& to) { ctx_jump(&from.sp, to.sp); }
// A fresh stack that the first switch to it enters at entry(), as if entry had been called (16-byte alignment).
inline void ctx_start(Fiber& f, void (*entry)()) {
  uint64_t* sp = reinterpret_cast<uint64_t*>(f.stack + kStack);  // page-aligned
  *--sp = 0;                                        // entry's return address: it never returns
  *--sp = (uint64_t)(uintptr_t)entry;               // where ctx_jump's ret goes
  for (int i = 0; i < 6; i++) *--sp = 0;            // rbp, rbx, r12-r15
  uint16_t cw;
  asm volatile("fnstcw %0" : "=m"(cw));
  *--sp = (uint64_t)__builtin_ia32_stmxcsr() | (uint64_t)cw << 32;  // this thread's rounding modes
  f.sp = sp;
}
#else
inline void ctx_switch(Fiber& from, Fiber& to) {
  if (swapcontext(&from.uc, &to.uc)) die("swapcontext");
}
inline void ctx_start(Fiber& f, void (*entry)()) {
  if (getcontext(&f.uc)) die("getcontext");
  f.uc.uc_stack.ss_sp = f.stack, f.uc.uc_stack.ss_size = kStack, f.uc.uc_link = nullptr;
  makecontext(&f.uc, entry, 0);
}
#endif
inline char* fiber_stack() {  // kStack bytes above one guard page: an overflow faults instead of writing elsewhere
  const size_t page = 4096;
  void* m = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED || mprotect(m, page, PROT_NONE)) die("a fiber's stack could not be mapped");
  return static_cast<char*>(m) + page;
}
// The ready threads, first come first run (each at most once: a ring of kMaxThreads); or, with EMU_SEED set in the
// environment, a ready thread picked at random each time (another interleaving for each seed: a protocol whose
// correctness depends on the order threads happen to run in fails under some seed).
inline int g_ready[kMaxThreads], g_ready_head = 0, g_ready_n = 0;
inline uint64_t g_sched_seed = [] {
  const char* s = getenv("EMU_SEED");
  return s && *s ? std::strtoull(s, nullptr, 10) : 0ull;
}();
inline uint64_t g_sched_state = g_sched_seed * 0x9E3779B97F4A7C15ull + 1;
inline int g_live = 0;                   // the running block's threads that have not exited
inline dim3 g_bid;                       // its blockIdx
inline void make_ready(int f) { g_ready[(g_ready_head + g_ready_n++) % kMaxThreads] = f; }
[[noreturn]] inline void deadlock() {
  fprintf(stderr, "EMU FATAL: deadlock: in block (%u, %u), %d threads wait, none can go on (a GPU may hang here):\n",
          g_bid.x, g_bid.y, g_live);
  auto same = [](const Fiber& a, const Fiber& b) {
    return b.what && a.what == b.what && a.id == b.id && a.arrived == b.arrived;
  };
  int shown = 0;
  for (int t = 0; t < kMaxThreads && shown < 8; t++) {
    const Fiber& f = g_fibers[t];
    if (!f.what) continue;
    int last = t;  // the run of threads from t on that wait for the same
    while (last + 1 < kMaxThreads && same(f, g_fibers[last + 1])) last++;
    fprintf(stderr, "  thread%s %d", last > t ? "s" : "", t);
    if (last > t) fprintf(stderr, "-%d", last);
    fprintf(stderr, " wait%s at %s", last > t ? "" : "s", f.what);
    if (f.id >= 0) fprintf(stderr, " %d", f.id);
    if (f.arrived) fprintf(stderr, " (%d of %d arrived)", *f.arrived, *f.count);
    fprintf(stderr, "\n");
    shown++;
    t = last;
  }
  fflush(stderr);
  abort();
}
// The running thread has put itself on a wait list, or exited: the next ready thread runs (the host once all have
// exited).
inline void switch_away() {
  const int from = g_fid;
  int to = kHost;
  if (g_ready_n) {
    if (g_sched_seed) {  // a random one of the ready to the head of the ring (xorshift64)
      g_sched_state ^= g_sched_state << 13, g_sched_state ^= g_sched_state >> 7, g_sched_state ^= g_sched_state << 17;
      std::swap(g_ready[g_ready_head], g_ready[(g_ready_head + g_sched_state % g_ready_n) % kMaxThreads]);
    }
    to = g_ready[g_ready_head];
    g_ready_head = (g_ready_head + 1) % kMaxThreads, g_ready_n--;
  } else if (g_live) {
    deadlock();
  }
  g_fid = to;
  ctx_switch(g_fibers[from], g_fibers[to]);
}
// Threads waiting for one event (a barrier's phase).
struct WaitList {
  std::vector<int> threads;
  void wait(const char* what, int id = -1, const int* arrived = nullptr, const int* count = nullptr) {
    Fiber& me = g_fibers[g_fid];
    me.what = what, me.id = id, me.arrived = arrived, me.count = count;
    threads.push_back(g_fid);
    switch_away();
    me.what = nullptr;
  }
  void wake_all() {
    for (int t : threads) make_ready(t);
    threads.clear();
  }
};
// std::barrier's arrive_and_wait for fibers: the n-th arrival releases the phase's waiters and goes on.
struct Barrier {
  int n, arrived = 0;
  WaitList waiting;
  explicit Barrier(int count) : n(count) {}
  void arrive_and_wait(const char* what) {
    if (++arrived < n) return waiting.wait(what, -1, &arrived, &n);
    arrived = 0;
    waiting.wake_all();
  }
};
inline const std::function<void(int)>* g_job = nullptr;
inline void fiber_main() {
  (*g_job)(g_fid);
  g_live--;
  switch_away();  // never comes back: the block's next run of this fiber starts afresh
  die("an exited fiber ran again");
}
// Runs f(0) .. f(n - 1), each as a fiber, and returns when all have exited.
inline void run_threads(int n, const std::function<void(int)>& f) {
  if (n < 1 || n > kMaxThreads || g_fid != kHost) die("run_threads: 1-1024 threads, from the host");
  g_job = &f, g_live = n;
  for (int t = 0; t < n; t++) {
    if (!g_fibers[t].stack) g_fibers[t].stack = fiber_stack();
#if defined(__SANITIZE_ADDRESS__)
    // An exited fiber never returned from its frames: AddressSanitizer's marks of them would stay on the stack.
    __asan_unpoison_memory_region(g_fibers[t].stack, kStack);
#endif
    ctx_start(g_fibers[t], fiber_main);
    make_ready(t);
  }
  switch_away();  // the host waits as the block's threads run; the last to exit comes back here
  g_fid = kHost;
}
struct Warp {
  Barrier bar{32};
  uint64_t slot[32][12];
  int op[32];
};
// The wgmma state of one warpgroup (128 threads): each thread's operation, seen by all during a collective.
struct WgOp {
  int n;              // N: 32, 64 or 128 columns
  bool rs;            // A from registers (an MN-major B), else both from shared memory (K-major; A MN-major if amn)
  bool amn;           // A MN-major from shared memory (ss_amn, ss_mn)
  bool bmn;           // B MN-major from shared memory (ss_mn)
  bool half;          // fp16 elements, else bf16
  float* d;           // this thread's n / 2 accumulators
  const uint32_t* a;  // this thread's A fragment (rs)
  uint64_t da, db;    // descriptors
  int accumulate;
  bool done;                    // multiplied at issue (eager mode)
  std::vector<uint32_t> reads;  // the shared 16-byte chunks it reads (the warpgroup's first thread's copy only)
};
struct WarpGroup {
  Barrier bar{128};
  const WgOp* ops[128];
};
// A vector clock: entry t counts the releases (barrier arrivals) of thread t that its holder has seen.
using Clock = std::vector<uint32_t>;
inline void join(Clock& into, const Clock& from) {
  for (size_t i = 0; i < into.size(); i++) into[i] = std::max(into[i], from[i]);
}
constexpr uint32_t kPending = 0xffffffffu;  // an access issued, not yet complete
// A chunk's last write (Block::wlast): the writing thread (-1: none yet) and its clock, packed in one word.
struct LastWrite {
  int tid;
  uint32_t clk;
};
inline uint64_t pack_write(int tid, uint32_t clk) { return (uint64_t)(uint32_t)tid << 32 | clk; }
inline LastWrite unpack_write(uint64_t v) { return {(int)(int32_t)(uint32_t)(v >> 32), (uint32_t)v}; }
// An mbarrier, or a named barrier (bar.sync / bar.arrive): `count` arrivals complete a phase, and what they had
// seen goes to those who wait for it (done[phase % 4]: a waiter reads its phase's before the fourth one after it).
// An mbarrier's phase also waits for its transaction bytes: those an arrival declares (expect_tx) less those copies
// have landed (complete_tx), which may come first (the count then goes below zero for a while).
struct Phases {
  int count = 0, arrived = 0;
  int64_t tx = 0;
  unsigned phase = 0;
  Clock seen, done[4];
  Clock seen_rc, done_rc[4];  // the same in racecheck's reading (tl_rc)
  WaitList waiting;           // for the pending phase
  void clear(int threads) {  // a fresh barrier: phase 0 pending, the ones "before" it complete and carrying nothing
    arrived = 0, phase = 0, tx = 0;
    seen.assign(threads, 0);
    seen_rc.assign(threads, 0);
    for (Clock& d : done) d.assign(threads, 0);
    for (Clock& d : done_rc) d.assign(threads, 0);
  }
  void complete_if_done() {
    if (arrived != count || tx != 0) return;
    done[phase % 4] = seen;
    done_rc[phase % 4] = seen_rc;
    std::fill(seen.begin(), seen.end(), 0);
    std::fill(seen_rc.begin(), seen_rc.end(), 0);
    arrived = 0;
    phase++;
    waiting.wake_all();
  }
  // Counts n arrivals with clock c (racecheck's reading: rc), declaring `expect`
  // transaction bytes; -> the phase they arrived in.
  unsigned arrive(const Clock& c, const Clock& rc, int64_t expect = 0, int n = 1) {
    const unsigned at = phase;
    join(seen, c);
    join(seen_rc, rc);
    tx += expect;
    arrived += n;
    if (arrived > count) die("mbarrier: an arrival past its count (its phase still waits for transaction bytes)");
    complete_if_done();
    return at;
  }
  // `bytes` of a copy landed (complete_tx), its writes as of clock c (rc).
  void complete_tx(const Clock& c, const Clock& rc, int64_t bytes) {
    join(seen, c);
    join(seen_rc, rc);
    tx -= bytes;
    complete_if_done();
  }
};
struct Block {
  Barrier bar;
  Warp warps[32];
  std::vector<std::unique_ptr<WarpGroup>> wgs;  // when the block is whole warpgroups
  std::vector<unsigned char> dirty;  // per shared byte: written by cp.async, not yet behind a fence.proxy.async
  // Per 16-byte chunk, for the race check: the thread of the last write and its clock when the write completed
  // (kPending before: a cp.async not yet waited for), packed in one word (pack_write), and per warpgroup the clock
  // of its first thread when its last wgmma read of the chunk retired (kPending while in flight; 0 none).
  std::vector<uint64_t> wlast;
  std::vector<int> rpend;
  std::vector<uint32_t> rclk;
  // Per 16-byte chunk, the ordinary loads that the race check follows (wgmma.cuh's ld_shared_*): each reading
  // thread with its clock at the load, until the next write.
  std::vector<std::vector<std::pair<int, uint32_t>>> reads;
  Clock sync_clock[2];  // __syncthreads: each thread's own entry, by barrier parity
  std::map<uint32_t, Phases> mbars;  // by shared offset
  Phases named[16];
  unsigned char* smem;
  size_t smem_bytes;
  std::map<int, std::vector<unsigned char>> statics;  // static __shared__ arrays, by source line
  explicit Block(int n) : bar(n) {}
};
// threadIdx: the running fiber's index (blockIdx: g_bid).
inline dim3 thread_idx() { return dim3((unsigned)g_fid, 0, 0); }
#define tl_tid (::emu::thread_idx())
inline dim3 g_grid, g_block;
inline dim3 g_grid_big_smem;  // the last launch's with over 48 KB of dynamic shared memory (a Hopper kernel's, not
                              // the small reductions that may follow it)
inline Block* g_blk = nullptr;  // the running block's (none on the host between launches)
inline unsigned char* smem() { return g_blk->smem; }
// A static `__shared__ T name[n];` (run.sh rewrites the declaration): one array per block, the first thread to
// reach it makes it, garbage-filled (NaN) as real shared memory is unset.
template <typename T>
T* static_smem(int line, size_t n) {
  auto& a = g_blk->statics[line];
  if (a.empty()) a.assign(n * sizeof(T), 0xff);
  return reinterpret_cast<T*>(a.data());
}
inline Warp& warp() { return g_blk->warps[tl_tid.x / 32]; }
inline int lane() { return tl_tid.x % 32; }
// collective: deposit, barrier, check same op, return; caller reads slots then calls done()
inline void deposit(int op) {
  Warp& w = warp();
  w.op[lane()] = op;
  w.bar.arrive_and_wait("a warp collective (shfl, ballot, ldmatrix, mma)");
  for (int i = 0; i < 32; i++)
    if (w.op[i] != op) die("warp lanes disagree on collective op (divergence)");
}
inline void done() { warp().bar.arrive_and_wait("the end of a warp collective"); }
inline PerThread<int> tl_phase_;  // __syncthreads passed by this thread in this block
#define tl_phase (::emu::tl_phase_[::emu::g_fid])
inline PerThread<Clock> tl_clock_;  // this thread's vector clock
#define tl_clock (::emu::tl_clock_[::emu::g_fid])
// The same clock in compute-sanitizer racecheck's reading of a barrier (g_racecheck_model; else the same as
// tl_clock): an mbarrier's phase, or a named barrier, orders before the waiters only the accesses of the threads that
// arrived on it (or issued the copies that completed it), not what those threads had themselves waited for. The PTX
// memory model's barriers are cumulative, so code correct under it can still be flagged by racecheck on a GPU: the
// H200 runs of 2026-11-26 flagged the ws backward's dQ readers, which had reached the consumers' stores only through
// thread wt 0's wait for them and then its arrival (on dq_sum) or the writers' named barrier. Racecheck sees ordinary
// shared loads and stores only, so only their checks against each other use it; the checks that involve wgmma's
// reads or async copies keep tl_clock (a store after a bulk copy's read is checked in tl_rc too: stricter than
// racecheck, which does not see that read). Each thread's own entry is the same in both clocks. (__syncthreads
// joins every thread's own entry: the same in both readings.)
inline bool g_racecheck_model = false;
inline PerThread<Clock> tl_rc_;
#define tl_rc (::emu::tl_rc_[::emu::g_fid])
// A release (a barrier arrival, a copy's completion): what this thread has seen so far goes with it (rc: under
// g_racecheck_model its own accesses alone); its later accesses count as after it.
struct Released {
  Clock c, rc;
};
inline Released release() {
  Released r{tl_clock, tl_rc};
  if (g_racecheck_model)
    for (size_t t = 0; t < r.rc.size(); t++)
      if (t != tl_tid.x) r.rc[t] = 0;
  tl_rc[tl_tid.x] = ++tl_clock[tl_tid.x];
  return r;
}
// A CTA-wide barrier joins everyone's clock; as no thread has seen more of thread t than t itself, each thread's own
// entry is enough (double-buffered by parity: a thread cannot reach the barrier after next before all have read).
inline void syncthreads() {
  Clock& slot = g_blk->sync_clock[tl_phase & 1];
  slot[tl_tid.x] = tl_clock[tl_tid.x];
  g_blk->bar.arrive_and_wait("__syncthreads");
  join(tl_clock, slot);
  join(tl_rc, slot);
  tl_rc[tl_tid.x] = ++tl_clock[tl_tid.x];
  tl_phase++;
}
inline float shfl_xor(unsigned mask, float v, int m) {
  if (mask != 0xffffffffu) die("mask");
  Warp& w = warp();
  float f = v;
  memcpy(&w.slot[lane()][0], &f, 4);
  deposit(1);
  float r;
  memcpy(&r, &w.slot[lane() ^ m][0], 4);
  done();
  return r;
}
template <typename T>  // __shfl_sync on a 4-byte value (float, or the embedding backward's token ids)
inline T shfl(unsigned mask, T v, int src) {
  static_assert(sizeof(T) == 4, "shfl: 4-byte values");
  if (mask != 0xffffffffu) die("mask");
  if (src < 0 || src > 31) die("shfl src");
  Warp& w = warp();
  memcpy(&w.slot[lane()][0], &v, 4);
  deposit(2);
  T r;
  memcpy(&r, &w.slot[src][0], 4);
  done();
  return r;
}
// __ballot_sync: bit i of the result is lane i's predicate, the same word in every lane.
inline unsigned ballot(unsigned mask, int pred) {
  if (mask != 0xffffffffu) die("mask");
  Warp& w = warp();
  w.slot[lane()][0] = pred != 0;
  deposit(8);
  unsigned r = 0;
  for (int i = 0; i < 32; i++) r |= unsigned(w.slot[i][0] != 0) << i;
  done();
  return r;
}
// __shfl_down_sync on any 4- or 8-byte value (the gradient norm's double partial sums): lanes past the warp's end
// read their own value, as on the GPU.
template <typename T>
inline T shfl_down(unsigned mask, T v, int delta) {
  static_assert(sizeof(T) <= 8, "shfl_down: at most 8 bytes");
  if (mask != 0xffffffffu) die("mask");
  Warp& w = warp();
  memcpy(&w.slot[lane()][0], &v, sizeof(T));
  deposit(7);
  T r;
  memcpy(&r, &w.slot[lane() + delta < 32 ? lane() + delta : lane()][0], sizeof(T));
  done();
  return r;
}
inline void check_smem(const void* p, size_t n) {
  const unsigned char* c = (const unsigned char*)p;
  if (c < g_blk->smem || c + n > g_blk->smem + g_blk->smem_bytes) die("shared memory access out of bounds");
}
inline void ldsm(uint32_t* r, const void* p, bool trans) {
  Warp& w = warp();
  if (((uintptr_t)p - (uintptr_t)g_blk->smem) % 16) die("ldmatrix row address not 16-byte aligned");
  check_smem(p, 16);
  w.slot[lane()][0] = (uint64_t)(uintptr_t)p;
  deposit(trans ? 4 : 3);
  const int g = lane() / 4, c = lane() % 4;
  for (int i = 0; i < 4; i++) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* row = (const uint16_t*)(uintptr_t)w.slot[8 * i + g][0];
      lo = row[2 * c], hi = row[2 * c + 1];
    } else {
      const uint16_t* r0 = (const uint16_t*)(uintptr_t)w.slot[8 * i + 2 * c][0];
      const uint16_t* r1 = (const uint16_t*)(uintptr_t)w.slot[8 * i + 2 * c + 1][0];
      lo = r0[g], hi = r1[g];
    }
    r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
  }
  done();
}
template <typename E>
inline float tof(uint16_t b) {
  E e;
  memcpy(&e, &b, 2);
  return float(e);
}
// How mma.sync adds: 0 (the default), the exact sum of the products and C rounded once to nearest (what the
// kernels' logic is checked with); 1, a model of the tensor cores' own adder (mode "tchw"): C and the products of
// each group of g_mma_group k's are aligned to the largest one's exponent, each cut (toward zero) to 24 +
// g_mma_neab bits below that exponent's leading bit, summed, and the sum cut toward zero to fp32; the next group
// adds to that. Published models of V100-H100 (Fasi et al. 2021, Khattak and Mikaitis 2025) have this shape, with
// a few extra alignment bits and groups of 4-16 products by format and generation; the mode runs several. Its point:
// each mma cuts toward zero, so a long chain of them into one accumulator drifts (a bias, not a random walk).
inline int g_mma_rz = 0, g_mma_group = 8, g_mma_neab = 3;
inline float mma_rz_sum(float c, const double* p, int n) {
  double all = c;  // NaN and infinities: as the exact sum (ilogb has no exponent for them)
  for (int k = 0; k < n; k++) all += p[k];
  if (!std::isfinite(all)) return (float)all;
  for (int k0 = 0; k0 < n; k0 += g_mma_group) {
    const int k1 = std::min(n, k0 + g_mma_group);
    int emax = INT_MIN;
    if (c != 0) emax = std::ilogb(c);
    for (int k = k0; k < k1; k++)
      if (p[k] != 0) emax = std::max(emax, std::ilogb(p[k]));
    if (emax == INT_MIN) continue;  // all zeros: c stays (its sign too)
    const int qexp = emax - 23 - g_mma_neab;  // the weight of the last bit kept
    double s = std::trunc(std::ldexp((double)c, -qexp));
    for (int k = k0; k < k1; k++) s += std::trunc(std::ldexp(p[k], -qexp));  // integers below 2^32: exact
    const double sum = std::ldexp(s, qexp);
    float f = (float)sum;
    if (std::fabs((double)f) > std::fabs(sum)) f = std::nextafter(f, 0.f);
    c = f;
  }
  return c;
}
// One mma.sync m16n8kK as a warp collective (op names it for the divergence check): every lane deposits its A
// (4 registers), B (2) and C (4), then computes its 4 accumulators from everyone's, A(row, k) and Bm(k, n) reading
// the deposited registers (w.slot[lane][0-3] A, [4-5] B) by the instruction's fragment table; products in double
// (exact for 16-bit and TF32 operands), added to C once (or by mma_rz_sum's model).
template <int K, class FA, class FB>
inline void mma_collective(int op, float* d, const uint32_t* a, const uint32_t* b, FA A, FB Bm) {
  Warp& w = warp();
  uint64_t* s = w.slot[lane()];
  for (int i = 0; i < 4; i++) s[i] = a[i];
  for (int i = 0; i < 2; i++) s[4 + i] = b[i];
  for (int i = 0; i < 4; i++) memcpy(&s[6 + i], &d[i], 4);
  deposit(op);
  const int g = lane() / 4, c = lane() % 4;
  float out[4];
  for (int i = 0; i < 4; i++) {
    const int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
    double p[K], acc = 0;
    for (int k = 0; k < K; k++) acc += p[k] = (double)A(w, row, k) * Bm(w, k, col);
    float cin;
    memcpy(&cin, &w.slot[lane()][6 + i], 4);
    out[i] = g_mma_rz ? mma_rz_sum(cin, p, K) : (float)(cin + acc);
  }
  done();
  for (int i = 0; i < 4; i++) d[i] = out[i];
}
// m16n8k16 on 16-bit E: A (16 x 16) and B (16 x 8) registers hold two elements each, the lower column (row) low.
template <typename E>
inline void mma_emu(float* d, const uint32_t* a, const uint32_t* b) {
  auto half = [](uint32_t v, int k) { return tof<E>((k % 2) ? v >> 16 : v & 0xffff); };
  mma_collective<16>(std::is_same<E, __half>::value ? 5 : 6, d, a, b,
                     [&](Warp& w, int r, int k) {
                       return half((uint32_t)w.slot[4 * (r % 8) + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k);
                     },
                     [&](Warp& w, int k, int n) {
                       return half((uint32_t)w.slot[4 * n + (k % 8) / 2][4 + (k >= 8)], k);
                     });
}
inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// cvt.rna.tf32.f32: to nearest with ties away from zero at 10 mantissa bits (add half of the dropped range to the
// magnitude, then truncate); NaN becomes the canonical NaN, infinities stay.
inline uint32_t tf32_round(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x7fffffu) ? 0x7fffffffu : u;
  return (u + 0x1000u) & 0xffffe000u;
}
// mma.sync.m16n8k8 .tf32 (PTX ISA fragment tables): A (16 x 8) a0 (g, c), a1 (g + 8, c), a2 (g, c + 4),
// a3 (g + 8, c + 4); B (8 x 8) b0 (k c, n g), b1 (k c + 4, n g); C as m16n8k16's. An operand that is not a TF32
// pattern (low 13 bits set) is an error: the kernels must round with cvt.rna first (the hardware's use of the
// dropped bits is unspecified).
inline void mma_tf32_emu(float* d, const uint32_t* a, const uint32_t* b) {
  auto val = [](uint64_t v) {
    const uint32_t u = (uint32_t)v;
    if ((u & 0x1fffu) && u != 0x7fffffffu) die("mma tf32 operand is not rounded to TF32 (cvt.rna.tf32.f32)");
    return bits_float(u);
  };
  mma_collective<8>(
      8, d, a, b, [&](Warp& w, int r, int k) { return val(w.slot[4 * (r % 8) + k % 4][(r >= 8) + 2 * (k >= 4)]); },
      [&](Warp& w, int k, int n) { return val(w.slot[4 * n + k % 4][4 + (k >= 4)]); });
}
struct Copy {
  void* dst;
  const void* src;
  bool valid;
  bool landed;  // copied at issue (eager mode); complete, for the race check, only at its wait_group
};
inline PerThread<std::vector<Copy>> tl_cur_;
#define tl_cur (::emu::tl_cur_[::emu::g_fid])
inline PerThread<std::vector<std::vector<Copy>>> tl_groups_;
#define tl_groups (::emu::tl_groups_[::emu::g_fid])
// (shared offset, bytes) this thread's finished copies and tile stores wrote, not yet behind its fence.proxy.async
inline PerThread<std::vector<std::pair<size_t, int>>> tl_unfenced_;
#define tl_unfenced (::emu::tl_unfenced_[::emu::g_fid])
// n bytes at shared offset off were written through the generic proxy (a finished cp.async, a store): wgmma may
// not read them before this thread's fence.proxy.async.
inline void mark_unfenced(size_t off, int n) {
  memset(&g_blk->dirty[off], 1, n);
  tl_unfenced.push_back({off, n});
}
// A race on 16-byte chunk `chunk` of shared memory, found by thread tl_tid of block g_bid; `other` the thread of
// the access it conflicts with.
[[noreturn]] inline void race(const char* what, const char* how, size_t chunk, int other) {
  fprintf(stderr, "EMU FATAL: race: %s %s (block %u, thread %u, shared bytes %zu-%zu, other thread %d)\n", what, how,
          g_bid.x + g_bid.y * g_grid.x, tl_tid.x, chunk * 16, chunk * 16 + 15, other);
  fflush(stderr);
  abort();
}
// A write (cp.async or store, named by `what`) of a 16-byte chunk that another warpgroup's wgmma read is a race
// unless the writer has seen, through barriers, that read retire. The write is recorded for wg_mma's check:
// pending (a cp.async) until its wait_group, complete at once (a store). ordinary: an st.shared (its check against
// earlier loads in racecheck's reading, tl_rc).
inline void note_write(size_t off, const char* what, bool pending, bool ordinary = false) {
  Block& b = *g_blk;
  const size_t chunk = off / 16;
  const int wg = tl_tid.x / 128;
  for (int g = 0; g < (int)b.wgs.size(); g++) {  // the warpgroups (none where the block is not whole ones)
    if (g == wg) continue;  // the writer's own warpgroup retired its reads in program order (wgmma.wait_group)
    const size_t i = chunk * 8 + g;
    if (b.rpend[i]) race(what, "writes shared memory that another warpgroup's wgmma is still reading", chunk, g * 128);
    if (b.rclk[i] > tl_clock[g * 128])
      race(what, "writes shared memory that another warpgroup's wgmma read, with no barrier after that read", chunk,
           g * 128);
  }
  const Clock& seen = ordinary ? tl_rc : tl_clock;  // an ordinary store after ordinary loads: racecheck's reading
  for (auto [t, clk] : b.reads[chunk])
    if (t != (int)tl_tid.x && clk > seen[t])
      race(what, "writes shared memory another thread read, with no barrier after that read", chunk, t);
  b.reads[chunk].clear();
  b.wlast[chunk] = pack_write(tl_tid.x, pending ? kPending : tl_clock[tl_tid.x]);
}
// An ordinary load of a 16-byte chunk: the last write to it must be complete and seen through barriers; the load
// is recorded for note_write's check of the next write (pending: a bulk copy's read, which any write is a race with
// until the issuing thread's wait_group.read refreshes it). ordinary: an ld.shared (checked in racecheck's reading,
// tl_rc).
inline void note_read(size_t off, const char* what, bool pending = false, bool ordinary = false) {
  Block& b = *g_blk;
  const size_t chunk = off / 16;
  const auto [wt, wclk] = unpack_write(b.wlast[chunk]);
  if (wt >= 0 && wclk == kPending)
    race(what, "reads shared memory whose cp.async has not been waited for", chunk, wt);
  if (wt >= 0 && wt != (int)tl_tid.x && (ordinary ? tl_rc : tl_clock)[wt] < wclk)
    race(what, "reads shared memory another thread wrote, with no barrier after that write", chunk, wt);
  const uint32_t now = pending ? kPending : tl_clock[tl_tid.x];
  for (auto& [t, clk] : b.reads[chunk])
    if (t == (int)tl_tid.x) {
      clk = now;
      return;
    }
  b.reads[chunk].push_back({(int)tl_tid.x, now});
}
inline void do_copy(Copy& c) {
  if (c.valid)
    memcpy(c.dst, c.src, 16);
  else
    memset(c.dst, 0, 16);
  c.landed = true;
  mark_unfenced((unsigned char*)c.dst - g_blk->smem, 16);
}
// A cp.async's wait_group: its write is complete (as of this thread's clock now), its data in place.
inline void retire_copy(Copy& c) {
  if (!c.landed) do_copy(c);
  const size_t chunk = ((unsigned char*)c.dst - g_blk->smem) / 16;
  // Completed only if it is still this thread's pending write (a later write by another thread stays).
  uint64_t& last = g_blk->wlast[chunk];
  if (last == pack_write(tl_tid.x, kPending)) last = pack_write(tl_tid.x, tl_clock[tl_tid.x]);
}
// fence.proxy.async: this thread's finished copies become visible to wgmma (the async proxy).
inline void proxy_fence() {
  for (auto [off, n] : tl_unfenced) memset(&g_blk->dirty[off], 0, n);
  tl_unfenced.clear();
}
inline void cp16(void* dst, const void* src, bool valid) {
  if (((uintptr_t)dst - (uintptr_t)g_blk->smem) % 16) die("cp.async dst not 16-byte aligned");
  if (valid && ((uintptr_t)src % 16)) die("cp.async src not 16-byte aligned");
  check_smem(dst, 16);
  note_write((unsigned char*)dst - g_blk->smem, "cp.async", true);
  Copy c{dst, src, valid, false};
  if (!g_lazy_cp) do_copy(c);
  tl_cur.push_back(c);
}
inline void commit() {
  tl_groups.push_back(tl_cur);
  tl_cur.clear();
}
inline void wait_group(int n) {
  while ((int)tl_groups.size() > n) {
    for (auto& c : tl_groups.front()) retire_copy(c);
    tl_groups.erase(tl_groups.begin());
  }
}
// ---- wgmma (csrc/cuda/wgmma.cuh), from the PTX ISA: a warpgroup collective. Eager mode multiplies at issue; lazy
// mode at the wait_group that retires it (the latest legal moment), reading registers and shared memory then, so
// that a kernel that touches an operand or an accumulator before its wait reads the wrong values.
inline uint32_t shared_offset(const void* p) {
  const unsigned char* c = (const unsigned char*)p;
  if (c < g_blk->smem || c > g_blk->smem + g_blk->smem_bytes) die("shared address of a non-shared pointer");
  return (uint32_t)(c - g_blk->smem);
}
inline PerThread<bool> tl_wg_fenced_;  // a wgmma.fence since the last wait_group (or the start)
#define tl_wg_fenced (::emu::tl_wg_fenced_[::emu::g_fid])
inline PerThread<std::vector<WgOp>> tl_wg_cur_;
#define tl_wg_cur (::emu::tl_wg_cur_[::emu::g_fid])
inline PerThread<std::vector<std::vector<WgOp>>> tl_wg_groups_;
#define tl_wg_groups (::emu::tl_wg_groups_[::emu::g_fid])
inline WarpGroup& warpgroup() {
  if (g_blk->wgs.empty()) die("wgmma in a block that is not whole warpgroups");
  return *g_blk->wgs[tl_tid.x / 128];
}
// One element of a 128-byte swizzled operand at (unswizzled) shared address addr: the swizzle XORs address bits 4-6
// (the 16-byte chunk in a 128-byte row) with bits 7-9 (the row in an 8-row group).
inline uint32_t wg_swizzle(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }
inline float wg_load(uint32_t addr, bool half) {
  const uint32_t at = wg_swizzle(addr);
  if (at % 2 || at + 2 > g_blk->smem_bytes) die("wgmma reads outside shared memory");
  if (g_blk->dirty[at])
    die("wgmma reads shared memory written by cp.async or a store without a fence.proxy.async after it");
  uint16_t b;
  memcpy(&b, g_blk->smem + at, 2);
  return half ? tof<__half>(b) : tof<__nv_bfloat16>(b);
}
// The (unswizzled) shared address of element (mn, k), k < 16, of the 16-bit operand a descriptor describes: K-major
// (k runs along a 128-byte row; 8-row groups SBO apart) or MN-major (mn runs along rows, 64 per row block, blocks LBO
// apart; k down 8 rows, then SBO on). cute_check.cpp holds this and the two register maps below to CUTLASS's.
inline uint32_t wg_operand_addr(uint64_t desc, int mn, int k, bool mn_major) {
  const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFF) << 4,
                 sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
  if ((desc >> 62) != 1) die("emulated wgmma reads only 128-byte swizzled operands (descriptor mode 1)");
  if ((desc >> 49) & 7) die("emulated wgmma: descriptor base offset must be 0");
  // Bits no field owns (14-15, 30-31, 46-48, 52-61): a start address summed past its 14 bits (wgmma::desc_add)
  // carries into bit 14, which would otherwise go unseen (a K-major operand's LBO is not read above).
  constexpr uint64_t kReserved = 0x3ull << 14 | 0x3ull << 30 | 0x7ull << 46 | 0x3FFull << 52;
  if (desc & kReserved) die("emulated wgmma: a descriptor sets bits no field owns (a start address overflowed?)");
  if (!mn_major) return start + (mn % 8) * 128 + (mn / 8) * sbo + k * 2;
  return start + (mn % 64) * 2 + (mn / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo;
}
inline float wg_operand(uint64_t desc, int mn, int k, bool mn_major, bool half) {
  return wg_load(wg_operand_addr(desc, mn, k, mn_major), half);
}
// Accumulator i of thread t (0-127) of a warpgroup: row and column of the 64 x N product (mma.m16n8's C layout per
// warp, N / 8 tiles of 4 one after the other).
inline void wg_acc_coord(int t, int i, int& row, int& col) {
  row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * (t % 4) + (i & 1);
}
// Where element (row, k) of a 64 x 16 A from registers lives: thread (0-127), register (0-3), upper half or not
// (mma.m16n8k16's A layout per warp).
inline void wg_a_home(int row, int k, int& thread, int& reg, bool& upper) {
  const int r = row % 16;
  thread = 32 * (row / 16) + 4 * (r % 8) + (k % 8) / 2, reg = (r >= 8) + 2 * (k >= 8), upper = k % 2;
}
inline void wg_exec(const WgOp& op) {
  WarpGroup& w = warpgroup();
  const int lt = tl_tid.x % 128;
  w.ops[lt] = &op;
  w.bar.arrive_and_wait("a wgmma");  // every thread's registers as they are now
  auto A = [&](int row, int k) {
    if (!op.rs) return wg_operand(op.da, row, k, op.amn, op.half);
    int t, reg;
    bool upper;
    wg_a_home(row, k, t, reg, upper);
    const uint32_t v = w.ops[t]->a[reg];
    const uint16_t b = upper ? v >> 16 : v & 0xffff;
    return op.half ? tof<__half>(b) : tof<__nv_bfloat16>(b);
  };
  float out[64];
  for (int i = 0; i < op.n / 2; i++) {
    int row, col;
    wg_acc_coord(lt, i, row, col);
    double acc = 0;
    for (int k = 0; k < 16; k++) acc += (double)A(row, k) * wg_operand(op.db, col, k, op.rs || op.bmn, op.half);
    out[i] = (float)((op.accumulate ? op.d[i] : 0.f) + acc);
  }
  w.bar.arrive_and_wait("the end of a wgmma");  // all reads done before any accumulator changes
  for (int i = 0; i < op.n / 2; i++) op.d[i] = out[i];
}
// The 16-byte chunks of a shared operand (rows x 16 elements), in an order that puts a chunk's 8 elements together.
inline void operand_chunks(std::vector<uint32_t>& out, uint64_t desc, int rows, bool mn_major) {
  for (int i = 0; i < rows * 16; i++) {
    const int mn = mn_major ? i % rows : i / 16, k = mn_major ? i / rows : i % 16;
    const uint32_t chunk = wg_swizzle(wg_operand_addr(desc, mn, k, mn_major)) / 16;
    if (out.empty() || out.back() != chunk) out.push_back(chunk);
  }
}
inline void wg_mma(int n, bool rs, bool half, float* d, const uint32_t* a, uint64_t da, uint64_t db, int accumulate,
                   bool amn = false, bool bmn = false) {
  if (!tl_wg_fenced) die("wgmma.mma_async without a wgmma.fence after the last wait_group");
  WarpGroup& w = warpgroup();
  Block& b = *g_blk;
  WgOp op{n, rs, amn, bmn, half, d, a, da, db, accumulate, false, {}};
  const int lt = tl_tid.x % 128, wg = tl_tid.x / 128;
  if (lt == 0) {
    if (!rs) operand_chunks(op.reads, da, 64, amn);
    operand_chunks(op.reads, db, n, rs || bmn);
  }
  w.ops[lt] = &op;
  w.bar.arrive_and_wait("a wgmma issue");
  const WgOp& o = *w.ops[0];
  if (o.n != n || o.rs != rs || o.amn != amn || o.bmn != bmn || o.half != half || o.da != da || o.db != db ||
      (o.accumulate != 0) != (accumulate != 0))
    die("wgmma: the warpgroup's threads disagree on the instruction, its descriptors or scale-d");
  // Every thread issues the product: each must have seen every write of what it reads complete.
  for (uint32_t chunk : o.reads) {
    const auto [wt, wclk] = unpack_write(b.wlast[chunk]);
    if (wt < 0) continue;
    if (wclk == kPending)
      race("wgmma", "reads shared memory whose cp.async has not been waited for", chunk, wt);
    if (wt != (int)tl_tid.x && tl_clock[wt] < wclk)
      race("wgmma", "reads shared memory another thread wrote, with no barrier after that write", chunk, wt);
  }
  w.bar.arrive_and_wait("the end of a wgmma issue");
  if (lt == 0)
    for (uint32_t chunk : op.reads) b.rpend[chunk * 8 + wg]++;
  if (!g_lazy_cp) {
    wg_exec(op);
    op.done = true;
  }
  tl_wg_cur.push_back(std::move(op));
}
inline void wg_fence() { tl_wg_fenced = true; }
inline void wg_commit() {
  tl_wg_groups.push_back(std::move(tl_wg_cur));
  tl_wg_cur.clear();
}
// Retiring a group: its products are made (lazy mode) and its reads complete as of this thread's clock now (the
// warpgroup's first thread stands for the warpgroup: a wgmma is one operation of all 128).
inline void wg_wait(int n) {
  Block& b = *g_blk;
  const int wg = tl_tid.x / 128;
  while ((int)tl_wg_groups.size() > n) {
    for (WgOp& op : tl_wg_groups.front()) {
      if (!op.done) wg_exec(op);
      for (uint32_t chunk : op.reads) b.rpend[chunk * 8 + wg]--, b.rclk[chunk * 8 + wg] = tl_clock[tl_tid.x];
    }
    tl_wg_groups.erase(tl_wg_groups.begin());
  }
  tl_wg_fenced = false;
}

// atomicAdd: one CUDA thread runs at a time (fibers, blocks in turn), so a plain add is already atomic.
inline void atomic_add(float* p, float v) { *p += v; }
inline int atomic_add(int* p, int v) {  // the old value
  const int old = *p;
  *p += v;
  return old;
}

// Ordinary shared loads and stores the race check follows (wgmma.cuh's ld_shared_* / st_shared_*, st_shared_b32).
// A store into a tile wgmma reads (the fused backward's dS^T), like a cp.async write, needs this thread's
// fence.proxy.async and then a barrier before another warpgroup's wgmma may read it.
template <typename T>
inline T ld_shared(const T* p, const char* what) {
  const size_t off = (const unsigned char*)p - g_blk->smem;
  if (off % sizeof(T)) die("ld.shared not aligned to its size");
  check_smem(p, sizeof(T));
  note_read(off, what, false, true);
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline void st_shared(T* p, T v, const char* what) {
  const size_t off = (unsigned char*)p - g_blk->smem;
  if (off % sizeof(T)) die("st.shared not aligned to its size");
  check_smem(p, sizeof(T));
  note_write(off, what, false, true);
  memcpy(p, &v, sizeof(T));
  mark_unfenced(off, sizeof(T));
}
inline void st_shared_b32(void* p, uint32_t v) { st_shared(static_cast<uint32_t*>(p), v, "a store"); }
// ---- mbarriers and named barriers (wgmma.cuh's, for the warp-specialised kernels). A wait that cannot end is a
// deadlock on the GPU too; here it is an error as soon as no thread is ready (deadlock()).
// Waits until phase `at` of `b` has completed, and takes what it carries.
inline void wait_phase(Phases& b, unsigned at, const char* what, int id) {
  while (b.phase == at) b.waiting.wait(what, id, &b.arrived, &b.count);
  join(tl_clock, b.done[at % 4]);
  join(tl_rc, b.done_rc[at % 4]);
}
inline Phases& mbar_at(uint32_t off) {
  auto it = g_blk->mbars.find(off);
  if (it == g_blk->mbars.end()) die("mbarrier used before mbarrier.init");
  return it->second;
}
inline void mbar_init(uint32_t off, int count) {
  if (off % 8 || off + 8 > g_blk->smem_bytes) die("mbarrier.init: not an 8-byte aligned shared address");
  if (count < 1) die("mbarrier.init: count must be positive");
  Phases& m = g_blk->mbars[off];
  m.clear((int)tl_clock.size());
  m.count = count;
}
// mbarrier.arrive, or with expect > 0 mbarrier.arrive.expect_tx (tma.cuh's arrive_expect); n arrivals at once with
// the count operand (wgmma.cuh's mbar_arrive(bar, count)): more than the phase still waits for is an error.
inline void mbar_arrive(uint32_t off, uint32_t expect = 0, int n = 1) {
  const Released r = release();
  mbar_at(off).arrive(r.c, r.rc, expect, n);
}
// mbarrier.expect_tx (tma.cuh's expect): more transaction bytes for the current phase, no arrival.
inline void mbar_expect(uint32_t off, uint32_t bytes) {
  Phases& m = mbar_at(off);
  m.tx += bytes;
  m.complete_if_done();
}
// try_wait.parity: until the phase of that parity has completed. A thread waits for the current phase, or for the
// one before if it has already completed (then at once): a phase two back would wait for the next one, as on the GPU.
// A thread with cp.async copies not yet waited for may not wait on an mbarrier: those copies can be published only
// after this wait, i.e. after the consumers' progress that the barrier stands for, so a copier that does this
// couples each tile's publication to the hand-back of another buffer (legal, but a bubble in every step: the
// warp-specialised kernels' copiers publish every tile before they wait again).
inline void mbar_wait(uint32_t off, uint32_t parity) {
  if (!tl_groups.empty() || !tl_cur.empty())
    die("mbarrier wait with cp.async copies in flight: their publication would wait for this barrier");
  Phases& m = mbar_at(off);
  const unsigned at = (m.phase & 1) == (parity & 1) ? m.phase : m.phase - 1;
  wait_phase(m, at, "the mbarrier at shared byte", (int)off);
}
// ---- TMA (csrc/cuda/tma.cuh), from the PTX ISA (cp.async.bulk.tensor) and cuda.h's cuTensorMapEncodeTiled. A map
// keeps the tensor's base, dims, strides and box in the opaque CUtensorMap (this emulator's own encoding); encoding
// checks the requirements cuda.h documents for what tma.cuh asks (rank 4, 2-byte elements, the 128-byte swizzle, no
// interleave). A copy is made at issue by the issuing thread: every element of the box, zeros outside the tensor,
// into shared memory in the box's row-major order with the 128-byte swizzle (wgmma's: address bits 4-6 ^= 7-9),
// written through the async proxy (no fence.proxy.async before wgmma), then its bytes complete on the mbarrier with
// the issuing thread's clock, so the race check sees the writes ordered before whoever waits for that phase.
constexpr uint64_t kTmaMagic = 0x414d54554d45ull;
inline long g_tma_copies = 0;  // every TMA copy so far (the tests ask whether a kernel took TMA)
inline void tma_encode(CUtensorMap* map, const void* base, const uint64_t (&dims)[4], const uint64_t (&strides)[3],
                       const uint32_t (&box)[4]) {
  if ((uintptr_t)map % 64) die("TMA map: not 64-byte aligned");
  if ((uintptr_t)base % 16) die("TMA map: the global address must be 16-byte aligned");
  for (int i = 0; i < 4; i++)
    if (dims[i] == 0 || dims[i] > (1ull << 32)) die("TMA map: each dim must be in [1, 2^32]");
  uint64_t extent = dims[0] * 2;
  for (int i = 0; i < 3; i++) {
    if (strides[i] % 16 || strides[i] >= (1ull << 40)) die("TMA map: strides must be multiples of 16 below 2^40");
    if (strides[i] < extent) die("TMA map: strides that do not nest (each at least the dimensions' extent before it)");
    extent = strides[i] * dims[i + 1];
  }
  for (int i = 0; i < 4; i++)
    if (box[i] == 0 || box[i] > 256) die("TMA map: each box dim must be in [1, 256]");
  if (box[0] * 2 % 16) die("TMA map: the box's inner dimension must be a multiple of 16 bytes");
  if (box[0] * 2 > 128) die("TMA map: the 128-byte swizzle takes boxes at most 128 bytes wide");
  uint64_t* o = reinterpret_cast<uint64_t*>(map);
  memset(o, 0, sizeof(CUtensorMap));
  o[0] = kTmaMagic, o[1] = (uint64_t)(uintptr_t)base;
  for (int i = 0; i < 4; i++) o[2 + i] = dims[i], o[9 + i] = box[i];
  for (int i = 0; i < 3; i++) o[6 + i] = strides[i];
}
inline const uint64_t* tma_map(const CUtensorMap* map) {
  const uint64_t* o = reinterpret_cast<const uint64_t*>(map);
  if (o[0] != kTmaMagic) die("TMA: a map the encoder did not make");
  return o;
}
// A map's box (o: tma_map's words): its bytes, and each of its elements at coordinates c, in the box's row-major
// order: f(at, elem) with `at` the element's place in an unswizzled box from shared byte `at0` and `elem` its global
// address, nullptr outside the tensor.
inline uint32_t box_bytes(const uint64_t* o) { return (uint32_t)(o[9] * o[10] * o[11] * o[12] * 2); }
template <class F>
void box_elements(const uint64_t* o, const std::array<int, 4>& c, uint32_t at0, F f) {
  const uint64_t *dims = o + 2, *strides = o + 6, *box = o + 9;
  unsigned char* base = reinterpret_cast<unsigned char*>((uintptr_t)o[1]);
  uint32_t at = at0;
  for (uint64_t i3 = 0; i3 < box[3]; i3++)
    for (uint64_t i2 = 0; i2 < box[2]; i2++)
      for (uint64_t i1 = 0; i1 < box[1]; i1++)
        for (uint64_t i0 = 0; i0 < box[0]; i0++, at += 2) {
          const int64_t g[4] = {c[0] + (int64_t)i0, c[1] + (int64_t)i1, c[2] + (int64_t)i2, c[3] + (int64_t)i3};
          bool inside = true;
          for (int i = 0; i < 4; i++) inside = inside && g[i] >= 0 && g[i] < (int64_t)dims[i];
          f(at, inside ? base + g[0] * 2 + g[1] * strides[0] + g[2] * strides[1] + g[3] * strides[2] : nullptr);
        }
}
inline void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, std::array<int, 4> c) {
  const uint64_t* o = tma_map(map);
  Block& b = *g_blk;
  const size_t bytes = box_bytes(o);
  if (dst % 1024) die("TMA copy: a box in the 128-byte swizzle must land 1024-byte aligned");
  if (dst + bytes > b.smem_bytes) die("TMA copy: the box runs past shared memory");
  box_elements(o, c, dst, [&](uint32_t at, unsigned char* elem) {
    const uint32_t to = wg_swizzle(at);
    if (at % 16 == 0) {  // a new 16-byte chunk
      note_write(to, "a TMA copy", false);
      memset(&b.dirty[to], 0, 16);
    }
    uint16_t v = 0;
    if (elem) memcpy(&v, elem, 2);
    memcpy(b.smem + to, &v, 2);
  });
  g_tma_copies++;
  const Released r = release();
  mbar_at(bar).complete_tx(r.c, r.rc, (int64_t)bytes);
}
inline Phases& named_at(int id, int count) {
  if (id < 1 || id > 15) die("named barrier: id must be 1-15 (0 is __syncthreads)");
  if (count <= 0 || count % 32 || count > (int)tl_clock.size())
    die("named barrier: count must be a positive multiple of 32, at most the block's threads");
  Phases& n = g_blk->named[id];
  if (n.seen.empty()) n.clear((int)tl_clock.size());
  if (n.arrived == 0) n.count = count;
  if (n.count != count) die("named barrier: threads disagree on its count");
  return n;
}
inline void bar_sync(int id, int count) {
  const Released r = release();
  Phases& n = named_at(id, count);
  wait_phase(n, n.arrive(r.c, r.rc), "named barrier", id);
}
inline void bar_arrive(int id, int count) {
  const Released r = release();
  named_at(id, count).arrive(r.c, r.rc);
}

// ---- Bulk copies from shared to global memory (tma.cuh's store, reduce_add, commit, wait_read, wait,
// fence_global), from the PTX ISA (cp.async.bulk / cp.reduce.async.bulk .bulk_group). The copy engine reads the
// source through the async proxy: bytes a store wrote without a fence.proxy.async after it are an error, and its read
// counts, for the race check, as pending from issue until the issuing thread's wait_group.read (any write to the
// source before then is a race). Eager mode copies at issue; lazy mode reads the source at the wait_group.read and
// writes global memory at the wait_group (the latest legal moments), so a buffer reused or a sum read early shows in
// the results too. A turn passed on (add_count) with copies in flight, a copy issued after a wait_count's acquire
// without fence.proxy.async.global, and copies never committed at exit are errors; a thread may exit once its
// copies have read their source (wait_group.read: shared memory goes with the CTA), and their writes are made then.
// A tensor store (tma.cuh's store_box) is a bulk copy whose destination is a map's box: its source is the box in
// the 128-byte swizzle, and only the elements inside the tensor are written.
struct Bulk {
  unsigned char* dst = nullptr;  // global
  uint32_t src = 0, bytes = 0;   // shared
  bool add = false;              // fp32 adds (reduce_add), else a copy (store)
  // A tensor store's map (the emulator's encoding; a copy: the kernel's parameter it came from is gone when the
  // thread's exit writes what it never waited for), and the box's coordinates.
  bool tensor = false;
  std::array<uint64_t, sizeof(CUtensorMap) / 8> map{};
  std::array<int, 4> c{};
  bool read = false, written = false;
  bool read_waited = false;  // a wait_group(.read) has covered it: its read is complete, for the race check
  std::vector<unsigned char> data;  // the source as read
};
inline PerThread<bool> tl_acquired_;  // a wait_count's acquire not yet behind fence.proxy.async.global
#define tl_acquired (::emu::tl_acquired_[::emu::g_fid])
inline PerThread<std::vector<Bulk>> tl_bulk_cur_;
#define tl_bulk_cur (::emu::tl_bulk_cur_[::emu::g_fid])
inline PerThread<std::vector<std::vector<Bulk>>> tl_bulk_groups_;
#define tl_bulk_groups (::emu::tl_bulk_groups_[::emu::g_fid])
inline bool bulk_in_flight() { return !tl_bulk_cur.empty() || !tl_bulk_groups.empty(); }
inline void bulk_read(Bulk& op) {
  if (!op.read) op.data.assign(g_blk->smem + op.src, g_blk->smem + op.src + op.bytes);
  op.read = true;
}
// initcheck's view of the copies to global memory (tensor stores and bulk copies, neither of which the tool counts as
// writes): the bytes they wrote, and the ranges the host marked written for the tool (tma.cuh's mark_stored), which
// must be the same bytes (tma_stores_marked).
inline std::vector<uintptr_t> g_tma_written;
inline std::vector<std::pair<uintptr_t, size_t>> g_marked;
inline void initcheck_mark(const void* base, size_t bytes) {
  g_marked.emplace_back((uintptr_t)base, bytes);
}
inline bool g_initcheck_track = false;  // recording, from the first initcheck_reset on (else long modes would grow)
inline void initcheck_reset() {
  g_tma_written.clear(), g_marked.clear();
  g_initcheck_track = true;
}
inline size_t initcheck_marks() {
  return g_marked.size();
}
// Whether the copies since initcheck_reset wrote exactly the marked bytes, every one once or more; `none`: both may
// be empty (else something must be marked).
inline bool tma_stores_marked(bool none = false) {
  std::vector<uintptr_t> written = g_tma_written, marked;
  std::sort(written.begin(), written.end());
  written.erase(std::unique(written.begin(), written.end()), written.end());
  for (const auto& [base, bytes] : g_marked)
    for (size_t i = 0; i < bytes; i++) marked.push_back(base + i);
  std::sort(marked.begin(), marked.end());
  marked.erase(std::unique(marked.begin(), marked.end()), marked.end());
  return (none || !marked.empty()) && written == marked;
}
inline void bulk_write(Bulk& op) {
  bulk_read(op);
  if (op.written) return;
  op.written = true;
  if (op.tensor) {  // element by element, read through the swizzle, inside the tensor only
    std::vector<uintptr_t> written;
    box_elements(op.map.data(), op.c, op.src, [&](uint32_t at, unsigned char* elem) {
      if (elem) {
        memcpy(elem, op.data.data() + (wg_swizzle(at) - op.src), 2);
        written.push_back((uintptr_t)elem), written.push_back((uintptr_t)elem + 1);
      }
    });
    if (g_initcheck_track) g_tma_written.insert(g_tma_written.end(), written.begin(), written.end());
    return;
  }
  if (g_initcheck_track)
    for (uint32_t i = 0; i < op.bytes; i++) g_tma_written.push_back((uintptr_t)op.dst + i);
  if (!op.add) {
    memcpy(op.dst, op.data.data(), op.bytes);
    return;
  }
  for (uint32_t i = 0; i < op.bytes; i += 4) {  // each add rounded to nearest even, as the GPU's (no fast-math here)
    float a, v;
    memcpy(&a, op.dst + i, 4);
    memcpy(&v, op.data.data() + i, 4);
    a += v;
    memcpy(op.dst + i, &a, 4);
  }
}
inline long g_bulk_copies = 0;  // every bulk copy so far (the tests ask whether a kernel took them)
inline long g_tma_stores = 0;   // the tensor stores among them
inline void bulk_enqueue(Bulk op) {
  Block& b = *g_blk;
  if (op.src + op.bytes > b.smem_bytes) die("bulk copy: the source runs past shared memory");
  if (tl_acquired)
    die("bulk copy to global memory after an acquire (wait_count) with no fence.proxy.async.global between");
  for (uint32_t off = op.src; off < op.src + op.bytes; off++)
    if (b.dirty[off]) die("bulk copy reads shared memory written by a store without a fence.proxy.async after it");
  for (uint32_t off = op.src; off < op.src + op.bytes; off += 16) note_read(off, "a bulk copy", true);
  if (!g_lazy_cp) bulk_write(op);
  tl_bulk_cur.push_back(std::move(op));
  g_bulk_copies++;
}
inline void bulk_issue(void* dst, uint32_t src, uint32_t bytes, bool add) {
  if ((uintptr_t)dst % 16 || src % 16) die("bulk copy: both addresses must be 16-byte aligned");
  if (bytes == 0 || bytes % 16) die("bulk copy: the size must be a positive multiple of 16");
  Bulk op;
  op.dst = static_cast<unsigned char*>(dst), op.src = src, op.bytes = bytes, op.add = add;
  bulk_enqueue(std::move(op));
}
inline void tma_store(const CUtensorMap* map, uint32_t src, std::array<int, 4> c) {
  Bulk op;
  const uint64_t* o = tma_map(map);
  std::copy(o, o + op.map.size(), op.map.begin());
  op.tensor = true, op.c = c, op.src = src, op.bytes = box_bytes(o);
  if (src % 1024) die("TMA store: a box in the 128-byte swizzle must come from a 1024-byte aligned address");
  bulk_enqueue(std::move(op));
  g_tma_stores++;
}
inline void bulk_commit() {
  tl_bulk_groups.push_back(std::move(tl_bulk_cur));
  tl_bulk_cur.clear();
}
// wait_group(.read) n: all but the newest n groups have read their source (and, unless read_only, written).
inline void bulk_wait(int n, bool read_only) {
  for (size_t g = 0; g + n < tl_bulk_groups.size(); g++)
    for (Bulk& op : tl_bulk_groups[g])
      if (!op.read_waited) {
        bulk_read(op);
        op.read_waited = true;
        for (uint32_t off = op.src; off < op.src + op.bytes; off += 16) note_read(off, "a bulk copy");
      }
  if (read_only) return;
  while ((int)tl_bulk_groups.size() > n) {
    for (Bulk& op : tl_bulk_groups.front()) bulk_write(op);
    tl_bulk_groups.erase(tl_bulk_groups.begin());
    tl_acquired = true;  // the writes are visible to this thread: to its async proxy only after a fence
  }
}
inline void bulk_fence_global() { tl_acquired = false; }
// A bulk copy from global into shared memory (tma.cuh's load_bulk), made at issue like a TMA copy (written through
// the async proxy, its bytes completed on the mbarrier with the issuing thread's clock). What an acquire, or the
// completion of this thread's own bulk group, made visible to it must be behind fence.proxy.async.global first.
inline long g_bulk_loads = 0;
inline void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  Block& b = *g_blk;
  if (dst % 16 || (uintptr_t)src % 16) die("bulk load: both addresses must be 16-byte aligned");
  if (bytes == 0 || bytes % 16) die("bulk load: the size must be a positive multiple of 16");
  if (dst + bytes > b.smem_bytes) die("bulk load: the destination runs past shared memory");
  if (tl_acquired)
    die("bulk load from global memory after an acquire or a bulk group's completion with no "
        "fence.proxy.async.global between");
  for (uint32_t off = dst; off < dst + bytes; off += 16) {
    note_write(off, "a bulk load", false);
    memset(&b.dirty[off], 0, 16);
  }
  memcpy(b.smem + dst, src, bytes);
  g_bulk_loads++;
  const Released r = release();
  mbar_at(bar).complete_tx(r.c, r.rc, (int64_t)bytes);
}

// The fused backward's turn-taking between CTAs. The emulator runs CTAs one after another in grid order, which is
// the order the hardware starts them in: a CTA that found its counter short would wait for one that starts later
// (or never comes), which on a GPU could hang; here it is an error at once.
inline void wait_count(const int* counter, int want) {
  const int v = *counter;
  if (v != want) {
    fprintf(stderr, "EMU FATAL: block %u waits for count %d, the counter holds %d\n", g_bid.x, want, v);
    abort();
  }
  tl_acquired = true;
}
inline void add_count(int* counter) {
  if (bulk_in_flight()) die("a turn passed on (release) with bulk copies to global memory not yet waited for");
  ++*counter;
}

// host side
inline std::map<const void*, int> g_attr;
// The device's largest dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin): an H100's unless
// a case sets another GPU's (99 KB: sm_86/sm_89, A10, L4, RTX 30xx/40xx; 163 KB: A100); a kernel's attribute above
// it fails as cudaFuncSetAttribute does there.
inline int g_smem_optin = 227 * 1024;
// The SM's shared memory (cudaDevAttrMaxSharedMemoryPerMultiprocessor): an H100's unless a case sets another.
inline int g_smem_per_sm = 228 * 1024;
inline cudaError_t g_last = cudaSuccess;
inline long g_launches = 0;
template <class F>
cudaError_t FuncSetAttribute(F* f, cudaFuncAttribute, int bytes) {
  if (bytes > g_smem_optin) return cudaErrorInvalidValue;
  g_attr[(const void*)f] = bytes;
  return cudaSuccess;
}
inline cudaError_t FuncSetAttribute(const void* f, cudaFuncAttribute, int bytes) {
  if (bytes > g_smem_optin) return cudaErrorInvalidValue;
  g_attr[f] = bytes;
  return cudaSuccess;
}
// Copies happen at issue: every emulated launch has finished by the time it returns.
inline cudaError_t MemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, void*) {
  memcpy(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t StreamSynchronize(void*) { return cudaSuccess; }
inline cudaError_t StreamIsCapturing(void*, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;  // the emulator has no graphs
  return cudaSuccess;
}
inline cudaError_t MemsetAsync(void* p, int v, size_t n, void*) {
  memset(p, v, n);
  return cudaSuccess;
}
// The pool's memory: a request past it fails as the device's would, out of memory, and (as every failed runtime call)
// leaves its error as the last error, for cudaGetLastError to return.
inline size_t g_pool_limit = SIZE_MAX;
inline cudaError_t MallocAsync(void** p, size_t n, void*) {
  if (n > g_pool_limit) {
    *p = nullptr;
    return g_last = cudaErrorMemoryAllocation;
  }
  *p = malloc(n);
  memset(*p, 0xff, n);
  return cudaSuccess;
}
// The stream-ordered pool (cuda/scratch.h) has nothing to configure on the host.
inline cudaError_t GetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t DeviceGetDefaultMemPool(cudaMemPool_t* pool, int) {
  *pool = nullptr;
  return cudaSuccess;
}
inline cudaError_t MemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) { return cudaSuccess; }
inline cudaError_t FreeAsync(void* p, void*) {
  free(p);
  return cudaSuccess;
}
// The compute capability the flash dispatch sees: 9 (the tensor-core kernels) unless a case sets 7 (a T4, sm_75:
// bf16/fp16 then take the simt kernels).
inline int g_cc_major = 9;
// The SMs a persistent launch (one CTA per SM) sees: a few, so that each CTA takes several tiles in turn.
inline int g_sm_count = 3;
inline cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrComputeCapabilityMajor        ? g_cc_major
           : attr == cudaDevAttrMultiProcessorCount          ? g_sm_count
           : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? g_smem_optin
           : attr == cudaDevAttrMaxSharedMemoryPerMultiprocessor ? g_smem_per_sm
                                                             : 0;
  return cudaSuccess;
}
inline cudaError_t GetLastError() {
  cudaError_t e = g_last;
  g_last = cudaSuccess;
  return e;
}
inline const char* GetErrorString(cudaError_t e) { return e == cudaErrorInvalidConfiguration ? "invalid configuration" : "emu error"; }
inline size_t g_max_smem_seen = 0;
template <class K, class... A>
void launch(K k, dim3 grid, dim3 block, size_t bytes, void*, A&&... args) {
  g_launches++;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u ||
      block.x * block.y * block.z > 1024) {
    g_last = cudaErrorInvalidConfiguration;
    return;
  }
  if (bytes > 48 * 1024) {
    auto it = g_attr.find((const void*)k);
    if (it == g_attr.end() || (size_t)it->second < bytes) {
      g_last = cudaErrorInvalidValue;
      return;
    }
  }
  if (block.y != 1 || block.z != 1) die("a block of more than one dimension (emulated: threadIdx.x alone)");
  g_max_smem_seen = std::max(g_max_smem_seen, bytes);
  g_grid = grid, g_block = block;
  if (bytes > 48 * 1024) g_grid_big_smem = grid;
  const int nt = block.x;
  for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
      Block blk(nt);
      blk.smem_bytes = bytes;
      blk.smem = (unsigned char*)malloc(bytes ? bytes : 1);
      blk.dirty.assign(bytes, 0);
      blk.wlast.assign(bytes / 16 + 1, pack_write(-1, 0));
      blk.rpend.assign((bytes / 16 + 1) * 8, 0), blk.rclk.assign((bytes / 16 + 1) * 8, 0);
      blk.reads.assign(bytes / 16 + 1, {});
      blk.sync_clock[0].assign(nt, 0), blk.sync_clock[1].assign(nt, 0);
      if (nt % 128 == 0)
        for (int i = 0; i < nt / 128; i++) blk.wgs.push_back(std::make_unique<WarpGroup>());
      memset(blk.smem, 0xff, bytes);  // garbage: NaN in bf16/fp16/fp32
      g_bid = dim3(bx, by, 0), g_blk = &blk;
      run_threads(nt, [&](int t) {
        tl_cur.clear();
        tl_groups.clear();
        tl_unfenced.clear();
        tl_phase = 0;
        tl_clock.assign(nt, 0);
        tl_clock[t] = 1;
        tl_rc = tl_clock;
        tl_wg_fenced = false;
        tl_wg_cur.clear();
        tl_wg_groups.clear();
        tl_bulk_cur.clear();
        tl_bulk_groups.clear();
        tl_acquired = false;
        k(args...);
        if (!tl_bulk_cur.empty()) die("bulk copy never committed at exit");
        for (auto& gq : tl_bulk_groups)
          for (Bulk& op : gq) {
            if (!op.read_waited) die("a thread exits before its bulk copies have read shared memory (wait_group.read)");
            bulk_write(op);
          }
        tl_bulk_groups.clear();
        if (!tl_wg_cur.empty() || !tl_wg_groups.empty()) die("wgmma not committed or never waited at exit");
        if (!tl_cur.empty()) die("uncommitted cp.async at exit");
        for (auto& gq : tl_groups) if (!gq.empty()) die("cp.async group never waited at exit");
        tl_groups.clear();
      });
      for (auto& [off, m] : blk.mbars)
        if (m.tx != 0) {
          fprintf(stderr, "EMU FATAL: the mbarrier at shared byte %u ends the block with %lld transaction bytes %s\n",
                  off, (long long)std::abs(m.tx), m.tx > 0 ? "declared and never copied" : "copied and never declared");
          abort();
        }
      for (int id = 1; id < 16; id++)
        if (blk.named[id].arrived) {
          fprintf(stderr, "EMU FATAL: named barrier %d ends the block with %d of %d arrivals pending\n", id,
                  blk.named[id].arrived, blk.named[id].count);
          abort();
        }
      g_blk = nullptr;
      free(blk.smem);
    }
}
}  // namespace emu

#define threadIdx tl_tid
#define blockIdx ::emu::g_bid
#define gridDim emu::g_grid
#define blockDim emu::g_block
#define __syncthreads() emu::syncthreads()
// storage.cuh's 16-byte loads and stores (load_pack, store_pack): a GPU faults on an unaligned one, the host does not.
// Counted (g_align16_checks), so that a test can tell that a kernel took its 16-byte path.
namespace emu {
inline long g_align16_checks = 0;
}
#define FASTGPT_ALIGN16_CHECK(p)                                                                                 \
  (emu::g_align16_checks++,                                                                                      \
   reinterpret_cast<uintptr_t>(p) % 16 ? emu::die("a 16-byte load or store of an address not 16-byte aligned") \
                                       : (void)0)
// storage.cuh's 16-byte loads and stores where they touch the block's (dynamic) shared memory, in the race check as
// ld.shared / st.shared: a load of a chunk whose cp.async has not been waited for, or that another thread wrote
// with no barrier since, fails (the LayerNorm ring's rows, its weight copy, cross-entropy's row copy).
namespace emu {
inline bool in_smem(const void* p) {
  const unsigned char* c = (const unsigned char*)p;
  return g_blk && c >= g_blk->smem && c < g_blk->smem + g_blk->smem_bytes;
}
inline void pack_loaded(const void* p) {
  if (in_smem(p)) ld_shared(static_cast<const uint4*>(p), "a 16-byte load");
}
inline void pack_stored(void* p) {
  if (in_smem(p)) st_shared(static_cast<uint4*>(p), *static_cast<uint4*>(p), "a 16-byte store");
}
}  // namespace emu
#define FASTGPT_PACK_LOADED(p) emu::pack_loaded(p)
#define FASTGPT_PACK_STORED(p) emu::pack_stored(const_cast<void*>(static_cast<const void*>(p)))
// The _rn intrinsics: one rounding each, never part of an FMA. The kernel units are built contracting a * b + c into
// FMAs, as nvcc does (run.sh), so the result passes through a volatile: the compiler cannot fuse across it.
namespace emu {
inline float rn(float x) {
  volatile float v = x;
  return v;
}
}  // namespace emu
#define __fmul_rn(a, b) emu::rn((float)(a) * (float)(b))
#define __fadd_rn(a, b) emu::rn((float)(a) + (float)(b))
#define __fsub_rn(a, b) emu::rn((float)(a) - (float)(b))
#define __shfl_xor_sync emu::shfl_xor
#define __shfl_sync emu::shfl
#define __shfl_down_sync emu::shfl_down
#define __ballot_sync emu::ballot
#define __ffs __builtin_ffs
#define cudaMemcpyAsync emu::MemcpyAsync
#define cudaStreamSynchronize emu::StreamSynchronize
#define cudaStreamIsCapturing emu::StreamIsCapturing
#define atomicAdd emu::atomic_add
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
template <typename T>  // global loads and stores that skip L1 (the fused backward's dq sums): plain ones here
inline T __ldcg(const T* p) {
  return *p;
}
template <typename T>
inline void __stcg(T* p, T v) {
  *p = v;
}
#define cudaFuncSetAttribute emu::FuncSetAttribute
#define cudaMemsetAsync emu::MemsetAsync
#define cudaMallocAsync emu::MallocAsync
#define cudaFreeAsync emu::FreeAsync
#define cudaGetDevice emu::GetDevice
#define cudaDeviceGetDefaultMemPool emu::DeviceGetDefaultMemPool
#define cudaMemPoolSetAttribute emu::MemPoolSetAttribute
#define cudaDeviceGetAttribute emu::DeviceGetAttribute
#define cudaGetLastError emu::GetLastError
#define cudaGetErrorString emu::GetErrorString
