// Causal (or full) scaled dot-product attention on the CPU, the way a flash kernel does it, and the reference for
// csrc/cuda/flash_attention.cu: q, k, v, out are (B, H, T, d) views with any batch/head/row strides (HeadStrides),
// so the same code serves separate (B, H, T, d) or (B, T, H, d) tensors and the engine's fused qkv. Forward keeps only
// the log-sum-exp of each score row, backward recomputes the probabilities from it. No T x T matrix is ever stored:
// work goes by blocks of kBlock query rows, so scratch is O(kBlock * T + T * hs) per thread, and the saved state
// (out, lse) is the same the CUDA flash kernel will save.
// Speed: every product (Q K^T, P V, dO V^T, dS K, dS^T Q, P^T dO) goes through one register-blocked kernel, 4 rows
// by up to 4 vectors of accumulators, whose vectors run along a contiguous axis (the keys, against a transposed copy
// of K or V, else the head dimension), so no dot product ends in a horizontal reduction. Each (b, h) first copies its
// operands into per-thread scratch, zero-padded to whole vectors; padded and masked entries are exact zeros.
// Determinism: each output element is summed in a fixed order that no thread count changes. Threads split over
// (b, h), which own their rows of out/lse and their dq/dk/dv columns, so dk and dv accumulate over query blocks in
// order, without atomics.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <omp.h>

#include "cpu/kernels.h"
#include "cpu/vmath.h"

namespace fastgpt::cpu {

namespace {
#ifdef __AVX512F__
constexpr int kW = 16;  // floats per vector register
#else
constexpr int kW = 8;
#endif
typedef float vf __attribute__((vector_size(kW * sizeof(float))));
constexpr int kBlock = 64;  // query rows per block: one kBlock x T score block per thread

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// c[i][j] (+)= sum_{k < K} a[i * ars + k * acs] * b[k * ldb + j] for i < 4, j < NV * kW: the accumulators stay in
// registers for the whole sum over k, which runs in order.
template <int NV>
void tile(float* c, int64_t ldc, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, int K,
          bool accumulate) {
  vf s[4][NV];
  for (int i = 0; i < 4; i++)
    for (int v = 0; v < NV; v++) s[i][v] = accumulate ? load(c + i * ldc + v * kW) : vf{};
  for (int k = 0; k < K; k++) {
    vf bv[NV];
    for (int v = 0; v < NV; v++) bv[v] = load(b + k * ldb + v * kW);
    for (int i = 0; i < 4; i++) {
      const float ai = a[i * ars + k * acs];
      for (int v = 0; v < NV; v++) s[i][v] += ai * bv[v];
    }
  }
  for (int i = 0; i < 4; i++)
    for (int v = 0; v < NV; v++) store(c + i * ldc + v * kW, s[i][v]);
}

// Four rows of C (4, n) (+)= A (4, K) B (K, n), n a multiple of kW; A's element (i, k) is a[i * ars + k * acs].
void rows4(float* c, int64_t ldc, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, int K,
           int n, bool accumulate) {
  for (int j = 0; j < n; j += 4 * kW) {
    switch (std::min(4, (n - j) / kW)) {
      case 4: tile<4>(c + j, ldc, a, ars, acs, b + j, ldb, K, accumulate); break;
      case 3: tile<3>(c + j, ldc, a, ars, acs, b + j, ldb, K, accumulate); break;
      case 2: tile<2>(c + j, ldc, a, ars, acs, b + j, ldb, K, accumulate); break;
      default: tile<1>(c + j, ldc, a, ars, acs, b + j, ldb, K, accumulate); break;
    }
  }
}

// Rows [0, n) of an (n, hs) matrix with row stride ld, into dst (rows, ldd), zero-padded to `rows` rows.
void copy_rows(float* dst, int64_t ldd, int rows, const float* src, int64_t ld, int n, int hs) {
  std::fill(dst, dst + rows * ldd, 0.f);
  for (int j = 0; j < n; j++) std::memcpy(dst + j * ldd, src + j * ld, hs * sizeof(float));
}

// The same transposed, into dst (hs, ldd), zero-padded to ldd columns. Stores run along dst's rows; the loads are
// strided (gathers where the machine has them).
void copy_transposed(float* dst, int64_t ldd, const float* src, int64_t ld, int n, int hs) {
  for (int d = 0; d < hs; d++) {
    float* row = dst + d * ldd;
#pragma omp simd
    for (int j = 0; j < n; j++) row[j] = src[j * ld + d];
    std::fill(row + n, row + ldd, 0.f);
  }
}

// Width of the scores a group of 4 rows from query g needs: its last row's keys, in whole vectors, at most W.
inline int group_width(int g, int W, bool causal) { return causal ? std::min(round_up(g + 4, kW), W) : W; }

// Per-thread scratch, taken before the parallel region (an allocation that fails inside one would end the process:
// no exception leaves an OpenMP region) in one buffer, zeroed, with each thread's part `per` floats long. The
// kernels index a head's copies with int: refused where a (Tp, hp) copy would not fit.
struct Scratch {
  std::vector<float> all;
  size_t per;
  Scratch(int Tp, int hp, int hs, size_t per_thread) : per(per_thread) {
    if ((int64_t)Tp * std::max(hp, kBlock) >= INT32_MAX || (int64_t)hs * Tp >= INT32_MAX)
      throw std::invalid_argument("flash attention on the CPU: T=" + std::to_string(Tp) + " (padded) by d=" +
                                  std::to_string(hs) + " is too large for one head's copies (2**31 floats)");
    all.resize(per * (size_t)omp_get_max_threads());
  }
  float* mine() { return all.data() + per * (size_t)omp_get_thread_num(); }
};

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}
}  // namespace

