// Flash attention on the GPU: the entry points (dispatch by dtype and head dim, scratch for backward), delta, and the
// fp32 path on CUDA cores that serves the engine's fp32 precision and any head dim up to 256. The bf16/fp16 tensor-core
// kernels are in flash_attention_fwd.cu and flash_attention_bwd.cu.
// fp32 path: a warp owns 4 rows (forward and dq) or 4 keys (dk/dv) and its lanes run along the other side of the
// score tile (32 keys or 32 queries), so each score is one lane's dot product over d from shared memory (rows padded
// by one float: lanes read different banks), the softmax statistics are warp reductions, and products with V, K, Q
// or dO broadcast one lane's probability at a time (shuffles) while lanes own d / 32 output columns each. Every sum
// runs in a fixed order and nothing uses atomics: the fp32 path is deterministic.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"

namespace fastgpt::cuda {

namespace flash {

namespace {

constexpr int kThreads = 128, kRows = 4;  // 4 warps; rows (or keys) per warp: 16 per CTA
constexpr int kTile = 32;                             // the lanes' side of a score tile
constexpr int kMaxChunks = 8;                         // d <= 8 * 32

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ bool visible(int query, int key, int T, bool causal) {
  return query < T && key < T && !(causal && key > query);
}

// rows [row0, row0 + n) of a (b, h) slice with row stride st into dst (n, pitch), zeros past T.
__device__ void load_rows(float* dst, int pitch, const float* src, int64_t st, int row0, int n, int T, int d) {
  for (int i = threadIdx.x; i < n * d; i += blockDim.x) {
    const int r = i / d, x = i % d;
    dst[r * pitch + x] = row0 + r < T ? src[(int64_t)(row0 + r) * st + x] : 0.f;
  }
}

__global__ void __launch_bounds__(kThreads) forward_f32_kernel(Params p) {
  extern __shared__ float sm[];
  const int d = p.d, dp = d + 1, T = p.T, nc = (d + 31) / 32;
  float* sQ = sm;                 // (16, d)
  float* sK = sQ + 16 * d;        // (32, d + 1)
  float* sV = sK + kTile * dp;    // (32, d)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * 16, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const float *Q = static_cast<const float*>(p.q) + in_off, *K = static_cast<const float*>(p.k) + in_off,
              *V = static_cast<const float*>(p.v) + in_off;
  load_rows(sQ, d, Q, p.is.st, q0, 16, T, d);

  float o[kRows][kMaxChunks] = {}, m[kRows], l[kRows];
  for (int r = 0; r < kRows; r++) m[r] = -INFINITY, l[r] = 0.f;
  const int kv_end = p.causal ? min(T, q0 + 16) : T;
  for (int k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    load_rows(sK, dp, K, p.is.st, k0, kTile, T, d);
    load_rows(sV, d, V, p.is.st, k0, kTile, T, d);
    __syncthreads();
    const int key = k0 + lane;
    float s[kRows] = {};
    for (int x = 0; x < d; x++) {
      const float kx = sK[lane * dp + x];
#pragma unroll
      for (int r = 0; r < kRows; r++) s[r] += sQ[(warp * kRows + r) * d + x] * kx;
    }
    float pe[kRows];
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      const float sr = visible(q0 + warp * kRows + r, key, T, p.causal) ? s[r] * p.scale : -INFINITY;
      const float mn = fmaxf(m[r], warp_max(sr));
      const float base = mn == -INFINITY ? 0.f : mn;
      pe[r] = expf(sr - base);
      const float alpha = expf(m[r] - base);
      l[r] = l[r] * alpha + warp_sum(pe[r]);
      m[r] = mn;
#pragma unroll
      for (int i = 0; i < kMaxChunks; i++) o[r][i] *= alpha;
    }
    for (int j = 0; j < kTile; j++) {
      float vx[kMaxChunks];
#pragma unroll
      for (int i = 0; i < kMaxChunks; i++) vx[i] = i < nc && lane + 32 * i < d ? sV[j * d + lane + 32 * i] : 0.f;
#pragma unroll
      for (int r = 0; r < kRows; r++) {
        const float pj = __shfl_sync(0xffffffffu, pe[r], j);
#pragma unroll
        for (int i = 0; i < kMaxChunks; i++) o[r][i] += pj * vx[i];
      }
    }
  }
  float* O = static_cast<float*>(p.out_w) + b * p.os.sb + h * p.os.sh;
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int row = q0 + warp * kRows + r;
    if (row >= T) continue;
#pragma unroll
    for (int i = 0; i < kMaxChunks; i++)
      if (i < nc && lane + 32 * i < d) O[(int64_t)row * p.os.st + lane + 32 * i] = o[r][i] / l[r];
    if (lane == 0) p.lse[(int64_t)bh * T + row] = m[r] + logf(l[r]);
  }
}

// dK, dV for 16 keys per CTA, over the query tiles that can see them.
__global__ void __launch_bounds__(kThreads) dkdv_f32_kernel(Params p) {
  extern __shared__ float sm[];
  const int d = p.d, dp = d + 1, T = p.T, nc = (d + 31) / 32;
  float* sK = sm;                // (16, d)
  float* sV = sK + 16 * d;       // (16, d)
  float* sQ = sV + 16 * d;       // (32, d + 1)
  float* sdO = sQ + kTile * dp;  // (32, d + 1)
  float* sL = sdO + kTile * dp;  // (32)
  float* sDl = sL + kTile;       // (32)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k0 = blockIdx.y * 16, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const float *Q = static_cast<const float*>(p.q) + in_off, *dO = static_cast<const float*>(p.dout) + out_off;
  load_rows(sK, d, static_cast<const float*>(p.k) + in_off, p.is.st, k0, 16, T, d);
  load_rows(sV, d, static_cast<const float*>(p.v) + in_off, p.is.st, k0, 16, T, d);

  float dk[kRows][kMaxChunks] = {}, dv[kRows][kMaxChunks] = {};
  for (int qt = p.causal ? k0 / kTile * kTile : 0; qt < T; qt += kTile) {
    __syncthreads();
    load_rows(sQ, dp, Q, p.is.st, qt, kTile, T, d);
    load_rows(sdO, dp, dO, p.os.st, qt, kTile, T, d);
    if (threadIdx.x < kTile) {
      const int q = qt + threadIdx.x;
      sL[threadIdx.x] = q < T ? p.lse[(int64_t)bh * T + q] : 0.f;
      sDl[threadIdx.x] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
    }
    __syncthreads();
    const int query = qt + lane;
    float s[kRows] = {}, dpv[kRows] = {};
    for (int x = 0; x < d; x++) {
      const float qx = sQ[lane * dp + x], ox = sdO[lane * dp + x];
#pragma unroll
      for (int r = 0; r < kRows; r++) {
        s[r] += qx * sK[(warp * kRows + r) * d + x];
        dpv[r] += ox * sV[(warp * kRows + r) * d + x];
      }
    }
    float pr[kRows], ds[kRows];
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      pr[r] = visible(query, k0 + warp * kRows + r, T, p.causal) ? expf(s[r] * p.scale - sL[lane]) : 0.f;
      ds[r] = pr[r] * (dpv[r] - sDl[lane]);
    }
    for (int j = 0; j < kTile; j++) {
      float qx[kMaxChunks], ox[kMaxChunks];
#pragma unroll
      for (int i = 0; i < kMaxChunks; i++) {
        const bool ok = i < nc && lane + 32 * i < d;
        qx[i] = ok ? sQ[j * dp + lane + 32 * i] : 0.f;
        ox[i] = ok ? sdO[j * dp + lane + 32 * i] : 0.f;
      }
#pragma unroll
      for (int r = 0; r < kRows; r++) {
        const float pj = __shfl_sync(0xffffffffu, pr[r], j), dsj = __shfl_sync(0xffffffffu, ds[r], j);
#pragma unroll
        for (int i = 0; i < kMaxChunks; i++) {
          dv[r][i] += pj * ox[i];
          dk[r][i] += dsj * qx[i];
        }
      }
    }
  }
  float *dK = static_cast<float*>(p.dk) + in_off, *dV = static_cast<float*>(p.dv) + in_off;
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int key = k0 + warp * kRows + r;
    if (key >= T) continue;
#pragma unroll
    for (int i = 0; i < kMaxChunks; i++)
      if (i < nc && lane + 32 * i < d) {
        dK[(int64_t)key * p.is.st + lane + 32 * i] = dk[r][i] * p.scale;
        dV[(int64_t)key * p.is.st + lane + 32 * i] = dv[r][i];
      }
  }
}

