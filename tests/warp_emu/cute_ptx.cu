// The wgmma instructions csrc/cuda/wgmma.cuh emits, beside CUTLASS's for the same operation: each pair of kernels below
// compiles (nvcc -ptx, sm_90a) to a PTX wgmma line that must be the same once register names are dropped (run.sh's
// "cute" mode compares them). That holds the immediates CUTLASS passes (scale-a, scale-b, transposes: a K-major A and B
// from shared memory, A from registers with an MN-major B, an MN-major A and a K-major B, or both MN-major) and the
// operand order to ours. The warp-specialised forward's synchronisation (mbarrier init / arrive / parity wait, named
// barriers, setmaxnreg), the TMA copies of both warp-specialised kernels (tma.cuh: map prefetch, expected bytes with
// and without an arrival, the 4-d tile copy, the forward's 4-d tensor store of O) and the backward's bulk copies to
// and from global memory are paired with CUTLASS's barrier.h, reg_reconfig.h and copy_sm90_tma.hpp the same way:
// sync_<what> kernels, compared by their instructions (opcode and qualifiers).
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <utility>

#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

namespace wg = fastgpt::cuda::wgmma;
namespace G = cute::SM90::GMMA;

template <class Op, int N, class... A, size_t... I>
__device__ void call_cute(float* d, std::index_sequence<I...>, int accumulate, A... a) {
  Op::fma(a..., d[I]..., accumulate ? G::ScaleOut::One : G::ScaleOut::Zero);
}

// ours_<kind>_<n>_<type> and cute_<kind>_<n>_<type>: one wgmma each, on descriptors and fragments from memory.
#define FASTGPT_PAIR(E, T, N)                                                                                      \
  __global__ void ours_ss_##N##_##T(float* o, uint64_t a, uint64_t b, int acc) {                                  \
    float d[N / 2];                                                                                                \
    for (int i = 0; i < N / 2; i++) d[i] = o[i];                                                                   \
    wg::Mma<E, N>::ss(d, a, b, acc);                                                                               \
    for (int i = 0; i < N / 2; i++) o[i] = d[i];                                                                   \
  }                                                                                                                \
  __global__ void cute_ss_##N##_##T(float* o, uint64_t a, uint64_t b, int acc) {                                  \
    float d[N / 2];                                                                                                \
    for (int i = 0; i < N / 2; i++) d[i] = o[i];                                                                   \
    call_cute<G::MMA_64x##N##x16_F32##T##T##_SS<G::Major::K, G::Major::K>, N>(d, std::make_index_sequence<N / 2>{}, \
                                                                              acc, a, b);                          \
    for (int i = 0; i < N / 2; i++) o[i] = d[i];                                                                   \
  }                                                                                                                \
  __global__ void ours_rs_##N##_##T(float* o, const uint32_t* f, uint64_t b, int acc) {                           \
    float d[N / 2];                                                                                                \
    for (int i = 0; i < N / 2; i++) d[i] = o[i];                                                                   \
    const uint32_t a[4] = {f[0], f[1], f[2], f[3]};                                                                \
    wg::Mma<E, N>::rs(d, a, b, acc);                                                                               \
    for (int i = 0; i < N / 2; i++) o[i] = d[i];                                                                   \
  }                                                                                                                \
  __global__ void cute_rs_##N##_##T(float* o, const uint32_t* f, uint64_t b, int acc) {                           \
    float d[N / 2];                                                                                                \
    for (int i = 0; i < N / 2; i++) d[i] = o[i];                                                                   \
    const uint32_t a0 = f[0], a1 = f[1], a2 = f[2], a3 = f[3];                                                     \
    call_cute<G::MMA_64x##N##x16_F32##T##T##_RS<G::Major::K, G::Major::MN>, N>(                                    \
        d, std::make_index_sequence<N / 2>{}, acc, a0, a1, a2, a3, b);                                             \
    for (int i = 0; i < N / 2; i++) o[i] = d[i];                                                                   \
  }

