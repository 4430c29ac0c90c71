// The cuBLASLt wrapper behind every dense product on the GPU (see cublaslt.h for the contract).
// cuBLASLt is column-major; a row-major (R, S) matrix with row stride ld is, byte for byte, the column-major (S, R)
// matrix with leading dimension ld. So row-major C = op(A) op(B) is computed as the column-major product
// C^T = op(B)^T op(A)^T: cuBLASLt's "A" is our B and its "B" is our A, with m = N, n = M, k = K, and the transpose
// flags carried over unchanged (a transposed row-major operand is a transposed column-major one too).
// Why cache: building descriptors and asking the heuristic costs far more than the product for small shapes, and a
// training step repeats the same few shapes forever; the cache key holds everything the heuristic looks at
// (shape, strides, transposes, batch, epilogue, element and compute types and the pointers' alignments).
// GELU epilogues (gemm_gelu): the MLP's GELU rides in the products around it, forward (GELU_AUX_BIAS, the
// pre-activation written beside the output for backward) and backward (DGELU on the product that makes its input's
// gradient); the bias gradient can ride in the weight gradient's product (gemm_bias_grad: BGRADB; off by default,
// since on an H200 cuBLASLt ran it as a kernel of its own after the product). A plan cuBLASLt refuses is remembered,
// and the caller falls back to its kernels.
// Autotune (set_matmul_autotune, off by default): a plan asks the heuristic for up to tune::kMaxCandidates
// algorithms instead of one, and its first run times them on that call's operands and keeps the fastest by
// matmul_tune.h's rules (the heuristic's own unless another beats it by 2%), once per plan and process.
// Mixed precision: the layouts carry each operand's cudaDataType_t, the descriptor the compute type with an fp32
// scale type, and the bias epilogue the bias type. When the epilogue cannot be used, a kernel adds the bias; for a
// 16-bit C the product then goes to fp32 scratch first, so that alpha * AB + beta * C + bias is rounded once, as the
// epilogue (and the CPU) would.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/check.h"
#include "cuda/cublaslt.h"
#include "cuda/matmul_tune.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // 32 MiB: enough for split-K / stream-K algorithms on H100

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
};

struct Candidate {
  cublasLtMatmulAlgo_t algo;
  size_t workspace = 0;
};

// Everything cuBLASLt needs for one problem, built once. use_epilogue is false when the bias epilogue was asked
// for but is not usable (misaligned bias, batched call, or no algorithm): the bias is then added by a kernel.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A, B, C (= D), i.e. our B, A, C
  cublasLtMatmulAlgo_t algo;
  size_t workspace = 0;
  bool use_epilogue = false;
  // Autotune: the heuristic's ranked candidates until the first run has timed them (empty after, or when off).
  std::vector<Candidate> candidates;
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;  // the one the plan uses
  size_t d_bytes = 0, aux_bytes = 0, bias_bytes = 0;   // extents of D, aux and the bias vector: the timing's scratch
  MatmulTuneRecord record;                             // the problem, for the report; the timing fills in the rest
};

using Key = std::array<int64_t, 26>;
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : k) {
      h ^= (uint64_t)v;
      h *= 1099511628211ull;
    }
    return (size_t)h;
  }
};

// One lock for the device table, the plan cache and the call itself: the call sets the bias pointer on a shared
// descriptor, and cublasLtMatmul only enqueues work, so holding the lock across it costs little.
std::mutex g_mutex;
std::unordered_map<int, DeviceState> g_devices;
std::unordered_map<Key, Plan, KeyHash> g_plans;
std::atomic<bool> g_autotune{false};
std::vector<MatmulTuneRecord> g_tune_records;  // every plan that met its first run with autotune on

// Handle of the current device, created on first use and never freed: it lives as long as the process, and
// destroying it from a static destructor could run after the CUDA context is gone. The workspace is not kept here:
// one buffer per device would be shared by GEMMs enqueued on different streams (the engine's, the caller's), which
// can then run at once; each call takes its own from the stream-ordered pool instead.
DeviceState& device_state(int device) {
  auto it = g_devices.find(device);
  if (it != g_devices.end()) return it->second;
  DeviceState s;
  FASTGPT_CUBLAS_CHECK(cublasLtCreate(&s.handle));
  return g_devices.emplace(device, s).first->second;
}

