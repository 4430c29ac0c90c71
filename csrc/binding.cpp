// The one binding file: exposes the engine (GPT, AdamW), the ops (CPU, and CUDA through DLPack) and the CUDA slot
// to Python as fastgpt._C. It owns every conversion between arrays and raw pointers and checks every shape before a kernel sees it,
// so bad input becomes a Python exception here, never a crash below. Arrays handed out (parameters, gradients,
// logits, optimizer moments) are zero-copy views that keep their owner alive.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cpu/kernels.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "interop/dlpack.h"
#include "engine/adamw.h"
#include "engine/comm.h"
#include "engine/comm_nccl.h"
#include "engine/gpt.h"
#include "engine/train_step.h"

namespace py = pybind11;
using namespace fastgpt;

using FArray = py::array_t<float, py::array::c_style>;
using IArray = py::array_t<int32_t, py::array::c_style>;

#ifndef FASTGPT_WITH_CUDA
namespace fastgpt::cuda {
bool built_with_cuda() { return false; }
int device_count() { return 0; }
std::string device_name(int) { throw std::runtime_error("fastgpt was built without CUDA"); }
bool smoke_test(int) { throw std::runtime_error("fastgpt was built without CUDA"); }
void set_device(int) { throw std::runtime_error("fastgpt was built without CUDA"); }
int64_t pool_reserved(int) { throw std::runtime_error("fastgpt was built without CUDA"); }
DeviceGuard::DeviceGuard(int) { throw std::runtime_error("fastgpt was built without CUDA"); }
DeviceGuard::~DeviceGuard() = default;
}  // namespace fastgpt::cuda
#endif

// A process-wide choice between CUDA paths (cuda/ops.h's get/set pairs) as one Python function: on None reads it, a
// bool sets it; -> the previous setting. A build without CUDA has no such paths and says what the switch chooses.
#ifdef FASTGPT_WITH_CUDA
#define FASTGPT_CUDA_SWITCH(get, set, what) \
  [](std::optional<bool> on) { return on ? cuda::set(*on) : cuda::get(); }
#else
#define FASTGPT_CUDA_SWITCH(get, set, what)                                                     \
  [](std::optional<bool>) -> bool {                                                             \
    throw std::runtime_error(std::string(what) + "; this build of fastgpt has no CUDA");        \
  }
#endif

namespace {

void need(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}


// A view of engine memory that keeps `owner` (the Python object holding the engine) alive.
FArray view(float* ptr, std::vector<py::ssize_t> shape, py::handle owner) {
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t s = sizeof(float);
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return FArray(shape, strides, ptr, owner);
}

// Engine memory as NumPy: a zero-copy view that keeps `owner` alive on the CPU, a host copy of device memory.
FArray host_array(Backend& be, float* ptr, std::vector<py::ssize_t> shape, py::handle owner) {
  if (!be.is_cuda()) return view(ptr, shape, owner);
  FArray out(shape);
  py::gil_scoped_release nogil;
  be.download(out.mutable_data(), ptr, out.size() * sizeof(float));
  return out;
}

// Engine memory of the storage type as float32 NumPy (a widened copy; a zero-copy view when it is float on the CPU).
FArray host_floats(Backend& be, const void* ptr, DType dtype, std::vector<py::ssize_t> shape, py::handle owner) {
  if (dtype == DType::f32) return host_array(be, static_cast<float*>(const_cast<void*>(ptr)), shape, owner);
  FArray out(shape);
  const int64_t n = out.size();
  py::gil_scoped_release nogil;
  if (!be.is_cuda()) {
    be.widen(out.mutable_data(), ptr, dtype, n);
  } else {  // 16-bit bits down, widened here: the device keeps no float copy
    std::vector<uint16_t> bits(n);
    be.download(bits.data(), ptr, n * 2);
    if (dtype == DType::bf16)
      cpu::widen(out.mutable_data(), reinterpret_cast<const bf16*>(bits.data()), n);
    else
      cpu::widen(out.mutable_data(), reinterpret_cast<const f16*>(bits.data()), n);
  }
  return out;
}

std::unique_ptr<Backend> backend_for(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend(0);
  if (device.rfind("cuda:", 0) == 0) {
    int index = -1;
    try {
      size_t used = 0;
      index = std::stoi(device.substr(5), &used);
      if (used != device.size() - 5 || !std::isdigit((unsigned char)device[5])) index = -1;  // "cuda:1x", "cuda:+1"
    } catch (const std::exception&) {
    }
    need(index >= 0, "device must be 'cpu', 'cuda' or 'cuda:N', got '" + device + "'");
    return make_cuda_backend(index);
  }
  throw std::invalid_argument("device must be 'cpu', 'cuda' or 'cuda:N', got '" + device + "'");
}

// ---- data parallel on CPUs: the engine's Comm over a Python object (fastgpt.distributed's MPI communicator,
// mpi4py underneath), so the engine needs no MPI headers and works with whichever MPI mpi4py was built for. The
// engine calls it without the GIL; each call takes it back and hands the buffers over as zero-copy NumPy views.
class PyComm final : public Comm {
 public:
  PyComm(py::object impl, int rank, int world) : impl_(std::move(impl)), rank_(rank), world_(world) {
    overlaps_ = py::hasattr(impl_, "overlaps") && impl_.attr("overlaps").cast<bool>();
  }
  ~PyComm() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "mpi"; }
  // Each call takes the GIL back (the engine calls without it) before it makes the NumPy views.
  void all_reduce(float* x, int64_t n, bool average) override {
    py::gil_scoped_acquire gil;
    impl_.attr("all_reduce")(array(x, n), average);
  }
  void reduce_scatter(float* x, int64_t shard, bool average) override {
    py::gil_scoped_acquire gil;
    impl_.attr("reduce_scatter")(array(x, shard * world_), shard, average);
  }
  void all_gather(void* x, int64_t shard_bytes) override {
    py::gil_scoped_acquire gil;
    impl_.attr("all_gather")(array(static_cast<uint8_t*>(x), shard_bytes * world_));
  }
  void broadcast(void* x, int64_t n, int root) override {
    py::gil_scoped_acquire gil;
    impl_.attr("broadcast")(array(static_cast<uint8_t*>(x), n), root);
  }
  void all_reduce_host(double* x, int n) override {
    py::gil_scoped_acquire gil;
    impl_.attr("all_reduce_host")(array(x, n));
  }
  void barrier() override {
    py::gil_scoped_acquire gil;
    impl_.attr("barrier")();
  }
  // MPI blocks, so "overlapping" reduces each layer's slices when the backward hands them over: the same order of
  // calls as NCCL's overlap, which lets the CPU tests check that every gradient is reduced exactly once.
  bool overlaps() const override { return overlaps_; }

 private:
  // A zero-copy view of engine memory, which outlives the call: the capsule owns nothing.
  template <typename T>
  static py::array_t<T> array(T* p, int64_t n) {
    return py::array_t<T>({(py::ssize_t)n}, {(py::ssize_t)sizeof(T)}, p, py::capsule((void*)p, [](void*) {}));
  }
  py::object impl_;
  int rank_, world_;
  bool overlaps_ = false;
};

