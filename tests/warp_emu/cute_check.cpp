// Holds the Hopper flash attention kernels' reading of wgmma (csrc/cuda/wgmma.cuh, flash_attention_sm90.cuh) and the
// warp emulator's (emu.h) to CUTLASS's CuTe, whose GMMA layouts and descriptors run on Hopper in CUTLASS's own kernels.
// The sm90 kernels and the emulator were both written from one reading of the PTX ISA; were that reading wrong, they
// would agree with each other and the emulator would pass them. Here the same questions are answered by CuTe's code:
// - where the kernels' tile loader puts element (r, c): CuTe's 128-byte swizzled K-major layout of the tile, and its
//   MN-major layout of the same bytes (the transposed operands);
// - the descriptors the kernels pass: those CuTe's make_gmma_desc and a TiledMMA partition make for each
//   warpgroup's 64 x 16 (A) or N x 16 (B) slice of those tiles, for every tile size and head dim the kernels use;
// - the element the emulator reads through such a descriptor: CuTe's address of that element of the slice;
// - the emulator's accumulator and register-A maps: CuTe's CLayout_64xN and ALayout_64x16;
// - the TMA loader (tma.cuh, the emulator's copies): the same placement, and the swizzle mode tma.cu encodes
//   (CU_TENSOR_MAP_SWIZZLE_128B) is the one CuTe's TMA takes for that shared-memory layout.
// Built by run.sh's "cute" mode against CUTLASS's headers (CUTLASS_INCLUDE); the kernels' helpers are compiled from
// their own sources with the emulator's asm swapped in, as in every other mode.
#include <cstddef>
#include <cstdint>

// CuTe takes a descriptor's start address from the shared-memory pointer (cvta): on the host, the offset from this
// 1024-byte aligned stand-in for shared memory.
alignas(1024) static unsigned char g_smem[2 * 192 * 128 * 2 + 4096];
#define CUTE_CVTA_GENERIC_TO_SHARED_ACTIVATED 1
namespace cute {
inline size_t __cvta_generic_to_shared(const void* p) { return (size_t)((const unsigned char*)p - g_smem); }
}  // namespace cute
#include <cute/atom/copy_traits_sm90_tma_swizzle.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include "cuda/flash_attention_sm90.cuh"
#include "cuda/tma.cuh"

using namespace cute;
namespace sm90 = fastgpt::cuda::flash::sm90;
namespace flash = fastgpt::cuda::flash;
using Elem = __nv_bfloat16;

static int g_checks = 0, g_failures = 0;
static void check(bool ok, const char* what, int a = 0, int b = 0, int c = 0, int d = 0) {
  g_checks++;
  if (ok) return;
  if (++g_failures <= 20) printf("FAIL %s (%d %d %d %d)\n", what, a, b, c, d);
}

// The kernels' loader in the emulator: a tile of ROWS x D elements whose value is their index r * D + c (rows at or
// past T are zero), copied into shared memory, then back out byte for byte.
template <int ROWS, int D>
void load_kernel(const uint16_t* src, int T, uint16_t* out) {
  unsigned char* tile = sm90::aligned(emu::smem());
  sm90::load<Elem, ROWS, D, 128>(tile, reinterpret_cast<const Elem*>(src), D, 0, T, threadIdx.x);
  fastgpt::cuda::cp_async_commit();
  fastgpt::cuda::cp_async_wait<0>();
  __syncthreads();
  for (int i = threadIdx.x; i < ROWS * D; i += 128) memcpy(&out[i], tile + 2 * i, 2);
}

// The TMA loader in the emulator: the tile of rows [0, ROWS) of head (b, h) of a tensor map (rows at or past T
// zero), one thread asking, everyone waiting on the mbarrier, then back out byte for byte.
template <int ROWS, int D>
void tma_kernel(const fastgpt::cuda::tma::HeadsMap* m, int b, int h, uint16_t* out) {
  namespace wgmma = fastgpt::cuda::wgmma;
  unsigned char* tile = sm90::aligned(emu::smem());
  const uint32_t bar = wgmma::shared_addr(tile + sm90::tile_bytes<ROWS, D>());
  if (threadIdx.x == 0) wgmma::mbar_init(bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    fastgpt::cuda::tma::arrive_expect(bar, sm90::tile_bytes<ROWS, D>());
    fastgpt::cuda::tma::load_tile<ROWS, D>(wgmma::shared_addr(tile), *m, bar, 0, h, b);
  }
  wgmma::mbar_wait(bar, 0);
  for (int i = threadIdx.x; i < ROWS * D; i += 128) memcpy(&out[i], tile + 2 * i, 2);
}

