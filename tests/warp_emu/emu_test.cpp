// Checks the flash attention kernels, run in the warp emulator (emu.h; see run.sh), against a float64 reference:
// out, lse, dq, dk, dv by relative error, per dtype (bf16 3e-2, fp16 5e-3, fp32 1e-4, fp32 on TF32 tensor cores
// 5e-6 with three products per product and 4e-3 with one: half inputs are rounded
// before the reference sees them, so these bound the kernels' own error), over both layouts, causal or not, T that
// is and is not a multiple of the tiles, atomic and deterministic dq, and the engine's fused qkv path; also the
// KV-cache decode, cross-entropy and LayerNorm kernels (plain and fused with the residual add), the optimizer
// step's (adamw.cu) and the embedding's (encoder.cu), the last two against the CPU references compiled in beside
// them. Outputs and shared memory start as NaN, so an element a kernel forgets to write fails. Modes (argv[1])
// pick the case lists; "tchw" (and one case of "quick") runs fp32 on TF32 x3 with mma.sync adding as tensor cores
// do, each sum cut toward zero (emu.h's mma_rz_sum), at the GPU test's measure.
#include <cuda_runtime.h>  // before the emulator's macros (cuda/scratch.h includes it again)
#include "emu.h"
#include "cuda/ops.h"
#include "cuda/flash_attention.cuh"  // flash::compute_delta, flash::Params
#include "cuda/scratch.h"
#include "cuda/tma.cuh"  // tma::make_heads_map
#include <cmath>
#include <algorithm>
#include <random>
#include <string>
#include <cerrno>
#include <csignal>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
using namespace fastgpt;
using cuda::DType;

template <typename E> float rnd(float x) { return float(E(x)); }
template <> float rnd<float>(float x) { return x; }

struct Ref { std::vector<double> out, lse, dq, dk, dv; };
// all tensors logical (B,H,T,d) contiguous doubles
static Ref reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                     const std::vector<double>& dout, int B, int H, int T, int d, bool causal) {
  Ref r;
  const size_t n = (size_t)B * H * T * d;
  r.out.assign(n, 0); r.lse.assign((size_t)B * H * T, 0); r.dq.assign(n, 0); r.dk.assign(n, 0); r.dv.assign(n, 0);
  const double scale = 1.0 / std::sqrt((double)d);
  std::vector<double> P(T * T), dP(T * T);
  for (int bh = 0; bh < B * H; bh++) {
    const double *Q = &q[(size_t)bh * T * d], *K = &k[(size_t)bh * T * d], *V = &v[(size_t)bh * T * d],
                 *dO = &dout[(size_t)bh * T * d];
    double *O = &r.out[(size_t)bh * T * d];
    for (int i = 0; i < T; i++) {
      double mx = -1e300;
      for (int j = 0; j < T; j++) {
        double s = 0; for (int x = 0; x < d; x++) s += Q[i * d + x] * K[j * d + x];
        s *= scale; P[i * T + j] = (causal && j > i) ? -INFINITY : s; mx = std::max(mx, P[i * T + j]);
      }
      double sum = 0; for (int j = 0; j < T; j++) { P[i * T + j] = std::exp(P[i * T + j] - mx); sum += P[i * T + j]; }
      for (int j = 0; j < T; j++) P[i * T + j] /= sum;
      r.lse[(size_t)bh * T + i] = mx + std::log(sum);
      for (int x = 0; x < d; x++) { double o = 0; for (int j = 0; j < T; j++) o += P[i * T + j] * V[j * d + x]; O[i * d + x] = o; }
    }
    for (int i = 0; i < T; i++) {
      double delta = 0; for (int x = 0; x < d; x++) delta += dO[i * d + x] * O[i * d + x];
      for (int j = 0; j < T; j++) {
        double dp = 0; for (int x = 0; x < d; x++) dp += dO[i * d + x] * V[j * d + x];
        dP[i * T + j] = P[i * T + j] * (dp - delta);  // dS
      }
    }
    for (int i = 0; i < T; i++) for (int x = 0; x < d; x++) {
      double a = 0; for (int j = 0; j < T; j++) a += dP[i * T + j] * K[j * d + x];
      r.dq[((size_t)bh * T + i) * d + x] = a * scale;
    }
    for (int j = 0; j < T; j++) for (int x = 0; x < d; x++) {
      double a = 0, b = 0;
      for (int i = 0; i < T; i++) { a += dP[i * T + j] * Q[i * d + x]; b += P[i * T + j] * dO[i * d + x]; }
      r.dk[((size_t)bh * T + j) * d + x] = a * scale; r.dv[((size_t)bh * T + j) * d + x] = b;
    }
  }
  return r;
}

static int failures = 0;
static float g_amp = 2.f;
static bool g_fwd_only = false;  // run() skips the backward (its dq, dk, dv are then not checked)
// run()'s backward asks for kv_sums (flash_attention_backward; the engine's K and V bias gradients) where this is 0
// or 1: 1, the kernel must make them (true; kv_sums += the column sums of dk | dv as returned, per (h, x)); 0, it
// must not (false; kv_sums untouched). -1: not asked for.
static int g_kv_expect = -1;
static cuda::F32Math g_f32 = cuda::F32Math::simt;  // how float32 cases multiply (the tf32 modes set it)
static bool g_normal = false;    // run() draws standard-normal inputs (tests/test_flash_attention.py's) and
                                 // relerr is ||got - ref|| / ||ref|| (its rel_err), for mode tchw
static double relerr(const std::vector<double>& got, const std::vector<double>& ref) {
  if (g_normal) {
    double e2 = 0, r2 = 0;
    for (size_t i = 0; i < ref.size(); i++) e2 += (got[i] - ref[i]) * (got[i] - ref[i]), r2 += ref[i] * ref[i];
    return e2 == e2 ? std::sqrt(e2 / std::max(r2, 1e-300)) : INFINITY;
  }
  double mx = 0, e = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    mx = std::max(mx, std::fabs(ref[i]));
    double di = std::fabs(got[i] - ref[i]);
    if (!(di == di)) return INFINITY;
    e = std::max(e, di);
  }
  return e / std::max(mx, 1e-2);
}

// The tile choice in the kernels' numbering (flash::Tiles, kKernelOptions' order, used throughout this file):
// cuda::set_flash_tiles counts from "auto", its option 0, so kernel option k is its k + 1; "auto" reads back as -1.
void set_tiles(const cuda::FlashTiles& t) { cuda::set_flash_tiles({t.fwd + 1, t.dkdv + 1, t.dq + 1}); }
cuda::FlashTiles kernel_tiles() {
  const cuda::FlashTiles t = cuda::flash_tiles();
  return {t.fwd - 1, t.dkdv - 1, t.dq - 1};
}
struct Outs { std::vector<double> out, lse, dq, dk, dv; };  // a run's results, logical (B, H, T, d) order

template <typename E>
Outs run(int B, int H, int T, int d, bool causal, bool bthd, bool det, DType dt, double tol, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::normal_distribution<float> N01;
  const size_t n = (size_t)B * H * T * d;
  // logical (b,h,t,x) -> physical index
  auto idx = [&](int b, int h, int t, int x) -> size_t {
    return bthd ? (((size_t)b * T + t) * H + h) * d + x : (((size_t)b * H + h) * T + t) * d + x;
  };
  cpu::HeadStrides s = bthd ? cpu::HeadStrides{(int64_t)T * H * d, d, (int64_t)H * d} : cpu::HeadStrides{(int64_t)H * T * d, (int64_t)T * d, d};
  std::vector<E> q(n), k(n), v(n), dout(n), out(n), dq(n), dk(n), dv(n);
  std::vector<double> lq(n), lk(n), lv(n), ldo(n);
  for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (int t = 0; t < T; t++) for (int x = 0; x < d; x++) {
    size_t L = (((size_t)b * H + h) * T + t) * d + x, Pp = idx(b, h, t, x);
    float a = rnd<E>(g_amp * U(rng)), bb = rnd<E>(g_amp * U(rng)), c = rnd<E>(U(rng)), e = rnd<E>(U(rng));
    if (g_normal) a = rnd<E>(N01(rng)), bb = rnd<E>(N01(rng)), c = rnd<E>(N01(rng)), e = rnd<E>(N01(rng));
    q[Pp] = E(a); k[Pp] = E(bb); v[Pp] = E(c); dout[Pp] = E(e);
    lq[L] = a; lk[L] = bb; lv[L] = c; ldo[L] = e;
  }
  const E nanv = E(NAN);
  std::fill(out.begin(), out.end(), nanv); std::fill(dq.begin(), dq.end(), nanv);
  std::fill(dk.begin(), dk.end(), nanv); std::fill(dv.begin(), dv.end(), nanv);
  std::vector<float> lse((size_t)B * H * T, NAN);
  cpu::AttentionShape sh{B, H, T, d, causal};
  cuda::flash_attention_forward(out.data(), s, lse.data(), q.data(), k.data(), v.data(), s, sh, dt, nullptr, g_f32);
  std::vector<float> kv(g_kv_expect >= 0 ? (size_t)2 * H * d : 0);
  for (size_t i = 0; i < kv.size(); i++) kv[i] = 0.25f * (float)(i % 7) - 0.5f;  // += onto these
  const std::vector<float> kv0 = kv;
  bool kv_made = false;
  if (!g_fwd_only)
    kv_made = cuda::flash_attention_backward(dq.data(), dk.data(), dv.data(), s, dout.data(), out.data(), s, q.data(),
                                             k.data(), v.data(), lse.data(), sh, dt, det, nullptr, g_f32,
                                             kv.empty() ? nullptr : kv.data());
  Ref r = reference(lq, lk, lv, ldo, B, H, T, d, causal);
  auto logical = [&](const std::vector<E>& a) {
    std::vector<double> o(n);
    for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (int t = 0; t < T; t++) for (int x = 0; x < d; x++)
      o[(((size_t)b * H + h) * T + t) * d + x] = float(a[idx(b, h, t, x)]);
    return o;
  };
  const Outs got{logical(out), std::vector<double>(lse.begin(), lse.end()), logical(dq), logical(dk), logical(dv)};
  double eo = relerr(got.out, r.out), el = relerr(got.lse, r.lse), eq = 0, ek = 0, ev = 0;
  if (!g_fwd_only) eq = relerr(got.dq, r.dq), ek = relerr(got.dk, r.dk), ev = relerr(got.dv, r.dv);
  bool ok = eo < tol && el < tol && eq < tol && ek < tol && ev < tol;
  double ekv = 0;  // kv_sums against the column sums (double) of the dk, dv returned, over |values|' sums
  if (g_kv_expect >= 0) {
    bool kv_ok = kv_made == (g_kv_expect == 1);
    for (int m = 0; m < 2 && kv_ok; m++) for (int h = 0; h < H; h++) for (int x = 0; x < d; x++) {
      const std::vector<double>& a = m == 0 ? got.dk : got.dv;
      double sum = 0, mag = 0;
      for (int b = 0; b < B; b++) for (int t = 0; t < T; t++) {
        const double y = a[(((size_t)b * H + h) * T + t) * d + x];
        sum += y, mag += fabs(y);
      }
      const size_t i = ((size_t)m * H + h) * d + x;
      const double want = kv_made ? kv0[i] + sum : kv0[i];
      ekv = std::max(ekv, fabs(kv[i] - want) / (mag + 1.0));
    }
    kv_ok = kv_ok && ekv < 1e-5;  // fp32 sums; a missing scale, row, warp or head is off by far more
    ok = ok && kv_ok;
    printf("%s kv_sums %s: %.2e\n", kv_ok ? "ok  " : "FAIL", kv_made ? "made" : "not made", ekv);
  }
  if (!ok) failures++;
  const cuda::FlashTiles tiles = kernel_tiles();
  if (getenv("EMU_HASH")) {  // a digest of the outputs' bits, to compare two builds of the same case (FNV-1a)
    uint64_t hsh = 1469598103934665603ull;
    for (const std::vector<double>* v : {&got.out, &got.lse, &got.dq, &got.dk, &got.dv})
      for (double x : *v) {
        uint64_t u;
        memcpy(&u, &x, 8);
        hsh = (hsh ^ u) * 1099511628211ull;
      }
    printf("hash %016llx ", (unsigned long long)hsh);
  }
  printf("%s dt=%d%s cc=%d.x B=%d H=%d T=%d d=%d causal=%d %s det=%d lazy=%d tiles=%d%d%d: out %.2e lse %.2e dq %.2e "
         "dk %.2e dv %.2e%s\n", ok ? "ok  " : "FAIL", (int)dt,
         dt != DType::f32                  ? ""
         : g_f32 == cuda::F32Math::tf32x3 ? " tf32x3"
         : g_f32 == cuda::F32Math::tf32   ? " tf32"
                                           : "",
         emu::g_cc_major, B, H, T, d, causal,
         bthd ? "bthd" : "bhtd", det, emu::g_lazy_cp, tiles.fwd, tiles.dkdv, tiles.dq, eo, el, eq, ek, ev,
         g_fwd_only ? " (forward only)" : "");
  fflush(stdout);
  return got;
}

// The tile options of the tensor-core kernels at d 64 (cuda::set_flash_tiles), deterministic backward: each run must
// match the reference (run() counts that), and every option must give the bits of the run with the same forward key
// block and the first dkdv/dq options (fwd 16x64 and 32x64 share one; -0 and +0 compare equal).
template <typename E>
void run_tiles(int B, int H, int T, bool causal, bool bthd, DType dt, double tol, unsigned seed,
               std::initializer_list<cuda::FlashTiles> list) {
  Outs base[2];  // by forward key block: 64, 128
  bool have[2] = {false, false};
  for (const cuda::FlashTiles& t : list) {
    const int kb = t.fwd == 2;
    if (!have[kb]) {
      set_tiles({kb ? 2 : 0, 0, 0});
      base[kb] = run<E>(B, H, T, 64, causal, bthd, true, dt, tol, seed);
      have[kb] = true;
    }
    set_tiles(t);
    const Outs o = run<E>(B, H, T, 64, causal, bthd, true, dt, tol, seed);
    const Outs& r = base[kb];
    const bool same = o.out == r.out && o.lse == r.lse && o.dq == r.dq && o.dk == r.dk && o.dv == r.dv;
    if (!same) failures++;
    printf("%s tiles=%d%d%d give the bits of tiles=%d00\n", same ? "ok  " : "FAIL", t.fwd, t.dkdv, t.dq, kb ? 2 : 0);
  }
  set_tiles({0, 0, 0});
  fflush(stdout);
}

// The Hopper kernels (wgmma): fwd options 3 "sm90 128x128", 4 "sm90 192x128", 5 "sm90 128x64" of
// flash_attention_sm90a.cu, dkdv option 2 and dq option 3 ("sm90 128x64") of flash_attention_bwd_sm90a.cu (the
// deterministic backward; the atomic one keeps its mma.sync kernel), each with the others' choices: run() checks all
// against the reference. Their sums are not the mma.sync kernels' (wgmma's order), so bits are not compared.
template <typename E>
void run_sm90(int B, int H, int T, int d, bool causal, bool bthd, bool det, DType dt, double tol, unsigned seed,
              std::initializer_list<cuda::FlashTiles> list) {
  for (const cuda::FlashTiles& t : list) {
    set_tiles(t);
    run<E>(B, H, T, d, causal, bthd, det, dt, tol, seed);
  }
  set_tiles({0, 0, 0});
}

// The warp-specialised Hopper forward (fwd options 6 "sm90 ws 128x128" and 7 "sm90 ws 192x128", 8 and 9 the same
// persistent; flash_attention_ws_sm90a.cu): run() checks it against the reference, and its out and lse must be the
// bits of fwd option 3 ("sm90 128x128": the same key blocks of 128, the same products and softmax per row, only the
// CTA's roles and synchronisation differ). Option 3's run takes backward passes `dkdv`, `dq`; the ws runs skip the
// backward, which would read the same out and lse. The launch must have one CTA per tile, or (persistent) one per
// SM (emu::g_sm_count: each CTA then takes several tiles in turn, its Q buffers and rings reused across them). The
// host must mark for initcheck exactly the bytes O's tensor stores wrote (tma.cuh mark_stored).
template <typename E>
void run_ws(int B, int H, int T, int d, bool causal, bool bthd, DType dt, double tol, unsigned seed, int dkdv, int dq) {
  set_tiles({3, dkdv, dq});
  const Outs base = run<E>(B, H, T, d, causal, bthd, true, dt, tol, seed);
  for (int fwd : {6, 7, 8, 9}) {
    set_tiles({fwd, dkdv, dq});
    g_fwd_only = true;
    const long stores0 = emu::g_tma_stores;
    emu::initcheck_reset();
    const Outs o = run<E>(B, H, T, d, causal, bthd, true, dt, tol, seed);
    const bool marked = emu::tma_stores_marked();
    g_fwd_only = false;
    const int rows = d == 64 && fwd % 2 ? 192 : 128;
    const long tiles = (long)B * H * ((T + rows - 1) / rows);
    const long ctas = fwd >= 8 ? std::min<long>(tiles, emu::g_sm_count) : tiles;
    // O by TMA stores of 64 rows x 64 columns: one per 64 rows of each head that start before T, and 64 columns
    const long stores = emu::g_tma_stores - stores0, want = (long)B * H * ((T + 63) / 64) * (d / 64);
    // (emu::g_grid, the emulated gridDim, keeps the last launch's: the forward's)
    const bool same = o.out == base.out && o.lse == base.lse, grid = emu::g_grid.x == ctas;
    const bool ok = same && grid && stores == want && marked;
    if (!ok) failures++;
    printf("%s sm90 ws fwd %d: out and lse are fwd 3's bits %d; %u CTAs for %ld tiles; %ld O stores; the bytes marked "
           "for initcheck are those they wrote %d\n", ok ? "ok  " : "FAIL", fwd, same, emu::g_grid.x, tiles, stores,
           marked);
  }
  set_tiles({0, 0, 0});
  fflush(stdout);
}

