// The one binding file: exposes the engine (GPT, AdamW), the CPU ops and the CUDA slot to Python as fastgpt._C.
// It owns every conversion between NumPy arrays and raw pointers and checks every shape before a kernel sees it,
// so bad input becomes a Python exception here, never a crash below. Arrays handed out (parameters, gradients,
// logits, optimizer moments) are zero-copy views that keep their owner alive.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "cpu/kernels.h"
#include "cuda/runtime.h"
#include "engine/adamw.h"
#include "engine/gpt.h"

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
}  // namespace fastgpt::cuda
#endif

namespace {

void need(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); i++) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Rows x cols view of an array whose last dimension is `cols` (leading dimensions flattened).
int64_t rows_of(const py::array& a, int64_t cols, const char* name) {
  need(a.ndim() >= 1 && a.shape(a.ndim() - 1) == cols,
       std::string(name) + " must have last dimension " + std::to_string(cols) + ", got shape " + shape_str(a));
  return cols == 0 ? 0 : a.size() / cols;
}

void same_shape(const py::array& a, const py::array& b, const char* na, const char* nb) {
  bool ok = a.ndim() == b.ndim();
  for (py::ssize_t i = 0; ok && i < a.ndim(); i++) ok = a.shape(i) == b.shape(i);
  need(ok, std::string(na) + " and " + nb + " must have the same shape, got " + shape_str(a) + " and " +
               shape_str(b));
}

FArray like(const py::array& a) {
  std::vector<py::ssize_t> shape(a.shape(), a.shape() + a.ndim());
  return FArray(shape);
}