// The byte offset of element (i, j) of a CuTe tensor over g_smem.
template <class Tensor>
int offset_of(Tensor const& t, int i, int j) {
  return (int)((const unsigned char*)raw_pointer_cast(&t(i, j)) - g_smem);
}

template <int ROWS, int D>
void check_tile() {
  // The loader against CuTe's layouts.
  const int T = ROWS - 3, bytes = sm90::tile_bytes<ROWS, D>();
  std::vector<uint16_t> src(ROWS * D), out(ROWS * D);
  for (int i = 0; i < ROWS * D; i++) src[i] = (uint16_t)(i + 1);
  emu::FuncSetAttribute(load_kernel<ROWS, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes + 1024);
  emu::launch(load_kernel<ROWS, D>, dim3(1), dim3(128), bytes + 1024, nullptr, src.data(), T, out.data());
  auto kmaj = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)g_smem),
                          tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<ROWS>, Int<D>>{}));
  // The MN-major view (mn = column c, k = row r): 64 x 8 atoms stacked down the rows first, as the loader fills them.
  auto mnmaj = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)g_smem),
                           tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<D>, Int<ROWS>>{},
                                         Step<_2, _1>{}));
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < D; c++) {
      const int at = offset_of(kmaj, r, c);
      check(at % 2 == 0 && at < bytes && out[at / 2] == (r < T ? src[r * D + c] : 0), "loader vs K-major", ROWS, D, r,
            c);
      check(offset_of(mnmaj, c, r) == at, "MN-major view vs K-major", ROWS, D, r, c);
    }
  // The TMA loader against the same layout: head (1, 2) of a (B 2, T, H 3, D) tensor in the bthd layout (the map
  // orders H before T by stride), and CuTe's TMA would encode this layout with the 128-byte swizzle tma.cu asks for.
  const int B = 2, H = 3;
  std::vector<uint16_t> heads((size_t)B * T * H * D);
  for (size_t i = 0; i < heads.size(); i++) heads[i] = (uint16_t)(i * 7 + 1);
  fastgpt::cuda::tma::HeadsMap m;
  const bool made = fastgpt::cuda::tma::make_heads_map(m, heads.data(), B, H, T, D, {(int64_t)T * H * D, D, H * D},
                                                       ROWS);
  check(made && m.slot_h == 1 && m.slot_t == 2 && m.slot_b == 3, "TMA map: the dims by stride", ROWS, D);
  std::fill(out.begin(), out.end(), 0xffff);
  emu::FuncSetAttribute(tma_kernel<ROWS, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes + 1024 + 8);
  emu::launch(tma_kernel<ROWS, D>, dim3(1), dim3(128), bytes + 1024 + 8, nullptr, &m, 1, 2, out.data());
  for (int r = 0; r < ROWS; r++)
    for (int c = 0; c < D; c++) {
      const int at = offset_of(kmaj, r, c);
      check(out[at / 2] == (r < T ? heads[((size_t)(T + r) * H + 2) * D + c] : 0), "TMA loader vs K-major", ROWS, D,
            r, c);
    }
  // (CuTe's to_CUtensorMapSwizzle, compiled for nvcc only, turns the pair (B128, 16-byte base) into
  // CU_TENSOR_MAP_SWIZZLE_128B.)
  const auto atom = GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{};
  check(detail::get_tma_swizzle_bits(atom) == TMA::SmemSwizzleBits::B128 &&
            detail::get_tma_swizzle_base(atom) == TMA::SmemSwizzleBase::SWIZZLE_BASE_16B,
        "CuTe's TMA swizzle mode for the tiles' layout", ROWS, D);
}

// Every descriptor of a warpgroup's slices in one TiledMMA pass: A (K-major) slices of an (M, D) tile, B slices of
// an (N, D) K-major tile (S = Q K^T and its kin) or of a (D, N) MN-major one (O = P V and its kin); the kernels'
// descriptors must be CuTe's, and the emulator must read CuTe's element through each.
template <class Desc, class Part>
void check_slices(Desc const& ours, Desc const& cutes, Part const& part, int mn_size, bool mn_major, const char* what,
                  int a, int b) {
  // An MN-major operand 64 wide is one block of 64 columns: the leading byte offset (to the next block) is never
  // read, and CuTe leaves it 0 where the kernels give the tile's block stride.
  const uint64_t lbo = mn_major && mn_size == 64 ? 0x3FFFull << 16 : 0;
  check((ours & ~lbo) == (cutes & ~lbo), what, a, b, (int)ours, (int)cutes);
  for (int mn = 0; mn < mn_size; mn++)
    for (int k = 0; k < 16; k++)
      check(emu::wg_swizzle(emu::wg_operand_addr(ours, mn, k, mn_major)) ==
                (uint32_t)((const unsigned char*)raw_pointer_cast(&part(make_coord(make_coord(mn, k)))) - g_smem),
            "emulator's operand address", a, b, mn, k);
}