// The fused backwards' dQ products, both operands from shared memory: ss_amn (N = 32, A MN-major, B K-major) and
// ss_mn (the 128-query warp-specialised backward's, N = 64, both MN-major).
#define FASTGPT_PAIR_SS(E, T, KIND, N, CALL, MA, MB)                                                               \
  __global__ void ours_##KIND##_##N##_##T(float* o, uint64_t a, uint64_t b, int acc) {                             \
    float d[N / 2];                                                                                                \
    for (int i = 0; i < N / 2; i++) d[i] = o[i];                                                                   \
    wg::Mma<E, N>::CALL(d, a, b, acc);                                                                             \
    for (int i = 0; i < N / 2; i++) o[i] = d[i];                                                                   \
  }                                                                                                                \
  __global__ void cute_##KIND##_##N##_##T(float* o, uint64_t a, uint64_t b, int acc) {                             \
    float d[N / 2];                                                                                                \
    for (int i = 0; i < N / 2; i++) d[i] = o[i];                                                                   \
    call_cute<G::MMA_64x##N##x16_F32##T##T##_SS<G::Major::MA, G::Major::MB>, N>(                                   \
        d, std::make_index_sequence<N / 2>{}, acc, a, b);                                                          \
    for (int i = 0; i < N / 2; i++) o[i] = d[i];                                                                   \
  }

FASTGPT_PAIR(__nv_bfloat16, BF16, 64)
FASTGPT_PAIR(__nv_bfloat16, BF16, 128)
FASTGPT_PAIR(__half, F16, 64)
FASTGPT_PAIR(__half, F16, 128)
FASTGPT_PAIR_SS(__nv_bfloat16, BF16, amn, 32, ss_amn, MN, K)
FASTGPT_PAIR_SS(__half, F16, amn, 32, ss_amn, MN, K)
FASTGPT_PAIR_SS(__nv_bfloat16, BF16, mn, 64, ss_mn, MN, MN)
FASTGPT_PAIR_SS(__half, F16, mn, 64, ss_mn, MN, MN)