// ---- ops on arrays that live on the CPU (NumPy) or on a GPU (DLPack capsules): one shape check per op, then the
// kernel of the device the arrays are on, on the caller's stream. Outputs are allocated by the caller (fastgpt.ops),
// in the caller's framework, so no memory crosses ownership here; gradient outputs arrive zeroed.
struct View {
  void* data = nullptr;
  std::vector<int64_t> shape;
  bool cuda = false;
  int device = -1;
  char dtype = 'f';  // 'f' float32, 'i' int32, 'b' bfloat16, 'h' float16
  int64_t size() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int ndim() const { return (int)shape.size(); }
  float* f() const { return static_cast<float*>(data); }
  int32_t* i() const { return static_cast<int32_t*>(data); }
  template <typename S>
  S* as() const {
    return static_cast<S*>(data);
  }
  DType dt() const { return dtype == 'b' ? DType::bf16 : dtype == 'h' ? DType::f16 : DType::f32; }
};

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// kind 'f': float32, 'i': int32, 'a': an activation or weight in a storage type: float32, bfloat16 or float16
// (NumPy float16, ml_dtypes bfloat16, or DLPack). NumPy arrays must be C-contiguous (fastgpt.ops converts them);
// DLPack tensors must be compact row-major on a CUDA device.
View view_of(py::handle obj, const std::string& name, char kind) {
  View v;
  const char* want = kind == 'i' ? "int32" : kind == 'a' ? "float32, bfloat16 or float16" : "float32";
  v.dtype = kind == 'i' ? 'i' : 'f';
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    const std::string dname = py::str(a.dtype().attr("name"));
    bool ok = kind == 'i' ? a.dtype().is(py::dtype::of<int32_t>()) : a.dtype().is(py::dtype::of<float>());
    if (!ok && kind == 'a' && a.itemsize() == 2 && (dname == "bfloat16" || dname == "float16")) {
      ok = true;
      v.dtype = dname == "bfloat16" ? 'b' : 'h';
    }
    need(ok, name + " must be " + want + ", got " + dname);
    need(a.flags() & py::array::c_style, name + " must be C-contiguous");
    v.data = const_cast<void*>(a.data());  // not request(): the buffer protocol has no bfloat16 format
    v.shape.assign(a.shape(), a.shape() + a.ndim());
    return v;
  }
  if (py::isinstance<py::capsule>(obj)) {
    auto cap = py::reinterpret_borrow<py::capsule>(obj);
    need(cap.name() && std::string(cap.name()) == "dltensor", name + ": expected an unused DLPack capsule");
    const DLTensor& t = cap.get_pointer<DLManagedTensor>()->dl_tensor;
    const uint8_t code = kind == 'i' ? kDLInt : kDLFloat;
    if (kind == 'a' && t.dtype.lanes == 1 && t.dtype.bits == 16 && (t.dtype.code == kDLBfloat || t.dtype.code == kDLFloat))
      v.dtype = t.dtype.code == kDLBfloat ? 'b' : 'h';
    else
      need(t.dtype.code == code && t.dtype.bits == 32 && t.dtype.lanes == 1,
           name + " must be " + (kind == 'a' ? "float32, bfloat16 or float16" : want));
    need(t.device.device_type == kDLCUDA || t.device.device_type == kDLCUDAManaged,
         name + " must be on a CUDA device (CPU arrays go through NumPy)");
    v.shape.assign(t.shape, t.shape + t.ndim);
    if (t.strides) {
      int64_t expect = 1;
      for (int d = t.ndim - 1; d >= 0; d--) {
        need(t.shape[d] == 1 || t.strides[d] == expect, name + " must be contiguous (row-major)");
        expect *= t.shape[d];
      }
    }
    v.data = static_cast<char*>(t.data) + t.byte_offset;
    v.cuda = true;
    v.device = t.device.device_id;
    return v;
  }
  throw py::type_error(name + " must be a NumPy array or a DLPack capsule");
}

struct Ctx {
  bool cuda = false;
#ifdef FASTGPT_WITH_CUDA
  cuda::Stream stream = nullptr;
  std::shared_ptr<cuda::DeviceGuard> device;  // the arrays' device, current while the Ctx lives
#endif
};

// All arrays of one call on one device; makes that device current for the kernels that follow, until the Ctx ends.
Ctx context(std::initializer_list<const View*> views, uintptr_t stream) {
  const View* first = *views.begin();
  for (const View* v : views)
    need(v->cuda == first->cuda && v->device == first->device,
         "all arrays of an op must be on the same device (got " + std::string(first->cuda ? "cuda:" : "cpu") +
             (first->cuda ? std::to_string(first->device) : "") + " and " + (v->cuda ? "cuda:" : "cpu") +
             (v->cuda ? std::to_string(v->device) : "") + ")");
  Ctx c;
  c.cuda = first->cuda;
  if (c.cuda) {
#ifdef FASTGPT_WITH_CUDA
    c.device = std::make_shared<cuda::DeviceGuard>(first->device);
    c.stream = reinterpret_cast<cuda::Stream>(stream);
#else
    throw std::runtime_error("CUDA arrays need a fastgpt built with CUDA (reinstall where nvcc is on PATH)");
#endif
  }
  return c;
}

#ifdef FASTGPT_WITH_CUDA
#define IF_CUDA(...) __VA_ARGS__
#define FASTGPT_DISPATCH(ctx, fn, ...)              \
  do {                                              \
    if ((ctx).cuda)                                 \
      cuda::fn(__VA_ARGS__, (ctx).stream);          \
    else                                            \
      cpu::fn(__VA_ARGS__);                         \
  } while (0)
#else
#define IF_CUDA(...)
#define FASTGPT_DISPATCH(ctx, fn, ...) ((void)(ctx), cpu::fn(__VA_ARGS__))
#endif

// Runs the statement with S bound to the storage type of View v.
#define TYPED(v, ...)                  \
  with_dtype((v).dt(), [&](auto tag_) { \
    using S = decltype(tag_);          \
    __VA_ARGS__;                       \
  })

// Rows of an array whose last dimension is `cols` >= 1 (leading dimensions flattened).
int64_t rows_of(const View& a, int64_t cols, const std::string& name) {
  need(a.ndim() >= 1 && a.shape.back() == cols,
       name + " must have last dimension " + std::to_string(cols) + ", got shape " + shape_str(a.shape));
  need(cols >= 1, name + " must have a last dimension >= 1, got shape " + shape_str(a.shape));
  return a.size() / cols;
}

// targets for logits (..., V) of N rows: one id per row, shaped as logits without V (or flat: (N,)), so that ids of
// another layout ((T, B) for (B, T, V)) are refused, not read in the wrong order.
void check_targets(const View& targets, const View& logits, int64_t N) {
  const std::vector<int64_t> rows(logits.shape.begin(), logits.shape.end() - 1);
  need(targets.shape == rows || targets.shape == std::vector<int64_t>{N},
       "targets must have shape " + shape_str(rows) + " (logits' without V) or (" + std::to_string(N) + ",), got " +
           shape_str(targets.shape));
}

void same_shape(const View& a, const View& b, const std::string& na, const std::string& nb) {
  need(a.shape == b.shape, na + " and " + nb + " must have the same shape, got " + shape_str(a.shape) + " and " +
                               shape_str(b.shape));
}

void shape_is(const View& a, std::vector<int64_t> shape, const std::string& name) {
  need(a.shape == shape, name + " must have shape " + shape_str(shape) + ", got " + shape_str(a.shape));
}

// The product x (N rows of C) times weight (OC, C) transposed, as the matmul ops take it: checks weight, x and the
// bias (OC, when given) and returns the dimensions.
struct MatmulDims {
  int64_t N;
  int C, OC;
};
MatmulDims matmul_dims(const View& x, const View& w, const View* bias) {
  need(w.ndim() == 2 && w.shape[0] >= 1 && w.shape[1] >= 1,
       "weight must be 2-D (out_features, in_features), both >= 1, got " + shape_str(w.shape));
  const MatmulDims d{rows_of(x, w.shape[1], "x"), (int)w.shape[1], (int)w.shape[0]};
  if (bias) shape_is(*bias, {d.OC}, "bias");
  return d;
}
// Its backward's arrays: dout (N, OC), the input's gradient (named dinp_name) shaped as x, dweight as weight,
// dbias (OC) when given.
void check_matmul_grads(const MatmulDims& d, const View& dout, const View& dinp, const char* dinp_name, const View& x,
                        const View& dw, const View& w, const View* db) {
  std::vector<int64_t> out_shape = x.shape;  // x's, with out_features last: rows in x's order
  out_shape.back() = d.OC;
  shape_is(dout, out_shape, "dout");
  same_shape(dinp, x, dinp_name, "x");
  same_shape(dw, w, "dweight", "weight");
  if (db) shape_is(*db, {d.OC}, "dbias");
}

// The storage-type arrays of one op share one dtype, the first one's.
void same_dtype(std::initializer_list<std::pair<const View*, const char*>> views) {
  const auto& [first, first_name] = *views.begin();
  for (const auto& [v, name] : views)
    need(v->dtype == first->dtype, std::string(name) + " must have the same dtype as " + first_name + " (" +
                                       dtype_name(first->dt()) + "), got " + dtype_name(v->dt()));
}

// Token ids in range; on a GPU the caller (fastgpt.ops) checks, since reading device memory here would sync.
void check_ids(const View& ids, int64_t V, const std::string& name) {
  if (ids.cuda) return;
  for (int64_t i = 0; i < ids.size(); i++)
    need(ids.i()[i] >= 0 && ids.i()[i] < V, name + " must hold ids in [0, " + std::to_string(V) + "), found " +
                                                std::to_string(ids.i()[i]));
}