template <int M, int N, int D>
void check_ss() {  // A: rows of an M x D tile at 0; B: an N x D tile after it (1024-byte aligned)
  constexpr int kB = sm90::tile_bytes<M, D>();
  using Op = std::conditional_t<N == 64, SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>,
                                SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>>;
  auto mma = make_tiled_mma(Op{}, Layout<Shape<Int<M / 64>, _1, _1>>{});
  auto sA = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)g_smem),
                        tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<M>, Int<D>>{}));
  auto sB = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)(g_smem + kB)),
                        tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<N>, Int<D>>{}));
  for (int w = 0; w < M / 64; w++) {
    auto thr = mma.get_thread_slice(128 * w);
    auto pA = thr.partition_A(sA);  // ((64, 16), 1, D / 16)
    auto pB = thr.partition_B(sB);  // ((N, 16), 1, D / 16)
    auto dA = thr.partition_fragment_A(sA), dB = thr.partition_fragment_B(sB);
    for (int kk = 0; kk < D / 16; kk++) {
      check_slices<uint64_t>(sm90::kmajor<M>(0, 64 * w, kk), dA(0, 0, kk), pA(_, 0, kk), 64, false, "K-major A", M,
                             64 * 100 * w + kk);
      check_slices<uint64_t>(sm90::kmajor<N>(kB, 0, kk), dB(0, 0, kk), pB(_, 0, kk), N, false, "K-major B", N, kk);
    }
  }
}

template <int K, int D>
void check_rs() {  // B: a K x D tile (K rows of the reduction, D columns = N) read MN-major
  using Op = std::conditional_t<D == 64, SM90_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>,
                                SM90_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>>;
  auto mma = make_tiled_mma(Op{});
  auto sB = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)g_smem),
                        tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<D>, Int<K>>{},
                                      Step<_2, _1>{}));
  auto thr = mma.get_thread_slice(0);
  auto pB = thr.partition_B(sB);
  auto dB = thr.partition_fragment_B(sB);
  for (int ks = 0; ks < K / 16; ks++)
    check_slices<uint64_t>(sm90::mnmajor<K>(0, ks), dB(0, 0, ks), pB(_, 0, ks), D, true, "MN-major B", K, ks);
}

// The fused backward's dQ = dS K (flash_attention_bwd_sm90a.cu): A = dS, MN-major, from the (128 keys, 64 queries)
// dS^T tile at 0 that store_ds writes; B = K, K-major, 32 columns (N) at a time from the (D, 128 keys) K^T tile that
// transpose writes, after it. The elements' offsets (sm90::offset) and the descriptors must be CuTe's.
template <int D>
void check_amn() {
  constexpr int KB = 128, kB = sm90::tile_bytes<KB, 64>();
  auto sA = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)g_smem),
                        tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>{}, Shape<_64, Int<KB>>{},
                                      Step<_2, _1>{}));
  auto sB = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)(g_smem + kB)),
                        tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{}, Shape<Int<D>, Int<KB>>{}));
  for (int key = 0; key < KB; key++) {
    for (int q = 0; q < 64; q++) check(sm90::offset<KB>(key, q) == offset_of(sA, q, key), "dS^T element", key, q);
    for (int x = 0; x < D; x++) check(kB + sm90::offset<D>(x, key) == offset_of(sB, x, key), "K^T element", D, x, key);
  }
  auto mma = make_tiled_mma(SM90_64x32x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::K>{});
  auto thr = mma.get_thread_slice(0);
  auto pA = thr.partition_A(sA);
  auto dA = thr.partition_fragment_A(sA);
  for (int ks = 0; ks < KB / 16; ks++)
    check_slices<uint64_t>(sm90::mnmajor<KB>(0, ks), dA(0, 0, ks), pA(_, 0, ks), 64, true, "MN-major A", D, ks);
  for (int n0 = 0; n0 < D; n0 += 32) {
    auto sBn = local_tile(sB, Shape<_32, Int<KB>>{}, make_coord(n0 / 32, 0));
    auto pB = thr.partition_B(sBn);
    auto dB = thr.partition_fragment_B(sBn);
    for (int ks = 0; ks < KB / 16; ks++)
      check_slices<uint64_t>(sm90::kmajor<D>(kB, n0, ks), dB(0, 0, ks), pB(_, 0, ks), 32, false, "K-major B of 32",
                             D * 1000 + n0, ks);
  }
}