size_t type_size(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16BF:
    case CUDA_R_16F: return 2;
    default: fail("gemm", "unsupported data type " + std::to_string((int)t), __FILE__, __LINE__);
  }
}

// Calls f(X{}) with X the storage type (float, bf16, f16) of a cudaDataType_t.
template <typename F>
void with_type(cudaDataType_t t, F&& f) {
  switch (t) {
    case CUDA_R_32F: return f(float{});
    case CUDA_R_16BF: return f(bf16{});
    case CUDA_R_16F: return f(f16{});
    default: fail("gemm", "unsupported data type " + std::to_string((int)t), __FILE__, __LINE__);
  }
}

// Largest power of two (element size..256) dividing the address of every batch entry: what the heuristic must be
// told, since by default it assumes 256-byte alignment and may pick an algorithm that then fails on our pointer.
uint32_t alignment(const void* p, int64_t stride_elems, int batch, size_t elem) {
  uint64_t a = (uint64_t)(uintptr_t)p;
  if (batch > 1) a |= (uint64_t)stride_elems * elem;
  uint32_t al = 256;
  while (al > elem && (a % al) != 0) al >>= 1;
  return al;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld, int batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  FASTGPT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  if (batch > 1) {
    int32_t count = batch;
    FASTGPT_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    FASTGPT_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return l;
}

// Descriptor for the given transposes and epilogue (BIAS when there is a bias and no other is named); bias (a
// representative pointer) is set so that the heuristic sees its alignment. The bias type is cuBLASLt's default
// (D's type) unless it differs, then set explicitly.
cublasLtMatmulDesc_t make_desc(const GemmTypes& t, cublasOperation_t op_a, cublasOperation_t op_b, const void* bias,
                               cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT) {
  cublasLtMatmulDesc_t d = nullptr;
  FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, t.compute, CUDA_R_32F));
  FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (bias && epi == CUBLASLT_EPILOGUE_DEFAULT) epi = CUBLASLT_EPILOGUE_BIAS;
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (bias) {
    FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    if (t.bias != t.c) {
      const int32_t bt = (int32_t)t.bias;
      FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    }
  }
  return d;
}

// Best algorithm for the plan's descriptor and layouts; false if cuBLASLt has none (not an error for the
// epilogue attempt, which then falls back to the plain product). optional: any refusal of the heuristic means
// "none" (the GELU epilogues, whose fallback then reports what the plain product meets).
// autotune: ask for up to tune::kMaxCandidates, ranked, into p.candidates (p.algo is the first all the same).
bool pick_algo(cublasLtHandle_t handle, Plan& p, uint32_t al_a, uint32_t al_b, uint32_t al_c, bool autotune,
               bool optional = false) {
  cublasLtMatmulPreference_t pref = nullptr;
  FASTGPT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kWorkspaceBytes;
  FASTGPT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // cuBLASLt's A is our B, its B our A.
  FASTGPT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b, sizeof(al_b)));
  FASTGPT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a, sizeof(al_a)));
  FASTGPT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  FASTGPT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  cublasLtMatmulHeuristicResult_t results[tune::kMaxCandidates];
  std::memset(results, 0, sizeof(results));
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref,
                                                           autotune ? tune::kMaxCandidates : 1, results, &found);
  FASTGPT_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  // Any other failure is an error, whatever `found` says (checked first, so that it is not taken for "none").
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (optional && st != CUBLAS_STATUS_SUCCESS)) return false;
  FASTGPT_CUBLAS_CHECK(st);
  // Each result says whether it can run (its state); the heuristic's first that can is the plan's.
  p.candidates.clear();
  for (int i = 0; i < found; i++)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) p.candidates.push_back({results[i].algo, results[i].workspaceSize});
  if (p.candidates.empty()) return false;
  p.algo = p.candidates[0].algo;
  p.workspace = p.candidates[0].workspace;
  if (!autotune) p.candidates.clear();
  return true;
}