void flash_attention_forward(float* out, const HeadStrides& os, float* lse, const float* q_, const float* k_,
                             const float* v_, const HeadStrides& is, const AttentionShape& shape) {
  const int B = shape.B, NH = shape.H, T = shape.T, hs = shape.d, hp = round_up(hs, kW);
  const bool causal = shape.causal;
  const float scale = 1.f / std::sqrt((float)hs);
  const int Tp = round_up(T, kBlock);  // whole blocks, so groups of 4 rows never overrun the copies
  const size_t qb = (size_t)kBlock * hp, ktn = (size_t)hs * Tp, vn = (size_t)Tp * hp, sn = (size_t)kBlock * Tp;
  Scratch scratch(Tp, hp, hs, 2 * qb + ktn + vn + sn);
#pragma omp parallel num_threads(omp_get_max_threads())
  {
    float* const q = scratch.mine();  // (kBlock, hp) rows of q; kt (hs, Tp) K^T; v (Tp, hp); s (kBlock, Tp) scores
    float *const kt = q + qb, *const v = kt + ktn, *const s = v + vn, *const o = s + sn;  // o (kBlock, hp)
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++) {
        const int64_t in = b * is.sb + h * is.sh;
        copy_transposed(kt, Tp, k_ + in, is.st, T, hs);
        copy_rows(v, hp, Tp, v_ + in, is.st, T, hs);
        for (int r0 = 0; r0 < T; r0 += kBlock) {
          const int rows = std::min(kBlock, T - r0), W = round_up(causal ? r0 + rows : T, kW);
          copy_rows(q, hp, kBlock, q_ + in + r0 * is.st, is.st, rows, hs);
          for (int g = 0; g < rows; g += 4)  // q_i . k_j
            rows4(s + g * W, W, q + g * hp, hp, 1, kt, Tp, hs, group_width(r0 + g, W, causal), false);
          float inv[kBlock];
          for (int r = 0; r < rows; r++) {
            const int n = causal ? r0 + r + 1 : T;
            float* p = s + r * W;
            float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
            for (int j = 0; j < n; j++) {
              p[j] *= scale;
              mx = p[j] > mx ? p[j] : mx;
            }
#pragma omp simd
            for (int j = 0; j < n; j++) p[j] = vexp(p[j] - mx);
            double sum = 0.0;  // in double: the row's lse needs the sum of up to T terms to full float accuracy
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; j++) sum += p[j];
            std::fill(p + n, p + W, 0.f);  // masked keys weigh exactly 0 in P V
            lse[((int64_t)b * NH + h) * T + r0 + r] = mx + (float)std::log(sum);
            inv[r] = (float)(1.0 / sum);
          }
          for (int g = 0; g < rows; g += 4)  // o_i = sum_j p_ij v_j
            rows4(o + g * hp, hp, s + g * W, W, 1, v, hp, group_width(r0 + g, W, causal), hp, false);
          for (int r = 0; r < rows; r++) {
            float* y = out + b * os.sb + h * os.sh + (r0 + r) * os.st;
            for (int d = 0; d < hs; d++) y[d] = o[r * hp + d] * inv[r];
          }
        }
      }
  }
}

