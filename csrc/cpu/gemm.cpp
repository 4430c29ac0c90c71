// Packed single-precision GEMM (see gemm.h). Goto/BLIS-style: op(B) is packed into NR-wide column panels shared
// by all threads, each thread packs MR-tall row panels of op(A) into its own buffer, and a register-blocked
// MR x NR micro-kernel written with GCC/Clang vector extensions does the flops. The vector width follows the
// target ISA at compile time, so the same source is portable and gets AVX-512 code under -march=native.
//
// Determinism: threads split only the M x N output into tiles; K is walked block by block in the same order for
// every element, and the block sizes are constants (never derived from the thread count), so the result is
// bitwise identical for any OMP_NUM_THREADS.
#include "cpu/gemm.h"

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace fastgpt::cpu {
namespace {

// Micro-tile: MR rows x NV vectors. Accumulators plus the B vectors must fit the register file, or the kernel spills.
#if defined(__AVX512F__)
// 32 zmm registers: 14 x 2 accumulators + 2 B vectors + 1 broadcast A.
constexpr int kVecBytes = 64;
constexpr int MR = 14;
constexpr int NV = 2;
#elif defined(__AVX__)
// 16 ymm registers: 6 x 2 accumulators + 2 B vectors + 1 broadcast A.
constexpr int kVecBytes = 32;
constexpr int MR = 6;
constexpr int NV = 2;
#else
// 16 xmm registers (SSE baseline), same budget.
constexpr int kVecBytes = 16;
constexpr int MR = 6;
constexpr int NV = 2;
#endif

constexpr int VW = kVecBytes / static_cast<int>(sizeof(float));  // floats per vector
constexpr int NR = NV * VW;                                        // micro-tile width

// KC: depth of one packed block; the A micro-panel (MR x KC, 21 KiB on AVX-512) stays in L1 while the kernel
// sweeps the B panels of a tile, and the packed A block (MB x KC) plus the tile's B columns (KC x NB) share L2.
// NC bounds the shared packed-B buffer (KC x NC floats, 6 MiB). KC is the only one that affects rounding (the
// K sum is split at multiples of KC); all are fixed constants, never derived from the thread count.
// Tuned on a 2-core Sapphire Rapids (48 KiB L1d, 2 MiB L2); KC 256..384 and MB 168..336 were within noise.
constexpr int64_t KC = 384;
constexpr int64_t MB = (168 + MR - 1) / MR * MR;
constexpr int64_t NB = (512 + NR - 1) / NR * NR;
constexpr int64_t NC = (4096 + NB - 1) / NB * NB;
// Below this many output tiles the N tiles are narrowed (a shape rule, independent of the thread count).
constexpr int64_t kMinTiles = 32;

typedef float vf __attribute__((vector_size(kVecBytes)));
// Same vector type without the alignment promise, for C rows (ldc is arbitrary).
typedef float vfu __attribute__((vector_size(kVecBytes), aligned(alignof(float))));

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Grow-only 64-byte aligned scratch, one per calling thread: packing buffers reach megabytes, and allocating them
// per call would pay page faults on every GEMM.
struct Scratch {
  float* ptr = nullptr;
  size_t cap = 0;
  float* get(size_t n) {
    if (n > cap) {
      std::free(ptr);
      ptr = nullptr;
      cap = 0;
      size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
      ptr = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (!ptr) throw std::bad_alloc();
      cap = n;
    }
    return ptr;
  }
  ~Scratch() { std::free(ptr); }
};

// Writes the MR x NR accumulator tile: c = alpha*acc + beta*c, or alpha*acc without reading c when overwrite.
// The first K block applies the caller's beta; later blocks accumulate (beta = 1).
inline void store_tile(const vf (&acc)[MR][NV], float* c, int64_t ldc, float alpha, float beta, bool overwrite) {
  if (overwrite) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) *reinterpret_cast<vfu*>(c + r * ldc + v * VW) = acc[r][v] * alpha;
  } else if (beta == 1.0f) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        vfu* p = reinterpret_cast<vfu*>(c + r * ldc + v * VW);
        *p = acc[r][v] * alpha + *p;
      }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        vfu* p = reinterpret_cast<vfu*>(c + r * ldc + v * VW);
        *p = acc[r][v] * alpha + *p * beta;
      }
  }
}