// cuBLASLt's A, B and C layouts of a row-major problem (the swap of the file comment).
void make_layouts(Plan& p, const GemmTypes& types, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  int64_t lda, int64_t ldb, int64_t ldc, int batch, int64_t stride_a, int64_t stride_b,
                  int64_t stride_c) {
  // cuBLASLt's A = our B: stored column-major (K, N) when trans_b (row-major (N, K)), else (N, K).
  p.a = make_layout(types.b, trans_b ? K : N, trans_b ? N : K, ldb, batch, stride_b);
  // cuBLASLt's B = our A: column-major (M, K) when trans_a (row-major (K, M)), else (K, M).
  p.b = make_layout(types.a, trans_a ? M : K, trans_a ? K : M, lda, batch, stride_a);
  p.c = make_layout(types.c, N, M, ldc, batch, stride_c);  // C^T: column-major (N, M)
}

// A call's bias and aux pointers on its plan's descriptor (made with representative ones); null leaves one alone.
void set_pointers(cublasLtMatmulDesc_t desc, const void* bias, const void* aux) {
  if (bias)
    FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux)
    FASTGPT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
}

const char* epilogue_name(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "none";
    case CUBLASLT_EPILOGUE_BIAS: return "bias";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "gelu_aux";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "gelu_aux_bias";
    case CUBLASLT_EPILOGUE_DGELU: return "dgelu";
    case CUBLASLT_EPILOGUE_BGRADB: return "bgradb";
    default: return "other";
  }
}

const char* type_name(cudaDataType_t t) {
  return t == CUDA_R_32F ? "fp32" : t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "fp16" : "other";
}

// The plan's problem for the report, and the extents of the outputs a timing writes (row-major C (M, N) with row
// stride ldc per batch entry, aux (M, N) with row stride ldaux in C's type, the bias vector: M for BGRADB's sums).
void describe(Plan& p, cublasLtEpilogue_t epi, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
              int64_t ldc, int batch, int64_t stride_c, int64_t ldaux, const GemmTypes& t) {
  p.epi = epi;
  const size_t es_c = type_size(t.c);
  p.d_bytes = ((size_t)(batch - 1) * stride_c + (size_t)(M - 1) * ldc + N) * es_c;
  p.aux_bytes = ldaux > 0 ? ((size_t)(M - 1) * ldaux + N) * es_c : 0;
  p.bias_bytes = (size_t)M * type_size(t.bias);
  MatmulTuneRecord& r = p.record;
  r.M = M, r.N = N, r.K = K, r.trans_a = trans_a, r.trans_b = trans_b, r.batch = batch;
  r.epilogue = epilogue_name(epi);
  r.ab_type = type_name(t.a), r.c_type = type_name(t.c);
  r.compute = t.compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? "tf32" : "fp32";
}

// Device memory for one timing: taken and given back with cudaMalloc/cudaFree, outside the stream-ordered pool and
// the engine's workspace (neither should grow, nor keep, what only the first run needs). A refusal (no memory)
// leaves ok false and the error cleared: the plan then keeps the heuristic's choice.
struct TuneBuffer {
  void* ptr = nullptr;
  bool ok = true;
  explicit TuneBuffer(size_t bytes) {
    if (bytes == 0) return;
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
      ptr = nullptr;
      ok = false;
      (void)cudaGetLastError();  // cudaErrorMemoryAllocation is not sticky: clear it for the calls after
    }
  }
  void release() {
    if (ptr) FASTGPT_CUDA_CHECK(cudaFree(ptr));
    ptr = nullptr;
  }
  ~TuneBuffer() {
    if (ptr) (void)cudaFree(ptr);  // only when an exception left early: it is already being reported
  }
  TuneBuffer(const TuneBuffer&) = delete;
  TuneBuffer& operator=(const TuneBuffer&) = delete;
};

