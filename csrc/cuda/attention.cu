// The engine's attention op on the GPU: the flash kernels (flash_attention.cu) applied to the fused projection
// qkv (B, T, 3C) through strides, so no per-head copies of q, k, v and no T x T scores are made. The twin of
// csrc/cpu/attention.cpp.
// float: the fp32 flash path, multiplying as `f32` says (TF32 tensor cores, three products per product or one, where
// the layout allows, else CUDA cores). bf16/fp16: the tensor-core flash path in the storage type itself
// (fp32 accumulation, lse in fp32), backward with deterministic = true (a separate dq pass, no atomics) so that
// training is bit-reproducible. The tensor-core kernels need head size 64 or 128 and 16-byte aligned rows; when
// that does not hold, 16-bit operands are widened into fp32 scratch (cudaMallocAsync, stream-ordered, freed on
// every path), attended on the fp32 path, and the outputs rounded once to nearest even, as the CPU does.
// dbias (the fused model's qkv bias gradient) is the column sums of dqkv: on the warp-specialised Hopper backward the
// kernel's own for the K and V thirds (flash_attention_backward's kv_sums), a pass over the Q third; else one pass.
// Also built on the host by tests/warp_emu/run.sh: kernel launches stay on one line, no shared memory or inline
// PTX, and the CUDA built-ins come through flash_attention.cuh (which the emulator swaps for its own).
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/flash_attention.cuh"
#include "cuda/ops.h"
#include "cuda/scratch.h"

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

// 16-bit operands widened into fresh fp32 scratch (cast.cu).
template <typename S>
float* widened(Scratch& dst, const S* src, int64_t n, Stream stream) {
  widen(dst.ptr, src, n, stream);
  return dst.ptr;
}
}  // namespace

template <typename S>
void attention_forward(S* out, float* lse, const S* qkv, int B, int T, int C, int NH, bool causal, Stream stream,
                       F32Math f32) {
  const AttentionShape shape{B, NH, T, C / NH, causal};
  if (std::is_same_v<S, float> || tensor_core_ok(C, NH, {out, qkv})) {
    flash_attention_forward(out, out_strides(T, C, NH), lse, qkv, qkv + C, qkv + 2 * C, qkv_strides(T, C, NH), shape,
                            dtype_of<S>(), stream, f32);
    return;
  }
  // 16-bit without a tensor-core layout: the fp32 path on widened copies, out rounded once.
  const int64_t BT = (int64_t)B * T;
  Scratch qkv32(BT * 3 * C, stream), out32(BT * C, stream);
  attention_forward<float>(out32.ptr, lse, widened(qkv32, qkv, BT * 3 * C, stream), B, T, C, NH, causal, stream);
  narrow(out, out32.ptr, BT * C, RoundKey{}, stream);
}

template <typename S>
void attention_backward(S* dqkv, const S* dout, const S* qkv, const S* out, const float* lse, int B, int T, int C,
                        int NH, bool causal, float* dbias, Stream stream, F32Math f32) {
  const AttentionShape shape{B, NH, T, C / NH, causal};
  const int64_t BT = (int64_t)B * T;
  if (std::is_same_v<S, float> || tensor_core_ok(C, NH, {dqkv, dout, qkv, out})) {
    // deterministic: the fp32 path always is; the tensor-core path then computes dq in its own pass, no atomics.
    // kv_sums: (K | V, head, column) is dbias's order past its Q third.
    const bool kv = flash_attention_backward(dqkv, dqkv + C, dqkv + 2 * C, qkv_strides(T, C, NH), dout, out,
                                             out_strides(T, C, NH), qkv, qkv + C, qkv + 2 * C, lse, shape,
                                             dtype_of<S>(), !std::is_same_v<S, float>, stream, f32,
                                             dbias ? dbias + C : nullptr);
    if (dbias) bias_backward(dbias, (const S*)dqkv, BT, kv ? C : 3 * C, stream, 3 * C);
    return;
  }
  Scratch dout32(BT * C, stream), qkv32(BT * 3 * C, stream), out32(BT * C, stream), dqkv32(BT * 3 * C, stream);
  attention_backward<float>(dqkv32.ptr, widened(dout32, dout, BT * C, stream), widened(qkv32, qkv, BT * 3 * C, stream),
                            widened(out32, out, BT * C, stream), lse, B, T, C, NH, causal, nullptr, stream);
  narrow(dqkv, dqkv32.ptr, BT * 3 * C, RoundKey{}, stream);
  if (dbias) bias_backward(dbias, (const S*)dqkv, BT, 3 * C, stream);
}

#define FASTGPT_INSTANTIATE(S)                                                                                 \
  template void attention_forward<S>(S*, float*, const S*, int, int, int, int, bool, Stream, F32Math);        \
  template void attention_backward<S>(S*, const S*, const S*, const S*, const float*, int, int, int, int, bool, \
                                      float*, Stream, F32Math);
FASTGPT_INSTANTIATE(float)
FASTGPT_INSTANTIATE(bf16)
FASTGPT_INSTANTIATE(f16)
#undef FASTGPT_INSTANTIATE

}  // namespace fastgpt::cuda