// acc(MR x NR) = sum_k a[k][0..MR) (x) b[k][0..NR), then merged into C. a and b are packed panels; b is 64-byte
// aligned. Accumulators start at zero so that every element of C sees the same per-block sum, full tile or not.
inline void micro_kernel(int64_t kc, const float* __restrict a, const float* __restrict b, float* c, int64_t ldc,
                         float alpha, float beta, bool overwrite) {
  vf acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  // C is usually far away (L3 or DRAM); start fetching the tile now so the merge at the end does not stall.
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    __builtin_prefetch(c + r * ldc, 1);
    __builtin_prefetch(c + r * ldc + NR - 1, 1);
  }

#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    vf bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const vf*>(b + v * VW);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const float ar = a[r];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += bv[v] * ar;
    }
    a += MR;
    b += NR;
  }
  store_tile(acc, c, ldc, alpha, beta, overwrite);
}

// Edge tiles (mr < MR or nr < NR) run the full kernel into a private tile, then merge only the valid part with
// the same formula, so padded rows/columns never touch C.
void edge_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int64_t mr, int64_t nr,
                 float alpha, float beta, bool overwrite) {
  alignas(64) float tmp[MR * NR];
  micro_kernel(kc, a, b, tmp, NR, 1.0f, 0.0f, true);
  for (int64_t r = 0; r < mr; ++r) {
    float* crow = c + r * ldc;
    const float* trow = tmp + r * NR;
    if (overwrite) {
      for (int64_t j = 0; j < nr; ++j) crow[j] = trow[j] * alpha;
    } else if (beta == 1.0f) {
      for (int64_t j = 0; j < nr; ++j) crow[j] = trow[j] * alpha + crow[j];
    } else {
      for (int64_t j = 0; j < nr; ++j) crow[j] = trow[j] * alpha + crow[j] * beta;
    }
  }
}

// Packs rows [i0, i0+mc) x cols [p0, p0+kc) of op(A) as MR-tall panels: panel-major, then k, then the MR rows.
// Rows past mc are zero so the kernel never needs a row count.
void pack_a(bool trans_a, const float* A, int64_t lda, int64_t i0, int64_t mc, int64_t p0, int64_t kc, float* dst) {
  if (!trans_a) {
    // op(A)(i,k) = A[i*lda + k]: gather MR row streams into k-major order.
    for (int64_t ir = 0; ir < mc; ir += MR) {
      const int64_t mr = std::min<int64_t>(MR, mc - ir);
      float* d = dst + ir * kc;
      const float* rows[MR];
      for (int r = 0; r < MR; ++r) rows[r] = A + (i0 + ir + std::min<int64_t>(r, mr - 1)) * lda + p0;
      if (mr == MR) {
        for (int64_t k = 0; k < kc; ++k)
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) d[k * MR + r] = rows[r][k];
      } else {
        for (int64_t k = 0; k < kc; ++k)
          for (int r = 0; r < MR; ++r) d[k * MR + r] = r < mr ? rows[r][k] : 0.0f;
      }
    }
    return;
  }
  // op(A)(i,k) = A[k*lda + i]: row k of A holds all mc values contiguously, so walk A row by row (one sequential
  // run per k instead of MR-float snippets from kc far-apart rows) and scatter MR-long pieces into the panels.
  // Consecutive rows are lda apart (often hundreds of KiB, i.e. a new page each), which the hardware prefetcher
  // does not follow, so fetch a few rows ahead by hand: without it the weight-gradient shape runs ~30% slower.
  constexpr int64_t kAhead = 8;
  for (int64_t k = 0; k < kc; ++k) {
    const float* src = A + (p0 + k) * lda + i0;
    if (k + kAhead < kc) {
      const float* next = src + kAhead * lda;
      for (int64_t i = 0; i < mc; i += 16) __builtin_prefetch(next + i);
      __builtin_prefetch(next + mc - 1);
    }
    int64_t ir = 0;
    for (; ir + MR <= mc; ir += MR) {
      float* d = dst + ir * kc + k * MR;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) d[r] = src[ir + r];
    }
    if (ir < mc) {
      float* d = dst + ir * kc + k * MR;
      for (int r = 0; r < MR; ++r) d[r] = ir + r < mc ? src[ir + r] : 0.0f;
    }
  }
}