// Autotune, at a plan's first run (under g_mutex): times its candidates on this call's operands and keeps the
// winner (tune::choose). D goes to scratch, and so do the epilogue's other outputs (BGRADB's bias sums, GELU_AUX's
// pre-activation): with beta != 0 the real C must be added to once, and no timing may write what the caller has
// (nor an input that aliases an output). The timing runs the product in place, as run_plan does (C = D: the
// scratch, holding a copy of C where beta != 0, else zeros): out of place, a candidate that reads D (as C, or for
// split-K's in-place sums) read the fresh allocation's bytes (compute-sanitizer's initcheck counted one whole D,
// 2026-11-26), and the timing was not of the call that then runs. Not while the stream is being recorded into a
// CUDA graph (no synchronisation is allowed there): the heuristic's choice then stays for good, so a graph and the
// eager calls after it run the same algorithm. Each decision, timed or not, goes to g_tune_records.
void decide(cublasLtHandle_t handle, Plan& p, float alpha, const void* A, const void* B, float beta, const void* C,
            const void* bias, const void* aux, cudaStream_t stream) {
  std::vector<Candidate> cands;
  cands.swap(p.candidates);  // decided once, whatever happens below
  MatmulTuneRecord rec = p.record;
  rec.candidates = (int)cands.size();
  rec.ms.assign(cands.size(), -1.0);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FASTGPT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    rec.skipped = "first run recorded into a CUDA graph";
    g_tune_records.push_back(rec);
    return;
  }
  const bool bias_out = p.epi == CUBLASLT_EPILOGUE_BGRADB;
  const bool aux_out = p.epi == CUBLASLT_EPILOGUE_GELU_AUX || p.epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  size_t ws_bytes = 0;
  for (const Candidate& c : cands) ws_bytes = std::max(ws_bytes, c.workspace);
  TuneBuffer d(p.d_bytes), ws(ws_bytes), bias_s(bias_out ? p.bias_bytes : 0), aux_s(aux_out ? p.aux_bytes : 0);
  if (!d.ok || !ws.ok || !bias_s.ok || !aux_s.ok) {
    rec.skipped = "no device memory for the timing's outputs";
    g_tune_records.push_back(rec);
    return;
  }
  if (beta != 0.f)
    FASTGPT_CUDA_CHECK(cudaMemcpyAsync(d.ptr, C, p.d_bytes, cudaMemcpyDeviceToDevice, stream));
  else
    FASTGPT_CUDA_CHECK(cudaMemsetAsync(d.ptr, 0, p.d_bytes, stream));
  set_pointers(p.desc, bias_out ? bias_s.ptr : bias, aux_out ? aux_s.ptr : aux);
  struct Events {  // destroyed on every path, a throw from a timing's check included
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } ev;
  FASTGPT_CUDA_CHECK(cudaEventCreate(&ev.start));
  FASTGPT_CUDA_CHECK(cudaEventCreate(&ev.stop));
  const cudaEvent_t start = ev.start, stop = ev.stop;
  const auto time = [&](int c, int reps) -> double {
    FASTGPT_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < reps; r++)
      if (cublasLtMatmul(handle, p.desc, &alpha, B, p.a, A, p.b, &beta, d.ptr, p.c, d.ptr, p.c, &cands[c].algo, ws.ptr,
                         cands[c].workspace, stream) != CUBLAS_STATUS_SUCCESS)
        return -1.0;  // this candidate cannot run here: out (tune::choose)
    FASTGPT_CUDA_CHECK(cudaEventRecord(stop, stream));
    FASTGPT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    FASTGPT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  };
  const tune::Choice ch = tune::choose((int)cands.size(), time);
  FASTGPT_CUDA_CHECK(cudaStreamSynchronize(stream));  // a candidate that failed part-way left products queued
  for (TuneBuffer* b : {&d, &ws, &bias_s, &aux_s}) b->release();
  p.algo = cands[ch.chosen].algo;
  p.workspace = cands[ch.chosen].workspace;
  rec.chosen = ch.chosen, rec.reps = ch.reps, rec.ms = ch.ms;
  if (ch.reps == 0) rec.skipped = "no candidate ran";
  g_tune_records.push_back(rec);
}

// Runs a cached plan under g_mutex: this call's bias and aux pointers on its descriptor (set_pointers), a workspace
// from the stream's pool, then the product.
// With autotune, its first run times its candidates first (decide). `optional`: cuBLASLt's run-time refusal
// (NOT_SUPPORTED: the heuristic's success "doesn't fully guarantee algo will run", cublasLt.h) is returned, with
// nothing queued, instead of thrown.
cublasStatus_t run_plan(cublasLtHandle_t handle, Plan& p, float alpha, const void* A, const void* B, float beta,
                        void* C, const void* bias, const void* aux, cudaStream_t stream, bool optional = false) {
  if (!p.candidates.empty()) decide(handle, p, alpha, A, B, beta, C, bias, aux, stream);
  set_pointers(p.desc, bias, aux);
  Scratch workspace((p.workspace + sizeof(float) - 1) / sizeof(float), stream);
  const cublasStatus_t st = cublasLtMatmul(handle, p.desc, &alpha, B, p.a, A, p.b, &beta, C, p.c, C, p.c, &p.algo,
                                           workspace.ptr, p.workspace, stream);
  if (!(optional && st == CUBLAS_STATUS_NOT_SUPPORTED)) FASTGPT_CUBLAS_CHECK(st);
  return st;
}