FArray zeros(std::vector<py::ssize_t> shape) {
  FArray out(shape);
  std::fill(out.mutable_data(), out.mutable_data() + out.size(), 0.f);
  return out;
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

void check_ids(const IArray& ids, int64_t V, const char* name) {
  const int32_t* p = ids.data();
  for (py::ssize_t i = 0; i < ids.size(); i++)
    need(p[i] >= 0 && p[i] < V, std::string(name) + " must hold ids in [0, " + std::to_string(V) + "), found " +
                                    std::to_string(p[i]));
}

void bind_ops(py::module_& m) {
  m.def("encoder_forward", [](const IArray& idx, const FArray& wte, const FArray& wpe) {
    need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(idx));
    need(wte.ndim() == 2 && wpe.ndim() == 2 && wte.shape(1) == wpe.shape(1),
         "wte (V, C) and wpe (maxT, C) must be 2-D with the same C, got " + shape_str(wte) + " and " + shape_str(wpe));
    const int B = idx.shape(0), T = idx.shape(1), C = wte.shape(1);
    need(T <= wpe.shape(0), "T must be <= wpe rows (" + std::to_string(wpe.shape(0)) + "), got " + std::to_string(T));
    check_ids(idx, wte.shape(0), "idx");
    FArray out({(py::ssize_t)B, (py::ssize_t)T, (py::ssize_t)C});
    py::gil_scoped_release nogil;
    cpu::encoder_forward(out.mutable_data(), idx.data(), wte.data(), wpe.data(), B, T, C);
    return out;
  });
  m.def("encoder_backward", [](const FArray& dout, const IArray& idx, int V, int maxT) {
    need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(idx));
    const int B = idx.shape(0), T = idx.shape(1);
    need(dout.ndim() == 3 && dout.shape(0) == B && dout.shape(1) == T,
         "dout must be (B, T, C) matching idx " + shape_str(idx) + ", got " + shape_str(dout));
    need(T <= maxT, "T must be <= maxT");
    check_ids(idx, V, "idx");
    const int C = dout.shape(2);
    FArray dwte = zeros({V, C}), dwpe = zeros({maxT, C});
    {
      py::gil_scoped_release nogil;
      cpu::encoder_backward(dwte.mutable_data(), dwpe.mutable_data(), dout.data(), idx.data(), B, T, C);
    }
    return py::make_tuple(dwte, dwpe);
  });
  m.def("layernorm_forward", [](const FArray& x, const FArray& w, const FArray& b) {
    need(w.ndim() == 1 && b.ndim() == 1 && w.shape(0) == b.shape(0),
         "weight and bias must be 1-D of the same length, got " + shape_str(w) + " and " + shape_str(b));
    const int C = w.shape(0);
    const int64_t N = rows_of(x, C, "x");
    FArray out = like(x), mean({(py::ssize_t)N}), rstd({(py::ssize_t)N});
    {
      py::gil_scoped_release nogil;
      cpu::layernorm_forward(out.mutable_data(), mean.mutable_data(), rstd.mutable_data(), x.data(), w.data(),
                             b.data(), N, C);
    }
    return py::make_tuple(out, mean, rstd);
  });
  m.def("layernorm_backward", [](const FArray& dout, const FArray& x, const FArray& w, const FArray& mean,
                                 const FArray& rstd) {
    same_shape(dout, x, "dout", "x");
    need(w.ndim() == 1, "weight must be 1-D, got " + shape_str(w));
    const int C = w.shape(0);
    const int64_t N = rows_of(x, C, "x");
    need(mean.size() == N && rstd.size() == N, "mean and rstd must hold one value per row (" + std::to_string(N) + ")");
    FArray dx = zeros(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
    FArray dw = zeros({C}), db = zeros({C});
    {
      py::gil_scoped_release nogil;
      cpu::layernorm_backward(dx.mutable_data(), dw.mutable_data(), db.mutable_data(), dout.data(), x.data(),
                              w.data(), mean.data(), rstd.data(), N, C);
    }
    return py::make_tuple(dx, dw, db);
  });
  m.def("matmul_forward", [](const FArray& x, const FArray& w, std::optional<FArray> bias) {
    need(w.ndim() == 2, "weight must be 2-D (out_features, in_features), got " + shape_str(w));
    const int OC = w.shape(0), C = w.shape(1);
    const int64_t N = rows_of(x, C, "x");
    if (bias) need(bias->ndim() == 1 && bias->shape(0) == OC, "bias must be (" + std::to_string(OC) + ",), got " +
                                                                     shape_str(*bias));
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    shape.back() = OC;
    FArray out(shape);
    const float* bp = bias ? bias->data() : nullptr;
    py::gil_scoped_release nogil;
    cpu::matmul_forward(out.mutable_data(), x.data(), w.data(), bp, N, C, OC);
    return out;
  }, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("matmul_backward", [](const FArray& dout, const FArray& x, const FArray& w, bool with_bias) {
    need(w.ndim() == 2, "weight must be 2-D (out_features, in_features), got " + shape_str(w));
    const int OC = w.shape(0), C = w.shape(1);
    const int64_t N = rows_of(x, C, "x");
    need(rows_of(dout, OC, "dout") == N, "dout must have as many rows as x");
    FArray dx = like(x), dw = zeros({OC, C}), db = zeros({OC});
    {
      py::gil_scoped_release nogil;
      cpu::matmul_backward(dx.mutable_data(), dw.mutable_data(), with_bias ? db.mutable_data() : nullptr,
                           dout.data(), x.data(), w.data(), N, C, OC);
    }
    return py::make_tuple(dx, dw, with_bias ? py::object(db) : py::object(py::none()));
  });
  m.def("gelu_forward", [](const FArray& x) {
    FArray out = like(x);
    py::gil_scoped_release nogil;
    cpu::gelu_forward(out.mutable_data(), x.data(), x.size());
    return out;
  });
  m.def("gelu_backward", [](const FArray& dout, const FArray& x) {
    same_shape(dout, x, "dout", "x");
    FArray dx = like(x);
    py::gil_scoped_release nogil;
    cpu::gelu_backward(dx.mutable_data(), x.data(), dout.data(), x.size());
    return dx;
  });
  auto attn_dims = [](const FArray& qkv, int n_head) {
    need(qkv.ndim() == 3 && qkv.shape(2) % 3 == 0, "qkv must be (B, T, 3C), got " + shape_str(qkv));
    const int C = qkv.shape(2) / 3;
    need(n_head >= 1 && C % n_head == 0, "n_head must divide C=" + std::to_string(C) + ", got " +
                                             std::to_string(n_head));
    return std::make_tuple((int)qkv.shape(0), (int)qkv.shape(1), C);
  };
  m.def("attention_forward", [attn_dims](const FArray& qkv, int n_head, bool causal) {
    auto [B, T, C] = attn_dims(qkv, n_head);
    FArray out({B, T, C}), lse({B, n_head, T});
    {
      py::gil_scoped_release nogil;
      cpu::attention_forward(out.mutable_data(), lse.mutable_data(), qkv.data(), B, T, C, n_head, causal);
    }
    return py::make_tuple(out, lse);
  });
  m.def("attention_backward", [attn_dims](const FArray& dout, const FArray& qkv, const FArray& out,
                                          const FArray& lse, int n_head, bool causal) {
    auto [B, T, C] = attn_dims(qkv, n_head);
    need(dout.ndim() == 3 && dout.shape(0) == B && dout.shape(1) == T && dout.shape(2) == C,
         "dout must be (B, T, C) = (" + std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(C) +
             "), got " + shape_str(dout));
    same_shape(dout, out, "dout", "out");
    need(lse.size() == (py::ssize_t)B * n_head * T, "lse must be (B, n_head, T)");
    FArray dqkv = like(qkv);
    py::gil_scoped_release nogil;
    cpu::attention_backward(dqkv.mutable_data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, n_head,
                            causal);
    return dqkv;
  });
  m.def("cross_entropy_forward", [](const FArray& logits, const IArray& targets) {
    need(logits.ndim() >= 1 && logits.shape(logits.ndim() - 1) >= 1, "logits must be (..., V) with V >= 1");
    const int V = logits.shape(logits.ndim() - 1);
    const int64_t N = rows_of(logits, V, "logits");
    need(targets.size() == N, "targets must hold one id per row of logits (" + std::to_string(N) + "), got " +
                                  shape_str(targets));
    check_ids(targets, V, "targets");
    FArray losses({(py::ssize_t)N}), lse({(py::ssize_t)N});
    {
      py::gil_scoped_release nogil;
      cpu::cross_entropy_forward(losses.mutable_data(), lse.mutable_data(), logits.data(), targets.data(), N, V);
    }
    return py::make_tuple(losses, lse);
  });
  m.def("cross_entropy_backward", [](const FArray& logits, const IArray& targets, const FArray& lse, float dloss) {
    const int V = logits.shape(logits.ndim() - 1);
    const int64_t N = rows_of(logits, V, "logits");
    need(targets.size() == N && lse.size() == N, "targets and lse must hold one value per row of logits");
    check_ids(targets, V, "targets");
    FArray dlogits = like(logits);
    py::gil_scoped_release nogil;
    cpu::cross_entropy_backward(dlogits.mutable_data(), logits.data(), lse.data(), targets.data(), dloss, N, V);
    return dlogits;
  });
  m.def("adamw_update", [](FArray param, const FArray& grad, FArray m_, FArray v_, float lr, float beta1,
                           float beta2, float eps, float weight_decay, int64_t step) {
    same_shape(param, grad, "param", "grad");
    same_shape(param, m_, "param", "m");
    same_shape(param, v_, "param", "v");
    need(step >= 1, "step must be >= 1 (the count after this update), got " + std::to_string(step));
    cpu::AdamWHyper h{lr, beta1, beta2, eps, weight_decay, (float)(1.0 - std::pow((double)beta1, (double)step)),
                      (float)std::sqrt(1.0 - std::pow((double)beta2, (double)step))};
    py::gil_scoped_release nogil;
    cpu::adamw_update(param.mutable_data(), grad.data(), m_.mutable_data(), v_.mutable_data(), param.size(), h);
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastgpt's compiled core: the GPT-2 engine, AdamW, the CPU ops and the CUDA slot";
  m.attr("built_with_cuda") = cuda::built_with_cuda();
  m.def("cuda_device_count", &cuda::device_count);
  m.def("cuda_device_name", &cuda::device_name);
  m.def("cuda_smoke_test", &cuda::smoke_test);

  py::class_<GPT>(m, "GPT")
      .def(py::init([](int block_size, int vocab_size, int n_layer, int n_head, int n_embd, uint64_t seed) {
             GPTConfig c{block_size, vocab_size, n_layer, n_head, n_embd};
             return new GPT(c, seed);
           }),
           py::arg("block_size"), py::arg("vocab_size"), py::arg("n_layer"), py::arg("n_head"), py::arg("n_embd"),
           py::arg("seed"))
      .def("num_parameters", &GPT::num_parameters)
      .def("named_views",
           [](const GPT& g) {
             py::list out;
             for (const NamedView& v : g.named_views()) out.append(py::make_tuple(v.name, v.shape, v.offset));
             return out;
           })
      .def("decay_ranges",
           [](const GPT& g) {
             py::list out;
             for (const ParamTensor& t : g.tensors()) out.append(py::make_tuple(t.name, t.offset, t.numel, t.decay));
             return out;
           })
      .def_property_readonly("params", [](py::object self) {
        GPT& g = self.cast<GPT&>();
        return view(g.params(), {(py::ssize_t)g.num_parameters()}, self);
      })
      .def_property_readonly("grads", [](py::object self) {
        GPT& g = self.cast<GPT&>();
        return view(g.grads(), {(py::ssize_t)g.num_parameters()}, self);
      })
      .def("forward",
           [](GPT& g, const IArray& idx, std::optional<IArray> targets, bool last_only) {
             need(idx.ndim() == 2, "idx must be 2-D (B, T), got shape " + shape_str(idx));
             if (targets) same_shape(idx, *targets, "idx", "targets");
             const int B = idx.shape(0), T = idx.shape(1);
             const int32_t* tp = targets ? targets->data() : nullptr;
             py::gil_scoped_release nogil;
             return g.forward(idx.data(), tp, B, T, last_only);
           },
           py::arg("idx"), py::arg("targets") = py::none(), py::arg("last_only") = false)
      .def("logits",
           [](py::object self) {
             GPT& g = self.cast<GPT&>();
             if (!g.logits_valid()) throw std::logic_error("no logits: call forward() (backward() overwrites them)");
             return view(const_cast<float*>(g.logits()), {g.last_B(), g.last_T(), g.config().vocab_size}, self);
           })
      .def("backward",
           [](GPT& g, float grad_scale) {
             need(std::isfinite(grad_scale), "grad_scale must be finite");
             py::gil_scoped_release nogil;
             g.backward(grad_scale);
           },
           py::arg("grad_scale") = 1.f)
      .def("zero_grad", &GPT::zero_grad)
      .def("clip_grad_norm", [](GPT& g, double max_norm) {
        py::gil_scoped_release nogil;
        return g.clip_grad_norm(max_norm);
      });

  py::class_<AdamW>(m, "AdamW")
      .def(py::init([](GPT& g, float lr, float beta1, float beta2, float eps, float weight_decay) {
             return new AdamW(g, AdamWConfig{lr, beta1, beta2, eps, weight_decay});
           }),
           py::keep_alive<1, 2>(), py::arg("model"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
           py::arg("eps"), py::arg("weight_decay"))
      .def("step",
           [](AdamW& o, float lr) {
             py::gil_scoped_release nogil;
             o.step(lr);
           })
      .def_property_readonly("step_count", &AdamW::step_count)
      .def_property_readonly("m", [](py::object self) {
        AdamW& o = self.cast<AdamW&>();
        return view(o.m(), {(py::ssize_t)o.size()}, self);
      })
      .def_property_readonly("v", [](py::object self) {
        AdamW& o = self.cast<AdamW&>();
        return view(o.v(), {(py::ssize_t)o.size()}, self);
      });

  py::module_ ops = m.def_submodule("ops", "CPU kernels on NumPy float32/int32 arrays");
  bind_ops(ops);
}