// The flash kernels' masks (flash_attention.cuh) against visible(), the rule they stand for, over every score of a
// lane's tile: mask_scores (the forward: -inf where a key is past T or, causal, after the query; rows past T as they
// are), probs_rows' SeenBelow (the backward, queries on the rows: rows past T see nothing) and SeenBy (keys on the
// rows, queries on the columns). Tiles start below, at and past T, on and off the diagonal.
void check_masks() {
  using namespace cuda::flash;
  constexpr int NT = 4;
  long checked = 0, wrong = 0;
  for (int T : {1, 5, 8, 9, 31, 32, 33})
    for (int causal = 0; causal < 2; causal++)
      for (int row0 = 0; row0 <= 48; row0 += 8)
        for (int k0 = 0; k0 <= 48; k0 += 8)
          for (int g = 0; g < 8; g++)
            for (int c = 0; c < 4; c++) {
              float s[NT][4];
              for (auto& x : s) std::fill(x, x + 4, 1.f);
              mask_scores(s, k0, row0, g, c, T, causal);
              const SeenBelow below(row0 + g, k0 + 2 * c, T, causal, true);  // probs_rows'
              const SeenBy seen(row0 + g, k0 + 2 * c, T, causal);  // rows are keys, columns queries
              for (int t = 0; t < NT; t++)
                for (int e = 0; e < 4; e++) {
                  const int row = row0 + g + (e >> 1) * 8, col = k0 + t * 8 + 2 * c + (e & 1);
                  const bool fwd_hidden = col >= T || (causal && col > row);
                  wrong += (s[t][e] == -INFINITY) != fwd_hidden;
                  wrong += below.hides(t, e) != !visible(row, col, T, causal);
                  wrong += seen.hides(t, e) != !visible(col, row, T, causal);
                  checked += 3;
                }
            }
  if (wrong) failures++;
  printf("%s flash masks: %ld of %ld scores' mask tests disagree with visible()\n", wrong ? "FAIL" : "ok  ", wrong,
         checked);
  fflush(stdout);
}

// make_heads_map's dense bytes: the range the ws forward marks for initcheck is O's bytes only where they have no
// gaps (the engine's and the binding's O: (B, H, T, d) or (B, T, H, d), row-major); a view with gaps gets 0 (nothing
// marked), as does one with no map (the broadcast head: the ws kernels decline it).
void check_dense_bytes() {
  const int B = 2, H = 3, T = 5, d = 64;
  const size_t all = (size_t)B * H * T * d * 2;
  struct Case {
    const char* name;
    cpu::HeadStrides s;
    int B, T;
    size_t want;
  } cases[] = {
      {"bhtd", {H * T * d, T * d, d}, B, T, all},
      {"bthd", {T * H * d, d, H * d}, B, T, all},
      {"(B, T, 3, H, d) qkv", {T * 3 * H * d, d, 3 * H * d}, B, T, 0},
      {"rows padded to 72", {H * T * 72, T * 72, 72}, B, T, 0},
      {"one head broadcast (stride 0)", {T * d, 0, d}, B, T, 0},
      {"B 1, any batch stride", {12345, T * d, d}, 1, T, (size_t)H * T * d * 2},
      {"T 1, any row stride", {H * d, d, 777}, B, 1, (size_t)B * H * d * 2},
      {"heads apart by twice their size", {2 * H * T * d, 2 * T * d, d}, B, T, 0},
  };
  bool ok = true;
  for (const Case& c : cases) {
    cuda::tma::HeadsMap m;
    size_t got = 0;
    static std::vector<unsigned char> base(1 << 16);  // (the emulator's encoder checks only the address)
    if (!cuda::tma::make_heads_map(m, base.data(), c.B, H, c.T, d, c.s, 64, &got)) got = 0;
    if (got != c.want) ok = false, printf("  dense bytes %s: %zu, want %zu\n", c.name, got, c.want);
  }
  if (!ok) failures++;
  printf("%s tma::make_heads_map's dense bytes: O's for row-major layouts, 0 for views with gaps (8 layouts)\n",
         ok ? "ok  " : "FAIL");
  fflush(stdout);
}

// The warp-specialised kernels on views the binding never makes but the engine and other callers may. "qkv": q, k,
// v in one (B, T, 3, H, d) buffer and dq, dk, dv in another (the engine's: T's stride 3Hd, H's d, so the TMA maps
// take H before T). "broadcast": one head serves all H, with H's stride 0 (strides that do not nest, which a TMA map
// cannot describe): for q, k, v in the forward, for out and dout in the backward (whose q, k, v and gradients are
// then plain copies, so every head's out is the broadcast one). The ws kernels decline those and the plain ones run.
// Forward: fwd 6, 7 and 8 must give fwd 3's out and lse; backward: dkdv 4 ("sm90 ws fused") dkdv 3's dq, dk, dv; all
// near the float64 reference; dkdv 5 ("sm90 ws fused 128x128") and 6, 7 (the two persistent) too. The emulator's count of TMA copies says which
// path ran. The ws forwards must mark for initcheck exactly the O they store (contiguous here), and a ws forward into
// an O with padded rows (tensor stores with gaps between them) must mark nothing.
template <typename E>
void run_ws_views(int B, int H, int T, bool causal, bool broadcast, DType dt, double tol, unsigned seed) {
  const int d = 64, rows = broadcast ? 1 : 3 * H;  // heads stored per (b, t) row of the buffer
  const size_t n = (size_t)B * H * T * d, nb = (size_t)B * T * d;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<E> buf((size_t)B * T * rows * d * (broadcast ? 3 : 1)), dout(broadcast ? nb : n);
  for (E& x : buf) x = E(g_amp * U(rng));
  for (E& x : dout) x = E(U(rng));
  const size_t part = broadcast ? nb : (size_t)H * d;  // q -> k -> v
  const cpu::HeadStrides contiguous{(int64_t)H * T * d, (int64_t)T * d, d}, one_head{(int64_t)T * d, 0, d};
  const cpu::HeadStrides is = broadcast ? one_head : cpu::HeadStrides{(int64_t)T * rows * d, d, (int64_t)rows * d};
  const cpu::HeadStrides& os_bwd = broadcast ? one_head : contiguous;
  const auto logical = [&](const E* a, const cpu::HeadStrides& st) {
    std::vector<double> o(n);
    for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (int t = 0; t < T; t++) for (int x = 0; x < d; x++)
      o[(((size_t)b * H + h) * T + t) * d + x] = float(a[b * st.sb + h * st.sh + t * st.st + x]);
    return o;
  };
  const Ref r = reference(logical(buf.data(), is), logical(buf.data() + part, is), logical(buf.data() + 2 * part, is),
                          logical(dout.data(), os_bwd), B, H, T, d, causal);
  const cpu::AttentionShape sh{B, H, T, d, causal};
  const char* what = broadcast ? "one head broadcast (H stride 0)" : "a qkv buffer";
  std::vector<E> out0;
  std::vector<float> lse0;
  for (int fwd : {3, 6, 7, 8}) {
    std::vector<E> out(n, E(NAN));
    std::vector<float> lse((size_t)B * H * T, NAN);
    set_tiles({fwd, 0, 0});
    const long copies = emu::g_tma_copies;
    emu::initcheck_reset();
    cuda::flash_attention_forward(out.data(), contiguous, lse.data(), buf.data(), buf.data() + part,
                                  buf.data() + 2 * part, is, sh, dt, nullptr);
    const bool tma = emu::g_tma_copies > copies;
    // the ws forwards' O (contiguous here) marked for initcheck, exactly; nothing marked where no tensor store ran
    const bool marked = tma ? emu::tma_stores_marked() : emu::initcheck_marks() == 0;
    if (fwd == 3) out0 = out, lse0 = lse;
    const bool same = memcmp(out.data(), out0.data(), n * sizeof(E)) == 0 && lse == lse0;
    const double eo = relerr(logical(out.data(), contiguous), r.out),
                 el = relerr(std::vector<double>(lse.begin(), lse.end()), r.lse);
    const bool ok = eo < tol && el < tol && same && tma == (fwd != 3 && !broadcast) && marked;
    if (!ok) failures++;
    printf("%s sm90 fwd %d on %s B=%d H=%d T=%d causal=%d: out %.2e lse %.2e, fwd 3's bits %d, TMA %d, marks %d\n",
           ok ? "ok  " : "FAIL", fwd, what, B, H, T, causal, eo, el, same, tma, marked);
  }
  if (!broadcast) {  // an O with gaps (each head's row padded to d + 8): the ws forward stores it, and marks nothing
    const int dp = d + 8;
    const cpu::HeadStrides padded{(int64_t)T * H * dp, dp, (int64_t)H * dp};
    std::vector<E> out((size_t)B * T * H * dp, E(0.f));
    std::vector<float> lse((size_t)B * H * T, NAN);
    set_tiles({6, 0, 0});
    const long stores0 = emu::g_tma_stores;
    emu::initcheck_reset();
    cuda::flash_attention_forward(out.data(), padded, lse.data(), buf.data(), buf.data() + part,
                                  buf.data() + 2 * part, is, sh, dt, nullptr);
    const bool stored = emu::g_tma_stores > stores0, unmarked = emu::initcheck_marks() == 0;
    const std::vector<double> got = logical(out.data(), padded), want = logical(out0.data(), contiguous);
    const bool same = got == want && lse == lse0, ok = stored && unmarked && same;
    if (!ok) failures++;
    printf("%s sm90 fwd 6 into an O with padded rows: fwd 3's bits %d, by tensor stores %d, nothing marked for "
           "initcheck %d\n", ok ? "ok  " : "FAIL", same, stored, unmarked);
  }
  // The backward's inputs: the qkv buffer as it is; or, broadcast, q, k, v copied out per head and out kept for one.
  std::vector<E> q = buf, out = out0;
  size_t qpart = part;
  cpu::HeadStrides is_bwd = is;
  if (broadcast) {
    q.resize(3 * n), qpart = n, is_bwd = contiguous;
    for (int w = 0; w < 3; w++)
      for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (size_t i = 0; i < (size_t)T * d; i++)
        q[w * n + ((size_t)b * H + h) * T * d + i] = buf[w * part + b * T * d + i];
    out.resize(nb);
    for (int b = 0; b < B; b++) std::copy_n(&out0[(size_t)b * H * T * d], (size_t)T * d, &out[(size_t)b * T * d]);
  }
  std::vector<E> grads0;
  for (int dkdv : {3, 4, 5, 6, 7}) {
    std::vector<E> grads(q.size(), E(NAN));
    set_tiles({3, dkdv, 0});
    const long copies = emu::g_tma_copies, bulk0 = emu::g_bulk_copies, loads0 = emu::g_bulk_loads;
    emu::initcheck_reset();
    cuda::flash_attention_backward(grads.data(), grads.data() + qpart, grads.data() + 2 * qpart, is_bwd, dout.data(),
                                   out.data(), os_bwd, q.data(), q.data() + qpart, q.data() + 2 * qpart, lse0.data(),
                                   sh, dt, true, nullptr);
    const bool tma = emu::g_tma_copies > copies, bulk = emu::g_bulk_copies > bulk0,
               loads = emu::g_bulk_loads > loads0;
    if (dkdv == 3) grads0 = grads;
    const bool same = memcmp(grads.data(), grads0.data(), grads.size() * sizeof(E)) == 0;
    const double eq = relerr(logical(grads.data(), is_bwd), r.dq),
                 ek = relerr(logical(grads.data() + qpart, is_bwd), r.dk),
                 ev = relerr(logical(grads.data() + 2 * qpart, is_bwd), r.dv);
    // Key blocks past the first hand their dQ parts to bulk copies; at 128-query steps key block 0 fetches the
    // finished sums back by bulk loads.
    // The bulk copies' bytes marked for initcheck, exactly (nothing marked where none ran).
    const bool ws = dkdv >= 4 && !broadcast, multi = ws && T > 128, marked = emu::tma_stores_marked(!multi);
    const bool ok = eq < tol && ek < tol && ev < tol && same && tma == ws && bulk == multi &&
                    loads == (multi && dkdv % 2 == 1) && marked;
    if (!ok) failures++;
    printf("%s sm90 dkdv %d on %s B=%d H=%d T=%d causal=%d: dq %.2e dk %.2e dv %.2e, dkdv 3's bits %d, TMA %d, "
           "bulk %d, bulk loads %d, marks %d\n", ok ? "ok  " : "FAIL", dkdv, what, B, H, T, causal, eq, ek, ev, same,
           tma, bulk, loads, marked);
  }
  set_tiles({0, 0, 0});
  fflush(stdout);
}

// The warp-specialised forms (dkdv options 4, "sm90 ws fused", and 5, "sm90 ws fused 128x128": steps of 64 and 128
// queries; 6 and 7 the same, persistent; flash_attention_bwd_ws_sm90a.cu; head dim 64, where 128 runs option 3) must
// give option 3's bits (`fused`, a run of the same case) in dq, dk and dv: the same products, sums and order. The
// launch must have one CTA per tile, or (persistent) one per SM (emu::g_sm_count). The emulator runs CTAs one after
// another, so the first persistent CTA takes every tile from the counter (its rings, K and V reused across them,
// key block 0's tiles between the others') and the others find none left.
template <typename E>
void run_ws_bwd(int B, int H, int T, bool causal, bool bthd, DType dt, double tol, unsigned seed, int fwd,
                const Outs& fused, std::initializer_list<int> options = {4, 5, 6, 7}) {
  for (int dkdv : options) {
    set_tiles({fwd, dkdv, 0});
    const long bulk0 = emu::g_bulk_copies, loads0 = emu::g_bulk_loads;
    emu::initcheck_reset();
    g_kv_expect = 1;  // the ws kernels make kv_sums
    const Outs o = run<E>(B, H, T, 64, causal, bthd, true, dt, tol, seed);
    g_kv_expect = -1;
    // The dQ sums' bulk copies (and a ws forward's O) marked for initcheck, exactly; where T <= 128 there are none
    const bool marked = emu::tma_stores_marked(T <= 128);
    const bool step128 = dkdv % 2 == 1, persistent = dkdv >= 6;
    // Key blocks past the first hand their dQ parts to the copy engine (one bulk copy per step); key block 0 adds
    // its own that way and fetches the finished sums back at 128-query steps only (kBulkSum).
    const bool bulk_ok = (emu::g_bulk_copies > bulk0) == (T > 128) &&
                         (emu::g_bulk_loads > loads0) == (T > 128 && step128);
    // the backward kernel's grid (kv_sums' reduction is launched after it)
    const long tiles = (long)B * H * ((T + 127) / 128);
    const bool grid = emu::g_grid_big_smem.x == (persistent ? std::min<long>(tiles, emu::g_sm_count) : tiles);
    const bool same = o.out == fused.out && o.lse == fused.lse && o.dq == fused.dq && o.dk == fused.dk &&
                      o.dv == fused.dv;
    const bool ok = same && bulk_ok && grid && marked;
    if (!ok) failures++;
    printf("%s sm90 ws fused, %d-query steps%s: dq, dk, dv are sm90 fused's bits %d, bulk dQ copies where T > 128 "
           "%d, %u CTAs for %ld tiles, the copies' bytes marked for initcheck %d\n", ok ? "ok  " : "FAIL",
           step128 ? 128 : 64, persistent ? ", persistent" : "", same, bulk_ok, emu::g_grid_big_smem.x, tiles, marked);
  }
  set_tiles({0, 0, 0});
  fflush(stdout);
}
template <typename E>
void run_ws_bwd(int B, int H, int T, bool causal, bool bthd, DType dt, double tol, unsigned seed, int fwd,
                std::initializer_list<int> options = {4, 5, 6, 7}) {
  set_tiles({fwd, 3, 0});
  run_ws_bwd<E>(B, H, T, causal, bthd, dt, tol, seed, fwd, run<E>(B, H, T, 64, causal, bthd, true, dt, tol, seed),
                options);
}

// The fused Hopper backward (dkdv option 3, "sm90 fused": dq made in the dkdv kernel, the CTAs of a (b, h) adding
// their parts in turn) after forward `fwd`, deterministic or not (it serves both): run() checks it against the
// reference; its dK and dV must be the bits of the two-pass dkdv kernel (option 2; the same products in the same
// order), and out and lse those of the same forward; at head dim 64 the warp-specialised form follows (run_ws_bwd).
template <typename E>
void run_fused_sm90(int B, int H, int T, int d, bool causal, bool bthd, DType dt, double tol, unsigned seed, int fwd) {
  set_tiles({fwd, 2, 3});
  const Outs two = run<E>(B, H, T, d, causal, bthd, true, dt, tol, seed);
  Outs fused;
  for (bool det : {true, false}) {
    set_tiles({fwd, 3, 0});
    g_kv_expect = 0;  // the plain fused kernel does not (the caller sums dk, dv)
    const Outs o = run<E>(B, H, T, d, causal, bthd, det, dt, tol, seed);
    g_kv_expect = -1;
    const bool same = o.out == two.out && o.lse == two.lse && o.dk == two.dk && o.dv == two.dv;
    if (!same) failures++;
    printf("%s sm90 fused det=%d: dk, dv (and out, lse) are the two-pass sm90 dkdv's bits\n", same ? "ok  " : "FAIL",
           det);
    if (det) fused = o;
  }
  if (d == 64) run_ws_bwd<E>(B, H, T, causal, bthd, dt, tol, seed, fwd, fused);
  set_tiles({0, 0, 0});
  fflush(stdout);
}