// The epilogue by hand: C(M,N) (row-major, row stride ldc, batch stride sc) = acc + beta * C + bias[col], in float
// and rounded once to CT. acc (the fp32 product alpha * AB packed (batch, M, N), or null for 0) and bias may be
// null. Serves the K == 0 product (beta * C + bias), a bias the cuBLASLt epilogue could not add to an fp32 C
// (acc null, beta 1) and a 16-bit C whose product went to fp32 scratch. beta == 0 never reads C, as BLAS does.
template <typename CT, typename BT>
__global__ void epilogue_kernel(CT* c, const float* __restrict__ acc, const BT* bias, float beta, int64_t M,
                                int64_t N, int64_t ldc, int64_t sc, int64_t total) {
  for (int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; n < total; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t col = n % N, row = (n / N) % M, b = n / (N * M);
    CT* p = c + b * sc + row * ldc + col;
    float v = acc ? acc[n] : 0.f;
    if (beta != 0.f) v += beta * to_float(*p);
    if (bias) v += to_float(bias[col]);
    *p = from_float<CT>(v);
  }
}

void epilogue(void* c, const float* acc, const void* bias, float beta, int64_t M, int64_t N, int64_t ldc, int batch,
              int64_t sc, const GemmTypes& t, cudaStream_t stream) {
  const int64_t total = (int64_t)batch * M * N;
  const int threads = 256;
  const unsigned blocks = (unsigned)std::min<int64_t>((total + threads - 1) / threads, 1 << 20);  // grid-stride
  with_type(t.c, [&](auto ctag) {
    with_type(t.bias, [&](auto btag) {
      using CT = decltype(ctag);
      using BT = decltype(btag);
      epilogue_kernel<CT, BT><<<blocks, threads, 0, stream>>>(static_cast<CT*>(c), acc, static_cast<const BT*>(bias),
                                                               beta, M, N, ldc, sc, total);
    });
  });
  FASTGPT_CUDA_CHECK_LAUNCH();
}