// Interleave the low / high halves of two vectors (a0 b0 a1 b1 ...). log2(VW) rounds of interleaving row i with
// row i + VW/2 transpose a VW x VW block; one two-source permute per output vector on AVX-512.
#if defined(__AVX512F__)
#define FASTGPT_ZIP_LO 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define FASTGPT_ZIP_HI 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#elif defined(__AVX__)
#define FASTGPT_ZIP_LO 0, 8, 1, 9, 2, 10, 3, 11
#define FASTGPT_ZIP_HI 4, 12, 5, 13, 6, 14, 7, 15
#else
#define FASTGPT_ZIP_LO 0, 4, 1, 5
#define FASTGPT_ZIP_HI 2, 6, 3, 7
#endif

inline void transpose_in_registers(vf (&rows)[VW]) {
#pragma GCC unroll 4
  for (int step = 1; step < VW; step *= 2) {
    vf t[VW];
#pragma GCC unroll 16
    for (int i = 0; i < VW / 2; ++i) {
      t[2 * i] = __builtin_shufflevector(rows[i], rows[i + VW / 2], FASTGPT_ZIP_LO);
      t[2 * i + 1] = __builtin_shufflevector(rows[i], rows[i + VW / 2], FASTGPT_ZIP_HI);
    }
#pragma GCC unroll 16
    for (int i = 0; i < VW; ++i) rows[i] = t[i];
  }
}

// Packs one NR-wide panel of op(B): rows [p0, p0+kc), cols [j0, j0+nr), k-major, zero-padded to NR columns.
void pack_b_panel(bool trans_b, const float* B, int64_t ldb, int64_t p0, int64_t kc, int64_t j0, int64_t nr,
                  float* d) {
  if (!trans_b) {
    // op(B)(k,j) = B[k*ldb + j]: contiguous rows.
    const float* src = B + p0 * ldb + j0;
    if (nr == NR) {
      for (int64_t k = 0; k < kc; ++k)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          *reinterpret_cast<vf*>(d + k * NR + v * VW) = *reinterpret_cast<const vfu*>(src + k * ldb + v * VW);
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t j = 0; j < NR; ++j) d[k * NR + j] = j < nr ? src[k * ldb + j] : 0.0f;
    }
  } else {
    // op(B)(k,j) = B[j*ldb + k]: a transpose. Whole VW x VW blocks go through registers; the ragged k tail and
    // partial panels fall back to scalar copies.
    const float* src = B + j0 * ldb + p0;
    int64_t k0 = 0;
    if (nr == NR) {
      for (; k0 + VW <= kc; k0 += VW) {
#pragma GCC unroll 4
        for (int g = 0; g < NV; ++g) {
          vf rows[VW];
#pragma GCC unroll 16
          for (int r = 0; r < VW; ++r) rows[r] = *reinterpret_cast<const vfu*>(src + (g * VW + r) * ldb + k0);
          transpose_in_registers(rows);
#pragma GCC unroll 16
          for (int c = 0; c < VW; ++c) *reinterpret_cast<vf*>(d + (k0 + c) * NR + g * VW) = rows[c];
        }
      }
    }
    for (int64_t j = 0; j < NR; ++j) {
      const float* s = src + j * ldb;
      for (int64_t k = k0; k < kc; ++k) d[k * NR + j] = j < nr ? s[k] : 0.0f;
    }
  }
}