using H = py::handle;

void bind_ops(py::module_& m) {
  m.def("encoder_forward", [](H out_, H idx_, H wte_, H wpe_, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), idx = view_of(idx_, "idx", 'i'), wte = view_of(wte_, "wte", 'a'),
         wpe = view_of(wpe_, "wpe", 'a');
    same_dtype({{&wte, "wte"}, {&wpe, "wpe"}, {&out, "out"}});
    need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(idx.shape));
    need(wte.ndim() == 2 && wpe.ndim() == 2 && wte.shape[1] == wpe.shape[1],
         "wte (V, C) and wpe (maxT, C) must be 2-D with the same C, got " + shape_str(wte.shape) + " and " +
             shape_str(wpe.shape));
    const int B = idx.shape[0], T = idx.shape[1], C = wte.shape[1];
    need(T <= wpe.shape[0], "T must be <= wpe rows (" + std::to_string(wpe.shape[0]) + "), got " + std::to_string(T));
    shape_is(out, {B, T, C}, "out");
    check_ids(idx, wte.shape[0], "idx");
    Ctx c = context({&out, &idx, &wte, &wpe}, stream);
    py::gil_scoped_release nogil;
    TYPED(wte, FASTGPT_DISPATCH(c, encoder_forward<S>, out.as<S>(), idx.i(), wte.as<S>(), wpe.as<S>(), B, T, C));
  });
  m.def("encoder_backward", [](H dwte_, H dwpe_, H dout_, H idx_, uintptr_t stream) {
    View dwte = view_of(dwte_, "dwte", 'f'), dwpe = view_of(dwpe_, "dwpe", 'f'), dout = view_of(dout_, "dout", 'a'),
         idx = view_of(idx_, "idx", 'i');
    need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(idx.shape));
    const int B = idx.shape[0], T = idx.shape[1];
    need(dout.ndim() == 3 && dout.shape[0] == B && dout.shape[1] == T,
         "dout must be (B, T, C) matching idx " + shape_str(idx.shape) + ", got " + shape_str(dout.shape));
    const int C = dout.shape[2];
    need(dwte.ndim() == 2 && dwte.shape[1] == C && dwpe.ndim() == 2 && dwpe.shape[1] == C,
         "dwte and dwpe must be (V, C) and (maxT, C)");
    need(T <= dwpe.shape[0],
         "T must be <= dwpe rows (block_size " + std::to_string(dwpe.shape[0]) + "), got " + std::to_string(T));
    const int V = dwte.shape[0];
    check_ids(idx, V, "idx");
    Ctx c = context({&dwte, &dwpe, &dout, &idx}, stream);
    (void)c;  // used by the CUDA branch only
    py::gil_scoped_release nogil;
    TYPED(dout, {
#ifdef FASTGPT_WITH_CUDA
      if (c.cuda) return cuda::encoder_backward(dwte.f(), dwpe.f(), dout.as<S>(), idx.i(), B, T, C, V, c.stream);
#endif
      cpu::encoder_backward(dwte.f(), dwpe.f(), dout.as<S>(), idx.i(), B, T, C);
    });
  });
  m.def("layernorm_forward", [](H out_, H mean_, H rstd_, H x_, H w_, H b_, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), mean = view_of(mean_, "mean", 'f'), rstd = view_of(rstd_, "rstd", 'f'),
         x = view_of(x_, "x", 'a'), w = view_of(w_, "weight", 'a'), b = view_of(b_, "bias", 'a');
    same_dtype({{&x, "x"}, {&w, "weight"}, {&b, "bias"}, {&out, "out"}});
    need(w.ndim() == 1 && b.shape == w.shape,
         "weight and bias must be 1-D of the same length, got " + shape_str(w.shape) + " and " + shape_str(b.shape));
    const int C = w.shape[0];
    const int64_t N = rows_of(x, C, "x");
    same_shape(out, x, "out", "x");
    need(mean.size() == N && rstd.size() == N, "mean and rstd must hold one value per row (" + std::to_string(N) + ")");
    Ctx c = context({&out, &mean, &rstd, &x, &w, &b}, stream);
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, layernorm_forward<S>, out.as<S>(), mean.f(), rstd.f(), x.as<S>(), w.as<S>(),
                              b.as<S>(), N, C));
  });
  m.def("residual_layernorm_forward", [](H res_, H out_, H mean_, H rstd_, H a_, H b_, H w_, H bias_,
                                         uintptr_t stream) {
    View res = view_of(res_, "res", 'a'), out = view_of(out_, "out", 'a'), mean = view_of(mean_, "mean", 'f'),
         rstd = view_of(rstd_, "rstd", 'f'), a = view_of(a_, "a", 'a'), b = view_of(b_, "b", 'a'),
         w = view_of(w_, "weight", 'a'), bias = view_of(bias_, "bias", 'a');
    same_dtype({{&a, "a"}, {&b, "b"}, {&w, "weight"}, {&bias, "bias"}, {&res, "res"}, {&out, "out"}});
    need(w.ndim() == 1 && bias.shape == w.shape,
         "weight and bias must be 1-D of the same length, got " + shape_str(w.shape) + " and " +
             shape_str(bias.shape));
    const int C = w.shape[0];
    const int64_t N = rows_of(a, C, "a");
    same_shape(b, a, "b", "a");
    same_shape(res, a, "res", "a");
    same_shape(out, a, "out", "a");
    need(mean.size() == N && rstd.size() == N, "mean and rstd must hold one value per row (" + std::to_string(N) + ")");
    Ctx c = context({&res, &out, &mean, &rstd, &a, &b, &w, &bias}, stream);
    py::gil_scoped_release nogil;
    TYPED(a, FASTGPT_DISPATCH(c, residual_layernorm_forward<S>, res.as<S>(), out.as<S>(), mean.f(), rstd.f(),
                              a.as<S>(), b.as<S>(), w.as<S>(), bias.as<S>(), N, C));
  });
  m.def("layernorm_backward", [](H dx_, H dw_, H db_, H dout_, H x_, H w_, H mean_, H rstd_,
                                 std::optional<H> dx_sum_, uintptr_t stream) {
    View dx = view_of(dx_, "dx", 'a'), dw = view_of(dw_, "dweight", 'f'), db = view_of(db_, "dbias", 'f'),
         dout = view_of(dout_, "dout", 'a'), x = view_of(x_, "x", 'a'), w = view_of(w_, "weight", 'a'),
         mean = view_of(mean_, "mean", 'f'), rstd = view_of(rstd_, "rstd", 'f');
    View dx_sum = dx_sum_ ? view_of(*dx_sum_, "dx_sum", 'f') : db;
    same_dtype({{&x, "x"}, {&w, "weight"}, {&dout, "dout"}, {&dx, "dx"}});
    need(w.ndim() == 1, "weight must be 1-D, got " + shape_str(w.shape));
    const int C = w.shape[0];
    const int64_t N = rows_of(x, C, "x");
    same_shape(dout, x, "dout", "x");
    same_shape(dx, x, "dx", "x");
    shape_is(dw, {C}, "dweight");
    shape_is(db, {C}, "dbias");
    shape_is(dx_sum, {C}, "dx_sum");
    need(mean.size() == N && rstd.size() == N, "mean and rstd must hold one value per row (" + std::to_string(N) + ")");
    Ctx c = context({&dx, &dw, &db, &dout, &x, &w, &mean, &rstd, &dx_sum}, stream);
    float* sum = dx_sum_ ? dx_sum.f() : nullptr;
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, layernorm_backward<S>, dx.as<S>(), dw.f(), db.f(), dout.as<S>(), x.as<S>(),
                              w.as<S>(), mean.f(), rstd.f(), N, C, sum));
  });
  m.def("matmul_forward", [](H out_, H x_, H w_, std::optional<H> bias_, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), x = view_of(x_, "x", 'a'), w = view_of(w_, "weight", 'a');
    View bias = bias_ ? view_of(*bias_, "bias", 'a') : x;
    same_dtype({{&x, "x"}, {&w, "weight"}, {&bias, "bias"}, {&out, "out"}});
    const auto [N, C, OC] = matmul_dims(x, w, bias_ ? &bias : nullptr);
    need(rows_of(out, OC, "out") == N, "out must have as many rows as x");
    Ctx c = context({&out, &x, &w, &bias}, stream);
    const bool has_bias = bool(bias_);
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, matmul_forward<S>, out.as<S>(), x.as<S>(), w.as<S>(),
                              has_bias ? bias.as<S>() : nullptr, N, C, OC));
  });
  m.def("matmul_backward", [](H dx_, H dw_, std::optional<H> db_, H dout_, H x_, H w_, uintptr_t stream) {
    View dx = view_of(dx_, "dx", 'a'), dw = view_of(dw_, "dweight", 'f'), dout = view_of(dout_, "dout", 'a'),
         x = view_of(x_, "x", 'a'), w = view_of(w_, "weight", 'a');
    same_dtype({{&x, "x"}, {&w, "weight"}, {&dout, "dout"}, {&dx, "dx"}});
    View db = db_ ? view_of(*db_, "dbias", 'f') : x;
    const MatmulDims d = matmul_dims(x, w, nullptr);
    const auto [N, C, OC] = d;
    check_matmul_grads(d, dout, dx, "dx", x, dw, w, db_ ? &db : nullptr);
    Ctx c = context({&dx, &dw, &db, &dout, &x, &w}, stream);
    float* dbp = db_ ? db.f() : nullptr;
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, matmul_backward<S>, dx.as<S>(), dw.f(), dbp, dout.as<S>(), x.as<S>(), w.as<S>(), N,
                              C, OC));
  });
  m.def("matmul_forward_gelu", [](H out_, H pre_, H x_, H w_, std::optional<H> bias_, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), pre = view_of(pre_, "pre", 'a'), x = view_of(x_, "x", 'a'),
         w = view_of(w_, "weight", 'a');
    View bias = bias_ ? view_of(*bias_, "bias", 'a') : x;
    same_dtype({{&x, "x"}, {&w, "weight"}, {&bias, "bias"}, {&out, "out"}, {&pre, "pre"}});
    const auto [N, C, OC] = matmul_dims(x, w, bias_ ? &bias : nullptr);
    need(rows_of(out, OC, "out") == N, "out must have as many rows as x");
    same_shape(pre, out, "pre", "out");
    Ctx c = context({&out, &pre, &x, &w, &bias}, stream);
    const bool has_bias = bool(bias_);
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, matmul_forward_gelu<S>, out.as<S>(), pre.as<S>(), x.as<S>(), w.as<S>(),
                              has_bias ? bias.as<S>() : nullptr, N, C, OC));
  });
  m.def("matmul_backward_dgelu", [](H dpre_, H dw_, std::optional<H> db_, H dout_, H x_, H w_, H pre_,
                                    uintptr_t stream) {
    View dpre = view_of(dpre_, "dpre", 'a'), dw = view_of(dw_, "dweight", 'f'), dout = view_of(dout_, "dout", 'a'),
         x = view_of(x_, "x", 'a'), w = view_of(w_, "weight", 'a'), pre = view_of(pre_, "pre", 'a');
    same_dtype({{&x, "x"}, {&w, "weight"}, {&dout, "dout"}, {&pre, "pre"}, {&dpre, "dpre"}});
    View db = db_ ? view_of(*db_, "dbias", 'f') : x;
    const MatmulDims d = matmul_dims(x, w, nullptr);
    const auto [N, C, OC] = d;
    same_shape(pre, x, "pre", "x");
    check_matmul_grads(d, dout, dpre, "dpre", x, dw, w, db_ ? &db : nullptr);
    Ctx c = context({&dpre, &dw, &db, &dout, &x, &w, &pre}, stream);
    float* dbp = db_ ? db.f() : nullptr;
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, matmul_backward_dgelu<S>, dpre.as<S>(), dw.f(), dbp, dout.as<S>(), x.as<S>(),
                              w.as<S>(), pre.as<S>(), N, C, OC));
  });
  m.def("gelu_forward", [](H out_, H x_, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), x = view_of(x_, "x", 'a');
    same_shape(out, x, "out", "x");
    same_dtype({{&x, "x"}, {&out, "out"}});
    Ctx c = context({&out, &x}, stream);
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, gelu_forward<S>, out.as<S>(), x.as<S>(), x.size()));
  });
  m.def("gelu_backward", [](H dx_, H dout_, H x_, uintptr_t stream) {
    View dx = view_of(dx_, "dx", 'a'), dout = view_of(dout_, "dout", 'a'), x = view_of(x_, "x", 'a');
    same_shape(dout, x, "dout", "x");
    same_shape(dx, x, "dx", "x");
    same_dtype({{&x, "x"}, {&dout, "dout"}, {&dx, "dx"}});
    Ctx c = context({&dx, &dout, &x}, stream);
    py::gil_scoped_release nogil;
    TYPED(x, FASTGPT_DISPATCH(c, gelu_backward<S>, dx.as<S>(), x.as<S>(), dout.as<S>(), x.size()));
  });
  auto attn_dims = [](const View& qkv, int n_head) {
    need(qkv.ndim() == 3 && qkv.shape[2] % 3 == 0 && qkv.shape[2] >= 3,
         "qkv must be (B, T, 3C) with C >= 1, got " + shape_str(qkv.shape));
    need(qkv.size() < (int64_t(1) << 31), "qkv must hold < 2**31 elements, got shape " + shape_str(qkv.shape));
    const int C = qkv.shape[2] / 3;
    need(n_head >= 1 && C % n_head == 0, "n_head must divide C=" + std::to_string(C) + ", got " +
                                             std::to_string(n_head));
    return std::make_tuple((int)qkv.shape[0], (int)qkv.shape[1], C);
  };
  m.def("attention_forward", [attn_dims](H out_, H lse_, H qkv_, int n_head, bool causal, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), lse = view_of(lse_, "lse", 'f'), qkv = view_of(qkv_, "qkv", 'a');
    same_dtype({{&qkv, "qkv"}, {&out, "out"}});
    auto [B, T, C] = attn_dims(qkv, n_head);
    shape_is(out, {B, T, C}, "out");
    shape_is(lse, {B, n_head, T}, "lse");
    Ctx c = context({&out, &lse, &qkv}, stream);
    py::gil_scoped_release nogil;
    TYPED(qkv, FASTGPT_DISPATCH(c, attention_forward<S>, out.as<S>(), lse.f(), qkv.as<S>(), B, T, C, n_head, causal));
  });
  m.def("attention_backward", [attn_dims](H dqkv_, H dout_, H qkv_, H out_, H lse_, int n_head, bool causal,
                                          uintptr_t stream, std::optional<H> dbias_) {
    View dqkv = view_of(dqkv_, "dqkv", 'a'), dout = view_of(dout_, "dout", 'a'), qkv = view_of(qkv_, "qkv", 'a'),
         out = view_of(out_, "out", 'a'), lse = view_of(lse_, "lse", 'f');
    View dbias = dbias_ ? view_of(*dbias_, "dbias", 'f') : lse;
    same_dtype({{&qkv, "qkv"}, {&dout, "dout"}, {&out, "out"}, {&dqkv, "dqkv"}});
    auto [B, T, C] = attn_dims(qkv, n_head);
    shape_is(dout, {B, T, C}, "dout");
    same_shape(dout, out, "dout", "out");
    shape_is(lse, {B, n_head, T}, "lse");
    same_shape(dqkv, qkv, "dqkv", "qkv");
    if (dbias_) shape_is(dbias, {3 * C}, "dbias");
    Ctx c = context({&dqkv, &dout, &qkv, &out, &lse, &dbias}, stream);
    float* dbp = dbias_ ? dbias.f() : nullptr;
    py::gil_scoped_release nogil;
    TYPED(qkv, FASTGPT_DISPATCH(c, attention_backward<S>, dqkv.as<S>(), dout.as<S>(), qkv.as<S>(), out.as<S>(),
                                lse.f(), B, T, C, n_head, causal, dbp));
  });
  // Attention against a KV cache (generation): caches (B, NH, Tmax, hs), new positions [pos, pos + T) of qkv.
  auto decode_dims = [](const View& kc, const View& vc, const View& qkv, int pos) {
    need(kc.ndim() == 4, "k_cache must be 4-D (B, n_head, Tmax, hs), got shape " + shape_str(kc.shape));
    same_shape(kc, vc, "k_cache", "v_cache");
    need(kc.size() > 0, "k_cache must be non-empty (B, n_head, Tmax, hs), got shape " + shape_str(kc.shape));
    const int B = kc.shape[0], NH = kc.shape[1], Tmax = kc.shape[2], hs = kc.shape[3];
    need(qkv.ndim() == 3 && qkv.shape[0] == B && qkv.shape[2] == 3 * (int64_t)NH * hs,
         "qkv must be (B, T, 3C) with B=" + std::to_string(B) + " and C = n_head * hs = " + std::to_string(NH * hs) +
             " (from the caches), got shape " + shape_str(qkv.shape));
    const int T = qkv.shape[1];
    const int64_t end = (int64_t)pos + T;  // no int overflow for pos near 2**31
    need(T >= 1 && pos >= 0 && end <= Tmax, "positions [pos, pos + T) = [" + std::to_string(pos) + ", " +
                                                std::to_string(end) + ") must lie in the cache's [0, " +
                                                std::to_string(Tmax) + ")");
    return std::make_tuple(B, T, Tmax, NH * hs, NH);
  };
  m.def("attention_decode_append", [decode_dims](H kc_, H vc_, H qkv_, int pos, uintptr_t stream) {
    View kc = view_of(kc_, "k_cache", 'a'), vc = view_of(vc_, "v_cache", 'a'), qkv = view_of(qkv_, "qkv", 'a');
    same_dtype({{&qkv, "qkv"}, {&kc, "k_cache"}, {&vc, "v_cache"}});
    auto [B, T, Tmax, C, NH] = decode_dims(kc, vc, qkv, pos);
    Ctx c = context({&kc, &vc, &qkv}, stream);
    py::gil_scoped_release nogil;
    TYPED(qkv, FASTGPT_DISPATCH(c, attention_decode_append<S>, kc.as<S>(), vc.as<S>(), qkv.as<S>(), B, T, pos, Tmax,
                                C, NH));
  });
  m.def("attention_decode_forward", [decode_dims](H out_, H qkv_, H kc_, H vc_, int pos, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), qkv = view_of(qkv_, "qkv", 'a'), kc = view_of(kc_, "k_cache", 'a'),
         vc = view_of(vc_, "v_cache", 'a');
    same_dtype({{&qkv, "qkv"}, {&kc, "k_cache"}, {&vc, "v_cache"}, {&out, "out"}});
    auto [B, T, Tmax, C, NH] = decode_dims(kc, vc, qkv, pos);
    shape_is(out, {B, T, C}, "out");
    Ctx c = context({&out, &qkv, &kc, &vc}, stream);
    py::gil_scoped_release nogil;
    TYPED(qkv, FASTGPT_DISPATCH(c, attention_decode_forward<S>, out.as<S>(), qkv.as<S>(), kc.as<S>(), vc.as<S>(), B, T,
                                pos, Tmax, C, NH));
  });
  // Flash attention on separate q, k, v: layout "bhtd" (B, H, T, d) or "bthd" (B, T, H, d), all four tensors the
  // same shape and dtype; lse (B, H, T) float32.
  struct Flash {
    cpu::AttentionShape shape;
    cpu::HeadStrides strides;
  };
  auto flash_args = [](const std::vector<std::pair<const View*, const char*>>& ts, const View& lse,
                       const std::string& layout, bool causal) {
    need(layout == "bhtd" || layout == "bthd", "layout must be 'bhtd' or 'bthd', got '" + layout + "'");
    const View& q = *ts[0].first;
    const std::string dims = layout == "bhtd" ? "(B, H, T, d)" : "(B, T, H, d)";
    need(q.ndim() == 4 && q.size() > 0, "q must be a non-empty 4-D " + dims + " array, got " + shape_str(q.shape));
    for (auto& [t, name] : ts) {
      same_shape(*t, q, name, "q");
      need(t->dtype == q.dtype, std::string(name) + " must have the same dtype as q");
    }
    const bool bhtd = layout == "bhtd";
    const int64_t B = q.shape[0], H = q.shape[bhtd ? 1 : 2], T = q.shape[bhtd ? 2 : 1], d = q.shape[3];
    shape_is(lse, {B, H, T}, "lse");
    need(lse.dtype == 'f', "lse must be float32");
    need(B * H * T * d < (int64_t(1) << 31) && T < (1 << 30), "attention tensors must hold < 2**31 elements");
    // The CUDA kernels' own limits (head dim, alignment, T) are checked by cuda::flash_attention_*.
    Flash f;
    f.shape = {(int)B, (int)H, (int)T, (int)d, causal};
    f.strides = bhtd ? cpu::HeadStrides{H * T * d, T * d, d} : cpu::HeadStrides{T * H * d, d, H * d};
    return f;
  };