// engine's fused qkv path (fp32)
void run_fused(int B, int T, int C, int NH, bool causal, unsigned seed);

// float32 on TF32 tensor cores (flash_attention_tf32.cu): three products per product within 5e-6 of float64, one
// within 4e-3; and the engine's fused qkv at head size 64, which takes the three-product kernels.
void run_tf32_cases(unsigned& seed) {
  g_f32 = cuda::F32Math::tf32x3;
  run<float>(1, 1, 100, 64, true, false, true, DType::f32, 5e-6, seed++);
  g_f32 = cuda::F32Math::tf32;
  run<float>(1, 1, 70, 128, false, true, true, DType::f32, 4e-3, seed++);
  g_f32 = cuda::F32Math::simt;
  run_fused(1, 40, 128, 2, true, seed++);
}

// float32 attention on TF32 x3 tensor cores where mma.sync adds as the hardware does (emu::mma_rz_sum: each mma
// cuts its sum toward zero), causal at d in ds, against tests/test_flash_attention.py's measure (standard-normal
// inputs, ||got - ref|| / ||ref||). Its test_cuda_float32_matches_float64 (1e-5) measured dk 1.05-1.12e-5 at T 1000
// on an H200 (2026-11-26); this model gave the old kernels 1.2-1.3e-5 there (dv too), which says where the error was
// made. Each adder model given (group of products, extra alignment bits; the published ones differ by generation)
// must stay under tol.
void run_tchw_cases(unsigned& seed, int T, double tol, std::initializer_list<std::pair<int, int>> adders,
                    std::initializer_list<int> ds) {
  g_f32 = cuda::F32Math::tf32x3;
  g_normal = true;
  emu::g_mma_rz = 1;
  for (auto [group, neab] : adders) {
    emu::g_mma_group = group, emu::g_mma_neab = neab;
    printf("mma adder: groups of %d products, %d extra alignment bits, cut toward zero\n", group, neab);
    for (int d : ds) run<float>(1, 1, T, d, true, false, true, DType::f32, tol, seed++);
  }
  emu::g_mma_rz = 0;
  g_normal = false;
  g_f32 = cuda::F32Math::simt;
}

void run_fused(int B, int T, int C, int NH, bool causal, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  const int d = C / NH;
  std::vector<float> qkv((size_t)B * T * 3 * C), out((size_t)B * T * C, NAN), dout((size_t)B * T * C),
      lse((size_t)B * NH * T, NAN), dqkv(qkv.size(), NAN);
  for (auto& x : qkv) x = 2 * U(rng);
  for (auto& x : dout) x = U(rng);
  const size_t n = (size_t)B * NH * T * d;
  std::vector<double> lq(n), lk(n), lv(n), ldo(n);
  for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) for (int t = 0; t < T; t++) for (int x = 0; x < d; x++) {
    size_t L = (((size_t)b * NH + h) * T + t) * d + x, base = ((size_t)b * T + t) * 3 * C + h * d + x;
    lq[L] = qkv[base]; lk[L] = qkv[base + C]; lv[L] = qkv[base + 2 * C]; ldo[L] = dout[((size_t)b * T + t) * C + h * d + x];
  }
  cuda::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, causal, nullptr);
  cuda::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH, causal, nullptr,
                           nullptr);
  Ref r = reference(lq, lk, lv, ldo, B, NH, T, d, causal);
  std::vector<double> go(n), gq(n), gk(n), gv(n), gl(lse.begin(), lse.end());
  for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) for (int t = 0; t < T; t++) for (int x = 0; x < d; x++) {
    size_t L = (((size_t)b * NH + h) * T + t) * d + x, base = ((size_t)b * T + t) * 3 * C + h * d + x;
    go[L] = out[((size_t)b * T + t) * C + h * d + x]; gq[L] = dqkv[base]; gk[L] = dqkv[base + C]; gv[L] = dqkv[base + 2 * C];
  }
  double eo = relerr(go, r.out), el = relerr(gl, r.lse), eq = relerr(gq, r.dq), ek = relerr(gk, r.dk), ev = relerr(gv, r.dv);
  const double tol = 1e-4;
  bool ok = eo < tol && el < tol && eq < tol && ek < tol && ev < tol;
  if (!ok) failures++;
  printf("%s fused B=%d T=%d C=%d NH=%d causal=%d: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", ok ? "ok  " : "FAIL",
         B, T, C, NH, causal, eo, el, eq, ek, ev);
  fflush(stdout);
}

// The KV-cache decode kernels (attention_decode.cu): append T new positions at t0 into caches (B, NH, Tmax, hs)
// that hold random keys/values below t0 and NaN above, then attend; the cache must hold exactly the new k/v at
// [t0, t0 + T) and NaN beyond, out must match float64 attention of row t over positions [0, t0 + t].
template <typename E>
void run_decode(int B, int T, int t0, int Tmax, int C, int NH, double tol, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  const int d = C / NH;
  const size_t nc = (size_t)B * NH * Tmax * d;
  std::vector<E> qkv((size_t)B * T * 3 * C), kc(nc, from_float<E>(NAN)), vc(nc, from_float<E>(NAN)), out((size_t)B * T * C, from_float<E>(NAN));
  for (auto& x : qkv) x = from_float<E>(g_amp * U(rng));
  for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) for (int t = 0; t < t0; t++) for (int x = 0; x < d; x++) {
    const size_t i = (((size_t)b * NH + h) * Tmax + t) * d + x;
    kc[i] = from_float<E>(g_amp * U(rng));
    vc[i] = from_float<E>(U(rng));
  }
  std::vector<double> k0(kc.size()), v0(vc.size());
  for (size_t i = 0; i < nc; i++) k0[i] = to_float(kc[i]), v0[i] = to_float(vc[i]);
  cuda::attention_decode_append(kc.data(), vc.data(), qkv.data(), B, T, t0, Tmax, C, NH, nullptr);
  cuda::attention_decode_forward(out.data(), qkv.data(), kc.data(), vc.data(), B, T, t0, Tmax, C, NH, nullptr);
  bool cache_ok = true;
  std::vector<double> ref(out.size()), got(out.size());
  const double scale = 1.0 / std::sqrt((double)d);
  for (int b = 0; b < B; b++) for (int h = 0; h < NH; h++) {
    const size_t base = ((size_t)b * NH + h) * Tmax * d;
    for (int t = 0; t < Tmax; t++) for (int x = 0; x < d; x++) {  // the append: new rows, old rows, NaN beyond
      const size_t i = base + (size_t)t * d + x;
      const float k = to_float(kc[i]), v = to_float(vc[i]);
      if (t >= t0 && t < t0 + T) {
        const size_t q = ((size_t)b * T + t - t0) * 3 * C + h * d + x;
        cache_ok &= k == to_float(qkv[q + C]) && v == to_float(qkv[q + 2 * C]);
        k0[i] = k, v0[i] = v;
      } else if (t < t0) {
        cache_ok &= k == k0[i] && v == v0[i];
      } else {
        cache_ok &= k != k && v != v;
      }
    }
    for (int t = 0; t < T; t++) {
      const int n = t0 + t + 1;
      std::vector<double> p(n);
      double mx = -1e300, sum = 0;
      for (int j = 0; j < n; j++) {
        double s = 0;
        for (int x = 0; x < d; x++) s += (double)to_float(qkv[((size_t)b * T + t) * 3 * C + h * d + x]) * k0[base + (size_t)j * d + x];
        p[j] = s * scale, mx = std::max(mx, p[j]);
      }
      for (int j = 0; j < n; j++) sum += (p[j] = std::exp(p[j] - mx));
      for (int x = 0; x < d; x++) {
        double o = 0;
        for (int j = 0; j < n; j++) o += p[j] * v0[base + (size_t)j * d + x];
        const size_t i = ((size_t)b * T + t) * C + h * d + x;
        ref[i] = o / sum, got[i] = to_float(out[i]);
      }
    }
  }
  const double e = relerr(got, ref);
  const bool ok = cache_ok && e < tol;
  if (!ok) failures++;
  printf("%s decode %zu-byte B=%d T=%d t0=%d Tmax=%d C=%d NH=%d: cache %s out %.2e\n", ok ? "ok  " : "FAIL", sizeof(E),
         B, T, t0, Tmax, C, NH, cache_ok ? "exact" : "WRONG", e);
  fflush(stdout);
}

void run_decode_cases(unsigned& seed) {
  run_decode<float>(2, 1, 0, 4, 16, 2, 1e-5, seed++);        // one key: fewer keys than warps
  run_decode<float>(1, 3, 2, 8, 24, 3, 1e-5, seed++);        // T > 1, n from 3 to 5 (some warps idle)
  run_decode<float>(2, 1, 37, 40, 128, 2, 1e-5, seed++);     // head size 64: two dimensions per lane
  run_decode<float>(1, 2, 9, 12, 200, 2, 1e-5, seed++);      // head size 100: lanes past it idle
  run_decode<float>(1, 1, 5, 8, 256, 1, 1e-5, seed++);       // head size 256: the largest
  run_decode<bf16>(2, 2, 30, 33, 128, 2, 1e-2, seed++);
  run_decode<f16>(1, 1, 50, 64, 192, 3, 2e-3, seed++);
}

// A GPU older than sm_80 (T4, sm_75) has no mma.sync m16n8k16 or cp.async: bf16/fp16 take the simt kernels there,
// at any head dim up to 256 (48 and 160 are refused by the tensor-core kernels, so these cases cannot pass through them).
void run_sm75_cases(unsigned& seed) {
  emu::g_cc_major = 7;
  run<__nv_bfloat16>(1, 2, 40, 64, true, true, false, DType::bf16, 3e-2, seed++);
  run<__half>(1, 1, 37, 48, false, false, true, DType::f16, 5e-3, seed++);
  run<__nv_bfloat16>(1, 1, 19, 160, true, false, false, DType::bf16, 3e-2, seed++);
  emu::g_cc_major = 9;
}

// The default tile choice, "auto" (cuda::set_flash_tiles' option 0): on a compute capability 9.0 device the Hopper
// kernels flash_attention.cu names for it (fwd 8 "sm90 ws 128x128 persistent"; at d 64 dkdv 7 "sm90 ws fused 128x128
// persistent", at d 128 dkdv 2 and dq 3, "sm90 128x64", for the atomic backward dkdv 3, "sm90 fused"), on an sm_80
// one the mma.sync kernels (option 0 of each): each run's outputs must be the bits of that explicit choice, also where
// only some kernels are "auto".
void run_auto_cases(unsigned& seed) {
  struct Case {
    int cc, d;
    bool det;
    cuda::FlashTiles chosen, want;  // the choice (public numbering: 0 "auto") and the kernels it must run
  };
  const Case cases[] = {{9, 64, true, {0, 0, 0}, {8, 7, 0}},  {9, 64, false, {0, 0, 0}, {8, 7, 0}},
                        {9, 128, true, {0, 0, 0}, {8, 2, 3}}, {9, 128, false, {0, 0, 0}, {8, 3, 3}},
                        {9, 64, true, {1, 0, 0}, {0, 7, 0}},  {8, 64, true, {0, 0, 0}, {0, 0, 0}}};
  for (const Case& c : cases) {
    const bool det = c.det;
    emu::g_cc_major = c.cc;
    const unsigned s = seed++;
    set_tiles(c.want);
    const Outs want = run<__nv_bfloat16>(1, 2, 150, c.d, true, det, det, DType::bf16, 3e-2, s);
    cuda::set_flash_tiles(c.chosen);
    const Outs got = run<__nv_bfloat16>(1, 2, 150, c.d, true, det, det, DType::bf16, 3e-2, s);
    const bool same = got.out == want.out && got.lse == want.lse && got.dq == want.dq && got.dk == want.dk &&
                      got.dv == want.dv;
    if (!same) failures++;
    printf("%s cc %d.0 d %d det %d: tiles %d%d%d (0 auto) give the bits of kernel options %d%d%d\n",
           same ? "ok  " : "FAIL", c.cc, c.d, det, c.chosen.fwd, c.chosen.dkdv, c.chosen.dq, c.want.fwd,
           c.want.dkdv, c.want.dq);
  }
  emu::g_cc_major = 9;
  set_tiles({0, 0, 0});
  fflush(stdout);
}

// GPUs with less shared memory per block than an H100 (emu::g_smem_optin): sm_86/sm_89 (A10, L4, RTX 30xx/40xx)
// allow 99 KB, where the TF32 kernels' backward (102-132 KB) does not fit, so float32 takes the simt kernels, and
// d 128's deterministic dq pass (102 KB with 64-key blocks) takes 32-key blocks, which must give the 64-key blocks'
// bits; an A100 (163 KB) runs everything.
void run_smem_cases(unsigned& seed, std::initializer_list<int> limits_kb = {99, 163}) {
  for (int kb : limits_kb) {
    emu::g_smem_optin = kb * 1024;
    g_f32 = cuda::F32Math::tf32x3;
    run<float>(1, 2, 70, 64, true, true, true, DType::f32, 5e-6, seed++);
    run<float>(1, 1, 40, 128, false, false, true, DType::f32, 5e-6, seed++);
    g_f32 = cuda::F32Math::simt;
    emu::g_smem_optin = 227 * 1024;
    const unsigned s = seed++;
    const Outs a = run<__nv_bfloat16>(1, 2, 100, 128, true, true, true, DType::bf16, 3e-2, s);
    emu::g_smem_optin = kb * 1024;
    const Outs b = run<__nv_bfloat16>(1, 2, 100, 128, true, true, true, DType::bf16, 3e-2, s);
    const bool same = a.out == b.out && a.lse == b.lse && a.dq == b.dq && a.dk == b.dk && a.dv == b.dv;
    printf("%s smem %d KB: d 128's outputs are the 227 KB run's bits\n", same ? "ok  " : "FAIL", kb);
    if (!same) failures++;
  }
  emu::g_smem_optin = 227 * 1024;
}

// Cross-entropy (cross_entropy.cu) on rows of logits stored as S: forward + backward, and forward_backward both
// into a separate gradient and in place (the engine's classifier writes it over the logits), against float64 from
// the same stored values. forward and forward_backward share the kernels' pass one, so their losses must be the same
// bits, and backward from forward's lse must give forward_backward's gradient bits; in place or not, dloss given or
// read from memory: the same bits too. offset: every buffer starts that many elements in (the 16-byte units become
// single loads), and every result must be the offset-0 run's bits. special: -inf logits (row 0's first unit, and
// every unit of threads 1 and 17, so one thread's (max, sum) starts from -inf and others' stay there; every 97th
// logit of the middle rows) and a NaN in the last row among thread 1's -inf (the warp's first merge is of two -inf
// maxima): that row's loss and gradient must be NaN. forward_backward keeps the row in shared memory where two
// blocks' rows fit on an SM (the launch's dynamic shared memory is the row, rounded up to 16 bytes), else reads it
// twice (none): both give the same bits, and the case checks which of the two ran.
static bool g_ce_copy = true;  // the kernel the next cases expect: the row kept (at an H100's limits), or read twice
struct CrossEntropyRun {
  std::vector<float> l1, lse, l2, l3;
  std::vector<double> g1, g2, g3, g4;  // the gradients, widened
};