// ours_sync_<what> and cute_sync_<what>: one synchronisation each, on a shared mbarrier and runtime ids and counts.
__global__ void ours_sync_mbar(uint32_t count, uint32_t parity) {
  __shared__ uint64_t bar;
  const uint32_t a = wg::shared_addr(&bar);
  wg::mbar_init(a, count);
  wg::mbar_arrive(a);
  wg::mbar_wait(a, parity);
}
__global__ void cute_sync_mbar(uint32_t count, uint32_t parity) {
  __shared__ uint64_t bar;
  cutlass::arch::ClusterBarrier::init(&bar, count);
  cutlass::arch::ClusterBarrier::arrive(&bar);
  cutlass::arch::ClusterBarrier::wait(&bar, parity);
}
__global__ void ours_sync_named(int id, int count) {
  wg::bar_sync(id, count);
  wg::bar_arrive(id, count);
}
__global__ void cute_sync_named(int id, int count) {
  cutlass::arch::NamedBarrier::sync(count, id);
  cutlass::arch::NamedBarrier::arrive(count, id);
}
__global__ void ours_sync_regs() {
  wg::regs_dec<24>();
  wg::regs_inc<240>();
}
__global__ void cute_sync_regs() {
  cutlass::arch::warpgroup_reg_dealloc<24>();
  cutlass::arch::warpgroup_reg_alloc<240>();
}
// Expected bytes (alone, then with an arrival) and one 4-d tile copy through a map in kernel parameters, counted on
// a shared mbarrier; CUTLASS's with its default L2 hint (evict normal), which tma::load passes.
__global__ void ours_sync_tma(const __grid_constant__ CUtensorMap map, uint32_t bytes, int c0, int c1, int c2, int c3) {
  __shared__ alignas(1024) unsigned char tile[16384];
  __shared__ uint64_t bar;
  namespace tma = fastgpt::cuda::tma;
  tma::prefetch(&map);
  tma::expect(wg::shared_addr(&bar), bytes);
  tma::arrive_expect(wg::shared_addr(&bar), bytes);
  tma::load(wg::shared_addr(tile), &map, wg::shared_addr(&bar), c0, c1, c2, c3);
}
__global__ void cute_sync_tma(const __grid_constant__ CUtensorMap map, uint32_t bytes, int c0, int c1, int c2, int c3) {
  __shared__ alignas(1024) unsigned char tile[16384];
  __shared__ uint64_t bar;
  cute::prefetch_tma_descriptor(&map);
  cutlass::arch::ClusterTransactionBarrier::expect_transaction(&bar, bytes);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&bar, bytes);
  cute::SM90_TMA_LOAD_4D::copy(&map, &bar, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL), tile, c0, c1,
                               c2, c3);
}
// The fused backward's bulk copy of a dQ part to global memory and its bulk-group completion (tma.cuh's store,
// commit, wait_read), beside CUTLASS's SM90_BULK_COPY_S2G, tma_store_arrive and tma_store_wait. The bulk add, the
// full wait and the global proxy fence have no CUTLASS counterpart (ours_bulk_add: tests/test_wgmma.py holds them to
// the PTX ISA's spelling).
__global__ void ours_sync_bulk(float* g, uint32_t bytes) {
  __shared__ alignas(128) float part[1024];
  namespace tma = fastgpt::cuda::tma;
  tma::store(g, wg::shared_addr(part), bytes);
  tma::commit();
  tma::wait_read<0>();
}
__global__ void cute_sync_bulk(float* g, uint32_t bytes) {
  __shared__ alignas(128) float part[1024];
  cute::SM90_BULK_COPY_S2G::copy(part, g, bytes);
  cute::tma_store_arrive();
  cute::tma_store_wait<0>();
}
// The 128-query fused backward's bulk copy of a finished dQ sum back into shared memory (tma.cuh's load_bulk, its
// bytes declared with an arrival), beside CUTLASS's SM90_BULK_COPY_G2S and arrive_and_expect_tx.
__global__ void ours_sync_g2s(const float* g, uint32_t bytes) {
  __shared__ alignas(128) float part[1024];
  __shared__ uint64_t bar;
  namespace tma = fastgpt::cuda::tma;
  tma::arrive_expect(wg::shared_addr(&bar), bytes);
  tma::load_bulk(wg::shared_addr(part), g, bytes, wg::shared_addr(&bar));
}
__global__ void cute_sync_g2s(const float* g, uint32_t bytes) {
  __shared__ alignas(128) float part[1024];
  __shared__ uint64_t bar;
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&bar, bytes);
  cute::SM90_BULK_COPY_G2S::copy(g, &bar, part, bytes);
}
// The warp-specialised forward's O: a 4-d tensor store from shared memory behind the proxy fence (wgmma.cuh's
// fence_proxy_async, tma.cuh's store_box, commit, wait_read), beside CUTLASS's tma_store_fence, SM90_TMA_STORE_4D,
// tma_store_arrive and tma_store_wait.
__global__ void ours_sync_tstore(const __grid_constant__ CUtensorMap map, int c0, int c1, int c2, int c3) {
  __shared__ alignas(1024) unsigned char tile[8192];
  namespace tma = fastgpt::cuda::tma;
  wg::fence_proxy_async();
  tma::store_box(&map, wg::shared_addr(tile), c0, c1, c2, c3);
  tma::commit();
  tma::wait_read<0>();
}
__global__ void cute_sync_tstore(const __grid_constant__ CUtensorMap map, int c0, int c1, int c2, int c3) {
  __shared__ alignas(1024) unsigned char tile[8192];
  cute::tma_store_fence();
  cute::SM90_TMA_STORE_4D::copy(&map, tile, c0, c1, c2, c3);
  cute::tma_store_arrive();
  cute::tma_store_wait<0>();
}
__global__ void ours_bulk_add(float* g, uint32_t bytes) {
  __shared__ alignas(128) float part[1024];
  namespace tma = fastgpt::cuda::tma;
  tma::fence_global();
  tma::reduce_add(g, wg::shared_addr(part), bytes);
  tma::commit();
  tma::wait<0>();
}
