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
// gradient); the bias gradient rides in the weight gradient's product (gemm_bias_grad: BGRADB sums the loaded dout
// tiles). A plan cuBLASLt refuses is remembered, and the caller falls back to its kernels.
// Mixed precision: the layouts carry each operand's cudaDataType_t, the descriptor the compute type with an fp32
// scale type, and the bias epilogue the bias type. When the epilogue cannot be used, a kernel adds the bias; for a
// 16-bit C the product then goes to fp32 scratch first, so that alpha * AB + beta * C + bias is rounded once, as the
// epilogue (and the CPU) would.
#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "cuda/check.h"
#include "cuda/cublaslt.h"
#include "cuda/runtime.h"
#include "cuda/scratch.h"
#include "cuda/storage.cuh"

namespace fastgpt::cuda {

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // 32 MiB: enough for split-K / stream-K algorithms on H100

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
};

// Everything cuBLASLt needs for one problem, built once. use_epilogue is false when the bias epilogue was asked
// for but is not usable (misaligned bias, batched call, or no algorithm): the bias is then added by a kernel.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A, B, C (= D), i.e. our B, A, C
  cublasLtMatmulAlgo_t algo;
  size_t workspace = 0;
  bool use_epilogue = false;
};

using Key = std::array<int64_t, 25>;
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
bool pick_algo(cublasLtHandle_t handle, Plan& p, uint32_t al_a, uint32_t al_b, uint32_t al_c, bool optional = false) {
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
  cublasLtMatmulHeuristicResult_t result;
  std::memset(&result, 0, sizeof(result));
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  FASTGPT_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || found == 0 || (optional && st != CUBLAS_STATUS_SUCCESS)) return false;
  FASTGPT_CUBLAS_CHECK(st);
  p.algo = result.algo;
  p.workspace = result.workspaceSize;
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

// Runs a cached plan under g_mutex: this call's bias and aux pointers on its descriptor (the plan was made with
// representative ones; null leaves an attribute alone), a workspace from the stream's pool, then the product.
void run_plan(cublasLtHandle_t handle, Plan& p, float alpha, const void* A, const void* B, float beta, void* C,
              const void* bias, const void* aux, cudaStream_t stream) {
  if (bias)
    FASTGPT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux)
    FASTGPT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  Scratch workspace((p.workspace + sizeof(float) - 1) / sizeof(float), stream);
  FASTGPT_CUBLAS_CHECK(cublasLtMatmul(handle, p.desc, &alpha, B, p.a, A, p.b, &beta, C, p.c, C, p.c, &p.algo,
                                      workspace.ptr, p.workspace, stream));
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
  const Key key = {device, trans_a, trans_b, M, N, K, lda, ldb, ldc, 1, 0, 0, 0, (int64_t)types.compute,
                   (int64_t)types.a, (int64_t)types.b, (int64_t)types.c, bias ? (int64_t)types.bias : -1, al_a, al_b,
                   al_c, al_bias, epi, al_aux, aux ? ldaux : 0};
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
    p.use_epilogue = pick_algo(dev.handle, p, al_a, al_b, al_c, true);
    if (!p.use_epilogue) {  // remembered as a refusal
      FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
      for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c}) FASTGPT_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(l));
      p = Plan{};
    }
    it = g_plans.emplace(key, p).first;
  }
  Plan& p = it->second;
  if (!p.use_epilogue) return false;
  run_plan(dev.handle, p, alpha, A, B, beta, C, bias, aux, stream);
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
  const Key key = {device, trans_a, trans_b, M, N, K, lda, ldb, ldc, batch, stride_a, stride_b, stride_c,
                   (int64_t)types.compute, (int64_t)types.a, (int64_t)types.b, (int64_t)types.c,
                   bias ? (int64_t)types.bias : -1, al_a, al_b, al_c, al_bias, CUBLASLT_EPILOGUE_DEFAULT, 0, 0};

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
        ok = pick_algo(dev.handle, p, al_a, al_b, al_c);
        if (ok) {
          p.use_epilogue = true;
        } else {
          FASTGPT_CUBLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
          p.desc = nullptr;
        }
      }
      if (!ok) {
        p.desc = make_desc(types, op_a, op_b, nullptr);
        if (!pick_algo(dev.handle, p, al_a, al_b, al_c))
          fail("cublasLtMatmulAlgoGetHeuristic", "no algorithm for M=" + std::to_string(M) +
                   " N=" + std::to_string(N) + " K=" + std::to_string(K) + " batch=" + std::to_string(batch) +
                   " types A/B/C " + std::to_string((int)types.a) + "/" + std::to_string((int)types.b) + "/" +
                   std::to_string((int)types.c) + " compute " + std::to_string((int)types.compute),
               __FILE__, __LINE__);
      }
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

}  // namespace fastgpt::cuda