template <typename S>
CrossEntropyRun cross_entropy_calls(const std::vector<S>& x, const std::vector<int32_t>& tgt, int N, int V, float dloss,
                                    int off) {
  const size_t n = (size_t)N * V;
  const S unset = from_float<S>(-7.f);  // not NaN: the NaN row must be written, not left
  std::vector<S> xs(n + off, unset), g1(n + off, unset), g2(n + off, unset), g3(n + off, unset), g4(n + off, unset);
  std::copy(x.begin(), x.end(), xs.begin() + off);
  std::copy(x.begin(), x.end(), g3.begin() + off);
  CrossEntropyRun r{std::vector<float>(N, -7.f), std::vector<float>(N, -7.f), std::vector<float>(N, -7.f),
                    std::vector<float>(N, -7.f)};
  // g3 and g4 take dloss as fp16's loss scaling does, a power of two read from memory times the rest: the same bits.
  const float scale = 8.f;
  const S* xp = xs.data() + off;
  cuda::cross_entropy_forward(r.l1.data(), r.lse.data(), xp, tgt.data(), N, V, nullptr);
  cuda::cross_entropy_backward(g1.data() + off, xp, r.lse.data(), tgt.data(), dloss, nullptr, N, V, nullptr);
  cuda::cross_entropy_backward(g4.data() + off, xp, r.lse.data(), tgt.data(), dloss / scale, &scale, N, V, nullptr);
  cuda::cross_entropy_forward_backward(r.l2.data(), g2.data() + off, xp, tgt.data(), dloss, nullptr, N, V, nullptr);
  cuda::cross_entropy_forward_backward(r.l3.data(), g3.data() + off, g3.data() + off, tgt.data(), dloss / scale,
                                       &scale, N, V, nullptr);
  auto wide = [&](const std::vector<S>& a) {
    std::vector<double> o(n);
    for (size_t i = 0; i < n; i++) o[i] = to_float(a[i + off]);
    return o;
  };
  r.g1 = wide(g1), r.g2 = wide(g2), r.g3 = wide(g3), r.g4 = wide(g4);
  return r;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename S>
void run_cross_entropy(int N, int V, float amp, double tol, unsigned seed, int offset = 0, bool special = false) {
  constexpr int kThreads = 512, P = 16 / (int)sizeof(S);  // cross_entropy.cu's block and unit
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<S> x(N * (size_t)V);
  std::vector<int32_t> tgt(N);
  for (auto& v : x) v = from_float<S>(amp * nd(rng));
  for (int n = 0; n < N; n++) tgt[n] = (int32_t)(rng() % V);
  if (special) {
    for (int n = 0; n < N; n++)
      for (int j = 0; j < V; j++) {
        const int u = j / P, thread = u % kThreads;
        const bool first = n == 0 || n == N - 1;
        if ((first && (thread == 1 || thread == 17)) || (n == 0 && u == 0) || (!first && j % 97 == 5))
          x[(size_t)n * V + j] = from_float<S>(-INFINITY);
      }
    for (int n = 0; n < N; n++) x[(size_t)n * V + tgt[n]] = from_float<S>(amp * nd(rng));  // a finite loss
    x[(size_t)(N - 1) * V + P + 1] = from_float<S>(NAN);  // thread 1's: its (-inf, NaN) meets thread 17's (-inf, 0)
  }
  const int rows = special ? N - 1 : N;  // the rows the float64 reference is compared with
  const float dloss = 0.37f;
  std::vector<double> rloss(rows), rgrad((size_t)rows * V);
  for (int n = 0; n < rows; n++) {
    std::vector<double> r(V);
    for (int j = 0; j < V; j++) r[j] = to_float(x[(size_t)n * V + j]);
    double mx = -INFINITY, sum = 0;
    for (int j = 0; j < V; j++) mx = std::max(mx, r[j]);
    for (int j = 0; j < V; j++) sum += std::exp(r[j] - mx);
    const double l = mx + std::log(sum);
    rloss[n] = l - r[tgt[n]];
    for (int j = 0; j < V; j++) rgrad[(size_t)n * V + j] = (std::exp(r[j] - l) - (j == tgt[n])) * dloss;
  }
  const size_t seen = emu::g_max_smem_seen;  // the run's largest, which the last line prints: kept
  emu::g_max_smem_seen = 0;
  const CrossEntropyRun a = cross_entropy_calls(x, tgt, N, V, dloss, 0);
  const size_t row = ((size_t)V * sizeof(S) + 15) / 16 * 16;
  const bool copy = g_ce_copy, kernel = emu::g_max_smem_seen == (copy ? row : 0);
  emu::g_max_smem_seen = std::max(seen, emu::g_max_smem_seen);
  auto head = [&](const auto& v, size_t k) { return std::vector<double>(v.begin(), v.begin() + k); };
  const size_t ng = (size_t)rows * V;
  const double e1 = relerr(head(a.l1, rows), rloss), e2 = relerr(head(a.l2, rows), rloss),
               d1 = relerr(head(a.g1, ng), rgrad), d2 = relerr(head(a.g2, ng), rgrad);
  const bool same = same_bits(a.l1, a.l2) && same_bits(a.l2, a.l3) && same_bits(a.g1, a.g2) &&
                    same_bits(a.g2, a.g3) && same_bits(a.g1, a.g4);
  bool nan_row = true, aligned = true;
  if (special) {
    for (const auto* l : {&a.l1, &a.l2, &a.l3}) nan_row = nan_row && std::isnan((*l)[N - 1]);
    for (size_t i = ng; i < x.size(); i++) nan_row = nan_row && std::isnan(a.g1[i]) && std::isnan(a.g2[i]);
  }
  if (offset) {
    const CrossEntropyRun b = cross_entropy_calls(x, tgt, N, V, dloss, offset);
    aligned = same_bits(a.l1, b.l1) && same_bits(a.lse, b.lse) && same_bits(a.l2, b.l2) && same_bits(a.l3, b.l3) &&
              same_bits(a.g1, b.g1) && same_bits(a.g2, b.g2) && same_bits(a.g3, b.g3) && same_bits(a.g4, b.g4);
  }
  const bool ok = e1 < 1e-5 && e2 < 1e-5 && d1 < tol && d2 < tol && same && nan_row && aligned && kernel;
  if (!ok) failures++;
  printf("%s cross_entropy %zu-byte N=%d V=%d amp=%g offset %d%s: loss %.2e / %.2e, dlogits %.2e / %.2e, "
         "one pass one / backward / in place %s%s%s; row %s%s\n",
         ok ? "ok  " : "FAIL", sizeof(S), N, V, amp, offset, special ? " -inf+NaN" : "", e1, e2, d1, d2,
         same ? "same bits" : "DIFFER", special ? (nan_row ? ", NaN row NaN" : ", NaN row NOT NaN") : "",
         offset ? (aligned ? ", offset same bits" : ", offset DIFFERS") : "",
         copy ? "kept in shared memory" : "read twice", kernel ? "" : " (NOT the kernel that ran)");
  fflush(stdout);
}

void run_cross_entropy_cases(unsigned& seed) {
  run_cross_entropy<float>(3, 1000, 1.f, 1e-5, seed++);
  run_cross_entropy<float>(2, 2, 1.f, 1e-5, seed++);          // fewer columns than threads
  run_cross_entropy<float>(2, 1537, 30.f, 1e-5, seed++, 1);   // peaky rows: the running max moves a lot; a tail
  run_cross_entropy<bf16>(2, 777, 3.f, 8e-3, seed++);         // gradients rounded to 8 bits
  run_cross_entropy<f16>(2, 600, 3.f, 1e-3, seed++, 2);
  run_cross_entropy<bf16>(3, 5000, 3.f, 8e-3, seed++, 3, true);  // more units than threads; off by 6 bytes
  run_cross_entropy<float>(3, 2500, 3.f, 1e-5, seed++, 1, true);
  run_cross_entropy<f16>(3, 4099, 3.f, 1e-3, seed++, 0, true);   // a tail of 3
  run_cross_entropy<bf16>(2, 50304, 1.f, 8e-3, seed++, 1);       // GPT-2's padded vocabulary
  run_cross_entropy<bf16>(2, 50257, 1.f, 8e-3, seed++);          // and its own: single loads, a tail of 1
  // Many rows: the thread that writes forward's loss (0) and forward_backward's (the target's) must hold the same
  // lse bits, so the block's merges must give every lane the same bits (with the kernels built contracting a * b + c
  // into FMAs, as nvcc does, an FMA in the merge rounds one lane's product and not its partner's).
  run_cross_entropy<float>(16, 3000, 3.f, 1e-5, seed++);
  // An SM with room for two 160 KB rows (no GPU has one yet): 20-21 units a thread, more than the 16 that
  // row_lse_async asks for before its first add, so its loop copies the rest as it goes.
  emu::g_smem_per_sm = 400 * 1024;
  run_cross_entropy<bf16>(2, 81928, 1.f, 8e-3, seed++, 1);
  emu::g_smem_per_sm = 228 * 1024;
  // Rows larger than two blocks an SM can keep (here an SM of 16 KB, 6 KB a row: small rows, for the emulator's time;
  // on an H100, 16-bit rows past 57,344 logits, float past 28,672) are read twice: aligned or not, a tail, -inf / NaN,
  // and 2050 units (each thread's batches of 4, in place as the engine runs it).
  g_ce_copy = false;
  emu::g_smem_per_sm = 16 * 1024;
  run_cross_entropy<bf16>(3, 5000, 3.f, 8e-3, seed++, 3, true);
  run_cross_entropy<f16>(2, 4099, 3.f, 1e-3, seed++);
  run_cross_entropy<float>(2, 2600, 3.f, 1e-5, seed++, 1);
  run_cross_entropy<bf16>(2, 16400, 3.f, 8e-3, seed++, 1);
  emu::g_smem_per_sm = 228 * 1024;
  // The per-block opt-in limit alone (an SM with room for two, a block allowed less): read twice too.
  emu::g_smem_optin = 8 * 1024;
  run_cross_entropy<float>(2, 2600, 3.f, 1e-5, seed++);
  emu::g_smem_optin = 227 * 1024;
  g_ce_copy = true;
}

// float64 LayerNorm of N rows x (C, stored as S), forward (out) and backward: dx = dinp0 + the row's gradient, and
// dweight/dbias added onto what dw/db hold.
template <typename S>
void layernorm_f64(const S* x, const S* w, const S* bias, const S* dy, const S* dinp0, int N, int C, double* out,
                   double* dx, double* dw, double* db) {
  for (int r = 0; r < N; r++) {
    const S* xr = x + (size_t)r * C;
    const S* gr = dy + (size_t)r * C;
    double m = 0, v = 0;
    for (int c = 0; c < C; c++) m += to_float(xr[c]);
    m /= C;
    for (int c = 0; c < C; c++) v += (to_float(xr[c]) - m) * (to_float(xr[c]) - m);
    const double rs = 1.0 / std::sqrt(v / C + 1e-5);
    double sd = 0, sdn = 0;
    for (int c = 0; c < C; c++) {
      const double norm = (to_float(xr[c]) - m) * rs, g = to_float(gr[c]);
      out[(size_t)r * C + c] = norm * to_float(w[c]) + to_float(bias[c]);
      sd += g * to_float(w[c]);
      sdn += g * to_float(w[c]) * norm;
      dw[c] += g * norm;
      db[c] += g;
    }
    for (int c = 0; c < C; c++) {
      const size_t i = (size_t)r * C + c;
      const double norm = (to_float(xr[c]) - m) * rs, g = to_float(gr[c]);
      dx[i] = to_float(dinp0[i]) + (g * to_float(w[c]) - sd / C - norm * sdn / C) * rs;
    }
  }
}

// k values shift + scale * (a draw of nd), each rounded to S.
template <typename S>
std::vector<S> normals(std::mt19937& rng, std::normal_distribution<float>& nd, size_t k, float scale, float shift) {
  std::vector<S> v(k);
  for (auto& x : v) x = from_float<S>(shift + scale * nd(rng));
  return v;
}

// LayerNorm (layernorm.cu) and the residual add fused with it (residual_layernorm.cu) on rows stored as S. The fused
// kernel must give the bits of the unfused pair: res = a + b rounded once (as residual.cu rounds it), then
// layernorm_forward's out, mean and rstd on that res; also with res written over a (the engine's in-place add).
// Both forward paths (layernorm_one_pass: the row kept in registers where C fits, else read for each pass) give
// those bits and out within tol of float64. `offset` elements shift a and b off 16-byte alignment (res, out aligned):
// the fused kernel then loads single elements where the unfused one loads packs, and must still agree with it.
// The LayerNorm's backward (dinp +=, dweight, dbias over row chunks) against float64 too.
template <typename S>
void run_residual_layernorm(int N, int C, int offset, double tol, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const size_t n = (size_t)N * C;
  auto fill = [&](size_t k, float scale, float shift) { return normals<S>(rng, nd, k, scale, shift); };
  const std::vector<S> a = fill(n + offset, 2.f, 0.5f), b = fill(n + offset, 1.f, 0.f), w = fill(C, 1.f, 0.f),
                       bias = fill(C, 1.f, 0.f), dy = fill(n, 1.f, 0.f), dinp0 = fill(n, 1.f, 0.f);
  const S nan = from_float<S>(NAN);
  std::vector<S> want(n);
  for (size_t i = 0; i < n; i++) want[i] = from_float<S>(to_float(a[i + offset]) + to_float(b[i + offset]));
  auto wide = [](const auto& v) {
    std::vector<double> o(v.size());
    for (size_t i = 0; i < v.size(); i++) o[i] = to_float(v[i]);
    return o;
  };
  // float64 LayerNorm of the rounded sums, forward and backward (dinp accumulates onto dinp0).
  std::vector<double> rout(n), rdx(n), rdw(C, 0.0), rdb(C, 0.0);
  layernorm_f64(want.data(), w.data(), bias.data(), dy.data(), dinp0.data(), N, C, rout.data(), rdx.data(),
                rdw.data(), rdb.data());
  bool same = true;
  double eo[2];
  std::vector<float> mean, rstd;  // the default path's, for the backward
  for (int one_pass : {0, 1}) {
    const bool before = cuda::set_layernorm_one_pass(one_pass);
    std::vector<S> res(n, nan), out(n, nan), out2(n, nan);
    std::vector<float> mean1(N, NAN), rstd1(N, NAN), mean2(N, NAN), rstd2(N, NAN);
    cuda::residual_layernorm_forward(res.data(), out.data(), mean1.data(), rstd1.data(), a.data() + offset,
                                     b.data() + offset, w.data(), bias.data(), N, C, nullptr);
    cuda::layernorm_forward(out2.data(), mean2.data(), rstd2.data(), want.data(), w.data(), bias.data(), N, C,
                            nullptr);
    std::vector<S> inplace = a, out3(n, nan);
    std::vector<float> mean3(N, NAN), rstd3(N, NAN);
    cuda::residual_layernorm_forward(inplace.data() + offset, out3.data(), mean3.data(), rstd3.data(),
                                     inplace.data() + offset, b.data() + offset, w.data(), bias.data(), N, C,
                                     nullptr);
    cuda::set_layernorm_one_pass(before);
    same = same && same_bits(res, want) && same_bits(out, out2) && same_bits(mean1, mean2) &&
           same_bits(rstd1, rstd2) &&
           memcmp(inplace.data(), a.data(), offset * sizeof(S)) == 0 &&
           memcmp(inplace.data() + offset, want.data(), n * sizeof(S)) == 0 && same_bits(out3, out2) &&
           same_bits(mean3, mean2) && same_bits(rstd3, rstd2);
    eo[one_pass] = relerr(wide(out), rout);
    if (one_pass) mean = mean1, rstd = rstd1;
  }
  std::vector<S> dinp = dinp0;
  std::vector<float> dw(C, 0.f), db(C, 0.f);
  cuda::layernorm_backward(dinp.data(), dw.data(), db.data(), dy.data(), want.data(), w.data(), mean.data(),
                           rstd.data(), N, C, nullptr);
  const double ex = relerr(wide(dinp), rdx), ew = relerr(wide(dw), rdw), eb = relerr(wide(db), rdb);
  const bool ok = same && eo[0] < tol && eo[1] < tol && ex < tol && ew < 1e-5 && eb < 1e-5;
  if (!ok) failures++;
  const char* type = std::is_same_v<S, float> ? "fp32" : std::is_same_v<S, bf16> ? "bf16" : "fp16";
  printf("%s residual_layernorm %s N=%d C=%d a,b offset %d: %s; out %.2e (rows read once), %.2e (again); dinp %.2e, "
         "dweight %.2e, dbias %.2e\n", ok ? "ok  " : "FAIL", type, N, C, offset,
         same ? "unfused bits" : "DIFFERS from the unfused pair", eo[1], eo[0], ex, ew, eb);
  fflush(stdout);
}

// The one-pass kernel the next cases expect where it runs: rows through the ring in shared memory (cp.async, at an
// H100's limits) or loaded into registers (an SM too small for its blocks' rings, or a GPU before sm_80).
static bool g_ln_ring = true;

// The ring kernel's dynamic shared memory as layernorm.cu lays it out (its ring_bytes), stated here so that a launch's
// size tells which kernel ran: 8 warps x 2 rows x (inp, dout, dinp), the weight, the (2, C) chunk sums in 16-byte
// slots (whole stripes of 32 packs, then the last one's quarters up to its last pack), and with `sum` each of the 8
// warps' dinp sums over C rounded up to stripes.
template <typename S>
size_t ln_ring_bytes(int C, bool sum) {
  constexpr int P = 16 / (int)sizeof(S), kStripe = 32 * P;
  const int packs = C / P, last = packs % 32;
  const size_t slots = ((size_t)packs / 32 * 32 + (last ? 32 : 0)) * (P / 4) - (last ? 32 - last : 0);
  return (8 * 2 * 3 + 1) * (size_t)C * sizeof(S) + 2 * slots * 16 +
         (sum ? 8 * (size_t)((C + kStripe - 1) / kStripe * kStripe) * sizeof(float) : 0);
}

// The LayerNorm backward's two paths (layernorm.cu): rows read once (warps of a block take the parts of a chunk and
// add their sums in turn) and the two-pass kernels. They must give the same dweight/dbias bits (the same parts in
// the same order, fmaf in both), each within tol of float64 for dinp (added onto values already there) and 1e-5 for
// dweight/dbias (also added onto values). `offset` elements shift every row view off 16-byte alignment; `fits` is
// whether the one-pass kernel must take the shape (else both calls run the two passes). dweight/dbias must also be
// the bits of the CPU reference (cpu/layernorm.cpp, compiled in beside them) on the same inputs, mean and rstd:
// 64-row chunks of 8-row fmaf parts, the chunks in double over 16 lanes of chunks, then the lanes in order.
// `cancel`: rows 0-63 get dout times 2^60 and rows 64-127 their copy with dout negated, so chunks 0 and 1 cancel
// exactly in the combine's lane order (lane 0, lane 1, then the rest) and in no other: summed after the small chunks,
// they would round those away (the float64 reference leaves the two chunks out, as they add exactly 0).
// Where the ring ran, the register kernel (as before sm_80) runs too and must give its dinp's bits.
template <typename S>
void run_layernorm_paths(int N, int C, int offset, bool fits, double tol, unsigned seed, bool cancel = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const size_t n = (size_t)N * C + offset;
  auto fill = [&](size_t k, float scale, float shift) { return normals<S>(rng, nd, k, scale, shift); };
  std::vector<S> x = fill(n, 2.f, 0.5f), dy = fill(n, 1.f, 0.f);
  const std::vector<S> dinp0 = fill(n, 1.f, 0.f), w = fill(C + offset, 1.f, 0.f), bias = fill(C + offset, 1.f, 0.f);
  const int skip = cancel ? 128 : 0;  // rows the float64 dweight/dbias leave out
  if (cancel) {
    if (N < 128 || N > 16 * 64) throw std::invalid_argument("run_layernorm_paths: cancel needs 2 to 16 chunks");
    for (size_t i = offset; i < offset + 64 * (size_t)C; i++) {
      dy[i] = from_float<S>(to_float(dy[i]) * 0x1p60f);
      x[i + 64 * C] = x[i];
      dy[i + 64 * C] = from_float<S>(-to_float(dy[i]));
    }
  }
  std::vector<float> dw0(C), db0(C);
  for (int c = 0; c < C; c++) dw0[c] = nd(rng), db0[c] = nd(rng);
  std::vector<S> out(n);
  std::vector<float> mean(N), rstd(N);
  cuda::layernorm_forward(out.data() + offset, mean.data(), rstd.data(), x.data() + offset, w.data() + offset,
                          bias.data() + offset, N, C, nullptr);
  std::vector<double> rout((size_t)N * C), rdx((size_t)N * C), rdw(dw0.begin(), dw0.end()),
      rdb(db0.begin(), db0.end());
  std::vector<double> cut_dw(C), cut_db(C);  // the cancelled chunks' float64 sums, thrown away
  layernorm_f64(x.data() + offset, w.data() + offset, bias.data() + offset, dy.data() + offset, dinp0.data() + offset,
                skip, C, rout.data(), rdx.data(), cut_dw.data(), cut_db.data());
  layernorm_f64(x.data() + offset + (size_t)skip * C, w.data() + offset, bias.data() + offset,
                dy.data() + offset + (size_t)skip * C, dinp0.data() + offset + (size_t)skip * C, N - skip, C,
                rout.data() + (size_t)skip * C, rdx.data() + (size_t)skip * C, rdw.data(), rdb.data());
  const auto wide = [offset](const auto& v) {
    std::vector<double> o(v.size() - offset);
    for (size_t i = 0; i < o.size(); i++) o[i] = to_float(v[i + offset]);
    return o;
  };
  const double eo = relerr(wide(out), rout);  // the forward on the same views (its packed rows where C fits)
  bool ok = cuda::layernorm_one_pass_fits(dinp0.data() + offset, dy.data() + offset, x.data() + offset,
                                          w.data() + offset, C) == fits && eo < tol;
  std::vector<float> dws[2], dbs[2];
  std::vector<S> ring_dinp;
  double ex[2], ew[2], eb[2];
  const size_t ring = fits && g_ln_ring ? ln_ring_bytes<S>(C, false) : 0;  // the ring kernel's bytes, or none
  bool kernel = true;
  for (int one_pass : {1, 0}) {
    const bool before = cuda::set_layernorm_one_pass(one_pass);
    std::vector<S> dinp = dinp0;
    std::vector<float> dw = dw0, db = db0;
    const size_t seen = emu::g_max_smem_seen;  // the run's largest, which the last line prints: kept
    emu::g_max_smem_seen = 0;
    cuda::layernorm_backward(dinp.data() + offset, dw.data(), db.data(), dy.data() + offset, x.data() + offset,
                             w.data() + offset, mean.data(), rstd.data(), N, C, nullptr);
    kernel = kernel && emu::g_max_smem_seen == (one_pass ? ring : 0);
    emu::g_max_smem_seen = std::max(seen, emu::g_max_smem_seen);
    cuda::set_layernorm_one_pass(before);
    ok = ok && memcmp(dinp.data(), dinp0.data(), offset * sizeof(S)) == 0;  // nothing before the view is written
    std::vector<double> wdw(dw.begin(), dw.end()), wdb(db.begin(), db.end());
    ex[one_pass] = relerr(wide(dinp), rdx);
    ew[one_pass] = relerr(wdw, rdw);
    eb[one_pass] = relerr(wdb, rdb);
    ok = ok && ex[one_pass] < tol && ew[one_pass] < 1e-5 && eb[one_pass] < 1e-5;
    dws[one_pass] = dw, dbs[one_pass] = db;
    if (one_pass) ring_dinp = dinp;
  }
  bool same_dinp = true;  // the ring's dinp is the register kernel's
  if (ring) {
    std::vector<S> dinp = dinp0;
    std::vector<float> dw = dw0, db = db0;
    const int cc = emu::g_cc_major;
    emu::g_cc_major = 7;
    cuda::layernorm_backward(dinp.data() + offset, dw.data(), db.data(), dy.data() + offset, x.data() + offset,
                             w.data() + offset, mean.data(), rstd.data(), N, C, nullptr);
    emu::g_cc_major = cc;
    same_dinp = memcmp(dinp.data(), ring_dinp.data(), n * sizeof(S)) == 0;
  }
  std::vector<float> cpu_dw = dw0, cpu_db = db0;
  std::vector<S> cpu_dinp = dinp0;
  cpu::layernorm_backward(cpu_dinp.data() + offset, cpu_dw.data(), cpu_db.data(), dy.data() + offset,
                          x.data() + offset, w.data() + offset, mean.data(), rstd.data(), N, C);
  const auto same_bits = [C](const std::vector<float>& a, const std::vector<float>& b) {
    return memcmp(a.data(), b.data(), C * sizeof(float)) == 0;
  };
  const bool same = same_bits(dws[0], dws[1]) && same_bits(dbs[0], dbs[1]) && same_bits(dws[1], cpu_dw) &&
                    same_bits(dbs[1], cpu_db);
  ok = ok && same && kernel && same_dinp;
  if (!ok) failures++;
  const char* type = std::is_same_v<S, float> ? "fp32" : std::is_same_v<S, bf16> ? "bf16" : "fp16";
  printf("%s layernorm_backward %s N=%d C=%d offset %d (%s%s%s%s): dweight/dbias %s, two paths and CPU; one pass: "
         "dinp %.2e, dweight %.2e, dbias %.2e; two: %.2e, %.2e, %.2e; forward out %.2e\n", ok ? "ok  " : "FAIL", type,
         N, C, offset, !fits ? "two passes only" : ring ? "one pass, ring" : "one pass, registers",
         ring ? (same_dinp ? ", the registers' dinp bits" : ", dinp NOT the registers' bits") : "",
         cancel ? ", chunks 0 and 1 cancel" : "", kernel ? "" : ", NOT the kernel that ran",
         same ? "same bits" : "DIFFER", ex[1], ew[1], eb[1], ex[0], ew[0], eb[0], eo);
  fflush(stdout);
}

// The LayerNorm backward's dinp_sum (the fused model's residual-projection bias gradients): dinp_sum += the column
// sums of dinp as it stands after the call. `fused`: the one-pass ring kernel must sum it as it writes (16-bit rows,
// the rings and the warps' sums fit the SM: the launch's shared memory says which kernel ran), in its order,
// replayed here (per 8-row part the rows in order from 0.f, the chunk's parts in order, the chunks in double over 16
// lanes, the lanes in order, then (float) onto dinp_sum); else bias_backward's pass over dinp gives it, whose bits
// it must be (cuda/matmul_bias.cu, on the same dinp). Either way within 1e-5 of float64, and dinp, dweight and
// dbias the bits of the same call without it.
template <typename S>
void run_layernorm_sum(int N, int C, int offset, bool fused, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const size_t n = (size_t)N * C + offset;
  auto fill = [&](size_t k, float scale, float shift) { return normals<S>(rng, nd, k, scale, shift); };
  const std::vector<S> x = fill(n, 2.f, 0.5f), dy = fill(n, 1.f, 0.f), dinp0 = fill(n, 1.f, 0.f);
  const std::vector<S> w = fill(C + offset, 1.f, 0.f), bias = fill(C + offset, 1.f, 0.f);
  std::vector<float> ds0(C);
  for (auto& v : ds0) v = nd(rng);
  std::vector<S> out(n);
  std::vector<float> mean(N), rstd(N);
  cuda::layernorm_forward(out.data() + offset, mean.data(), rstd.data(), x.data() + offset, w.data() + offset,
                          bias.data() + offset, N, C, nullptr);
  const auto run = [&](std::vector<S>& dinp, std::vector<float>& dw, std::vector<float>& db, float* ds) {
    dinp = dinp0, dw.assign(C, 0.5f), db.assign(C, -0.5f);
    cuda::layernorm_backward(dinp.data() + offset, dw.data(), db.data(), dy.data() + offset, x.data() + offset,
                             w.data() + offset, mean.data(), rstd.data(), N, C, ds, nullptr);
  };
  std::vector<S> dinp_a, dinp_b;
  std::vector<float> dw_a, db_a, dw_b, db_b, ds = ds0;
  run(dinp_a, dw_a, db_a, nullptr);
  const size_t seen = emu::g_max_smem_seen;
  emu::g_max_smem_seen = 0;
  run(dinp_b, dw_b, db_b, ds.data());
  const size_t smem = emu::g_max_smem_seen;
  emu::g_max_smem_seen = std::max(seen, smem);
  const bool same = memcmp(dinp_a.data(), dinp_b.data(), n * sizeof(S)) == 0 && dw_a == dw_b && db_a == db_b;
  const bool kernel = fused == (smem == ln_ring_bytes<S>(C, true));
  std::vector<float> want = ds0;
  std::vector<double> exact(C, 0.0);
  const int64_t nchunks = (N + 63) / 64;
  for (int c = 0; c < C; c++) {
    double lanes[16] = {};
    for (int64_t ch = 0; ch < nchunks; ch++) {
      float t = 0.f;
      for (int64_t p0 = ch * 64; p0 < std::min<int64_t>(N, ch * 64 + 64); p0 += 8) {
        float q = 0.f;
        for (int64_t r = p0; r < std::min<int64_t>(N, p0 + 8); r++) {
          const float v = to_float(dinp_b[offset + r * C + c]);
          q += v;
          exact[c] += v;
        }
        t = p0 == ch * 64 ? q : t + q;
      }
      lanes[ch % 16] += t;
    }
    double total = 0.0;
    for (double l : lanes) total += l;
    want[c] += (float)total;
  }
  if (!fused) {
    want = ds0;
    cuda::bias_backward(want.data(), dinp_b.data() + offset, N, C, nullptr);
  }
  double err2 = 0, ref2 = 0;
  for (int c = 0; c < C; c++) {
    const double e = ((double)ds[c] - ds0[c]) - exact[c];
    err2 += e * e, ref2 += exact[c] * exact[c];
  }
  const double rel = std::sqrt(err2 / ref2);
  const bool bits = ds == want;
  const bool ok = same && kernel && bits && rel <= 1e-5;
  if (!ok) failures++;
  const char* type = std::is_same_v<S, float> ? "fp32" : std::is_same_v<S, bf16> ? "bf16" : "fp16";
  printf("%s layernorm_backward dinp_sum %s N=%d C=%d offset %d (%s%s): %s, %.2e from float64; dinp/dweight/dbias "
         "%s\n", ok ? "ok  " : "FAIL", type, N, C, offset, fused ? "summed in the one-pass kernel" : "bias_backward",
         kernel ? "" : ", NOT the kernel that ran", bits ? "the order's bits" : "DIFFERS from the order's bits", rel,
         same ? "the bits without it" : "CHANGED by it");
  fflush(stdout);
}

void run_layernorm_cases(unsigned& seed) {
  run_residual_layernorm<float>(13, 96, 0, 1e-5, seed++);  // rows not a multiple of the block's 8 warps
  run_residual_layernorm<float>(9, 7, 0, 1e-5, seed++);    // fewer columns than lanes, not whole packs
  run_residual_layernorm<float>(130, 40, 0, 1e-5, seed++); // three row chunks for dweight/dbias
  run_residual_layernorm<bf16>(11, 64, 0, 1e-2, seed++);
  run_residual_layernorm<f16>(11, 80, 0, 2e-3, seed++);
  // The forward's packed rows: GPT-2's width (three packs per lane), the widest, a part-filled last stripe; too
  // wide and not whole packs (the forward that reads a row again either way); a and b off 16-byte alignment.
  run_residual_layernorm<bf16>(10, 768, 0, 1e-2, seed++);
  run_residual_layernorm<f16>(9, 1024, 0, 2e-3, seed++);
  run_residual_layernorm<float>(9, 1020, 0, 1e-5, seed++);
  run_residual_layernorm<bf16>(9, 1032, 0, 1e-2, seed++);
  run_residual_layernorm<bf16>(9, 100, 0, 1e-2, seed++);
  run_residual_layernorm<bf16>(10, 768, 3, 1e-2, seed++);
  run_residual_layernorm<float>(11, 132, 1, 1e-5, seed++);
  // The backward's two paths. Widths: one pack per lane (8 columns of bf16, 4 of fp32) and lanes with none; each of
  // the four instances (up to 256, 512, 768, 1024 columns); a partly filled last stripe. Rows: chunks cut short,
  // parts cut short, warps with no rows, one row.
  run_layernorm_paths<bf16>(70, 768, 0, true, 1e-2, seed++);
  run_layernorm_paths<bf16>(9, 1024, 0, true, 1e-2, seed++);
  run_layernorm_paths<bf16>(131, 40, 0, true, 1e-2, seed++);
  run_layernorm_paths<f16>(17, 520, 0, true, 2e-3, seed++);
  run_layernorm_paths<f16>(1, 264, 0, true, 2e-3, seed++);
  run_layernorm_paths<float>(66, 132, 0, true, 1e-5, seed++);
  run_layernorm_paths<float>(8, 1020, 0, true, 1e-5, seed++);
  run_layernorm_paths<float>(65, 384, 0, true, 1e-5, seed++);
  // The two passes only: too wide, not whole packs, views off 16-byte alignment.
  run_layernorm_paths<bf16>(5, 1032, 0, false, 1e-2, seed++);
  run_layernorm_paths<bf16>(12, 100, 0, false, 1e-2, seed++);
  run_layernorm_paths<float>(70, 64, 1, false, 1e-5, seed++);
  run_layernorm_paths<bf16>(9, 64, 3, false, 1e-2, seed++);
  // More chunks than the combine's 16 lanes (the cases above have 1 or 2: lanes with none): 17, lane 0 taking two,
  // the last of one row.
  run_layernorm_paths<bf16>(64 * 16 + 1, 40, 0, true, 1e-2, seed++);
  run_layernorm_paths<bf16>(64 * 5 + 3, 40, 0, true, 1e-2, seed++, true);  // the lanes' order
  // The register kernel (the cases above ran the ring): a GPU before sm_80, and an SM whose shared memory does not
  // hold its blocks' rings (sm_86's 100 KB: two 79.5 KB blocks of bf16 at C 768 do not fit, one fp32 block of 155 KB
  // neither), each with a part cut short, warps with no rows and a widest row.
  g_ln_ring = false;
  emu::g_cc_major = 7;
  run_layernorm_paths<bf16>(70, 768, 0, true, 1e-2, seed++);
  run_layernorm_paths<float>(9, 1020, 0, true, 1e-5, seed++);
  emu::g_cc_major = 9;
  emu::g_smem_per_sm = 100 * 1024, emu::g_smem_optin = 99 * 1024;
  run_layernorm_paths<bf16>(70, 768, 0, true, 1e-2, seed++);
  run_layernorm_paths<f16>(9, 1024, 0, true, 2e-3, seed++);
  run_layernorm_paths<float>(65, 768, 0, true, 1e-5, seed++);
  // sm_80 (164 KB an SM, 1 KB of it reserved a block): the widest fp32 rows on either side of the limit, two blocks
  // an SM (C 404: 82,416 bytes a block fit, 408: 83,232 do not) and one (816: 166,464; 820: 167,280); GPT-2's bf16
  // rows (81,408) fit.
  emu::g_smem_per_sm = 164 * 1024, emu::g_smem_optin = 163 * 1024;
  run_layernorm_paths<float>(65, 408, 0, true, 1e-5, seed++);
  run_layernorm_paths<float>(65, 820, 0, true, 1e-5, seed++);
  g_ln_ring = true;
  run_layernorm_paths<float>(65, 404, 0, true, 1e-5, seed++);
  run_layernorm_paths<float>(65, 816, 0, true, 1e-5, seed++);
  run_layernorm_paths<bf16>(70, 768, 0, true, 1e-2, seed++);
  // dinp_sum at sm_80's limits: GPT-2's bf16 rows take the ring without the sums (103.5 KB a block with them), 256
  // columns (four blocks an SM, 36.4 KB each) the sums too.
  run_layernorm_sum<bf16>(70, 768, 0, false, seed++);
  run_layernorm_sum<bf16>(70, 256, 0, true, seed++);
  emu::g_smem_per_sm = 228 * 1024, emu::g_smem_optin = 227 * 1024;
  // dinp_sum at an H100's limits: summed in the kernel for 16-bit rows of each instance's widths (GPT-2's, a partly
  // filled last stripe, two stripes, one pack a lane, the widest), one row, more chunks than the combine's 16 lanes; bias_backward
  // for fp32 (the fused model keeps the unfused bits there), the two passes (views off alignment, or chosen), and
  // before sm_80.
  run_layernorm_sum<bf16>(70, 768, 0, true, seed++);
  run_layernorm_sum<f16>(131, 520, 0, true, seed++);
  run_layernorm_sum<bf16>(70, 384, 0, true, seed++);
  run_layernorm_sum<f16>(17, 400, 0, true, seed++);
  run_layernorm_sum<bf16>(1, 40, 0, true, seed++);
  run_layernorm_sum<f16>(9, 1024, 0, true, seed++);
  run_layernorm_sum<bf16>(64 * 17 + 1, 40, 0, true, seed++);
  run_layernorm_sum<float>(66, 132, 0, false, seed++);
  run_layernorm_sum<bf16>(9, 64, 3, false, seed++);
  const bool before = cuda::set_layernorm_one_pass(false);
  run_layernorm_sum<bf16>(70, 768, 0, false, seed++);
  cuda::set_layernorm_one_pass(before);
  emu::g_cc_major = 7;
  run_layernorm_sum<bf16>(70, 768, 0, false, seed++);
  emu::g_cc_major = 9;
  // A block taking several chunks in turn (one SM: kOnePassBlocks blocks, 2 at GPT-2's width, 1 for fp32's), its
  // rows' ring and its means running on from chunk to chunk, the last chunk short (a part cut short, warps with no
  // rows), for each form: the ring with dinp's sums (14 chunks on 2 blocks), the ring, fp32's ring, the register
  // kernel.
  const int sms = emu::g_sm_count;
  emu::g_sm_count = 1;
  run_layernorm_sum<bf16>(64 * 13 + 21, 768, 0, true, seed++);
  run_layernorm_paths<bf16>(64 * 9 + 13, 768, 0, true, 1e-2, seed++);
  run_layernorm_paths<float>(64 * 4 + 9, 768, 0, true, 1e-5, seed++);
  g_ln_ring = false;
  emu::g_cc_major = 7;
  run_layernorm_paths<bf16>(64 * 5 + 3, 768, 0, true, 1e-2, seed++);
  emu::g_cc_major = 9;
  g_ln_ring = true;
  emu::g_sm_count = sms;
}

// The embedding's kernels (encoder.cu) against the CPU reference (cpu/encoder.cpp, compiled in beside them): the
// forward and both gradients must be the CPU's bits, added onto gradients that already hold values. CUB's sort
// (encoder_sort.cu) cannot run here; these two stand-ins keep its contract, a stable sort of the positions by id.
namespace fastgpt::cuda {
size_t sort_positions_scratch_bytes(int64_t n, int) { return (size_t)n * sizeof(int32_t); }
void sort_positions_by_token(int32_t* tok_sorted, int32_t* pos_sorted, void* scratch, size_t, const int32_t* idx,
                             int64_t n, int, Stream) {
  int32_t* pos = static_cast<int32_t*>(scratch);
  for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)i;
  std::stable_sort(pos, pos + n, [&](int32_t a, int32_t b) { return idx[a] < idx[b]; });
  for (int64_t i = 0; i < n; i++) tok_sorted[i] = idx[pos[i]], pos_sorted[i] = pos[i];
}
}  // namespace fastgpt::cuda

