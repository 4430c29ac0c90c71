// Conversions between float32 and the 16-bit storage types (dtype.h), over whole arrays: widening 16-bit operands
// for the float kernels, and writing compute weights from fp32 masters (to nearest, or stochastically for bf16).
// Plus the per-thread scratch those widened operands live in.
#include <vector>

#include "cpu/kernels.h"

namespace fastgpt::cpu {

template <typename S>
void widen(float* out, const S* in, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = to_float(in[i]);
}

template <typename S>
void narrow(S* out, const float* in, int64_t n, const RoundKey& key) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) out[i] = round_weight<S>(in[i], key, i);
}

template void widen<bf16>(float*, const bf16*, int64_t);
template void widen<f16>(float*, const f16*, int64_t);
template void narrow<bf16>(bf16*, const float*, int64_t, const RoundKey&);
template void narrow<f16>(f16*, const float*, int64_t, const RoundKey&);

float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> slots[kScratchSlots];
  std::vector<float>& s = slots[slot];
  if ((int64_t)s.size() < n) s.resize(n);
  return s.data();
}

}  // namespace fastgpt::cpu
