// Host emulation of the CUDA features the flash kernels use: one OS thread per CUDA thread, barriers for
// __syncthreads and for warp collectives (ldmatrix, mma, shfl), cp.async eager or lazy.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>
using std::max;
using std::min;

#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(x)

namespace emu {
inline int g_lazy_cp = 0;  // 0: cp.async copies at issue, 1: at wait_group (latest legal moment)
struct Warp {
  std::barrier<> bar{32};
  uint64_t slot[32][12];
  int op[32];
};
struct Block {
  std::barrier<> bar;
  Warp warps[32];
  unsigned char* smem;
  size_t smem_bytes;
  std::mutex statics_mu;
  std::map<int, std::vector<unsigned char>> statics;  // static __shared__ arrays, by source line
  explicit Block(int n) : bar(n) {}
};
inline thread_local dim3 tl_tid, tl_bid;
inline dim3 g_grid, g_block;
inline thread_local Block* tl_block;
inline unsigned char* smem() { return tl_block->smem; }
// A static `__shared__ T name[n];` (run.sh rewrites the declaration): one array per block, the first thread to
// reach it makes it, garbage-filled (NaN) as real shared memory is unset.
template <typename T>
T* static_smem(int line, size_t n) {
  std::lock_guard<std::mutex> lock(tl_block->statics_mu);
  auto& a = tl_block->statics[line];
  if (a.empty()) a.assign(n * sizeof(T), 0xff);
  return reinterpret_cast<T*>(a.data());
}
inline Warp& warp() { return tl_block->warps[tl_tid.x / 32]; }
inline int lane() { return tl_tid.x % 32; }
[[noreturn]] inline void die(const char* m) { fprintf(stderr, "EMU FATAL: %s\n", m); fflush(stderr); abort(); }
// collective: deposit, barrier, check same op, return; caller reads slots then calls done()
inline void deposit(int op) {
  Warp& w = warp();
  w.op[lane()] = op;
  w.bar.arrive_and_wait();
  for (int i = 0; i < 32; i++)
    if (w.op[i] != op) die("warp lanes disagree on collective op (divergence)");
}
inline void done() { warp().bar.arrive_and_wait(); }
inline void syncthreads() { tl_block->bar.arrive_and_wait(); }
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
inline float shfl(unsigned mask, float v, int src) {
  if (mask != 0xffffffffu) die("mask");
  if (src < 0 || src > 31) die("shfl src");
  Warp& w = warp();
  memcpy(&w.slot[lane()][0], &v, 4);
  deposit(2);
  float r;
  memcpy(&r, &w.slot[src][0], 4);
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
  if (c < tl_block->smem || c + n > tl_block->smem + tl_block->smem_bytes) die("shared memory access out of bounds");
}
inline void ldsm(uint32_t* r, const void* p, bool trans) {
  Warp& w = warp();
  if (((uintptr_t)p - (uintptr_t)tl_block->smem) % 16) die("ldmatrix row address not 16-byte aligned");
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
template <typename E>
inline void mma_emu(float* d, const uint32_t* a, const uint32_t* b) {
  Warp& w = warp();
  uint64_t* s = w.slot[lane()];
  for (int i = 0; i < 4; i++) s[i] = a[i];
  for (int i = 0; i < 2; i++) s[4 + i] = b[i];
  for (int i = 0; i < 4; i++) memcpy(&s[6 + i], &d[i], 4);
  deposit(sizeof(E) == 2 && std::is_same<E, __half>::value ? 5 : 6);
  auto A = [&](int r, int k) {
    const int ln = 4 * (r % 8) + (k % 8) / 2, reg = (r >= 8) + 2 * (k >= 8);
    const uint32_t v = (uint32_t)w.slot[ln][reg];
    return tof<E>((k % 2) ? v >> 16 : v & 0xffff);
  };
  auto Bm = [&](int k, int n) {
    const int ln = 4 * n + (k % 8) / 2, reg = (k >= 8);
    const uint32_t v = (uint32_t)w.slot[ln][4 + reg];
    return tof<E>((k % 2) ? v >> 16 : v & 0xffff);
  };
  const int g = lane() / 4, c = lane() % 4;
  float out[4];
  for (int i = 0; i < 4; i++) {
    const int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
    double acc = 0;
    for (int k = 0; k < 16; k++) acc += (double)A(row, k) * Bm(k, col);
    float cin;
    memcpy(&cin, &w.slot[lane()][6 + i], 4);
    out[i] = (float)(cin + acc);
  }
  done();
  for (int i = 0; i < 4; i++) d[i] = out[i];
}
struct Copy {
  void* dst;
  const void* src;
  bool valid;
};
inline thread_local std::vector<Copy> tl_cur;
inline thread_local std::vector<std::vector<Copy>> tl_groups;
inline void do_copy(const Copy& c) {
  if (c.valid)
    memcpy(c.dst, c.src, 16);
  else
    memset(c.dst, 0, 16);
}
inline void cp16(void* dst, const void* src, bool valid) {
  if (((uintptr_t)dst - (uintptr_t)tl_block->smem) % 16) die("cp.async dst not 16-byte aligned");
  if (valid && ((uintptr_t)src % 16)) die("cp.async src not 16-byte aligned");
  check_smem(dst, 16);
  Copy c{dst, src, valid};
  if (g_lazy_cp)
    tl_cur.push_back(c);
  else
    do_copy(c);
}
inline void commit() {
  tl_groups.push_back(tl_cur);
  tl_cur.clear();
}
inline void wait_group(int n) {
  while ((int)tl_groups.size() > n) {
    for (auto& c : tl_groups.front()) do_copy(c);
    tl_groups.erase(tl_groups.begin());
  }
}
inline void atomic_add(float* p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }

// host side
inline std::map<const void*, int> g_attr;
inline cudaError_t g_last = cudaSuccess;
inline long g_launches = 0;
template <class F>
cudaError_t FuncSetAttribute(F* f, cudaFuncAttribute, int bytes) {
  if (bytes > 227 * 1024) return cudaErrorInvalidValue;
  g_attr[(const void*)f] = bytes;
  return cudaSuccess;
}
inline cudaError_t FuncSetAttribute(const void* f, cudaFuncAttribute, int bytes) {
  if (bytes > 227 * 1024) return cudaErrorInvalidValue;
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
inline cudaError_t MallocAsync(void** p, size_t n, void*) {
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
inline cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrComputeCapabilityMajor ? g_cc_major : 0;
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
  g_max_smem_seen = std::max(g_max_smem_seen, bytes);
  g_grid = grid, g_block = block;
  const int nt = block.x;
  for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
      Block blk(nt);
      blk.smem_bytes = bytes;
      blk.smem = (unsigned char*)malloc(bytes ? bytes : 1);
      memset(blk.smem, 0xff, bytes);  // garbage: NaN in bf16/fp16/fp32
      std::vector<std::thread> th;
      for (int t = 0; t < nt; t++)
        th.emplace_back([&, t] {
          tl_tid = dim3(t, 0, 0);
          tl_bid = dim3(bx, by, 0);
          tl_block = &blk;
          tl_cur.clear();
          tl_groups.clear();
          k(args...);
          if (!tl_cur.empty()) die("uncommitted cp.async at exit");
          for (auto& gq : tl_groups) if (!gq.empty()) die("cp.async group never waited at exit");
          tl_groups.clear();
        });
      for (auto& x : th) x.join();
      free(blk.smem);
    }
}
}  // namespace emu

#define threadIdx emu::tl_tid
#define blockIdx emu::tl_bid
#define gridDim emu::g_grid
#define blockDim emu::g_block
#define __syncthreads() emu::syncthreads()
#define __fmul_rn(a, b) ((float)(a) * (float)(b))  // host float arithmetic rounds to nearest (SSE, no fast-math)
#define __fsub_rn(a, b) ((float)(a) - (float)(b))
#define __shfl_xor_sync emu::shfl_xor
#define __shfl_sync emu::shfl
#define __shfl_down_sync emu::shfl_down
#define cudaMemcpyAsync emu::MemcpyAsync
#define cudaStreamSynchronize emu::StreamSynchronize
#define cudaStreamIsCapturing emu::StreamIsCapturing
#define atomicAdd emu::atomic_add
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
