// Flash attention forward for Hopper (sm_90a only; see CMakeLists.txt): the forward_kernel of
// flash_attention_fwd.cu with its products on warpgroup MMA (wgmma.cuh) instead of mma.sync. Each warpgroup (4 warps,
// 128 threads) owns 64 query rows; a CTA of WG warpgroups shares the K and V blocks of BC keys, double-buffered with
// cp.async into 128-byte swizzled shared memory, which wgmma reads directly: no ldmatrix, and one instruction
// multiplies 64 rows by BC keys (S = Q K^T, both operands from shared memory) or 64 rows by d (O += P V, P from the
// S accumulators in registers, V read transposed). The online softmax, masking, causal block skip and store are the
// mma.sync kernel's, per warp, on the same accumulator layout. As in FlashAttention-3, a block's softmax runs while
// the previous block's P V is still on the tensor cores (the loop's comment). Chosen with the fwd tile options
// "sm90 ..." (flash_attention.cu's kKernelOptions) on a device of compute capability 9.0, from a build with sm_90a
// code. Ran and passed its tests on an H200 (2026-11-26); there the warp-specialised forward
// (flash_attention_ws_sm90a.cu, which this file's forward_sm90 sends its options to) is faster, and "auto"'s.
#include "cuda/check.h"
#include "cuda/flash_attention_sm90.cuh"