// The 128-query warp-specialised backward's dQ = dS K (flash_attention_bwd_ws_sm90a.cu's dq_rows_product): A = dS,
// MN-major, warpgroup wg's 64 queries (column block wg, mnmajor_block) of the (128 keys, 128 queries) dS^T tile at 0
// that store_ds writes; B = K, MN-major (d along N, as V in P V) from the (128 keys, 64) K tile after it, as the
// loader's TMA copy leaves it. The elements' offsets and the descriptors must be CuTe's.
void check_mn() {
  constexpr int KB = 128, kB = sm90::tile_bytes<KB, 128>();
  auto sA = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)g_smem),
                        tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>{}, Shape<_128, Int<KB>>{},
                                      Step<_2, _1>{}));
  auto sB = make_tensor(make_smem_ptr((cutlass::bfloat16_t*)(g_smem + kB)),
                        tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::bfloat16_t>{}, Shape<_64, Int<KB>>{},
                                      Step<_2, _1>{}));
  for (int key = 0; key < KB; key++) {
    for (int q = 0; q < 128; q++) check(sm90::offset<KB>(key, q) == offset_of(sA, q, key), "dS^T element", key, q);
    for (int x = 0; x < 64; x++) check(kB + sm90::offset<KB>(key, x) == offset_of(sB, x, key), "K element", key, x);
  }
  auto mma = make_tiled_mma(SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{});
  auto thr = mma.get_thread_slice(0);
  for (int wg = 0; wg < 2; wg++) {
    auto sAw = local_tile(sA, Shape<_64, Int<KB>>{}, make_coord(wg, 0));
    auto pA = thr.partition_A(sAw);
    auto dA = thr.partition_fragment_A(sAw);
    for (int ks = 0; ks < KB / 16; ks++)
      check_slices<uint64_t>(sm90::mnmajor_block<KB>(0, wg, ks), dA(0, 0, ks), pA(_, 0, ks), 64, true,
                             "MN-major A of a column block", wg, ks);
  }
  auto pB = thr.partition_B(sB);
  auto dB = thr.partition_fragment_B(sB);
  for (int ks = 0; ks < KB / 16; ks++)
    check_slices<uint64_t>(sm90::mnmajor<KB>(kB, ks), dB(0, 0, ks), pB(_, 0, ks), 64, true, "MN-major B of K", KB, ks);
}

template <int N>
void check_registers() {
  for (int t = 0; t < 128; t++)
    for (int i = 0; i < N / 2; i++) {
      int row, col;
      emu::wg_acc_coord(t, i, row, col);
      const int idx = GMMA::CLayout_64xN<N>{}(t, i);  // m + 64 n
      check(row == idx % 64 && col == idx / 64, "accumulator layout", N, t, i);
    }
  for (int t = 0; t < 128; t++)
    for (int v = 0; v < 8; v++) {  // value v: 16-bit half v % 2 of register v / 2
      const int idx = GMMA::ALayout_64x16{}(t, v);
      int home, reg;
      bool upper;
      emu::wg_a_home(idx % 64, idx / 64, home, reg, upper);
      check(home == t && reg == v / 2 && upper == (v % 2 == 1), "register A layout", t, v);
    }
}

int main() {
  check_tile<64, 64>(), check_tile<128, 64>(), check_tile<192, 64>();
  check_tile<64, 128>(), check_tile<128, 128>();
  // The forward's S = Q K^T (M = 64, 128, 192 query rows; N = 64 or 128 keys), the backward's S^T = K Q^T,
  // dP^T = V dO^T (128 keys x 64 queries) and dq's S = Q K^T (128 queries x 64 keys).
  check_ss<64, 64, 64>(), check_ss<128, 64, 64>(), check_ss<128, 128, 64>(), check_ss<192, 128, 64>();
  check_ss<64, 64, 128>(), check_ss<128, 64, 128>(), check_ss<128, 128, 128>();
  // O = P V (K = 64 or 128 keys), dQ = dS K (64 keys), dV = P^T dO and dK = dS^T Q (64 queries).
  check_rs<64, 64>(), check_rs<128, 64>(), check_rs<64, 128>(), check_rs<128, 128>();
  check_amn<64>(), check_amn<128>();  // the fused backward's dQ = dS K
  check_mn();                         // and the 128-query warp-specialised one's
  check_registers<32>(), check_registers<64>(), check_registers<128>();
  printf("cute checks %d failures %d\n", g_checks, g_failures);
  return g_failures != 0;
}