// hot: the share of positions given token `hot` (a run longer than a warp's 32 indices, as "\n" in real text);
// offset: dout starts this many elements into its buffer (1 makes 16-bit rows 2-byte aligned: one value per lane);
// runs, if given (summing to B T): the ids' run lengths once sorted, in id order (ids 0, 2, 4, ...; hot unused),
// each id at random positions: runs that end on a warp's 32 indices, or on a 32-row chunk past them.
template <typename S>
void run_encoder(int B, int T, int C, int V, double hot, int offset, unsigned seed, std::vector<int> runs = {}) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> tok(0, V - 1);
  std::uniform_real_distribution<double> u;
  const int64_t BT = (int64_t)B * T;
  const int maxT = T + 3;
  std::vector<int32_t> idx(BT);
  for (auto& t : idx) t = u(rng) < hot ? V / 2 : tok(rng);
  if (!runs.empty()) {
    size_t i = 0;
    for (size_t r = 0; r < runs.size(); r++)
      for (int k = 0; k < runs[r]; k++) idx.at(i++) = (int32_t)(2 * r);
    if (i != idx.size() || 2 * runs.size() > (size_t)V) emu::die("run_encoder: runs must sum to B T, ids below V");
    std::shuffle(idx.begin(), idx.end(), rng);
  }
  auto fill = [&](size_t k) {
    std::vector<S> v(k);
    for (auto& x : v) x = from_float<S>(nd(rng));
    return v;
  };
  const std::vector<S> wte = fill((size_t)V * C), wpe = fill((size_t)maxT * C), dbuf = fill(BT * C + offset);
  const S* dout = dbuf.data() + offset;
  std::vector<float> dwte0((size_t)V * C), dwpe0((size_t)maxT * C);
  for (auto& x : dwte0) x = nd(rng);
  for (auto& x : dwpe0) x = nd(rng);
  const S nan = from_float<S>(NAN);
  std::vector<S> out1(BT * C, nan), out2(BT * C, nan);
  std::vector<float> dwte1 = dwte0, dwte2 = dwte0, dwpe1 = dwpe0, dwpe2 = dwpe0;
  cpu::encoder_forward<S>(out1.data(), idx.data(), wte.data(), wpe.data(), B, T, C);
  cuda::encoder_forward<S>(out2.data(), idx.data(), wte.data(), wpe.data(), B, T, C, nullptr);
  cpu::encoder_backward<S>(dwte1.data(), dwpe1.data(), dout, idx.data(), B, T, C);
  cuda::encoder_backward<S>(dwte2.data(), dwpe2.data(), dout, idx.data(), B, T, C, V, nullptr);
  const bool same = memcmp(out1.data(), out2.data(), out1.size() * sizeof(S)) == 0 &&
                    memcmp(dwte1.data(), dwte2.data(), dwte1.size() * 4) == 0 &&
                    memcmp(dwpe1.data(), dwpe2.data(), dwpe1.size() * 4) == 0 && dwte1 != dwte0;
  if (!same) failures++;
  const char* type = std::is_same_v<S, float> ? "fp32" : std::is_same_v<S, bf16> ? "bf16" : "fp16";
  printf("%s encoder %s B=%d T=%d C=%d V=%d hot=%.2f offset=%d runs=%zu: %s\n", same ? "ok  " : "FAIL", type, B, T, C,
         V, hot, offset, runs.size(), same ? "the CPU's bits (forward, dwte, dwpe)" : "DIFFERS from the CPU");
  fflush(stdout);
}