// dQ for 16 queries per CTA, over the key tiles they see.
__global__ void __launch_bounds__(kThreads) dq_f32_kernel(Params p) {
  extern __shared__ float sm[];
  const int d = p.d, dp = d + 1, T = p.T, nc = (d + 31) / 32;
  float* sQ = sm;               // (16, d)
  float* sdO = sQ + 16 * d;     // (16, d)
  float* sK = sdO + 16 * d;     // (32, d + 1)
  float* sV = sK + kTile * dp;  // (32, d + 1)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * 16, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t in_off = b * p.is.sb + h * p.is.sh, out_off = b * p.os.sb + h * p.os.sh;
  const float *K = static_cast<const float*>(p.k) + in_off, *V = static_cast<const float*>(p.v) + in_off;
  load_rows(sQ, d, static_cast<const float*>(p.q) + in_off, p.is.st, q0, 16, T, d);
  load_rows(sdO, d, static_cast<const float*>(p.dout) + out_off, p.os.st, q0, 16, T, d);
  float lse[kRows], dl[kRows];
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int q = q0 + warp * kRows + r;
    lse[r] = q < T ? p.lse[(int64_t)bh * T + q] : 0.f;
    dl[r] = q < T ? p.delta[(int64_t)bh * T + q] : 0.f;
  }
  float dq[kRows][kMaxChunks] = {};
  const int kv_end = p.causal ? min(T, q0 + 16) : T;
  for (int k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();
    load_rows(sK, dp, K, p.is.st, k0, kTile, T, d);
    load_rows(sV, dp, V, p.is.st, k0, kTile, T, d);
    __syncthreads();
    const int key = k0 + lane;
    float s[kRows] = {}, dpv[kRows] = {};
    for (int x = 0; x < d; x++) {
      const float kx = sK[lane * dp + x], vx = sV[lane * dp + x];
#pragma unroll
      for (int r = 0; r < kRows; r++) {
        s[r] += sQ[(warp * kRows + r) * d + x] * kx;
        dpv[r] += sdO[(warp * kRows + r) * d + x] * vx;
      }
    }
    float ds[kRows];
#pragma unroll
    for (int r = 0; r < kRows; r++) {
      const float pr = visible(q0 + warp * kRows + r, key, T, p.causal) ? expf(s[r] * p.scale - lse[r]) : 0.f;
      ds[r] = pr * (dpv[r] - dl[r]);
    }
    for (int j = 0; j < kTile; j++) {
      float kx[kMaxChunks];
#pragma unroll
      for (int i = 0; i < kMaxChunks; i++) kx[i] = i < nc && lane + 32 * i < d ? sK[j * dp + lane + 32 * i] : 0.f;
#pragma unroll
      for (int r = 0; r < kRows; r++) {
        const float dsj = __shfl_sync(0xffffffffu, ds[r], j);
#pragma unroll
        for (int i = 0; i < kMaxChunks; i++) dq[r][i] += dsj * kx[i];
      }
    }
  }
  float* dQ = static_cast<float*>(p.dq) + in_off;