// C = beta*C for the degenerate cases (K == 0 or alpha == 0), where op(A)*op(B) contributes nothing.
void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t i = 0; i < M; ++i) {
    float* row = C + i * ldc;
    if (beta == 0.0f) {
      std::fill(row, row + N, 0.0f);
    } else if (beta != 1.0f) {
      for (int64_t j = 0; j < N; ++j) row[j] *= beta;
    }
  }
}

}  // namespace

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.0f) {
    scale_c(M, N, beta, C, ldc);
    return;
  }

  // Output tiles are whole MR x NR micro-tiles, spread as evenly as possible: M is cut into m_tiles runs of MR-row
  // panels (at most MB rows each), each NC-wide column block into runs of NR-column panels (at most NB wide).
  // When M alone gives few tiles the N runs get narrower, so small-M products still spread over the cores. Tile
  // shapes never change rounding (every element goes through the same micro-tile grid anchored at the origin),
  // so they are free to follow the shape; they never follow the thread count anyway.
  const int64_t m_panels = (M + MR - 1) / MR;
  const int64_t m_tiles = (m_panels + MB / MR - 1) / (MB / MR);
  const int64_t kc_cap = std::min(KC, K);
  const int64_t nc_cap = std::min(NC, round_up(N, NR));
  const int64_t mb_cap = (m_panels + m_tiles - 1) / m_tiles * MR;
  int64_t nb = NB;
  while (nb > NR && m_tiles * ((nc_cap + nb - 1) / nb) < kMinTiles) nb = round_up(nb / 2, NR);

  const int max_threads = omp_get_max_threads();
  const size_t b_size = static_cast<size_t>(kc_cap * nc_cap);
  const size_t a_stride = static_cast<size_t>(round_up(mb_cap * kc_cap, 16));  // keeps each thread 64-byte aligned
  static thread_local Scratch scratch;
  float* const bpack = scratch.get(b_size + a_stride * static_cast<size_t>(max_threads));
  float* const apack_all = bpack + b_size;

#pragma omp parallel num_threads(max_threads)
  {
    float* const apack = apack_all + a_stride * static_cast<size_t>(omp_get_thread_num());
    for (int64_t jc = 0; jc < N; jc += NC) {
      const int64_t nc = std::min(NC, N - jc);
      const int64_t n_panels = (nc + NR - 1) / NR;
      const int64_t n_tiles = std::min(n_panels, (nc + nb - 1) / nb);
      for (int64_t pc = 0; pc < K; pc += KC) {
        const int64_t kc = std::min(KC, K - pc);
        const bool first = pc == 0;
        const bool overwrite = first && beta == 0.0f;
        const float blk_beta = first ? beta : 1.0f;

#pragma omp for schedule(static)
        for (int64_t p = 0; p < n_panels; ++p) {
          const int64_t jr = p * NR;
          pack_b_panel(trans_b, B, ldb, pc, kc, jc + jr, std::min<int64_t>(NR, nc - jr), bpack + jr * kc);
        }
        // (implicit barrier: the packed B block is complete)

        int64_t packed_ib = -1;  // this thread's packed A block, reused across consecutive N tiles
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m_tiles * n_tiles; ++t) {
          const int64_t ib = t / n_tiles;
          const int64_t jb = t % n_tiles;
          const int64_t i0 = ib * m_panels / m_tiles * MR;
          const int64_t mc = std::min(M, (ib + 1) * m_panels / m_tiles * MR) - i0;
          if (ib != packed_ib) {
            pack_a(trans_a, A, lda, i0, mc, pc, kc, apack);
            packed_ib = ib;
          }
          const int64_t j0 = jb * n_panels / n_tiles * NR;
          const int64_t j1 = std::min(nc, (jb + 1) * n_panels / n_tiles * NR);
          for (int64_t ir = 0; ir < mc; ir += MR) {
            const int64_t mr = std::min<int64_t>(MR, mc - ir);
            const float* ap = apack + ir * kc;
            for (int64_t jr = j0; jr < j1; jr += NR) {
              const int64_t nr = std::min<int64_t>(NR, j1 - jr);
              const float* bp = bpack + jr * kc;
              float* cp = C + (i0 + ir) * ldc + jc + jr;
              if (mr == MR && nr == NR) {
                micro_kernel(kc, ap, bp, cp, ldc, alpha, blk_beta, overwrite);
              } else {
                edge_kernel(kc, ap, bp, cp, ldc, mr, nr, alpha, blk_beta, overwrite);
              }
            }
          }
        }
        // (implicit barrier: nobody still reads bpack when the next block overwrites it)
      }
    }
  }
}

}  // namespace fastgpt::cpu