#ifdef FASTGPT_WITH_CUDA
  auto dtype_of = [](const View& v) {
    return v.dtype == 'b' ? cuda::DType::bf16 : v.dtype == 'h' ? cuda::DType::f16 : cuda::DType::f32;
  };
#endif
  // How float32 multiplies on a GPU (cuda::F32Math); checked on every device, used by CUDA.
  auto f32_math = [](const std::string& name) {
    need(name == "tf32x3" || name == "tf32" || name == "simt",
         "fp32_math must be 'tf32x3', 'tf32' or 'simt', got '" + name + "'");
#ifdef FASTGPT_WITH_CUDA
    return name == "tf32x3" ? cuda::F32Math::tf32x3 : name == "tf32" ? cuda::F32Math::tf32 : cuda::F32Math::simt;
#else
    return 0;
#endif
  };
  m.def("flash_attention_forward", [flash_args, f32_math IF_CUDA(, dtype_of)](H out_, H lse_, H q_, H k_, H v_,
                                                                              const std::string& layout, bool causal,
                                                                              const std::string& fp32_math,
                                                                              uintptr_t stream) {
    const auto math = f32_math(fp32_math);
    View out = view_of(out_, "out", 'a'), lse = view_of(lse_, "lse", 'f'), q = view_of(q_, "q", 'a'),
         k = view_of(k_, "k", 'a'), v = view_of(v_, "v", 'a');
    Flash f = flash_args({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}}, lse, layout, causal);
    Ctx c = context({&out, &lse, &q, &k, &v}, stream);
    need(c.cuda || q.dtype == 'f', "q, k, v must be float32 on the CPU (fastgpt.ops widens 16-bit inputs)");
    py::gil_scoped_release nogil;
#ifdef FASTGPT_WITH_CUDA
    if (c.cuda)
      return cuda::flash_attention_forward(out.data, f.strides, lse.f(), q.data, k.data, v.data, f.strides, f.shape,
                                           dtype_of(q), c.stream, math);
#endif
    (void)math;  // the CPU computes in fp32
    cpu::flash_attention_forward(out.f(), f.strides, lse.f(), q.f(), k.f(), v.f(), f.strides, f.shape);
  });
  m.def("flash_attention_backward", [flash_args, f32_math IF_CUDA(, dtype_of)](H dq_, H dk_, H dv_, H dout_, H q_,
                                                                               H k_, H v_, H out_, H lse_,
                                                                               const std::string& layout, bool causal,
                                                                               bool deterministic,
                                                                               const std::string& fp32_math,
                                                                               uintptr_t stream) {
    const auto math = f32_math(fp32_math);
    View dq = view_of(dq_, "dq", 'a'), dk = view_of(dk_, "dk", 'a'), dv = view_of(dv_, "dv", 'a'),
         dout = view_of(dout_, "dout", 'a'), q = view_of(q_, "q", 'a'), k = view_of(k_, "k", 'a'),
         v = view_of(v_, "v", 'a'), out = view_of(out_, "out", 'a'), lse = view_of(lse_, "lse", 'f');
    Flash f = flash_args({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}, {&dq, "dq"}, {&dk, "dk"},
                          {&dv, "dv"}},
                         lse, layout, causal);
    Ctx c = context({&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse}, stream);
    need(c.cuda || q.dtype == 'f', "q, k, v must be float32 on the CPU (fastgpt.ops widens 16-bit inputs)");
    py::gil_scoped_release nogil;
#ifdef FASTGPT_WITH_CUDA
    if (c.cuda) {
      cuda::flash_attention_backward(dq.data, dk.data, dv.data, f.strides, dout.data, out.data, f.strides, q.data,
                                     k.data, v.data, lse.f(), f.shape, dtype_of(q), deterministic, c.stream, math);
      return;
    }
#endif
    (void)deterministic, (void)math;  // the CPU kernel is always deterministic, and computes in fp32
    cpu::flash_attention_backward(dq.f(), dk.f(), dv.f(), f.strides, dout.f(), out.f(), f.strides, q.f(), k.f(),
                                  v.f(), lse.f(), f.shape);
  });
  // matmul_backward's 16-bit bias gradient on the GPU: cuBLASLt's epilogue or the column-sum kernel (cuda/ops.h).
  m.def("matmul_bias_grad_epilogue",
        FASTGPT_CUDA_SWITCH(bias_grad_epilogue, set_bias_grad_epilogue,
                            "the bias-gradient epilogue chooses between CUDA paths"),
        py::arg("on") = py::none());
  // How the GPU's products pick cuBLASLt's algorithm: its heuristic's first, or the fastest of its candidates timed
  // at each problem's first run (cuda/ops.h), and the decisions made so far.
  m.def("matmul_autotune",
        FASTGPT_CUDA_SWITCH(matmul_autotune, set_matmul_autotune,
                            "matmul autotune chooses between cuBLASLt's algorithms"),
        py::arg("on") = py::none());
  m.def("matmul_autotune_report", []() {
    py::list out;
#ifdef FASTGPT_WITH_CUDA
    for (const cuda::MatmulTuneRecord& r : cuda::matmul_autotune_report()) {
      py::dict d;
      d["M"] = r.M, d["N"] = r.N, d["K"] = r.K, d["trans_a"] = r.trans_a, d["trans_b"] = r.trans_b;
      d["batch"] = r.batch, d["epilogue"] = r.epilogue, d["ab_type"] = r.ab_type, d["c_type"] = r.c_type;
      d["compute"] = r.compute, d["candidates"] = r.candidates, d["chosen"] = r.chosen, d["reps"] = r.reps;
      d["ms"] = r.ms, d["skipped"] = r.skipped;
      out.append(d);
    }
#else
    throw std::runtime_error("matmul autotune chooses between cuBLASLt's algorithms; this build of fastgpt has no "
                             "CUDA");
#endif
    return out;
  });
  // The LayerNorm kernels on the GPU: one read of each row, or the older kernels that read it again (cuda/ops.h).
  m.def("layernorm_one_pass",
        FASTGPT_CUDA_SWITCH(layernorm_one_pass, set_layernorm_one_pass,
                            "the one-pass LayerNorm chooses between CUDA paths"),
        py::arg("on") = py::none());
  // The CUDA tensor-core kernels' tile choice (cuda/ops.h FlashTiles): a (fwd, dkdv, dq) tuple of option indices.
  m.def("flash_attention_tiles", [](std::optional<std::tuple<int, int, int>> tiles) {
#ifdef FASTGPT_WITH_CUDA
    cuda::FlashTiles t = cuda::flash_tiles();
    if (tiles) t = cuda::set_flash_tiles({std::get<0>(*tiles), std::get<1>(*tiles), std::get<2>(*tiles)});
    return std::make_tuple(t.fwd, t.dkdv, t.dq);
#else
    (void)tiles;
    throw std::runtime_error("flash attention tiles choose between CUDA kernels; this build of fastgpt has no CUDA");
    return std::make_tuple(0, 0, 0);
#endif
  }, py::arg("tiles") = py::none());
  m.def("flash_attention_tile_options", []() {
#ifdef FASTGPT_WITH_CUDA
    const cuda::FlashTileOptions o = cuda::flash_tile_options();
    return std::make_tuple(o.fwd, o.dkdv, o.dq);
#else
    throw std::runtime_error("flash attention tiles choose between CUDA kernels; this build of fastgpt has no CUDA");
    return std::make_tuple(std::vector<std::string>{}, std::vector<std::string>{}, std::vector<std::string>{});
#endif
  });
  m.def("cross_entropy_forward", [](H losses_, H lse_, H logits_, H targets_, uintptr_t stream) {
    View losses = view_of(losses_, "losses", 'f'), lse = view_of(lse_, "lse", 'f'),
         logits = view_of(logits_, "logits", 'a'), targets = view_of(targets_, "targets", 'i');
    need(logits.ndim() >= 1 && logits.shape.back() >= 1, "logits must be (..., V) with V >= 1");
    const int V = logits.shape.back();
    const int64_t N = rows_of(logits, V, "logits");
    check_targets(targets, logits, N);
    need(losses.size() == N && lse.size() == N, "losses and lse must hold one value per row");
    check_ids(targets, V, "targets");
    Ctx c = context({&losses, &lse, &logits, &targets}, stream);
    py::gil_scoped_release nogil;
    TYPED(logits, FASTGPT_DISPATCH(c, cross_entropy_forward<S>, losses.f(), lse.f(), logits.as<S>(), targets.i(), N, V));
  });
  m.def("cross_entropy_backward", [](H dlogits_, H logits_, H targets_, H lse_, float dloss, uintptr_t stream) {
    View dlogits = view_of(dlogits_, "dlogits", 'a'), logits = view_of(logits_, "logits", 'a'),
         targets = view_of(targets_, "targets", 'i'), lse = view_of(lse_, "lse", 'f');
    same_dtype({{&logits, "logits"}, {&dlogits, "dlogits"}});
    need(logits.ndim() >= 1 && logits.shape.back() >= 1, "logits must be (..., V) with V >= 1");
    const int V = logits.shape.back();
    const int64_t N = rows_of(logits, V, "logits");
    check_targets(targets, logits, N);
    need(lse.size() == N, "lse must hold one value per row of logits");
    same_shape(dlogits, logits, "dlogits", "logits");
    check_ids(targets, V, "targets");
    Ctx c = context({&dlogits, &logits, &targets, &lse}, stream);
    py::gil_scoped_release nogil;
    TYPED(logits, FASTGPT_DISPATCH(c, cross_entropy_backward<S>, dlogits.as<S>(), logits.as<S>(), lse.f(), targets.i(),
                                   dloss, (const float*)nullptr, N, V));
  });
  m.def("cross_entropy_forward_backward", [](H losses_, H dlogits_, H logits_, H targets_, float dloss,
                                             uintptr_t stream) {
    View losses = view_of(losses_, "losses", 'f'), dlogits = view_of(dlogits_, "dlogits", 'a'),
         logits = view_of(logits_, "logits", 'a'), targets = view_of(targets_, "targets", 'i');
    same_dtype({{&logits, "logits"}, {&dlogits, "dlogits"}});
    need(logits.ndim() >= 1 && logits.shape.back() >= 1, "logits must be (..., V) with V >= 1");
    const int V = logits.shape.back();
    const int64_t N = rows_of(logits, V, "logits");
    check_targets(targets, logits, N);
    need(losses.size() == N, "losses must hold one value per row of logits");
    same_shape(dlogits, logits, "dlogits", "logits");
    check_ids(targets, V, "targets");
    Ctx c = context({&losses, &dlogits, &logits, &targets}, stream);
    py::gil_scoped_release nogil;
    TYPED(logits, FASTGPT_DISPATCH(c, cross_entropy_forward_backward<S>, losses.f(), dlogits.as<S>(), logits.as<S>(),
                                   targets.i(), dloss, (const float*)nullptr, N, V));
  });
  // Conversions: float32 -> bf16/fp16 (to nearest, or stochastically keyed by seed/step/index as the optimizer
  // writes bf16 weights), and back.
  m.def("narrow", [](H out_, H in_, bool stochastic, uint64_t seed, uint64_t step, uintptr_t stream) {
    View out = view_of(out_, "out", 'a'), in = view_of(in_, "x", 'f');
    need(out.dtype == 'b' || out.dtype == 'h', "out must be bfloat16 or float16");
    same_shape(out, in, "out", "x");
    need(!stochastic || out.dtype == 'b', "stochastic rounding is for bfloat16 only");
    Ctx c = context({&out, &in}, stream);
    const RoundKey key{stochastic, seed, step, 0};
    py::gil_scoped_release nogil;
    if (out.dtype == 'b')
      FASTGPT_DISPATCH(c, narrow<bf16>, out.as<bf16>(), in.f(), in.size(), key);
    else
      FASTGPT_DISPATCH(c, narrow<f16>, out.as<f16>(), in.f(), in.size(), key);
  });
  m.def("widen", [](H out_, H in_, uintptr_t stream) {
    View out = view_of(out_, "out", 'f'), in = view_of(in_, "x", 'a');
    same_shape(out, in, "out", "x");
    Ctx c = context({&out, &in}, stream);
    py::gil_scoped_release nogil;
    if (in.dtype == 'b')
      FASTGPT_DISPATCH(c, widen<bf16>, out.f(), in.as<bf16>(), in.size());
    else if (in.dtype == 'h')
      FASTGPT_DISPATCH(c, widen<f16>, out.f(), in.as<f16>(), in.size());
    else
      throw std::invalid_argument("x must be bfloat16 or float16");
  });
  m.def("adamw_update", [](H param_, H grad_, H m_, H v_, float lr, float beta1, float beta2, float eps,
                           float weight_decay, int64_t step, uintptr_t stream) {
    View param = view_of(param_, "param", 'f'), grad = view_of(grad_, "grad", 'f'), m = view_of(m_, "exp_avg", 'f'),
         v = view_of(v_, "exp_avg_sq", 'f');
    same_shape(param, grad, "param", "grad");
    same_shape(param, m, "param", "exp_avg");
    same_shape(param, v, "param", "exp_avg_sq");
    need(step >= 1, "step must be >= 1 (the count after this update), got " + std::to_string(step));
    const cpu::AdamWHyper h = cpu::adamw_hyper(lr, beta1, beta2, eps, weight_decay, step);
    Ctx c = context({&param, &grad, &m, &v}, stream);
    py::gil_scoped_release nogil;
    FASTGPT_DISPATCH(c, adamw_update, param.f(), grad.f(), m.f(), v.f(), param.size(), h);
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastgpt's compiled core: the GPT-2 engine, AdamW, the CPU ops and the CUDA slot";
  m.attr("built_with_cuda") = cuda::built_with_cuda();
  m.def("cuda_device_count", &cuda::device_count);
  m.def("cuda_device_name", &cuda::device_name);
  m.def("cuda_smoke_test", &cuda::smoke_test);
  m.def("cuda_set_device", &cuda::set_device, py::arg("device"));
  m.def("cuda_pool_reserved", &cuda::pool_reserved, py::arg("device") = 0);
#ifdef FASTGPT_CUDA_ARCHS
  m.attr("cuda_architectures") = FASTGPT_CUDA_ARCHS;  // e.g. "75-real 80-real 90": what the build compiled for
#else
  m.attr("cuda_architectures") = "";
#endif
  m.def("cuda_precision_unsupported", &cuda::precision_unsupported, py::arg("major"), py::arg("minor"),
        py::arg("precision"));

  py::class_<GPT>(m, "GPT")
      .def(py::init([](int block_size, int vocab_size, int n_layer, int n_head, int n_embd, uint64_t seed,
                       const std::string& device, const std::string& precision, std::shared_ptr<Comm> comm,
                       bool fused, std::optional<int> recompute) {
             GPTConfig c{block_size, vocab_size, n_layer, n_head, n_embd};
             const Precision p = parse_precision(precision);
             auto be = backend_for(device);
             if (comm && comm->name() == "mpi") need(!be->is_cuda(), "the MPI communicator serves CPU models only");
             if (comm && comm->name() == "nccl") need(be->is_cuda(), "the NCCL communicator serves CUDA models only");
             py::gil_scoped_release nogil;  // the broadcast of the initial weights is a collective: other threads may run
             auto* g = new GPT(c, seed, std::move(be), p, std::move(comm));
             std::unique_ptr<GPT> owned(g);
             g->set_fused(fused);
             // 0: keeping every activation is the fastest (model.py's docstring has the measurements)
             g->set_recompute(recompute.value_or(0));
             return owned.release();
           }),
           py::arg("block_size"), py::arg("vocab_size"), py::arg("n_layer"), py::arg("n_head"), py::arg("n_embd"),
           py::arg("seed"), py::arg("device") = "cpu", py::arg("precision") = "fp32", py::arg("comm") = nullptr,
           py::arg("fused") = true, py::arg("recompute") = py::none())
      .def_property_readonly("fused", &GPT::fused)
      .def_property_readonly("recompute", &GPT::recompute)
      .def_property("classifier_rows", &GPT::classifier_rows, &GPT::set_classifier_rows)
      .def_property_readonly("rank", &GPT::rank)
      .def_property_readonly("world_size", &GPT::world_size)
      .def_property_readonly("grad_sync_count", &GPT::grad_sync_count)
      .def_property_readonly("zero_stage", &GPT::zero_stage)
      .def_property_readonly("shard", [](GPT& g) { return py::make_tuple(g.shard_begin(), g.shard_size()); })
      .def("sync_grads", [](GPT& g) {
        py::gil_scoped_release nogil;
        g.sync_grads();
      })
      .def_property_readonly("device", [](GPT& g) { return g.backend().name(); })
      .def_property_readonly("precision", [](GPT& g) { return std::string(precision_name(g.precision())); })
      // The 16-bit weights the kernels read, widened to float32 (a copy; the masters themselves in fp32/tf32).
      .def("compute_params",
           [](py::object self) {
             GPT& g = self.cast<GPT&>();
             FArray out = host_floats(g.backend(), g.compute_params(), g.storage(), {(py::ssize_t)g.num_parameters()},
                                      self);
             // fp32 on the CPU is a view of the masters: copy it, so the result cannot write to them.
             return g.storage() == DType::f32 && !g.backend().is_cuda() ? FArray(out.attr("copy")()) : out;
           })
      .def("load_compute_params",
           [](GPT& g, const FArray& flat) {
             need(g.storage() != DType::f32, "compute weights are the fp32 masters in fp32/tf32: load the params");
             need(flat.ndim() == 1 && flat.size() == g.num_parameters(),
                  "compute params must be a flat float32 array of " + std::to_string(g.num_parameters()) + " values");
             py::gil_scoped_release nogil;
             g.load_compute_params(flat.data());
           })
      .def_property_readonly("seed", &GPT::seed)
      .def("refresh_compute_params", [](GPT& g) {
        py::gil_scoped_release nogil;
        g.refresh_compute_params();
      })
      .def("memory",
           [](GPT& g) {
             py::dict d;
             d["parameters"] = g.param_bytes();
             d["gradients"] = g.grad_bytes();
             d["activations"] = g.activation_bytes();
             d["kv_cache"] = g.cache_bytes();
             d["total"] = g.backend().bytes_in_use();
             d["scratch"] = g.backend().scratch_bytes();
             return d;
           })
      // fp16 loss scaling (GradScaler's rules): the state (read from the device: waits for it), and its settings.
      .def_property_readonly("loss_scale", [](GPT& g) {
        py::gil_scoped_release nogil;
        return (double)g.loss_scale().scale;
      })
      .def_property_readonly("loss_scale_growth_tracker", [](GPT& g) {
        py::gil_scoped_release nogil;
        return g.loss_scale().growth_tracker;
      })
      .def("set_loss_scaler",
           [](GPT& g, double scale, double growth_factor, double backoff_factor, int64_t growth_interval,
              int64_t growth_tracker) {
             need(g.loss_scaling(), "loss scaling is used by precision='fp16' only");
             auto f32 = [](double x) { return std::isfinite(x) && std::isfinite((float)x); };  // kept as float32
             need(f32(scale) && scale > 0, "init_scale must be a finite float32 number > 0");
             need(f32(growth_factor) && growth_factor > 1, "growth_factor must be a finite float32 number > 1");
             need(backoff_factor > 0 && backoff_factor < 1, "backoff_factor must be in (0, 1)");
             need(growth_interval >= 1, "growth_interval must be >= 1");
             need(growth_tracker >= 0 && growth_tracker < growth_interval, "growth_tracker must be in [0, growth_interval)");
             LossScale s;
             s.scale = (float)scale;
             s.growth_factor = (float)growth_factor;
             s.backoff_factor = (float)backoff_factor;
             s.growth_interval = growth_interval;
             s.growth_tracker = growth_tracker;
             py::gil_scoped_release nogil;
             g.set_loss_scale(s);
           },
           py::arg("init_scale"), py::arg("growth_factor"), py::arg("backoff_factor"), py::arg("growth_interval"),
           py::arg("growth_tracker") = 0)
      .def("num_parameters", &GPT::num_parameters)
      .def("named_views",
           [](const GPT& g) {
             py::list out;
             for (const NamedView& v : g.named_views()) out.append(py::make_tuple(v.name, v.shape, v.offset));
             return out;
           })
      // The flat buffers: zero-copy views on the CPU, host copies from a GPU.
      .def_property_readonly("params", [](py::object self) {
        GPT& g = self.cast<GPT&>();
        return host_array(g.backend(), g.params(), {(py::ssize_t)g.num_parameters()}, self);
      })
      .def_property_readonly("grads", [](py::object self) {
        GPT& g = self.cast<GPT&>();
        return host_array(g.backend(), g.grads(), {(py::ssize_t)g.num_parameters()}, self);
      })
      .def("load_params",
           [](GPT& g, const FArray& flat) {
             need(flat.ndim() == 1 && flat.size() == g.num_parameters(),
                  "params must be a flat float32 array of " + std::to_string(g.num_parameters()) + " values");
             py::gil_scoped_release nogil;
             g.backend().upload(g.params(), flat.data(), g.num_parameters() * sizeof(float));
             g.refresh_compute_params();
           })
      .def("forward",
           [](GPT& g, const IArray& idx, std::optional<IArray> targets, bool last_only, bool keep_logits) {
             need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(view_of(idx, "idx", 'i').shape));
             if (targets) same_shape(view_of(idx, "idx", 'i'), view_of(*targets, "targets", 'i'), "idx", "targets");
             const int B = idx.shape(0), T = idx.shape(1);
             const int32_t* tp = targets ? targets->data() : nullptr;
             py::gil_scoped_release nogil;
             return g.forward(idx.data(), tp, B, T, last_only, keep_logits);
           },
           py::arg("idx"), py::arg("targets") = py::none(), py::arg("last_only") = false,
           py::arg("keep_logits") = true)
      .def("forward_backward",
           [](GPT& g, const IArray& idx, const IArray& targets, float grad_scale, bool sync) {
             need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(view_of(idx, "idx", 'i').shape));
             same_shape(view_of(idx, "idx", 'i'), view_of(targets, "targets", 'i'), "idx", "targets");
             need(std::isfinite(grad_scale), "grad_scale must be finite");
             const int B = idx.shape(0), T = idx.shape(1);
             py::gil_scoped_release nogil;
             return g.forward_backward(idx.data(), targets.data(), B, T, grad_scale, sync);
           },
           py::arg("idx"), py::arg("targets"), py::arg("grad_scale") = 1.0f, py::arg("sync") = true)
      .def("decode",
           [](GPT& g, const IArray& idx, int pos) {
             need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(view_of(idx, "idx", 'i').shape));
             const int B = idx.shape(0), T = idx.shape(1);
             py::gil_scoped_release nogil;
             g.decode(idx.data(), B, T, pos);
           },
           py::arg("idx"), py::arg("pos"))
      .def_property_readonly("cache_length", &GPT::cache_length)
      .def("free_cache", &GPT::free_cache)
      .def("logits",
           [](py::object self) {
             GPT& g = self.cast<GPT&>();
             if (!g.logits_valid()) throw std::logic_error("no logits: call forward() (backward() overwrites them)");
             return host_floats(g.backend(), g.logits(), g.storage(), {g.last_B(), g.last_T(), g.config().vocab_size},
                                self);
           })
      .def("backward",
           [](GPT& g, float grad_scale, bool sync) {
             need(std::isfinite(grad_scale), "grad_scale must be finite");
             py::gil_scoped_release nogil;
             g.backward(grad_scale, sync);
           },
           py::arg("grad_scale") = 1.f, py::arg("sync") = true)
      .def("zero_grad", &GPT::zero_grad)
      .def("unscale_grads", [](GPT& g) {
        py::gil_scoped_release nogil;
        return g.unscale_grads();
      })
      .def("clip_grad_norm", [](GPT& g, double max_norm) {
        py::gil_scoped_release nogil;
        return g.clip_grad_norm(max_norm);
      });

  py::class_<AdamW>(m, "AdamW")
      .def(py::init([](GPT& g, float lr, float beta1, float beta2, float eps, float weight_decay, int zero_stage) {
             return new AdamW(g, AdamWConfig{lr, beta1, beta2, eps, weight_decay}, zero_stage);
           }),
           py::keep_alive<1, 2>(), py::arg("model"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
           py::arg("eps"), py::arg("weight_decay"), py::arg("zero_stage") = 0)
      .def_property_readonly("moments_begin", &AdamW::moments_begin)
      .def("step",
           [](AdamW& o, float lr) {
             py::gil_scoped_release nogil;
             return o.step(lr);
           })
      .def("load_state",
           [](AdamW& o, const FArray& m, const FArray& v, int64_t step_count, int64_t skipped_steps) {
             for (const FArray* a : {&m, &v})
               need(a->ndim() == 1 && a->size() == o.size(),
                    "moments must be flat float32 arrays of " + std::to_string(o.size()) + " values (this "
                    "optimizer's part of the parameters), got " + std::to_string(a->size()));
             py::gil_scoped_release nogil;
             o.load_state(m.data(), v.data(), step_count, skipped_steps);
           },
           py::arg("m"), py::arg("v"), py::arg("step_count"), py::arg("skipped_steps"))
      .def_property_readonly("step_count", [](const AdamW& o) {
        py::gil_scoped_release nogil;
        return o.step_count();
      })
      .def_property_readonly("skipped_steps", [](const AdamW& o) {
        py::gil_scoped_release nogil;
        return o.skipped_steps();
      })
      .def_property_readonly("m", [](py::object self) {
        AdamW& o = self.cast<AdamW&>();
        return host_array(o.backend(), o.m(), {(py::ssize_t)o.size()}, self);
      })
      .def_property_readonly("v", [](py::object self) {
        AdamW& o = self.cast<AdamW&>();
        return host_array(o.backend(), o.v(), {(py::ssize_t)o.size()}, self);
      });

  py::class_<TrainStep>(m, "TrainStep")
      .def(py::init<GPT&, AdamW&>(), py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::arg("model"),
           py::arg("opt"))
      .def("run",
           [](TrainStep& t, const IArray& idx, const IArray& targets, float lr, double max_norm, bool graph) {
             need(idx.ndim() == 3,
                  "idx must be 3-D (A, B, T), got shape " + shape_str(view_of(idx, "idx", 'i').shape));
             same_shape(view_of(idx, "idx", 'i'), view_of(targets, "targets", 'i'), "idx", "targets");
             const int A = idx.shape(0), B = idx.shape(1), T = idx.shape(2);
             py::gil_scoped_release nogil;
             t.run(idx.data(), targets.data(), A, B, T, lr, max_norm, graph);
           },
           py::arg("idx"), py::arg("targets"), py::arg("lr"), py::arg("max_norm"), py::arg("graph"))
      .def("stats",
           [](TrainStep& t) {
             StepStats s;
             {
               py::gil_scoped_release nogil;
               s = t.stats();
             }
             return py::make_tuple(s.loss, s.norm, s.applied, s.step_count, s.skipped_steps);
           })
      .def_property_readonly("graph_eligible", &TrainStep::graph_eligible)
      .def_property_readonly("captures", &TrainStep::captures)
      .def_property_readonly("capture_error", &TrainStep::capture_error)
      .def_property_readonly("replays", &TrainStep::replays);

  // Communicators: built by fastgpt.distributed, handed to GPT(comm=...); host collectives for the Python layer.
  m.attr("built_with_nccl") = built_with_nccl();
  m.def("nccl_unique_id", [] { return py::bytes(nccl_unique_id()); });
  py::class_<Comm, std::shared_ptr<Comm>>(m, "Comm")
      .def_static("mpi", [](py::object impl, int rank, int world) -> std::shared_ptr<Comm> {
        need(world >= 1 && rank >= 0 && rank < world, "rank must be in [0, world_size)");
        return std::make_shared<PyComm>(std::move(impl), rank, world);
      })
      .def_static("nccl", [](py::bytes id, int rank, int world, int device) {
        std::string raw = id;
        py::gil_scoped_release nogil;  // ncclCommInitRank waits for every rank
        return make_nccl_comm(raw, rank, world, device);
      })
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("world_size", &Comm::world_size)
      .def_property_readonly("name", &Comm::name)
      // x: float64 NumPy array, summed over ranks in place (the same bits on every rank).
      .def("all_reduce_host", [](Comm& c, py::array_t<double, py::array::c_style> x) {
        double* p = x.mutable_data();
        const int n = (int)x.size();
        py::gil_scoped_release nogil;
        c.all_reduce_host(p, n);
      })
      .def("barrier", [](Comm& c) {
        py::gil_scoped_release nogil;
        c.barrier();
      })
      .def("abort", &Comm::abort);

  py::module_ ops = m.def_submodule("ops", "the kernels on NumPy arrays (CPU) or DLPack capsules (CUDA)");
  bind_ops(ops);
}