#pragma unroll
  for (int r = 0; r < kRows; r++) {
    const int q = q0 + warp * kRows + r;
    if (q >= T) continue;
#pragma unroll
    for (int i = 0; i < kMaxChunks; i++)
      if (i < nc && lane + 32 * i < d) dQ[(int64_t)q * p.is.st + lane + 32 * i] = dq[r][i] * p.scale;
  }
}

template <typename E>
__global__ void delta_kernel(Params p) {
  const int64_t rows = (int64_t)p.B * p.H * p.T;
  const int lane = threadIdx.x % 32;
  for (int64_t row = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; row < rows;
       row += (int64_t)gridDim.x * blockDim.x / 32) {
    const int64_t t = row % p.T, bh = row / p.T, b = bh / p.H, h = bh % p.H;
    const int64_t off = b * p.os.sb + h * p.os.sh + t * p.os.st;
    const E *o = static_cast<const E*>(p.out) + off, *dO = static_cast<const E*>(p.dout) + off;
    float s = 0.f;
    for (int x = lane; x < p.d; x += 32) s += float(o[x]) * float(dO[x]);
    s = warp_sum(s);
    if (lane == 0) p.delta[row] = s;
  }
}

void set_smem(const void* kernel, int bytes) {
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace

void forward_f32(const Params& p, Stream stream) {
  const int bytes = (16 * p.d + kTile * (p.d + 1) + kTile * p.d) * sizeof(float);
  set_smem((const void*)forward_f32_kernel, bytes);
  forward_f32_kernel<<<dim3(p.B * p.H, (p.T + 15) / 16), kThreads, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

void backward_f32(const Params& p, Stream stream) {
  const int kv_bytes = (32 * p.d + 2 * kTile * (p.d + 1) + 2 * kTile) * sizeof(float);
  set_smem((const void*)dkdv_f32_kernel, kv_bytes);
  dkdv_f32_kernel<<<dim3(p.B * p.H, (p.T + 15) / 16), kThreads, kv_bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
  const int q_bytes = (32 * p.d + 2 * kTile * (p.d + 1)) * sizeof(float);
  set_smem((const void*)dq_f32_kernel, q_bytes);
  dq_f32_kernel<<<dim3(p.B * p.H, (p.T + 15) / 16), kThreads, q_bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

template <typename E>
void compute_delta(const Params& p, Stream stream) {
  const int64_t rows = (int64_t)p.B * p.H * p.T;
  const unsigned blocks = (unsigned)std::min<int64_t>((rows + 7) / 8, 1 << 16);  // 8 warps per block
  delta_kernel<E><<<blocks, 256, 0, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace flash

namespace {

// Stream-ordered fp32 scratch, returned to the pool on every exit path (exceptions included).
struct Scratch {
  float* ptr = nullptr;
  Stream stream;
  Scratch(size_t n, Stream s) : stream(s) {
    if (n) FASTGPT_CUDA_CHECK(cudaMallocAsync((void**)&ptr, n * sizeof(float), stream));
  }
  ~Scratch() {
    if (ptr) cudaFreeAsync(ptr, stream);
  }
};

flash::Params make_params(const HeadStrides& is, const HeadStrides& os, const AttentionShape& s) {
  flash::Params p{};
  p.is = is;
  p.os = os;
  p.B = s.B, p.H = s.H, p.T = s.T, p.d = s.d;
  p.causal = s.causal;
  p.scale = 1.f / std::sqrt((float)s.d);
  return p;
}

bool tensor_core_ok(DType dtype, int d) { return dtype != DType::f32 && (d == 64 || d == 128); }

// What the kernels take; the binding checks the same first, so these fire only for direct C++ callers.
void check_shape(const AttentionShape& s, DType dtype) {
  if (dtype != DType::f32 && !tensor_core_ok(dtype, s.d))
    throw std::invalid_argument("flash attention in bf16/fp16 needs head dim 64 or 128");
  if (dtype == DType::f32 && s.d > 256) throw std::invalid_argument("flash attention in fp32 needs d <= 256");
  // Row blocks go on grid y (at most 65535): 16 rows per block in fp32, 64 in bf16/fp16.
  if ((int64_t)s.T > 65535LL * (dtype == DType::f32 ? 16 : 64))
    throw std::invalid_argument("flash attention on a GPU takes T <= 1048560 (fp32) or 4194240 (bf16/fp16)");
}

}  // namespace

void flash_attention_forward(void* out, const HeadStrides& os, float* lse, const void* q, const void* k,
                             const void* v, const HeadStrides& is, const AttentionShape& shape, DType dtype,
                             Stream stream) {
  check_shape(shape, dtype);
  flash::Params p = make_params(is, os, shape);
  p.q = q, p.k = k, p.v = v, p.out_w = out, p.lse = lse;
  if (shape.B * shape.H * shape.T == 0) return;
  if (dtype == DType::bf16) return flash::forward_tc<__nv_bfloat16>(p, stream);
  if (dtype == DType::f16) return flash::forward_tc<__half>(p, stream);
  flash::forward_f32(p, stream);
}

void flash_attention_backward(void* dq, void* dk, void* dv, const HeadStrides& is, const void* dout,
                              const void* out, const HeadStrides& os, const void* q, const void* k, const void* v,
                              const float* lse, const AttentionShape& shape, DType dtype, bool deterministic,
                              Stream stream) {
  check_shape(shape, dtype);
  const int64_t rows = (int64_t)shape.B * shape.H * shape.T;
  if (rows == 0) return;
  flash::Params p = make_params(is, os, shape);
  p.q = q, p.k = k, p.v = v, p.out = out, p.dout = dout, p.dq = dq, p.dk = dk, p.dv = dv;
  p.lse = const_cast<float*>(lse);  // read only in backward
  Scratch delta(rows, stream);
  Scratch accum(dtype != DType::f32 && !deterministic ? rows * shape.d : 0, stream);
  p.delta = delta.ptr;
  p.dq_accum = accum.ptr;
  switch (dtype) {
    case DType::bf16:
      flash::compute_delta<__nv_bfloat16>(p, stream);
      return flash::backward_tc<__nv_bfloat16>(p, deterministic, stream);
    case DType::f16:
      flash::compute_delta<__half>(p, stream);
      return flash::backward_tc<__half>(p, deterministic, stream);
    case DType::f32:
      flash::compute_delta<float>(p, stream);
      return flash::backward_f32(p, stream);
  }
}

}  // namespace fastgpt::cuda