void flash_attention_backward(float* dq_, float* dk_, float* dv_, const HeadStrides& is, const float* dout,
                              const float* out, const HeadStrides& os, const float* q_, const float* k_,
                              const float* v_, const float* lse, const AttentionShape& shape) {
  const int B = shape.B, NH = shape.H, T = shape.T, hs = shape.d, hp = round_up(hs, kW);
  const bool causal = shape.causal;
  const float scale = 1.f / std::sqrt((float)hs);
  const int Tp = round_up(T, kBlock);
  const size_t rn = (size_t)Tp * hp, tn = (size_t)hs * Tp, bn = (size_t)kBlock * Tp;
  Scratch scratch(Tp, hp, hs, 5 * rn + 2 * tn + 2 * bn + (size_t)kBlock * hp);
#pragma omp parallel num_threads(omp_get_max_threads())
  {
    float* const q = scratch.mine();  // q, k, dy, dk, dv (Tp, hp); kt, vt (hs, Tp); P, dS (kBlock, Tp); dq (kBlock, hp)
    float *const k = q + rn, *const dy = k + rn, *const dk = dy + rn, *const dv = dk + rn, *const kt = dv + rn;
    float *const vt = kt + tn, *const pb = vt + tn, *const dsb = pb + bn, *const dq = dsb + bn;
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++) {
        const int64_t in = b * is.sb + h * is.sh, on = b * os.sb + h * os.sh;
        const float *dyb = dout + on, *yb = out + on;
        copy_rows(q, hp, Tp, q_ + in, is.st, T, hs);
        copy_rows(k, hp, Tp, k_ + in, is.st, T, hs);
        copy_rows(dy, hp, Tp, dyb, os.st, T, hs);
        copy_transposed(kt, Tp, k_ + in, is.st, T, hs);
        copy_transposed(vt, Tp, v_ + in, is.st, T, hs);
        std::fill(dk, dk + rn, 0.f);
        std::fill(dv, dv + rn, 0.f);
        for (int r0 = 0; r0 < T; r0 += kBlock) {
          const int rows = std::min(kBlock, T - r0), W = round_up(causal ? r0 + rows : T, kW);
          float *P = pb, *dS = dsb;
          for (int g = 0; g < rows; g += 4) {
            const int wg = group_width(r0 + g, W, causal);
            rows4(P + g * W, W, q + (r0 + g) * hp, hp, 1, kt, Tp, hs, wg, false);    // q_i . k_j
            rows4(dS + g * W, W, dy + (r0 + g) * hp, hp, 1, vt, Tp, hs, wg, false);  // dout_i . v_j
          }
          for (int r = 0; r < rows; r++) {
            const int i = r0 + r, n = causal ? i + 1 : T;
            float *p = P + r * W, *ds = dS + r * W;
            const float Di = dot(dyb + i * os.st, yb + i * os.st, hs);  // sum_j p_ij dp_ij, as out_i = sum_j p_ij v_j
            const float li = lse[((int64_t)b * NH + h) * T + i];
#pragma omp simd
            for (int j = 0; j < n; j++) {
              p[j] = vexp(p[j] * scale - li);
              ds[j] = p[j] * (ds[j] - Di) * scale;
            }
            std::fill(p + n, p + W, 0.f);  // masked keys: exact zeros in every product below
            std::fill(ds + n, ds + W, 0.f);
          }
          for (int g = 0; g < rows; g += 4)  // dq_i = sum_j ds_ij k_j: row i sees all its keys in this block
            rows4(dq + g * hp, hp, dS + g * W, W, 1, k, hp, group_width(r0 + g, W, causal), hp, false);
          for (int r = 0; r < rows; r++)
            std::memcpy(dq_ + in + (r0 + r) * is.st, dq + r * hp, hs * sizeof(float));
          // dk_j += sum_i ds_ij q_i, dv_j += sum_i p_ij dout_i, over the block's rows from the first that sees key j.
          for (int j = 0; j < W; j += 4) {
            const int rmin = causal ? std::max(0, j - r0) : 0;
            if (rmin >= rows) break;
            rows4(dk + j * hp, hp, dS + rmin * W + j, 1, W, q + (r0 + rmin) * hp, hp, rows - rmin, hp, true);
            rows4(dv + j * hp, hp, P + rmin * W + j, 1, W, dy + (r0 + rmin) * hp, hp, rows - rmin, hp, true);
          }
        }
        for (int t = 0; t < T; t++) {
          std::memcpy(dk_ + in + t * is.st, dk + t * hp, hs * sizeof(float));
          std::memcpy(dv_ + in + t * is.st, dv + t * hp, hs * sizeof(float));
        }
      }
  }
}

}  // namespace fastgpt::cpu