// A product with an epilogue that cuBLASLt may refuse (GELU, bias gradient): batch 1, the plan made once and a
// refusal remembered, so the caller's fallback runs from then on without asking again. bias: the bias (GELU forward)
// or the bias gradient's output; aux (with ldaux) the GELU epilogues' pre-activation, or null. Returns false, having
// queued nothing, when cuBLASLt cannot do it.
bool optional_epilogue(cublasLtEpilogue_t epi, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                       float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C,
                       int64_t ldc, const void* bias, void* aux, int64_t ldaux, cudaStream_t stream,
                       const GemmTypes& types) {
  if (M <= 0 || N <= 0 || K <= 0) return false;
  const size_t es_c = type_size(types.c);
  // cuBLASLt's rules for the aux matrix: its leading dimension (ours, the row stride) a multiple of 8 and at least
  // D's column-major rows (our N); 16-byte aligned aux and bias (vector), as for the bias epilogue.
  if (aux && (ldaux % 8 != 0 || ldaux < N || alignment(aux, 0, 1, es_c) < 16)) return false;
  if (bias && alignment(bias, 0, 1, type_size(types.bias)) < 16) return false;
  int device = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  const uint32_t al_a = alignment(A, 0, 1, type_size(types.a)), al_b = alignment(B, 0, 1, type_size(types.b)),
                 al_c = alignment(C, 0, 1, es_c), al_aux = aux ? alignment(aux, 0, 1, es_c) : 0,
                 al_bias = bias ? alignment(bias, 0, 1, type_size(types.bias)) : 0;
  const bool autotune = g_autotune.load();
  const Key key = {device, trans_a, trans_b, M, N, K, lda, ldb, ldc, 1, 0, 0, 0, (int64_t)types.compute,
                   (int64_t)types.a, (int64_t)types.b, (int64_t)types.c, bias ? (int64_t)types.bias : -1, al_a, al_b,
                   al_c, al_bias, epi, al_aux, aux ? ldaux : 0, autotune};
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceState& dev = device_state(device);
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    Plan p;
    make_layouts(p, types, trans_a, trans_b, M, N, K, lda, ldb, ldc, 1, 0, 0, 0);
    p.desc = make_desc(types, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, bias, epi);
    if (aux) {  // the aux pointer (its alignment) and leading dimension are part of what the heuristic judges
      FASTGPT_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
      FASTGPT_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ldaux, sizeof(ldaux)));
    }
    p.use_epilogue = pick_algo(dev.handle, p, al_a, al_b, al_c, autotune, true);
    describe(p, epi, trans_a, trans_b, M, N, K, ldc, 1, 0, aux ? ldaux : 0, types);
    if (!p.use_epilogue) {  // remembered as a refusal
      FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
      for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c}) FASTGPT_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(l));
      p = Plan{};
    }
    it = g_plans.emplace(key, p).first;
  }
  Plan& p = it->second;
  if (!p.use_epilogue) return false;
  if (run_plan(dev.handle, p, alpha, A, B, beta, C, bias, aux, stream, true) != CUBLAS_STATUS_SUCCESS) {
    p.use_epilogue = false;  // refused at run time: remembered, as a refusal at plan time is
    return false;
  }
  return true;
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, void* C, int64_t ldc, const void* bias, cudaStream_t stream,
          const GemmTypes& types, int batch, int64_t stride_a, int64_t stride_b, int64_t stride_c) {
  if (M <= 0 || N <= 0 || batch <= 0) return;
  if (K <= 0) {  // empty sum: cuBLASLt may reject k = 0, and the answer is just beta * C (+ bias)
    epilogue(C, nullptr, bias, beta, M, N, ldc, batch, stride_c, types, stream);
    return;
  }
  int device = 0;
  FASTGPT_CUDA_CHECK(cudaGetDevice(&device));
  const size_t es_a = type_size(types.a), es_b = type_size(types.b), es_c = type_size(types.c);
  const uint32_t al_a = alignment(A, stride_a, batch, es_a), al_b = alignment(B, stride_b, batch, es_b),
                 al_c = alignment(C, stride_c, batch, es_c);
  // The epilogue wants a 16-byte aligned bias (found by others to fail otherwise) and one vector for the batch.
  const size_t es_bias = bias ? type_size(types.bias) : 4;
  const bool want_epilogue = bias != nullptr && batch == 1 && alignment(bias, 0, 1, es_bias) >= 16;
  const uint32_t al_bias = want_epilogue ? alignment(bias, 0, 1, es_bias) : 0;
  const bool autotune = g_autotune.load();
  const Key key = {device, trans_a, trans_b, M, N, K, lda, ldb, ldc, batch, stride_a, stride_b, stride_c,
                   (int64_t)types.compute, (int64_t)types.a, (int64_t)types.b, (int64_t)types.c,
                   bias ? (int64_t)types.bias : -1, al_a, al_b, al_c, al_bias, CUBLASLT_EPILOGUE_DEFAULT, 0, 0,
                   autotune};

  // A 16-bit C whose bias the epilogue cannot add: the product goes to fp32 scratch, then one kernel rounds
  // acc + beta * C + bias once (adding the bias to an already rounded C would round twice).
  const auto product_then_bias = [&]() {
    Scratch acc((size_t)batch * M * N, stream);
    GemmTypes ft = types;
    ft.c = CUDA_R_32F;
    gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, 0.f, acc.ptr, N, nullptr, stream, ft, batch, stride_a,
         stride_b, M * N);
    epilogue(C, acc.ptr, bias, beta, M, N, ldc, batch, stride_c, types, stream);
  };
  if (bias && !want_epilogue && types.c != CUDA_R_32F) return product_then_bias();

  bool used_epilogue = false;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceState& dev = device_state(device);
    auto it = g_plans.find(key);
    if (it == g_plans.end()) {
      // bf16 and TF32 GEMMs need sm_80's tensor cores: say so on a T4 (sm_75) rather than pass on cuBLASLt's
      // "not supported".
      if (types.a == CUDA_R_16BF || types.compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
        int major = 0;
        FASTGPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        if (major < 8)
          throw std::invalid_argument(std::string(types.a == CUDA_R_16BF ? "bfloat16" : "TF32") +
                                      " matmuls need a GPU of compute capability 8.0 or newer; " +
                                      device_name(device) + " has float16 and float32 matmuls");
      }
      Plan p;
      make_layouts(p, types, trans_a, trans_b, M, N, K, lda, ldb, ldc, batch, stride_a, stride_b, stride_c);
      const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      bool ok = false;
      if (want_epilogue) {
        p.desc = make_desc(types, op_a, op_b, bias);
        ok = pick_algo(dev.handle, p, al_a, al_b, al_c, autotune);
        if (ok) {
          p.use_epilogue = true;
        } else {
          FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
          p.desc = nullptr;
        }
      }
      if (!ok) {
        p.desc = make_desc(types, op_a, op_b, nullptr);
        if (!pick_algo(dev.handle, p, al_a, al_b, al_c, autotune))
          fail("cublasLtMatmulAlgoGetHeuristic", "no algorithm for M=" + std::to_string(M) +
                   " N=" + std::to_string(N) + " K=" + std::to_string(K) + " batch=" + std::to_string(batch) +
                   " types A/B/C " + std::to_string((int)types.a) + "/" + std::to_string((int)types.b) + "/" +
                   std::to_string((int)types.c) + " compute " + std::to_string((int)types.compute),
               __FILE__, __LINE__);
      }
      describe(p, p.use_epilogue ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, trans_a, trans_b, M, N, K, ldc,
               batch, stride_c, 0, types);
      it = g_plans.emplace(key, p).first;
    }
    Plan& p = it->second;
    used_epilogue = p.use_epilogue;
    // No epilogue for a 16-bit C's bias: leave the lock, take the fp32 scratch route below.
    if (!(bias && !used_epilogue && types.c != CUDA_R_32F))
      run_plan(dev.handle, p, alpha, A, B, beta, C, used_epilogue ? bias : nullptr, nullptr, stream);
  }
  if (bias && !used_epilogue) {
    if (types.c != CUDA_R_32F) return product_then_bias();
    epilogue(C, nullptr, bias, 1.f, M, N, ldc, batch, stride_c, types, stream);
  }
}