void run_encoder_cases(unsigned& seed) {
  run_encoder<bf16>(2, 150, 96, 50, 0.3, 0, seed++);   // a hot run across warps, 300 positions: three blocks
  run_encoder<float>(3, 37, 40, 7, 0.0, 0, seed++);    // V 7: every run long; channels past C in the lanes
  run_encoder<f16>(1, 70, 33, 300, 0.5, 0, seed++);    // odd C: one value per lane
  run_encoder<bf16>(2, 45, 64, 1000, 0.1, 1, seed++);  // 2-byte aligned dout: one value per lane
  run_encoder<f16>(1, 300, 8, 4, 1.0, 0, seed++);      // one token everywhere: a single run of all positions
  // Sorted, the first case's runs end on a window's last index (32, 16 + 16, 31), take a window with no start
  // (96: two whole chunks past its window, the next chunk another id's), go past their window by one row (33), by
  // a chunk (64) and by a chunk and a row (64 from index 385); the second's last run ends on BT after whole chunks
  // (its next chunk would start at BT); the third's runs from a full window through a whole chunk into the last,
  // partial, chunk (the partial window after it has no run start).
  run_encoder<bf16>(1, 480, 40, 64, 0.0, 0, seed++, {32, 16, 16, 96, 1, 31, 33, 31, 64, 1, 63, 1, 64, 31});
  run_encoder<float>(2, 96, 24, 16, 0.0, 0, seed++, {5, 27, 40, 24, 96});
  run_encoder<f16>(1, 77, 33, 8, 0.0, 0, seed++, {3, 74});  // the last window partial, the run reaching BT
  // Pieces of 256 sorted indices (cpu::kEncoderPiece): a run over four pieces (its first from index 100, two whole,
  // the last cut short), one value a lane (odd C); then a run ending on a piece's end (512), one starting on a
  // piece's start and going on into the next, a piece that is one run's continuation and another's first piece (768)
  // and the next piece the second's continuation (1024).
  run_encoder<f16>(1, 1100, 33, 8, 0.0, 0, seed++, {100, 900, 100});
  run_encoder<float>(2, 640, 24, 16, 0.0, 0, seed++, {512, 300, 1, 467});
}

// The bias gradient's column sums (matmul_bias.cu): dbias += the sums over rows of dout, whose order the kernels
// fix (a 512-row chunk's row lane y sums rows y, y + 8, ... in order, the lanes added in order from 0.f; the chunks'
// sums likewise in 8 lanes), replayed here in float for their bits, and within 1e-6 of float64; bias_add adds sums
// as they are. offset: dout starts that many values past an aligned address (the one-value-a-load form). ld: the
// rows' stride (0: OC), the engine's Q third of dqkv (attention.cu); the values past OC in a row must not count.
template <typename S>
void run_bias(int64_t N, int OC, int offset, unsigned seed, int64_t ld = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t stride = ld ? ld : OC;
  std::vector<S> buf((size_t)(N * stride + offset));
  for (auto& x : buf) x = from_float<S>(nd(rng));
  const S* dout = buf.data() + offset;
  // offset 0 must be the 16-byte path: an unaligned buffer would quietly take the other one and still pass
  const bool aligned = reinterpret_cast<uintptr_t>(buf.data()) % 16 == 0;
  std::vector<float> dbias0(OC);
  for (auto& x : dbias0) x = nd(rng);
  const auto lanes = [](const float* s) {
    float t = 0.f;
    for (int y = 0; y < 8; y++) t += s[y];
    return t;
  };
  const int64_t nchunks = (N + 511) / 512;
  std::vector<float> want = dbias0;
  std::vector<double> exact(OC);
  for (int c = 0; c < OC; c++) {
    std::vector<float> part(nchunks);
    for (int64_t k = 0; k < nchunks; k++) {
      float s[8] = {};
      for (int64_t r = k * 512; r < std::min<int64_t>(N, (k + 1) * 512); r++) {
        s[(r - k * 512) % 8] += to_float(dout[r * stride + c]);
        exact[c] += to_float(dout[r * stride + c]);
      }
      part[k] = lanes(s);
    }
    float t = part[0];
    if (nchunks > 1) {
      float s[8] = {};
      for (int64_t k = 0; k < nchunks; k++) s[k % 8] += part[k];
      t = lanes(s);
    }
    want[c] += t;
  }
  std::vector<float> got = dbias0;
  cuda::bias_backward<S>(got.data(), dout, N, OC, nullptr, ld);
  double err2 = 0, ref2 = 0;
  for (int c = 0; c < OC; c++) {
    const double e = ((double)got[c] - dbias0[c]) - exact[c];
    err2 += e * e, ref2 += exact[c] * exact[c];
  }
  const double rel = std::sqrt(err2 / ref2);
  std::vector<float> added = dbias0, sums(OC);
  for (auto& x : sums) x = nd(rng);
  cuda::bias_add(added.data(), sums.data(), OC, nullptr);
  bool add_ok = true;
  for (int c = 0; c < OC; c++) add_ok = add_ok && added[c] == dbias0[c] + sums[c];
  const bool ok = got == want && rel <= 1e-6 && add_ok && aligned;
  if (!ok) failures++;
  const char* type = std::is_same_v<S, float> ? "fp32" : std::is_same_v<S, bf16> ? "bf16" : "fp16";
  printf("%s bias_backward %s N=%ld OC=%d ld=%ld offset=%d: %s, %.2e from float64; bias_add %s%s\n",
         ok ? "ok  " : "FAIL", type, (long)N, OC, (long)stride, offset, got == want ? "the order's bits" : "DIFFERS from the order's bits", rel,
         add_ok ? "exact" : "WRONG", aligned ? "" : " (the buffer is NOT 16-byte aligned)");
  fflush(stdout);
}

// The backward's delta (flash_attention.cu's delta_kernel): delta[b, h, t] = dout . out over the row's d elements.
// Its order is fixed (a row's 16-byte packs spread over `lanes` lanes, the fewest powers of two up to 32 that give
// each lane a pack; lane g sums packs g, g + lanes, ... element by element, a * b + s contracted as the GPU
// contracts it; the lanes joined by butterfly), replayed here for its bits, and within 1e-6 of float64. Both layouts;
// `pad` elements after each row (a stride that is not whole packs: one element a load). Every case runs again with
// out and dout one element off 16-byte alignment (one element a load), against the replay of those values; the
// emulator counts 16-byte loads, so each run must have taken the path its alignment calls for. With one SM the grid
// stops at 64 blocks and its blocks loop over the rest of the rows.
template <typename E>
void run_delta(int B, int H, int T, int d, bool bthd, int pad, unsigned seed, bool loops = false) {
  constexpr int N = 16 / (int)sizeof(E);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const size_t rows = (size_t)B * H * T;
  cpu::HeadStrides s;
  if (bthd) {
    s.st = (int64_t)H * d + pad, s.sh = d, s.sb = T * s.st;
  } else {
    s.st = d + pad, s.sh = T * s.st, s.sb = H * s.sh;
  }
  const bool vec = d % N == 0 && (B == 1 || s.sb % N == 0) && (H == 1 || s.sh % N == 0) && (T == 1 || s.st % N == 0);
  const int offset = 1;
  const size_t span = (size_t)(B * s.sb + 31) / 16 * 16;  // out, then dout, 16-byte aligned, room for the offset
  std::vector<E> buf(2 * span);
  for (auto& x : buf) x = E(nd(rng));
  E* const o = buf.data();
  E* const dO = buf.data() + span;
  const bool aligned = reinterpret_cast<uintptr_t>(o) % 16 == 0 && reinterpret_cast<uintptr_t>(dO) % 16 == 0;
  long packed[2];  // 16-byte loads of the aligned and the offset run
  const auto call = [&](int off) {
    std::vector<float> delta(rows, NAN);
    cuda::flash::Params p{};
    p.out = o + off, p.dout = dO + off, p.delta = delta.data(), p.os = s, p.B = B, p.H = H, p.T = T, p.d = d;
    emu::g_align16_checks = 0;
    cuda::flash::compute_delta<E>(p, nullptr);
    packed[off != 0] = emu::g_align16_checks;
    return delta;
  };
  const std::vector<float> got = call(0);
  const unsigned grid = emu::g_grid.x;  // the blocks launched; fewer than the rows need: they loop
  std::vector<float> shifted_want(rows);  // the replay for the offset run's values
  int lanes = 1;
  const int packs = (d + N - 1) / N;
  while (lanes < packs && lanes < 32) lanes *= 2;
  bool order = true;
  double err2 = 0, ref2 = 0;
  for (int pass = 0; pass < 2; pass++) {
    const int off = pass ? offset : 0;
    for (int b = 0; b < B; b++)
      for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) {
          const E *ro = o + off + b * s.sb + h * s.sh + t * s.st, *rd = dO + off + b * s.sb + h * s.sh + t * s.st;
          float lane_sum[32] = {};
          double exact = 0;
          for (int g = 0; g < lanes; g++)
            for (int k = g; k < packs; k += lanes)
              for (int x = k * N; x < std::min(d, k * N + N); x++) {
                lane_sum[g] = std::fma(float(ro[x]), float(rd[x]), lane_sum[g]);
                exact += (double)float(ro[x]) * float(rd[x]);
              }
          for (int m = lanes / 2; m > 0; m >>= 1) {  // butterfly: every lane of a group ends with lane 0's sum
            float next[32];
            for (int g = 0; g < lanes; g++) next[g] = lane_sum[g] + lane_sum[g ^ m];
            std::copy(next, next + lanes, lane_sum);
          }
          const size_t r = ((size_t)b * H + h) * T + t;
          if (pass) {
            shifted_want[r] = lane_sum[0];
          } else {
            order = order && got[r] == lane_sum[0];
            err2 += (got[r] - exact) * (got[r] - exact), ref2 += exact * exact;
          }
        }
  }
  const std::vector<float> shifted = call(offset);
  const bool shifted_ok = shifted == shifted_want;
  const double rel = std::sqrt(err2 / ref2);
  const int64_t needed = ((int64_t)rows + 256 / lanes - 1) / (256 / lanes);
  const bool paths = (packed[0] > 0) == vec && packed[1] == 0, looped = grid < needed;
  const bool ok = order && shifted_ok && rel <= 1e-6 && aligned && paths && looped == loops;
  if (!ok) failures++;
  const char* type = std::is_same_v<E, float> ? "fp32" : std::is_same_v<E, __half> ? "fp16" : "bf16";
  printf("%s delta %s B=%d H=%d T=%d d=%d %s pad %d (%d lanes a row, %u of %ld blocks%s; %ld and %ld 16-byte loads, "
         "%s expected): %s, %.2e from float64; offset %d: %s%s\n", ok ? "ok  " : "FAIL", type, B, H, T, d,
         bthd ? "bthd" : "bhtd", pad, lanes, grid, (long)needed,
         looped == loops ? "" : loops ? ", NO loop" : ", a loop NOT expected", packed[0], packed[1],
         vec ? "some then none" : "none", order ? "the order's bits" : "DIFFERS from the order's bits", rel, offset,
         shifted_ok ? "the order's bits" : "DIFFERS", aligned ? "" : " (the buffer is NOT 16-byte aligned)");
  fflush(stdout);
}