namespace fastgpt::cuda::flash {

namespace {

template <int D, int WG, int BC>
constexpr int sm90_smem_bytes() {
  return sm90::tile_bytes<64 * WG + 4 * BC, D>() + 1024;  // Q, K and V twice each, and room to align
}

template <typename E, int D, int WG, int BC>
__global__ void __launch_bounds__(128 * WG, D == 64 && BC == 64 ? 2 : 1) forward_sm90_kernel(Params p) {
  constexpr int NT = 128 * WG, BR = 64 * WG;   // threads, query rows per CTA
  constexpr int kQBytes = sm90::tile_bytes<BR, D>(), kKVBytes = sm90::tile_bytes<BC, D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* sQ = sm90::aligned(smem_raw);  // (BR, D) swizzled (flash_attention_sm90.cuh)
  unsigned char* sK = sQ + kQBytes;             // 2 x (BC, D)
  unsigned char* sV = sK + 2 * kKVBytes;        // 2 x (BC, D)

  const int tid = threadIdx.x, wg = wgmma::warp_uniform(tid / 128), warp = wgmma::warp_uniform(tid / 32 % 4);
  const int lane = tid % 32, g = lane / 4, c = lane % 4;
  const int qblock = gridDim.y - 1 - blockIdx.y, bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = qblock * BR, T = p.T;
  const int64_t in_off = b * p.is.sb + h * p.is.sh;
  const E* Q = static_cast<const E*>(p.q) + in_off;
  const E* K = static_cast<const E*>(p.k) + in_off;
  const E* V = static_cast<const E*>(p.v) + in_off;
  const int kv_end = p.causal ? min(T, q0 + BR) : T;
  const int nblocks = (kv_end + BC - 1) / BC;
  const int wg0 = q0 + wg * 64, w0 = wg0 + warp * 16;  // the warpgroup's and the warp's first query
  // The blocks this warpgroup sees (causal: those with a key at or before its last query), a prefix of the CTA's;
  // warpgroup-uniform, as wgmma needs all 128 threads.
  const int nvis = p.causal ? min(nblocks, (wg0 + 64 + BC - 1) / BC) : nblocks;

  sm90::load<E, BR, D, NT>(sQ, Q, p.is.st, q0, T, tid);
  sm90::load<E, BC, D, NT>(sK, K, p.is.st, 0, T, tid);
  cp_async_commit();

  const uint32_t aQ = wgmma::shared_addr(sQ), aK = wgmma::shared_addr(sK), aV = wgmma::shared_addr(sV);
  float o[D / 8][4] = {};  // this warp's 16 rows x D of O (wgmma's N / 2 accumulators per lane, in order)
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8; m in log2 units
  float s[BC / 8][4];       // S = Q K^T for this warp's 16 rows x BC keys, then P
  uint32_t pa[BC / 16][4];  // P of the block before, as wgmma A fragments (tiles 2ks, 2ks + 1: fragment ks)
  float alpha[2];           // O's factor from the block before's softmax, applied before its P V
  const float sl2 = p.scale * kLog2e;

  // Software pipelined as FlashAttention-3 (intra-warpgroup overlap): step j issues S_j = Q K_j^T and then
  // O += P_{j-1} V_{j-1}, waits for S_j alone and runs block j's softmax while the tensor cores still multiply
  // P_{j-1} V_{j-1}; O is rescaled by block j's factor at step j + 1, before that step's P V is issued. V_j is
  // therefore needed one step after K_j: step j loads K_{j+1} and V_j, and one barrier per step orders both
  // buffers (each warpgroup has waited for its products of step j - 1 before it). Each branch below holds its wgmma
  // and their waits whole, so that ptxas need not serialise them (its C7520 warning).
  for (int j = 0; j <= nblocks; j++) {
    cp_async_wait<0>();          // K_j and V_{j - 1}, loaded in step j - 1
    wgmma::fence_proxy_async();  // this thread's copies, then everyone's (the barrier), reach wgmma's reads
    __syncthreads();
    if (j < nblocks) {  // into the buffers of K_{j - 1} and V_{j - 2}, whose products ended before the barrier
      if (j + 1 < nblocks) sm90::load<E, BC, D, NT>(sK + ((j + 1) & 1) * kKVBytes, K, p.is.st, (j + 1) * BC, T, tid);
      sm90::load<E, BC, D, NT>(sV + (j & 1) * kKVBytes, V, p.is.st, j * BC, T, tid);
      cp_async_commit();
    }
    const uint32_t kb = aK + (j & 1) * kKVBytes, vb = aV + ((j - 1) & 1) * kKVBytes;
    const int k0 = j * BC;
    // A block with keys to mask; tested once before the branches (inside the lambda, 192x128 spilled 80 bytes).
    const bool partial = hides_any(w0, w0 + 16, k0, k0 + BC, T, p.causal);
    const auto softmax = [&](float (&sc)[BC / 8][4], float (&factor)[2]) {
      if (partial) mask_scores(sc, k0, w0, g, c, T, p.causal);
      softmax_rows(sc, sl2, m, l, factor);
      return l[0] + l[1];
    };
    const auto none = [] {};
    // Step 0 is its own branch, not a `j > 0` test around the P V issue (flash_attention_sm90.cuh's steps).
    if (j == 0)  // S_0 alone (every warpgroup sees block 0: nvis >= 1)
      sm90::first_block<E, BR, BC, D>(s, alpha, pa, aQ, kb, wg, softmax, none, none);
    else if (j < nvis)  // S_j, with P_{j-1} V_{j-1} behind it
      sm90::next_block<E, BR, BC, D>(s, o, alpha, pa, pa, aQ, kb, vb, wg, softmax, none, none, none);
    else if (j == nvis)  // the last P V
      sm90::last_pv<E, BC, D>(o, alpha, pa, vb, none, none);
  }

  store_rows(o, m, l, w0, g, c, T, static_cast<E*>(p.out) + b * p.os.sb + h * p.os.sh, p.os.st,
             p.lse + (int64_t)bh * T);
}

template <typename E, int D, int WG, int BC>
void launch_sm90(const Params& p, Stream stream) {
  constexpr int bytes = sm90_smem_bytes<D, WG, BC>(), rows = 64 * WG;
  FASTGPT_CUDA_CHECK(cudaFuncSetAttribute(forward_sm90_kernel<E, D, WG, BC>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  dim3 grid(p.B * p.H, (p.T + rows - 1) / rows);  // B * H on x: y and z stop at 65535
  forward_sm90_kernel<E, D, WG, BC><<<grid, 128 * WG, bytes, stream>>>(p);
  FASTGPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

// The "sm90" fwd options of kKernelOptions, in order (CTA rows x keys per block): 128x128, 192x128, 128x64. Head dim
// 128 has no 192x128 (three warpgroups' registers would spill): it runs 128x128 for that option. The "sm90 ws"
// options after them go to the warp-specialised kernel (flash_attention_ws_sm90a.cu), or, where it can make no TMA
// map of the inputs, to 128x128 here (its bits).
template <typename E>
void forward_sm90(const Params& p, Stream stream) {
  if (p.tiles.fwd >= kFirstWsSm90 && forward_ws_sm90<E>(p, stream, p.tiles.fwd - kFirstWsSm90)) return;
  const int option = p.tiles.fwd - kFirstSm90.fwd;
  if (p.d == 64) {
    if (option == 1) return launch_sm90<E, 64, 3, 128>(p, stream);
    if (option == 2) return launch_sm90<E, 64, 2, 64>(p, stream);
    return launch_sm90<E, 64, 2, 128>(p, stream);
  }
  if (option == 2) return launch_sm90<E, 128, 2, 64>(p, stream);
  launch_sm90<E, 128, 2, 128>(p, stream);
}

template void forward_sm90<__nv_bfloat16>(const Params&, Stream);
template void forward_sm90<__half>(const Params&, Stream);

}  // namespace fastgpt::cuda::flash
