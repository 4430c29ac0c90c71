// The engine's attention op on the GPU: the flash kernels (flash_attention.cu) applied to the fused projection
// qkv (B, T, 3C) through strides, so no per-head copies of q, k, v and no T x T scores are made. The twin of
// csrc/cpu/attention.cpp.
// float: the fp32 flash path on CUDA cores. bf16/fp16: the tensor-core flash path in the storage type itself
// (fp32 accumulation, lse in fp32), backward with deterministic = true (a separate dq pass, no atomics) so that
// training is bit-reproducible. The tensor-core kernels need head size 64 or 128 and 16-byte aligned rows; when
// that does not hold, 16-bit operands are widened into fp32 scratch (cudaMallocAsync, stream-ordered, freed on
// every path), attended on the fp32 path, and the outputs rounded once to nearest even, as the CPU does.
// Also built on the host by tests/warp_emu/run.sh: kernel launches stay on one line, no shared memory or inline
// PTX, and the CUDA built-ins come through flash_attention.cuh (which the emulator swaps for its own).
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"
#include "cuda/ops.h"

namespace fastgpt::cuda {

namespace {
HeadStrides qkv_strides(int T, int C, int NH) { return {(int64_t)T * 3 * C, C / NH, 3 * (int64_t)C}; }
HeadStrides out_strides(int T, int C, int NH) { return {(int64_t)T * C, C / NH, C}; }

template <typename S>
constexpr DType dtype_of() {
  return std::is_same_v<S, float> ? DType::f32 : std::is_same_v<S, bf16> ? DType::bf16 : DType::f16;
}

// Whether the tensor-core kernels take this layout (flash_attention.cu's rules): head size 64 or 128, every
// stride a multiple of 8 elements (C % 8, since hs is) and every base pointer (qkv + C included) 16-byte aligned.
bool tensor_core_ok(int C, int NH, std::initializer_list<const void*> ptrs) {
  if (NH <= 0 || C % NH != 0) return false;
  const int hs = C / NH;
  if ((hs != 64 && hs != 128) || C % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Stream-ordered fp32 scratch, returned to the pool on every exit path (exceptions included).
struct Scratch {
  float* ptr = nullptr;
  Stream stream;
  Scratch(int64_t n, Stream s) : stream(s) {
    if (n > 0) FASTGPT_CUDA_CHECK(cudaMallocAsync((void**)&ptr, (size_t)n * sizeof(float), stream));
  }
  ~Scratch() {
    if (ptr) cudaFreeAsync(ptr, stream);  // no throw from a destructor
  }
};

template <typename S>
__global__ void widen_kernel(float* out, const S* in, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = to_float(in[i]);
}

template <typename S>
__global__ void narrow_kernel(S* out, const float* in, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = from_float<S>(in[i]);
}

constexpr int kThreads = 256;
unsigned blocks_for(int64_t n) { return (unsigned)std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16); }

template <typename S>
float* widen_into(Scratch& dst, const S* src, int64_t n, Stream stream) {
  if (n > 0) {
    widen_kernel<S><<<blocks_for(n), kThreads, 0, stream>>>(dst.ptr, src, n);
    FASTGPT_CUDA_CHECK_LAUNCH();
  }
  return dst.ptr;
}

template <typename S>
void narrow_from(S* dst, const Scratch& src, int64_t n, Stream stream) {
  if (n > 0) {
    narrow_kernel<S><<<blocks_for(n), kThreads, 0, stream>>>(dst, src.ptr, n);
    FASTGPT_CUDA_CHECK_LAUNCH();
  }
}
}  // namespace

template <typename S>
void attention_forward(S* out, float* lse, const S* qkv, int B, int T, int C, int NH, bool causal, Stream stream) {
  const AttentionShape shape{B, NH, T, C / NH, causal};
  if (std::is_same_v<S, float> || tensor_core_ok(C, NH, {out, qkv})) {
    flash_attention_forward(out, out_strides(T, C, NH), lse, qkv, qkv + C, qkv + 2 * C, qkv_strides(T, C, NH), shape,
                            dtype_of<S>(), stream);
    return;
  }
  // 16-bit without a tensor-core layout: the fp32 path on widened copies, out rounded once.
  const int64_t BT = (int64_t)B * T;
  Scratch qkv32(BT * 3 * C, stream), out32(BT * C, stream);
  const float* q = widen_into(qkv32, qkv, BT * 3 * C, stream);
  attention_forward<float>(out32.ptr, lse, q, B, T, C, NH, causal, stream);
  narrow_from(out, out32, BT * C, stream);
}

template <typename S>
void attention_backward(S* dqkv, const S* dout, const S* qkv, const S* out, const float* lse, int B, int T, int C,
                        int NH, bool causal, Stream stream) {
  const AttentionShape shape{B, NH, T, C / NH, causal};
  if (std::is_same_v<S, float> || tensor_core_ok(C, NH, {dqkv, dout, qkv, out})) {
    // deterministic: the fp32 path always is; the tensor-core path then computes dq in its own pass, no atomics.
    flash_attention_backward(dqkv, dqkv + C, dqkv + 2 * C, qkv_strides(T, C, NH), dout, out, out_strides(T, C, NH),
                             qkv, qkv + C, qkv + 2 * C, lse, shape, dtype_of<S>(), !std::is_same_v<S, float>,
                             stream);
    return;
  }
  const int64_t BT = (int64_t)B * T;
  Scratch dout32(BT * C, stream), qkv32(BT * 3 * C, stream), out32(BT * C, stream), dqkv32(BT * 3 * C, stream);
  const float* dy = widen_into(dout32, dout, BT * C, stream);
  const float* x = widen_into(qkv32, qkv, BT * 3 * C, stream);
  const float* o = widen_into(out32, out, BT * C, stream);
  attention_backward<float>(dqkv32.ptr, dy, x, o, lse, B, T, C, NH, causal, stream);
  narrow_from(dqkv, dqkv32, BT * 3 * C, stream);
}

#define FASTGPT_INSTANTIATE(S)                                                                                 \
  template void attention_forward<S>(S*, float*, const S*, int, int, int, int, bool, Stream);                 \
  template void attention_backward<S>(S*, const S*, const S*, const S*, const float*, int, int, int, int, bool, \
                                      Stream);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