void run_delta_cases(unsigned& seed) {
  run_delta<__nv_bfloat16>(2, 3, 70, 64, true, 0, seed++);  // GPT-2's d: 8 lanes, 32 rows a block (across heads)
  run_delta<__half>(1, 2, 40, 128, false, 0, seed++);       // 16 lanes
  run_delta<float>(2, 2, 33, 64, false, 0, seed++);         // 4 floats a pack: 16 lanes
  run_delta<float>(1, 2, 20, 256, true, 0, seed++);         // 64 packs: 32 lanes, two packs each
  run_delta<float>(1, 1, 9, 12, true, 0, seed++);           // 3 packs: 4 lanes, one idle
  run_delta<__nv_bfloat16>(1, 2, 17, 20, false, 0, seed++); // d not whole packs: one element a load, the last part-full
  run_delta<float>(1, 3, 5, 1, true, 0, seed++);            // d 1: one lane a row, 256 rows a block
  run_delta<float>(2, 2, 30, 64, false, 2, seed++);         // rows 66 floats apart: aligned bases, one element a load
  run_delta<__half>(1, 3, 1, 64, true, 3, seed++);          // T 1, B 1: odd row and batch strides unused: 16 bytes
  const int sms = emu::g_sm_count;
  emu::g_sm_count = 1;  // 64 blocks at most: the 75 blocks' rows loop
  run_delta<__nv_bfloat16>(1, 4, 600, 64, false, 0, seed++, true);
  emu::g_sm_count = sms;
}

void run_bias_cases(unsigned& seed) {
  run_bias<bf16>(1300, 768, 0, seed++);  // three chunks, the last part-filled; GPT-2's width: three column blocks
  run_bias<f16>(512, 40, 0, seed++);     // one chunk (added straight to dbias); five packs of a 256-column block
  run_bias<f16>(2100, 36, 0, seed++);    // 36 values: not whole packs, one value a load; five chunks
  run_bias<float>(4700, 24, 0, seed++);  // ten chunks: the chunk lanes wrap; 4 floats a pack
  run_bias<float>(700, 50, 0, seed++);   // 50 floats: not whole packs, one value a load
  run_bias<bf16>(900, 64, 1, seed++);    // rows off 16-byte alignment: one value a load
  run_bias<float>(1100, 64, 2, seed++);  // the same in float
  run_bias<f16>(5, 304, 0, seed++);      // fewer rows than lanes; 304 columns: a second, part-filled block
  run_bias<bf16>(1300, 768, 0, seed++, 2304);  // the Q third of GPT-2's dqkv: rows 2304 apart, 16 bytes a load
  run_bias<f16>(700, 40, 0, seed++, 44);       // rows not whole packs apart: one value a load
}

// The optimizer step's kernels (adamw.cu) against the CPU reference (cpu/adamw.cpp, compiled in beside them): the
// one-launch AdamW over segments with different weight decay (moments offset from the segments' start, the clip
// factor and step counter read from StepScalars) must give the CPU's bits in every storage type, a skipped step
// must write nothing, adamw_prepare (one thread) the CPU's scalars, and the norm's partial sums and the loss's tree
// sum the CPU's values to rounding.
template <typename S>
void run_adamw_step(unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t begin = 37, n = 5000;  // flat indices [begin, begin + n)
  AdamWSegments seg;
  seg.n = 3;
  seg.begin = begin;
  seg.end[0] = begin + 1200, seg.end[1] = begin + 1201, seg.end[2] = begin + n;  // one segment of one element
  seg.weight_decay[0] = 0.1f, seg.weight_decay[1] = 0.f, seg.weight_decay[2] = 0.25f;
  std::vector<float> param(begin + n), grad(begin + n), m(n), v(n);
  for (auto& x : param) x = 0.05f * nd(rng);
  for (auto& x : grad) x = 0.01f * nd(rng);
  for (auto& x : m) x = 0.001f * nd(rng);
  for (auto& x : v) x = 1e-5f * std::fabs(nd(rng));
  StepScalars s;
  s.t = 4;
  const double parts[2] = {0.5, 1.5}, loss = 2.0;
  const float lr = 3e-3f;
  cpu::adamw_prepare(&s, &lr, parts, 2, &loss, 1, 1.0, false, 0.9f, 0.95f, nullptr);  // norm sqrt(2) > 1: clips
  const RoundKey key{std::is_same_v<S, bf16>, 77, 0, 0};
  bool same = true;
  for (int applied : {1, 0}) {
    s.applied = applied;
    std::vector<float> p1 = param, p2 = param, m1 = m, m2 = m, v1 = v, v2 = v;
    const S nan = from_float<S>(NAN);
    std::vector<S> l1(begin + n, nan), l2(begin + n, nan);
    S* lp1 = std::is_same_v<S, float> ? nullptr : l1.data();
    S* lp2 = std::is_same_v<S, float> ? nullptr : l2.data();
    cpu::adamw_step<S>(p1.data(), lp1, grad.data(), m1.data(), v1.data(), seg, 0.9f, 0.95f, 1e-8f, &s, key);
    cuda::adamw_step<S>(p2.data(), lp2, grad.data(), m2.data(), v2.data(), seg, 0.9f, 0.95f, 1e-8f, &s, key,
                        nullptr);
    same = same && p1 == p2 && m1 == m2 && v1 == v2 && memcmp(l1.data(), l2.data(), l1.size() * sizeof(S)) == 0;
    if (applied) same = same && p1 != param && p1[begin - 1] == param[begin - 1];  // moved, but not before begin
    else same = same && p2 == param && m2 == m;                                   // skipped: nothing written
  }
  if (!same) failures++;
  const char* type = std::is_same_v<S, float> ? "fp32" : std::is_same_v<S, bf16> ? "bf16" : "fp16";
  printf("%s adamw_step %s n=%ld 3 segments: %s\n", same ? "ok  " : "FAIL", type, (long)n,
         same ? "the CPU's bits (and nothing written when skipped)" : "DIFFERS from the CPU");
  fflush(stdout);
}

void run_adamw_cases(unsigned& seed) {
  run_adamw_step<float>(seed++);
  run_adamw_step<bf16>(seed++);
  run_adamw_step<f16>(seed++);
  std::mt19937 rng(seed++);
  std::normal_distribution<float> nd;
  // Sums of squares over 2.5 chunks, in order; then the step's scalars from them, a finite and a NaN loss.
  const int64_t n = 2 * cpu::kSumChunk + cpu::kSumChunk / 2;
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  std::vector<double> pc(3), pg(3, NAN);
  cpu::sum_squares_partials(pc.data(), x.data(), n);
  cuda::sum_squares_partials(pg.data(), x.data(), n, nullptr);
  double tc = 0, tg = NAN;
  cpu::sum_in_order(&tc, pg.data(), 3);
  cuda::sum_in_order(&tg, pg.data(), 3, nullptr);
  bool ok = relerr(pg, pc) < 1e-13 && tc == tg;
  for (double loss : {3.0, (double)NAN}) {
    StepScalars a, b;
    a.t = b.t = 9;
    const float lr = 6e-4f;
    cpu::adamw_prepare(&a, &lr, pg.data(), 3, &loss, 1, 1.0, false, 0.9f, 0.95f, nullptr);
    cuda::adamw_prepare(&b, &lr, pg.data(), 3, &loss, 1, 1.0, false, 0.9f, 0.95f, nullptr, nullptr);
    ok = ok && a.lr == lr && b.lr == lr && a.sumsq == b.sumsq && a.norm == b.norm && a.gscale == b.gscale && a.applied == b.applied &&
         a.t == b.t && a.skipped == b.skipped && a.bias_correction1 == b.bias_correction1 &&
         a.bias_correction2_sqrt == b.bias_correction2_sqrt && a.applied == (loss == loss) && a.gscale < 1.f;
    // fp16: the same sums of squares as gradients scaled by 2^10 squared, the scale divided out in the prepare
    // (exactly: the same norm and clip, gscale carrying the 2^-10), and the scale grows (growth_interval 1).
    std::vector<double> scaled(pg);
    for (double& e : scaled) e *= 1024.0 * 1024.0;
    StepScalars c, d;
    c.t = d.t = 9;
    LossScale lc, ld;
    lc.scale = ld.scale = 1024.f;
    lc.growth_interval = ld.growth_interval = 1;
    cpu::adamw_prepare(&c, &lr, scaled.data(), 3, &loss, 1, 1.0, false, 0.9f, 0.95f, &lc);
    cuda::adamw_prepare(&d, &lr, scaled.data(), 3, &loss, 1, 1.0, false, 0.9f, 0.95f, &ld, nullptr);
    ok = ok && c.norm == a.norm && d.norm == a.norm && c.gscale == a.gscale / 1024.f && d.gscale == c.gscale &&
         c.applied == a.applied && d.applied == a.applied && lc.scale == 2048.f && ld.scale == 2048.f &&
         lc.growth_tracker == 0 && ld.growth_tracker == 0;
  }
  // The loss: a tree over 1024 threads against the CPU's sum in order, to rounding; reset, then accumulate.
  std::vector<float> losses(3001);
  for (auto& e : losses) e = 4.f + nd(rng);
  double lc = 0, lg = NAN;
  cpu::loss_accumulate(&lc, losses.data(), 3001, 2.0, true);
  cuda::loss_accumulate(&lg, losses.data(), 3001, 2.0, true, nullptr);
  cpu::loss_accumulate(&lc, losses.data(), 1000, 2.0, false);
  cuda::loss_accumulate(&lg, losses.data(), 1000, 2.0, false, nullptr);
  ok = ok && std::fabs(lc - lg) <= 1e-6 * lc && lc > 3.5;
  if (!ok) failures++;
  printf("%s adamw norm partials / in-order sum / prepare / loss_accumulate: %s\n", ok ? "ok  " : "FAIL",
         ok ? "as the CPU" : "DIFFER from the CPU");
  fflush(stdout);
}

// The engine's scratch workspace (cuda/scratch.h): the first pass of a sequence of calls may go to the pool and
// sizes the buffer; every later pass takes all of its scratch from the buffer, pieces live at once never overlap,
// and a sequence with a larger need grows it once more. Then a real kernel (the LayerNorm backward) through it.
void run_workspace() {
  cuda::Workspace ws(nullptr);
  const cuda::WorkspaceScope scope(&ws);
  bool ok = true;
  auto pass = [&](std::initializer_list<size_t> sizes) {  // one window: all live together, then all released
    std::vector<std::unique_ptr<cuda::Scratch>> live;
    std::vector<std::pair<char*, char*>> spans;
    bool all_from_buffer = true;
    char* first = nullptr;  // of the pieces from the buffer: each starts a multiple of 256 bytes after it
    for (size_t n : sizes) {
      live.push_back(std::make_unique<cuda::Scratch>(n, nullptr));
      all_from_buffer = all_from_buffer && !live.back()->pooled;
      char* p = reinterpret_cast<char*>(live.back()->ptr);
      for (auto& s : spans) ok = ok && (p + n * 4 <= s.first || p >= s.second);  // no overlap with a live piece
      spans.push_back({p, p + n * 4});
      if (!live.back()->pooled) first = first ? first : p;
      ok = ok && (live.back()->pooled || (p - first) % 256 == 0);
    }
    return all_from_buffer;
  };
  const bool first = pass({1000, 300, 7});  // sizes the buffer, which the next pass allocates (at its rewind)
  const bool second = pass({1000, 300, 7});
  const size_t cap1 = ws.capacity();
  const bool third = pass({7, 1000});
  const size_t cap2 = ws.capacity();
  const bool bigger = pass({1000, 300, 7, 5000});
  const bool after = pass({1000, 300, 7, 5000});
  ok = ok && !first && second && third && cap1 == cap2 && cap1 >= 1307 * 4 && !bigger && after &&
       ws.capacity() >= 6307 * 4;
  // The LayerNorm backward's partial sums, twice: the second call finds the buffer the first one sized.
  const int N = 300, C = 40;
  std::vector<float> x(N * C, 0.5f), dy(N * C, 1.f), w(C, 1.f), dw(C, 0.f), db(C, 0.f), dx(N * C, 0.f);
  std::vector<float> mean(N, 0.f), rstd(N, 1.f);
  cuda::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                           N, C, nullptr);
  const size_t cap3 = ws.capacity();
  cuda::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                           N, C, nullptr);
  ok = ok && ws.capacity() == cap3 && db[0] == 2.f * N;
  // Out of memory: the pool refuses a request (leaving its error as the last error, as the runtime does), the call
  // throws, and the caller goes on with smaller ones. The refused size is not the buffer's next target (a rewind
  // would ask the pool for it again, and every call after would fail), and the next launch check does not report
  // the refusal again.
  emu::g_pool_limit = 1 << 20;
  bool refused = false, recovered = false;
  try {
    cuda::Scratch huge(1 << 20, nullptr);
  } catch (const std::runtime_error&) {
    refused = true;
  }
  try {
    recovered = pass({1000, 300, 7});
    cuda::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                             rstd.data(), N, C, nullptr);
  } catch (const std::exception& e) {
    printf("after the refused request: %s\n", e.what());
    recovered = false;
  }
  const bool cap_kept = ws.capacity() == cap3;
  // The buffer's own growth refused: two pieces the pool serves one at a time (each under its limit) make a window
  // it cannot serve in one piece, which the next rewind asks for. That call goes on with the pool's pieces, and the
  // buffer does not ask for that size again (every later rewind would fail).
  const size_t piece = cap3 / 4 + 64;  // floats: more than the buffer holds, so from the pool
  emu::g_pool_limit = piece * 4 * 3 / 2;
  bool regrow_refused = false, regrow_recovered = false;
  try {
    pass({piece, piece});
    pass({7});
    regrow_refused = ws.capacity() < 2 * piece * 4;
  } catch (const std::runtime_error& e) {
    printf("the refused growth failed the call: %s\n", e.what());
  }
  try {
    pass({7});
    pass({1000, 300, 7});
    regrow_recovered = true;
  } catch (const std::exception& e) {
    printf("after the refused growth: %s\n", e.what());
    regrow_recovered = false;
  }
  // The same window again while the device still cannot give it in one piece: its pieces fit one at a time, so
  // no call may fail (the buffer must not ask again, at each rewind, for the size it was refused).
  int steady_failures = 0;
  for (int i = 0; i < 4; i++) {
    try {
      pass({piece, piece});
    } catch (const std::runtime_error&) {
      steady_failures++;
    }
  }
  if (steady_failures) printf("the refused window again: %d of 4 calls failed\n", steady_failures);
  ok = ok && steady_failures == 0;
  emu::g_pool_limit = SIZE_MAX;
  pass({1000, 300, 7});
  const bool regrown = pass({1000, 300, 7});  // the buffer sized again by what the calls need
  ok = ok && refused && recovered && cap_kept && db[0] == 3.f * N && regrow_refused && regrow_recovered && regrown;
  if (!ok) failures++;
  printf("%s scratch workspace: sized by the first pass (%zu bytes), reused after, grown for a larger need, "
         "usable after an out-of-memory request and a refused growth\n", ok ? "ok  " : "FAIL", cap1);
  fflush(stdout);
}