bool gemm_gelu(GeluEpilogue kind, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
               int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc, const void* bias, void* aux,
               int64_t ldaux, cudaStream_t stream, const GemmTypes& types) {
  if (kind == GeluEpilogue::backward && bias) fail("gemm_gelu", "the GELU-gradient epilogue takes no bias", __FILE__,
                                                   __LINE__);
  if (!aux) fail("gemm_gelu", "the GELU epilogues need the pre-activation (aux)", __FILE__, __LINE__);
  const cublasLtEpilogue_t epi = kind == GeluEpilogue::backward ? CUBLASLT_EPILOGUE_DGELU
                                 : bias                         ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                                : CUBLASLT_EPILOGUE_GELU_AUX;
  return optional_epilogue(epi, trans_a, trans_b, M, N, K, 1.f, A, lda, B, ldb, 0.f, C, ldc, bias, aux, ldaux, stream,
                           types);
}

bool gemm_bias_grad(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                    int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc, void* dbias,
                    cudaStream_t stream, const GemmTypes& types) {
  if (!dbias) fail("gemm_bias_grad", "dbias must not be null", __FILE__, __LINE__);
  // The sum over K of op(A): cuBLASLt's B is our A (the file comment), and BGRADB sums its B over k into a vector
  // as long as D's columns, our M.
  return optional_epilogue(CUBLASLT_EPILOGUE_BGRADB, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                           dbias, nullptr, 0, stream, types);
}

bool matmul_autotune() { return g_autotune.load(); }
bool set_matmul_autotune(bool on) { return g_autotune.exchange(on); }

std::vector<MatmulTuneRecord> matmul_autotune_report() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_tune_records;
}

}  // namespace fastgpt::cuda