// ---- The emulator's own checks, on small kernels that break a rule: each must end the run (abort) with its
// message, where a GPU would hang or give wrong answers; and the same kernels kept to the rule must run. Each broken
// kernel runs in a child process (the emulator runs on one OS thread, so fork is safe).
__global__ void selftest_named(int* out, int arriving) {  // warps below `arriving` / 32 sync on named barrier 1
  if ((int)threadIdx.x < arriving) emu::bar_sync(1, 64);
  out[threadIdx.x] = 1;
}
__global__ void selftest_shfl(float* out, int lanes, bool ballot_above) {  // lanes below `lanes` shuffle
  const int lane = threadIdx.x % 32;
  if (lane < lanes)
    out[threadIdx.x] = emu::shfl_xor(0xffffffffu, (float)threadIdx.x, 1);
  else if (ballot_above)
    out[threadIdx.x] = (float)emu::ballot(0xffffffffu, 1);
}
__global__ void selftest_mbar(int* out, int arrivals) {  // an mbarrier of count 2, `arrivals` arrive, all wait
  if (threadIdx.x == 0) emu::mbar_init(0, 2);
  __syncthreads();
  if ((int)threadIdx.x < arrivals) emu::mbar_arrive(0);
  emu::mbar_wait(0, 0);
  out[threadIdx.x] = 1;
}
__global__ void selftest_sync(int* out, int exiting) {  // threads below `exiting` leave before __syncthreads
  if ((int)threadIdx.x < exiting) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void selftest_order(int* order, int* next) {  // the order threads leave a __syncthreads in
  __syncthreads();
  order[emu::atomic_add(next, 1)] = threadIdx.x;
}
static void selftest_expect(const char* name, const std::function<void()>& f, const std::vector<std::string>& want) {
  fflush(stdout);
  fflush(stderr);
  int fd[2];
  if (pipe(fd)) { perror("pipe"); exit(2); }
  const pid_t pid = fork();
  if (pid == 0) {
    const rlimit none{0, 0};
    setrlimit(RLIMIT_CORE, &none);
    alarm(60);  // a child that neither ends nor aborts (a busy wait) dies by SIGALRM: a failure, not a hung test
    dup2(fd[1], 2);
    close(fd[0]);
    f();
    _exit(0);
  }
  close(fd[1]);
  std::string err;
  char buf[4096];
  for (ssize_t n; (n = read(fd[0], buf, sizeof buf)) > 0;) err.append(buf, n);
  close(fd[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  bool ok = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  for (const std::string& w : want) ok = ok && err.find(w) != std::string::npos;
  printf("%s selftest: %s: %s\n", ok ? "ok  " : "FAIL", name, ok ? "stopped with its message" : err.c_str());
  if (!ok) failures++;
}
static void run_selftest() {
  std::vector<int> out(64, 0);
  std::vector<float> outf(64, 0.f);
  auto all_ones = [&] { return std::all_of(out.begin(), out.end(), [](int v) { return v == 1; }); };
  // Kept to the rules: the run goes on and every thread finishes.
  emu::launch(selftest_named, dim3(1), dim3(64), 0, nullptr, out.data(), 64);
  bool ok = all_ones();
  std::fill(out.begin(), out.end(), 0);
  emu::launch(selftest_mbar, dim3(1), dim3(64), 64, nullptr, out.data(), 2);
  ok = ok && all_ones();
  std::fill(out.begin(), out.end(), 0);
  emu::launch(selftest_sync, dim3(1), dim3(64), 0, nullptr, out.data(), 0);
  ok = ok && all_ones();
  emu::launch(selftest_shfl, dim3(1), dim3(64), 0, nullptr, outf.data(), 32, false);
  for (int t = 0; t < 64; t++) ok = ok && outf[t] == (float)(t ^ 1);
  printf("%s selftest: named barrier, mbarrier, __syncthreads and shuffles kept to the rules run\n",
         ok ? "ok  " : "FAIL");
  if (!ok) failures++;
  // The schedule: first come, first run (the last to arrive goes on, then the others in the order they came), or
  // with EMU_SEED a shuffle of that (all 64 threads still run).
  std::vector<int> order(64, -1), first_come(64);
  int next = 0;
  emu::launch(selftest_order, dim3(1), dim3(64), 0, nullptr, order.data(), &next);
  first_come[0] = 63;
  for (int t = 0; t < 63; t++) first_come[t + 1] = t;
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  bool all = next == 64;
  for (int t = 0; t < 64; t++) all = all && sorted[t] == t;
  ok = all && (emu::g_sched_seed ? order != first_come : order == first_come);
  printf("%s selftest: threads leave a barrier %s\n", ok ? "ok  " : "FAIL",
         emu::g_sched_seed ? "in a shuffled order (EMU_SEED)" : "first come, first run");
  if (!ok) failures++;
  // Broken: waits no thread can end are a deadlock (a hang on a GPU), reported with what the threads wait for.
  selftest_expect("a named barrier short of arrivals", [&] {
    emu::launch(selftest_named, dim3(1), dim3(64), 0, nullptr, out.data(), 32);
  }, {"deadlock", "named barrier 1 (32 of 64 arrived)"});
  selftest_expect("an mbarrier phase never completed", [&] {
    emu::launch(selftest_mbar, dim3(1), dim3(64), 64, nullptr, out.data(), 1);
  }, {"deadlock", "the mbarrier at shared byte 0 (1 of 2 arrived)"});
  selftest_expect("__syncthreads with exited threads", [&] {
    emu::launch(selftest_sync, dim3(1), dim3(64), 0, nullptr, out.data(), 5);
  }, {"deadlock", "__syncthreads (59 of 64 arrived)"});
  selftest_expect("a shuffle that half the warp skips", [&] {
    emu::launch(selftest_shfl, dim3(1), dim3(64), 0, nullptr, outf.data(), 16, false);
  }, {"deadlock", "a warp collective (shfl, ballot, ldmatrix, mma) (16 of 32 arrived)"});
  selftest_expect("lanes at different collectives", [&] {
    emu::launch(selftest_shfl, dim3(1), dim3(64), 0, nullptr, outf.data(), 16, true);
  }, {"warp lanes disagree on collective op"});
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "quick";
  emu::g_lazy_cp = argc > 2 ? atoi(argv[2]) : 0;
  unsigned seed = 1;
  if (emu::g_sched_seed) printf("schedule: the ready threads in random order, EMU_SEED=%llu\n",
                                (unsigned long long)emu::g_sched_seed);
  set_tiles({0, 0, 0});  // the mma.sync kernels, which the cases below run unless they choose others ("auto" is
                         // the Hopper kernels at the emulator's compute capability 9.0: run_auto_cases)
  try {
    if (mode == "quick") {
      run_auto_cases(seed);
      emu::g_racecheck_model = true;  // racecheck's reading (mode racecheck has more): the default backward's dQ ring,
      run_ws_bwd<__nv_bfloat16>(1, 1, 260, true, false, DType::bf16, 3e-2, seed++, 3, {7});  // a turn-0 step in it
      emu::g_racecheck_model = false;
      run<__nv_bfloat16>(1, 2, 100, 64, true, false, false, DType::bf16, 3e-2, seed++);
      run_tiles<__nv_bfloat16>(1, 1, 150, true, false, DType::bf16, 3e-2, seed++, {{1, 1, 1}, {2, 1, 2}});
      run_sm90<__nv_bfloat16>(1, 1, 150, 64, true, false, true, DType::bf16, 3e-2, seed++, {{3, 2, 3}});
      run_fused_sm90<__nv_bfloat16>(1, 1, 260, 64, true, true, DType::bf16, 3e-2, seed++, 5);
      check_dense_bytes();
      check_masks();
      // The persistent forwards on 2 SMs: 3 (b, h) of 2 query tiles, so a group of two (each CTA one (b, h)'s tiles)
      // and a last group of one (its two tiles on the two CTAs), every CTA three tiles (its Q buffers reused).
      emu::g_sm_count = 2;
      run_ws<__nv_bfloat16>(1, 3, 200, 64, true, false, DType::bf16, 3e-2, seed++, 0, 0);
      emu::g_sm_count = 3;
      run_ws_views<__half>(1, 2, 70, false, true, DType::f16, 5e-3, seed++);
      run_sm75_cases(seed);
      // (dk 3.5e-6 here when every product went straight into O, dK, dV, dQ; 1.3e-6 with the per-block sums)
      run_tchw_cases(seed, 256, 2e-6, {{8, 3}}, {64});
      run_cross_entropy_cases(seed);
      run_layernorm_cases(seed);
      run_adamw_cases(seed);
      run_encoder_cases(seed);
      run_bias_cases(seed);
      run_delta_cases(seed);
      run_workspace();
      run_selftest();
    } else if (mode == "selftest") {
      run_selftest();
    } else if (mode == "bias") {
      run_bias_cases(seed);
    } else if (mode == "delta") {
      run_delta_cases(seed);
    } else if (mode == "encoder") {
      run_encoder_cases(seed);
    } else if (mode == "adamw") {
      run_adamw_cases(seed);
      run_workspace();
    } else if (mode == "ce") {
      run_cross_entropy_cases(seed);
    } else if (mode == "ln") {
      run_layernorm_cases(seed);
      // More chunks than the combine's 16 lanes load 16 at a time ahead: 258, lanes 0 and 1 a second batch of one
      // (here only: 16k rows take the emulator a minute and a half).
      run_layernorm_paths<bf16>(64 * 257 + 5, 8, 0, true, 1e-2, seed++);
    } else if (mode == "tc") {
      for (int d : {64, 128})
        for (int T : {1, 17, 64, 100, 130})
          for (int causal : {0, 1})
            for (int det : {0, 1}) {
              run<__nv_bfloat16>(1, 2, T, d, causal, (T + det) % 2, det, DType::bf16, 3e-2, seed++);
              if (T == 100 || T == 1) run<__half>(2, 1, T, d, causal, det, det, DType::f16, 5e-3, seed++);
            }
    } else if (mode == "f32") {
      for (int d : {64, 33, 100, 256})
        for (int T : {1, 17, 40, 70})
          for (int causal : {0, 1}) run<float>(1, 2, T, d, causal, (T + d) % 2, false, DType::f32, 1e-4, seed++);
      for (int causal : {0, 1}) run_fused(2, 50, 96, 3, causal, seed++);
    } else if (mode == "tf32") {  // float32 on TF32 tensor cores, three products per product and one
      // (T from 2: at T 1, dq and dk are a difference that is exactly zero, which the relative error cannot measure.)
      for (cuda::F32Math f : {cuda::F32Math::tf32x3, cuda::F32Math::tf32}) {
        g_f32 = f;
        const double tol = f == cuda::F32Math::tf32x3 ? 5e-6 : 4e-3;
        for (int d : {64, 128})
          for (int T : {2, 17, 64, 100, 130})
            for (int causal : {0, 1}) run<float>(1, 2, T, d, causal, (T + causal) % 2, true, DType::f32, tol, seed++);
      }
    } else if (mode == "tchw") {  // fp32 flash on TF32 x3 under the tensor cores' truncating adder (emu.h)
      run_tchw_cases(seed, 1000, 5e-6, {{8, 3}, {4, 0}, {4, 3}}, {64, 128});
    } else if (mode == "mix") {
      run<__nv_bfloat16>(1, 2, 100, 128, true, false, false, DType::bf16, 3e-2, seed++);
      run<__nv_bfloat16>(1, 1, 100, 128, false, true, true, DType::bf16, 3e-2, seed++);
      run<__half>(1, 1, 130, 64, false, true, true, DType::f16, 5e-3, seed++);
      run_tiles<__half>(1, 1, 140, false, true, DType::f16, 5e-3, seed++, {{1, 1, 2}});
      run_sm90<__half>(1, 1, 140, 128, false, true, true, DType::f16, 5e-3, seed++, {{5, 2, 3}});
      run_fused_sm90<__half>(1, 1, 200, 128, false, false, DType::f16, 5e-3, seed++, 0);
      run<float>(1, 1, 40, 100, true, true, false, DType::f32, 1e-4, seed++);
      run_fused(1, 20, 64, 2, true, seed++);
      run_tf32_cases(seed);
      // The choice of kernels by shared memory does not depend on when copies land: one of the two mix runs (CI's
      // time), at the limit that changes the choice ("smem" runs both limits).
      if (!emu::g_lazy_cp) run_smem_cases(seed, {99});
      run_decode_cases(seed);
    } else if (mode == "tiles") {  // every option, both causal settings, T below, at and past the tiles
      for (int T : {1, 30, 64, 129, 200})
        for (int causal : {0, 1})
          run_tiles<__nv_bfloat16>(1, 2, T, causal, (T + causal) % 2, DType::bf16, 3e-2, seed++,
                                   {{0, 1, 0}, {0, 0, 1}, {0, 0, 2}, {1, 1, 1}, {1, 0, 2}, {2, 0, 0}, {2, 1, 2}});
      run_tiles<__half>(2, 1, 150, true, true, DType::f16, 5e-3, seed++, {{1, 1, 2}, {2, 1, 1}});
    } else if (mode == "sm90") {  // every sm90 option at both head dims, T below, at and past the tiles
      for (int d : {64, 128})
        for (int T : {1, 30, 64, 129, 200, 300})
          for (int causal : {0, 1})
            run_sm90<__nv_bfloat16>(1, 2, T, d, causal, (T + causal) % 2, true, DType::bf16, 3e-2, seed++,
                                    {{3, 2, 0}, {4, 0, 3}, {5, 2, 3}});
      run_sm90<__half>(2, 1, 150, 64, true, true, true, DType::f16, 5e-3, seed++, {{3, 2, 3}, {4, 0, 0}, {5, 0, 0}});
      run_sm90<__half>(1, 2, 100, 128, false, false, true, DType::f16, 5e-3, seed++, {{3, 2, 3}, {5, 0, 3}});
      run_sm90<__nv_bfloat16>(1, 2, 150, 64, true, true, false, DType::bf16, 3e-2, seed++, {{3, 2, 3}});  // atomic
      // scripts/flash_sanitize.py's Hopper shape (B 2, H 3, two query tiles per head; causal bhtd, else bthd)
      for (int causal : {1, 0})
        run_sm90<__half>(2, 3, 200, 128, causal, !causal, true, DType::f16, 5e-3, seed++,
                         {{3, 2, 3}, {4, 0, 0}, {5, 0, 0}});
    } else if (mode == "ws") {  // the warp-specialised sm90 forward: both options, both head dims, T below, at and
      // past its tiles (T 300 with 192 rows: the causal CTA's first warpgroup skips a key block the others use)
      check_dense_bytes();
      for (int d : {64, 128})
        for (int T : {1, 30, 64, 129, 200, 300, 520})
          for (int causal : {0, 1})
            run_ws<__nv_bfloat16>(1, 2, T, d, causal, (T + causal) % 2, DType::bf16, 3e-2, seed++, T % 2 ? 2 : 0,
                                  T % 2 ? 0 : 3);
      run_ws<__half>(2, 1, 150, 64, true, true, DType::f16, 5e-3, seed++, 2, 3);
      // scripts/flash_sanitize.py's Hopper shape (B 2, H 3: 12 tiles, 4 per persistent CTA; causal bhtd, else bthd)
      for (int causal : {1, 0}) run_ws<__half>(2, 3, 200, 128, causal, !causal, DType::f16, 5e-3, seed++, 0, 0);
      emu::g_sm_count = 4;  // 6 (b, h) on 4 persistent CTAs: a group of four, then one of two
      run_ws<__nv_bfloat16>(2, 3, 300, 64, true, true, DType::bf16, 3e-2, seed++, 0, 0);
      emu::g_sm_count = 3;
      run_ws_views<__nv_bfloat16>(2, 3, 200, true, false, DType::bf16, 3e-2, seed++);
      run_ws_views<__half>(1, 2, 130, false, true, DType::f16, 5e-3, seed++);
    } else if (mode == "fused") {  // the fused sm90 backward: both head dims, T below, at and past its tiles
      for (int d : {64, 128})
        for (int T : {1, 30, 64, 65, 128, 129, 200, 300, 520})
          for (int causal : {0, 1})
            run_fused_sm90<__nv_bfloat16>(T < 200 ? 2 : 1, 2, T, d, causal, (T + causal) % 2, DType::bf16, 3e-2,
                                          seed++, T % 3 ? 3 : 0);
      run_fused_sm90<__half>(2, 1, 257, 64, true, false, DType::f16, 5e-3, seed++, 4);
      run_fused_sm90<__half>(1, 2, 190, 128, false, true, DType::f16, 5e-3, seed++, 5);
    } else if (mode == "wsbwd") {  // the warp-specialised fused backward alone: T below, at and past its tiles,
      // rings reused (T 520: nine steps), key blocks past the diagonal
      for (int T : {1, 64, 65, 129, 260, 520})
        for (int causal : {0, 1})
          run_ws_bwd<__nv_bfloat16>(T < 200 ? 2 : 1, 2, T, causal, (T + causal) % 2, DType::bf16, 3e-2, seed++,
                                    T % 3 ? 3 : 6);
      run_ws_bwd<__half>(2, 1, 190, true, false, DType::f16, 5e-3, seed++, 0);
      run_ws_views<__nv_bfloat16>(2, 3, 200, true, false, DType::bf16, 3e-2, seed++);
      run_ws_views<__half>(1, 2, 130, false, true, DType::f16, 5e-3, seed++);
    } else if (mode == "racecheck") {  // the warp-specialised kernels under racecheck's reading of an mbarrier
      // (emu.h's g_racecheck_model, tl_rc); causal: query steps that key block 0 alone meets (turn 0: the part is the
      // sum, the writers read the consumers' stores). The old dq_writer (only wt 0 waiting for dq_full at 128-query
      // steps; at 64 the others' own waits before wt 0's) fails here, as it did under racecheck on the H200.
      emu::g_racecheck_model = true;
      for (int causal : {1, 0}) {
        run_ws<__nv_bfloat16>(1, 2, 300, 64, causal, causal, DType::bf16, 3e-2, seed++, 0, 0);
        run_ws_bwd<__nv_bfloat16>(1, 2, 260, causal, !causal, DType::bf16, 3e-2, seed++, 3);
        // persistent CTAs with many tiles: readers that skip key blocks j > 0 run ahead of the consumers (the old
        // dq_writer's waits passed on a phase of the same parity there, ordered only through wt 0's barrier)
        run_ws_bwd<__nv_bfloat16>(1, 3, 520, causal, !causal, DType::bf16, 3e-2, seed++, 3, {6});
      }
      run_ws<__half>(2, 3, 200, 128, true, true, DType::f16, 5e-3, seed++, 0, 0);
    } else if (mode == "auto") {
      run_auto_cases(seed);
    } else if (mode == "sm75") {
      run_sm75_cases(seed);
    } else if (mode == "smem") {
      run_smem_cases(seed);
    } else if (mode == "decode") {
      run_decode_cases(seed);
    } else if (mode == "big") {
      for (int causal : {0, 1}) for (int det : {0, 1}) {
        run<__nv_bfloat16>(2, 2, 257, 64, causal, det, det, DType::bf16, 3e-2, seed++);
        run<__half>(1, 2, 200, 128, causal, !det, det, DType::f16, 5e-3, seed++);
      }
      run<float>(2, 2, 131, 64, true, true, false, DType::f32, 1e-4, seed++);
    } else if (mode == "peaky") {
      g_amp = 6.f;
      run<__nv_bfloat16>(1, 2, 150, 64, true, false, false, DType::bf16, 3e-2, seed++);
      run<__nv_bfloat16>(1, 2, 150, 128, false, true, true, DType::bf16, 3e-2, seed++);
      run<__half>(1, 2, 150, 64, false, false, true, DType::f16, 5e-3, seed++);
      run<float>(1, 2, 70, 64, true, true, false, DType::f32, 1e-4, seed++);
    } else if (mode == "grid") {
      // B*H > 65535 with tiny T: must still work (grid x)
      run<__nv_bfloat16>(1, 70000, 1, 64, true, false, true, DType::bf16, 3e-2, seed++);
    }
  } catch (std::exception& e) {
    printf("EXCEPTION: %s\n", e.what());
    failures++;
  }
  printf("launches %ld, max dyn smem %zu, failures %d\n", emu::g_launches, emu::g_max_smem_seen, failures);
  return failures != 0;
}
