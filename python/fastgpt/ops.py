"""fastgpt.ops: each kernel of the engine, forward and backward, on arrays, so every op can be checked against
PyTorch on its own. Arrays on the CPU (NumPy arrays, CPU torch tensors, anything with DLPack) run the C++ CPU
kernels and come back as NumPy float32 arrays. CUDA arrays (torch tensors, CuPy arrays) are passed zero-copy
through DLPack to the CUDA kernels, run on the caller's current stream, and come back as arrays of the caller's
framework. Parameter gradients are returned fresh (the engine accumulates them; here they start from zero).

Precision: the model's ops (embedding, layernorm, residual_layernorm, matmul, gelu, attention, cross_entropy) run in
the storage type of their activation and weight inputs, float32, bfloat16 or float16 (one dtype per call), as the
engine does in bf16/fp16: 16-bit loads, float arithmetic, one rounding per output. On the CPU, bfloat16 arrays are
ml_dtypes arrays (NumPy has no bfloat16; CPU torch tensors of either 16-bit dtype are taken too) and outputs come
back in the same dtype. Statistics (mean, rstd, lse, losses) and parameter gradients are always float32.
"""
import ml_dtypes
import numpy as np

from . import _C
from ._convert import INT32_MAX, INT64_MAX, as_float32, as_ids, check_float, check_int, to_numpy

_ops = _C.ops
_CUDA_DEVICES = (2, 13)  # DLPack kDLCUDA, kDLCUDAManaged


def _on_cuda(x):
    dev = getattr(x, "__dlpack_device__", None)
    return not isinstance(x, np.ndarray) and dev is not None and dev()[0] in _CUDA_DEVICES


class _Host:
    """Arrays on the CPU: NumPy in, NumPy out."""
    stream = 0

    def f32(self, x, name):
        return as_float32(x, name)

    def floating(self, x, name):
        # The CPU flash kernel computes in float32: half inputs (ml_dtypes bfloat16 too) are widened exactly.
        half = _host_half(x)
        return half.astype(np.float32) if half is not None else as_float32(x, name)

    def storage(self, x, name):
        """float32, or a 16-bit array kept in its dtype (bfloat16 as ml_dtypes, float16)."""
        half = _host_half(x)
        return np.require(half, requirements="C") if half is not None else as_float32(x, name)

    def ids(self, x, name, ndim=None):
        return as_ids(x, name, ndim)

    def empty(self, shape, like=None):
        return np.empty(shape, np.float32 if like is None else like.dtype)

    def zeros(self, shape, like=None):
        return np.zeros(shape, np.float32 if like is None else like.dtype)

    def arg(self, a):
        return a


class _Device:
    """Arrays on a GPU, in the framework of `like` (torch or CuPy): outputs are allocated there, on its current stream,
    and handed to the kernels as DLPack capsules."""

    def __init__(self, like):
        self.module = type(like).__module__.split(".")[0]
        if self.module == "torch":
            import torch
            self.torch, self.device = torch, like.device
            self.stream = torch.cuda.current_stream(like.device).cuda_stream
        elif self.module == "cupy":
            import cupy
            self.cupy, self.device = cupy, like.device
            with like.device:  # CuPy's current stream is per device: the arrays' one, not the current device's
                self.stream = cupy.cuda.get_current_stream().ptr
        else:
            raise TypeError(f"CUDA arrays from {self.module} are not supported (torch tensors or CuPy arrays)")

    def _check(self, x, name):
        if not _on_cuda(x):
            raise ValueError(f"{name} must be on the GPU like the other arrays of this op")
        if type(x).__module__.split(".")[0] != self.module:
            raise TypeError(f"{name} must be a {self.module} array like the other arrays of this op")

    def f32(self, x, name):
        self._check(x, name)
        if str(x.dtype) not in ("torch.float32", "float32"):
            raise TypeError(f"{name} must be float32 on the GPU, got {x.dtype}")
        return x if self._contiguous(x) else self._contiguous_copy(x)

    def storage(self, x, name):
        return self.floating(x, name)

    def floating(self, x, name):
        """float32, bfloat16 or float16, contiguous and (for the tensor-core kernels) 16-byte aligned."""
        self._check(x, name)
        if str(x.dtype).replace("torch.", "") not in ("float32", "bfloat16", "float16"):
            raise TypeError(f"{name} must be float32, bfloat16 or float16 on the GPU, got {x.dtype}")
        x = x if self._contiguous(x) else self._contiguous_copy(x)
        ptr = x.data_ptr() if self.module == "torch" else x.data.ptr
        return x if ptr % 16 == 0 else x.clone() if self.module == "torch" else x.copy()

    def ids(self, x, name, ndim=None):
        self._check(x, name)
        if ndim is not None and x.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
        if "int" not in str(x.dtype) or "uint8" in str(x.dtype):
            raise TypeError(f"{name} must be an integer array of token ids, got dtype {x.dtype}")
        if x.numel() if self.module == "torch" else x.size:
            # One device sync (both ends in one copy back): the kernels index memory with these ids.
            if self.module == "torch":
                lo, hi = self.torch.stack(self.torch.aminmax(x)).tolist()
            else:
                lo, hi = self.cupy.stack([x.min(), x.max()]).get().tolist()
            if lo < 0 or hi >= 2**31:
                raise ValueError(f"{name} holds ids outside [0, 2**31) (min {lo}, max {hi})")
            self.id_max = max(getattr(self, "id_max", -1), hi)
        if self.module == "torch":
            return x.to(self.torch.int32).contiguous()
        return self.cupy.ascontiguousarray(x, dtype=self.cupy.int32)

    def check_vocab(self, V, name):
        if getattr(self, "id_max", -1) >= V:
            raise ValueError(f"{name} must hold ids in [0, {V}), found {self.id_max}")

    def _contiguous(self, x):
        return x.is_contiguous() if self.module == "torch" else x.flags.c_contiguous

    def _contiguous_copy(self, x):
        return x.contiguous() if self.module == "torch" else self.cupy.ascontiguousarray(x)

    def empty(self, shape, like=None):
        """float32, or the dtype of the array `like`."""
        if self.module == "torch":
            dtype = self.torch.float32 if like is None else like.dtype
            return self.torch.empty(shape, dtype=dtype, device=self.device)
        with self.device:
            return self.cupy.empty(shape, self.cupy.float32 if like is None else like.dtype)

    def zeros(self, shape, like=None):
        if self.module == "torch":
            dtype = self.torch.float32 if like is None else like.dtype
            return self.torch.zeros(shape, dtype=dtype, device=self.device)
        with self.device:
            return self.cupy.zeros(shape, self.cupy.float32 if like is None else like.dtype)

    def arg(self, a):
        # DLPack names CUDA's legacy default stream 1 (0 is reserved); torch refuses tensors that require grad.
        # Exported with the arrays' device current: torch refuses to export a tensor of another device than the
        # current one (BufferError: an op on cuda:1 tensors while cuda:0 is current), and both frameworks order the
        # consumer's stream after their current stream, which is per device.
        if self.module == "torch":
            with self.torch.cuda.device(self.device):
                return a.detach().__dlpack__(stream=self.stream or 1)
        with self.device:
            return a.__dlpack__(stream=self.stream or 1)


def _host_half(x):
    """x as a NumPy bfloat16 (ml_dtypes) or float16 array if it is one (or a CPU torch tensor of one), else None."""
    if isinstance(x, np.ndarray):
        return x if x.dtype in (np.float16, ml_dtypes.bfloat16) else None
    dtype = str(getattr(x, "dtype", ""))
    if dtype == "torch.float16":
        return x.detach().cpu().numpy()
    if dtype == "torch.bfloat16":  # NumPy cannot take torch's bfloat16: reinterpret the bits
        import torch
        return x.detach().cpu().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return None


def _where(*arrays):
    like = next((a for a in arrays if a is not None and _on_cuda(a)), None)
    return _Host() if like is None else _Device(like)


def _shape(a):
    return tuple(a.shape)


def embedding_forward(idx, wte, wpe):
    """Token + position embedding: idx (B, T) -> (B, T, C)."""
    d = _where(idx, wte, wpe)
    idx, wte, wpe = d.ids(idx, "idx", ndim=2), d.storage(wte, "wte"), d.storage(wpe, "wpe")
    if isinstance(d, _Device):
        d.check_vocab(_shape(wte)[0], "idx")
    out = d.empty(_shape(idx) + _shape(wte)[1:], like=wte)
    _ops.encoder_forward(d.arg(out), d.arg(idx), d.arg(wte), d.arg(wpe), d.stream)
    return out


def embedding_backward(dout, idx, vocab_size, block_size):
    """-> (dwte (vocab_size, C), dwpe (block_size, C))."""
    d = _where(dout, idx)
    dout, idx = d.storage(dout, "dout"), d.ids(idx, "idx", ndim=2)
    V, maxT = check_int(vocab_size, "vocab_size", 1), check_int(block_size, "block_size", 1)
    if isinstance(d, _Device):
        d.check_vocab(V, "idx")
    C = _shape(dout)[-1]
    dwte, dwpe = d.zeros((V, C)), d.zeros((maxT, C))
    _ops.encoder_backward(d.arg(dwte), d.arg(dwpe), d.arg(dout), d.arg(idx), d.stream)
    return dwte, dwpe


def layernorm_forward(x, weight, bias):
    """x (..., C) -> (out (..., C), mean (N,), rstd (N,)), eps 1e-5."""
    d = _where(x, weight, bias)
    x, weight, bias = d.storage(x, "x"), d.storage(weight, "weight"), d.storage(bias, "bias")
    n = int(np.prod(_shape(x)[:-1], dtype=np.int64)) if len(_shape(x)) else 0
    out, mean, rstd = d.empty(_shape(x), like=x), d.empty((n,)), d.empty((n,))
    _ops.layernorm_forward(d.arg(out), d.arg(mean), d.arg(rstd), d.arg(x), d.arg(weight), d.arg(bias), d.stream)
    return out, mean, rstd


def residual_layernorm_forward(a, b, weight, bias):
    """The residual add and the LayerNorm after it, in one op: a, b (..., C) -> (res = a + b, out =
    layernorm(res), mean (N,), rstd (N,)), res rounded to the storage type before the LayerNorm reads it, so the
    results are those of the two ops in turn. Its backward is layernorm_backward's, its dx added to the residual
    gradient (which flows to a and b alike)."""
    d = _where(a, b, weight, bias)
    a, b, weight, bias = d.storage(a, "a"), d.storage(b, "b"), d.storage(weight, "weight"), d.storage(bias, "bias")
    n = int(np.prod(_shape(a)[:-1], dtype=np.int64)) if len(_shape(a)) else 0
    res, out, mean, rstd = d.empty(_shape(a), like=a), d.empty(_shape(a), like=a), d.empty((n,)), d.empty((n,))
    _ops.residual_layernorm_forward(d.arg(res), d.arg(out), d.arg(mean), d.arg(rstd), d.arg(a), d.arg(b),
                                    d.arg(weight), d.arg(bias), d.stream)
    return res, out, mean, rstd


def layernorm_backward(dout, x, weight, mean, rstd, dx_sum=False):
    """-> (dx, dweight, dbias), and with dx_sum=True also the column sums of dx (C,) in fp32: the bias gradient of
    a linear layer whose output's gradient dx is (the fused model's residual projections, whose bias gradients its
    LayerNorm backward gives). On a GPU in 16 bits they are summed as dx is written where the one-pass kernel takes
    the rows and its shared memory holds the sums (an H100/H200 at GPT-2's width; a fixed order of its own); else
    by a pass over dx in the linear layer's order: ops.matmul_backward's bias gradient of dx, bit for bit."""
    d = _where(dout, x, weight, mean, rstd)
    dout, x, weight = d.storage(dout, "dout"), d.storage(x, "x"), d.storage(weight, "weight")
    mean, rstd = d.f32(mean, "mean"), d.f32(rstd, "rstd")
    rows = _shape(x)[:-1]
    n = int(np.prod(rows, dtype=np.int64))
    for a, name in ((mean, "mean"), (rstd, "rstd")):  # another layout of the rows would be read in the wrong order
        if _shape(a) not in (rows, rows + (1,), (n,), (n, 1)):
            raise ValueError(f"{name} must be x.shape[:-1] {rows} or flat ({n},), either with or without a trailing "
                             f"1, got shape {_shape(a)}")
    if not isinstance(dx_sum, (bool, np.bool_)):
        raise TypeError(f"dx_sum must be True or False, got {dx_sum!r}")
    dx, dw, db = d.zeros(_shape(x), like=x), d.zeros(_shape(weight)), d.zeros(_shape(weight))
    ds = d.zeros(_shape(weight)) if dx_sum else None
    _ops.layernorm_backward(d.arg(dx), d.arg(dw), d.arg(db), d.arg(dout), d.arg(x), d.arg(weight), d.arg(mean),
                            d.arg(rstd), None if ds is None else d.arg(ds), d.stream)
    return (dx, dw, db, ds) if dx_sum else (dx, dw, db)


def _cuda_switch(name, enabled):
    """The binding's process-wide CUDA switch `name` (None reads it, a bool sets it) -> its previous setting."""
    if enabled is not None and not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"{name}: enabled must be True, False or None, got {enabled!r}")
    return bool(getattr(_ops, name)(None if enabled is None else bool(enabled)))


def layernorm_one_pass(enabled=None):
    """How the LayerNorm ops (and the model's LayerNorms) run on a GPU. True (the default): each row is read once.
    The forward and the fused residual + LayerNorm keep a row in registers from its load to its output (widths
    that are a multiple of 8 16-bit or 4 float values, up to 1024); the backward reads dout and x once for dx and
    for the weight and bias gradients' partial sums (the same widths, views 16-byte aligned). False: the older
    kernels, which read a row again for each pass (the backward in two kernels). Other widths always take those.
    The backward's two paths give the same weight and bias gradients, bit for bit; the forward's differ in the
    order a row is summed (rounding only), and the fused op gives the unfused pair's bits under either setting.
    Process-wide, for benchmarks and tests to compare the two; a CUDA graph of a training step keeps the path it
    was recorded with. None leaves it. -> the previous setting. Needs a build with CUDA."""
    return _cuda_switch("layernorm_one_pass", enabled)


def matmul_forward(x, weight, bias=None):
    """nn.Linear: x (..., in) @ weight (out, in)^T + bias (out) -> (..., out)."""
    d = _where(x, weight, bias)
    x, weight = d.storage(x, "x"), d.storage(weight, "weight")
    bias = None if bias is None else d.storage(bias, "bias")
    out = d.empty(_shape(x)[:-1] + _shape(weight)[:1], like=x)
    _ops.matmul_forward(d.arg(out), d.arg(x), d.arg(weight), None if bias is None else d.arg(bias), d.stream)
    return out


def matmul_backward(dout, x, weight, bias=True):
    """-> (dx, dweight, dbias or None). On a GPU the bias gradient is a column-sum kernel (in 16-bit storage
    matmul_bias_grad_epilogue(True) makes it the epilogue of the weight gradient's product)."""
    d = _where(dout, x, weight)
    dout, x, weight = d.storage(dout, "dout"), d.storage(x, "x"), d.storage(weight, "weight")
    dx, dw = d.empty(_shape(x), like=x), d.zeros(_shape(weight))
    db = d.zeros(_shape(weight)[:1]) if bias else None
    _ops.matmul_backward(d.arg(dx), d.arg(dw), None if db is None else d.arg(db), d.arg(dout), d.arg(x),
                         d.arg(weight), d.stream)
    return dx, dw, db


def matmul_bias_grad_epilogue(enabled=None):
    """How matmul_backward (and the engine's linear layers, but the fused model's qkv, whose bias gradient comes with
    the attention backward: attention_backward's bias_grad) make the bias gradient on a GPU in bfloat16/float16:
    False (the default) in a column-sum kernel (a second pass over dout, 16 bytes a load, every sum in an order
    that depends on the row count alone; float32 always takes it), True in cuBLASLt's epilogue of the weight
    gradient's product (BGRADB, in fp32), which on an H200 ran as a second pass of its own and slowed the product.
    Process-wide, for benchmarks and tests to compare the two; a CUDA graph of a training step keeps the path it was
    recorded with. None leaves it. -> the previous setting. Needs a build with CUDA."""
    return _cuda_switch("matmul_bias_grad_epilogue", enabled)


def matmul_autotune(enabled=None):
    """How every product on a GPU (matmul ops, the model's linear layers and classifier) picks cuBLASLt's
    algorithm. False (the default): its heuristic's first choice, as PyTorch does. True: each problem's first run
    (its shape, strides, alignments, types and epilogue) times up to 8 of the heuristic's candidates on its own
    operands, outputs to scratch, and keeps the fastest; the heuristic's own stays unless another is more than 2%
    faster. Like torch.backends.cudnn.benchmark: a few milliseconds once per problem, and the choice rests on timings,
    so results can differ in rounding from untuned runs and between processes; within a process each problem keeps
    its algorithm under each setting (a CUDA graph recorded before its first eager run keeps the heuristic's).
    Process-wide, and part of each plan's key: turned on, each problem is timed at its next run; turned off, it
    takes the heuristic's plan again. None leaves it. -> the previous setting. Needs a build with CUDA."""
    return _cuda_switch("matmul_autotune", enabled)


def matmul_autotune_report():
    """The decisions matmul_autotune has made in this process, one dict per problem, in the order they were met:
    M, N, K, trans_a, trans_b, batch (the row-major product C (M, N) = op(A) op(B)), epilogue ("none", "bias",
    "gelu_aux", "gelu_aux_bias", "dgelu", "bgradb"), ab_type, c_type, compute, candidates, ms (each candidate's
    median milliseconds per product, -1 where it could not run), chosen (the index kept; 0 is the heuristic's),
    reps (products per timing) and skipped (why nothing was timed, else ""). Needs a build with CUDA."""
    return list(_ops.matmul_autotune_report())


def matmul_forward_gelu(x, weight, bias=None):
    """nn.Linear then GELU (tanh), the fused model's MLP up-projection: -> (out = gelu(pre), pre = x @ weight^T +
    bias), pre kept for matmul_backward_dgelu. On a GPU in 16-bit storage the GELU is the product's cuBLASLt epilogue
    (applied to the fp32 accumulator); elsewhere matmul_forward then gelu_forward, the same bits as those two."""
    d = _where(x, weight, bias)
    x, weight = d.storage(x, "x"), d.storage(weight, "weight")
    bias = None if bias is None else d.storage(bias, "bias")
    shape = _shape(x)[:-1] + _shape(weight)[:1]
    out, pre = d.empty(shape, like=x), d.empty(shape, like=x)
    _ops.matmul_forward_gelu(d.arg(out), d.arg(pre), d.arg(x), d.arg(weight), None if bias is None else d.arg(bias),
                             d.stream)
    return out, pre


def matmul_backward_dgelu(dout, x, weight, pre, bias=True):
    """The backward of nn.Linear on x = gelu(pre), through the GELU: -> (dpre, dweight, dbias or None), dpre the
    gradient of pre itself. On a GPU in 16-bit storage the GELU's derivative is the epilogue of the product that
    makes dx; elsewhere matmul_backward then gelu_backward."""
    d = _where(dout, x, weight, pre)
    dout, x = d.storage(dout, "dout"), d.storage(x, "x")
    weight, pre = d.storage(weight, "weight"), d.storage(pre, "pre")
    dpre, dw = d.empty(_shape(x), like=x), d.zeros(_shape(weight))
    db = d.zeros(_shape(weight)[:1]) if bias else None
    _ops.matmul_backward_dgelu(d.arg(dpre), d.arg(dw), None if db is None else d.arg(db), d.arg(dout), d.arg(x),
                               d.arg(weight), d.arg(pre), d.stream)
    return dpre, dw, db


def gelu_forward(x):
    """GELU, tanh approximation."""
    d = _where(x)
    x = d.storage(x, "x")
    out = d.empty(_shape(x), like=x)
    _ops.gelu_forward(d.arg(out), d.arg(x), d.stream)
    return out


def gelu_backward(dout, x):
    d = _where(dout, x)
    dout, x = d.storage(dout, "dout"), d.storage(x, "x")
    dx = d.empty(_shape(x), like=x)
    _ops.gelu_backward(d.arg(dx), d.arg(dout), d.arg(x), d.stream)
    return dx


def attention_forward(qkv, n_head, causal=True):
    """Scaled dot-product attention on the fused projection qkv (B, T, 3C) = q | k | v, n_head heads.
    -> (out (B, T, C), lse (B, n_head, T)): lse is all backward needs besides the inputs."""
    d = _where(qkv)
    qkv, n_head = d.storage(qkv, "qkv"), check_int(n_head, "n_head", 1, INT32_MAX)
    B, T, C3 = _shape(qkv) if len(_shape(qkv)) == 3 else (0, 0, 0)
    out, lse = d.empty((B, T, C3 // 3), like=qkv), d.empty((B, n_head, T))
    _ops.attention_forward(d.arg(out), d.arg(lse), d.arg(qkv), n_head, bool(causal), d.stream)
    return out, lse


def attention_backward(dout, qkv, out, lse, n_head, causal=True, bias_grad=False):
    """-> dqkv (B, T, 3C); with bias_grad, (dqkv, dbias): dbias (3C, float32) the column sums of dqkv, the qkv
    projection's bias gradient as the fused model makes it (on an H100/H200 in 16 bits its K and V thirds come from
    the attention kernel's own tiles, summed in another order; elsewhere a pass over dqkv, matmul_backward's bits)."""
    d = _where(dout, qkv, out, lse)
    dout, qkv, out = d.storage(dout, "dout"), d.storage(qkv, "qkv"), d.storage(out, "out")
    lse = d.f32(lse, "lse")
    dqkv = d.empty(_shape(qkv), like=qkv)
    db = d.zeros(_shape(qkv)[-1:]) if bias_grad else None
    _ops.attention_backward(d.arg(dqkv), d.arg(dout), d.arg(qkv), d.arg(out), d.arg(lse),
                            check_int(n_head, "n_head", 1, INT32_MAX), bool(causal), d.stream,
                            None if db is None else d.arg(db))
    return (dqkv, db) if bias_grad else dqkv


def attention_decode_append(k_cache, v_cache, qkv, pos):
    """Generation's KV cache: writes the keys and values of the new positions [pos, pos + T) of qkv (B, T, 3C) into
    k_cache and v_cache (B, n_head, Tmax, hs), in place (so both must already be contiguous arrays of qkv's dtype:
    NumPy float32 / float16 / ml_dtypes bfloat16, or CUDA tensors)."""
    d = _where(k_cache, v_cache, qkv)
    qkv = d.storage(qkv, "qkv")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        in_place = d.storage(cache, name) is cache and str(cache.dtype) == str(qkv.dtype)
        if isinstance(d, _Host):
            in_place = in_place and isinstance(cache, np.ndarray) and cache.flags.writeable
        if not in_place:  # a converted copy would take the write and be thrown away
            raise TypeError(f"{name} is written in place: it must be a writeable contiguous array of qkv's dtype "
                            f"({qkv.dtype}), got {type(cache).__name__} of dtype {getattr(cache, 'dtype', None)}")
    pos = check_int(pos, "pos", 0, INT32_MAX)
    _ops.attention_decode_append(d.arg(k_cache), d.arg(v_cache), d.arg(qkv), pos, d.stream)


def attention_decode_forward(qkv, k_cache, v_cache, pos):
    """Attention of the new positions [pos, pos + T) of qkv (B, T, 3C) (its q third) against the caches (B, n_head,
    Tmax, hs), which must already hold their keys and values (attention_decode_append): new row t attends to the
    cached positions [0, pos + t]. -> out (B, T, C)."""
    d = _where(qkv, k_cache, v_cache)
    qkv, k_cache, v_cache = d.storage(qkv, "qkv"), d.storage(k_cache, "k_cache"), d.storage(v_cache, "v_cache")
    out = d.empty(_shape(qkv)[:2] + (_shape(qkv)[2] // 3,) if len(_shape(qkv)) == 3 else (0, 0, 0), like=qkv)
    pos = check_int(pos, "pos", 0, INT32_MAX)
    _ops.attention_decode_forward(d.arg(out), d.arg(qkv), d.arg(k_cache), d.arg(v_cache), pos, d.stream)
    return out


_LAYOUTS = {"bhtd": "(B, H, T, d)", "bthd": "(B, T, H, d)"}


def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'bhtd' or 'bthd', got {layout!r}")


def _flash_dims(q, layout):
    shape = _shape(q)
    if len(shape) != 4:
        raise ValueError(f"q must be 4-D {_LAYOUTS[layout]} for layout {layout!r}, got shape {shape}")
    B, d = shape[0], shape[3]
    H, T = (shape[1], shape[2]) if layout == "bhtd" else (shape[2], shape[1])
    return B, H, T, d


_FP32_MATH = ("tf32x3", "tf32", "simt")


def _check_fp32_math(fp32_math):
    if fp32_math not in _FP32_MATH:
        raise ValueError(f"fp32_math must be one of {_FP32_MATH}, got {fp32_math!r}")


def flash_attention_forward(q, k, v, causal=True, layout="bhtd", fp32_math="tf32x3"):
    """Scaled dot-product attention softmax(q k^T / sqrt(d)) v with the flash algorithm: no T x T matrix is stored.
    q, k, v: (B, H, T, d) (layout "bhtd") or (B, T, H, d) ("bthd"), one shape and dtype. On a GPU: float32, bfloat16
    or float16 (half precision needs d 64 or 128); on the CPU everything runs in float32.
    fp32_math: how float32 multiplies on a GPU. "tf32x3" (default): TF32 tensor cores, three products per product
    (each operand split into a TF32 part and a TF32 remainder), as accurate as fp32, as PyTorch's own float32
    attention; "tf32": one TF32 product (inputs rounded to 10 mantissa bits, ~1e-3 relative; fastest); "simt": fp32
    on CUDA cores. The tensor-core choices need sm_80 or newer, d 64 or 128 and 16-byte aligned rows; elsewhere
    float32 runs on CUDA cores. Other dtypes, and the CPU, ignore it.
    -> (out like q, lse (B, H, T) float32: the log-sum-exp of each scaled score row, all backward needs)."""
    _check_layout(layout)  # before any input is converted
    _check_fp32_math(fp32_math)
    d = _where(q, k, v)
    q, k, v = d.floating(q, "q"), d.floating(k, "k"), d.floating(v, "v")
    B, H, T, _ = _flash_dims(q, layout)
    out, lse = d.empty(_shape(q), like=q), d.empty((B, H, T))
    _ops.flash_attention_forward(d.arg(out), d.arg(lse), d.arg(q), d.arg(k), d.arg(v), layout, bool(causal),
                                 fp32_math, d.stream)
    return out, lse


def flash_attention_backward(dout, q, k, v, out, lse, causal=True, layout="bhtd", deterministic=False,
                             fp32_math="tf32x3"):
    """-> (dq, dk, dv), shaped and typed like q. deterministic=True makes the GPU half-precision backward
    bit-reproducible (a separate dq pass instead of atomic adds; slower). The CPU and GPU float32 paths always are.
    fp32_math: as flash_attention_forward's (float32 on a GPU)."""
    _check_layout(layout)
    _check_fp32_math(fp32_math)
    d = _where(dout, q, k, v, out, lse)
    dout, q, k, v, out = (d.floating(x, n) for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out")))
    lse = d.f32(lse, "lse")
    dq, dk, dv = (d.empty(_shape(q), like=q) for _ in range(3))
    _ops.flash_attention_backward(d.arg(dq), d.arg(dk), d.arg(dv), d.arg(dout), d.arg(q), d.arg(k), d.arg(v),
                                  d.arg(out), d.arg(lse), layout, bool(causal), bool(deterministic), fp32_math,
                                  d.stream)
    return dq, dk, dv


def flash_attention_tiles(fwd=None, dkdv=None, dq=None):
    """Picks the GPU's bfloat16/float16 flash attention kernels and their tile shapes, process-wide, so that a
    benchmark can time each on the GPU at hand (bench/bench_flash_attention.py --tiles). Each argument is an option's
    name or index (flash_attention_tile_options()); None keeps the current one. Option 0 of each, "auto", is the
    default: on an H100/H200 (compute capability 9.0, a build with sm_90a code) the Hopper kernels measured fastest
    there (fwd "sm90 ws 128x128 persistent"; backward at head dim 64 dkdv "sm90 ws fused 128x128 persistent", at 128
    dkdv and dq "sm90 128x64", or dkdv "sm90 fused" for the atomic backward), elsewhere the mma.sync "16x64" of each. Head dim 128 runs the first mma.sync option
    of each except for the "sm90" ones. The mma.sync dkdv and dq options give the same
    bits, and so do the mma.sync forward options with the same key block. The "sm90" options are Hopper kernels
    (warpgroup MMA, wgmma; fwd "sm90 ws ...": warp-specialised, one warpgroup copying K and V while the others take
    turns on the tensor cores; dkdv and dq: the deterministic backward's passes; dkdv "sm90 fused": one kernel that also
    makes dq, deterministic too, for either backward, the dq option then unused; dkdv "sm90 ws fused": the same bits
    from a warp-specialised kernel, a loader warp and three dq-summing warps beside the two multiplying warpgroups,
    and "sm90 ws fused 128x128" the same in steps of 128 queries, head dim 128 running "sm90 fused"; "... persistent":
    the same kernels with one CTA per SM, each taking tile after tile from a counter): they need a
    GPU of compute capability 9.0 and a build with sm_90a code, choosing one elsewhere raises ValueError, and a call
    on another device of the process runs the default. -> the previous choice, {"fwd": name, "dkdv": name, "dq":
    name}, which can be passed back as flash_attention_tiles(**previous). Needs a build with CUDA."""
    options = flash_attention_tile_options()
    current = _ops.flash_attention_tiles()
    chosen = []
    for (name, value), now in zip((("fwd", fwd), ("dkdv", dkdv), ("dq", dq)), current):
        names = options[name]
        if value is None:
            chosen.append(now)
        elif isinstance(value, str) and value in names:
            chosen.append(names.index(value))
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < len(names):
            chosen.append(int(value))
        else:
            raise ValueError(f"flash_attention_tiles: {name} must be one of {names} or an index below {len(names)}, "
                             f"got {value!r}")
    before = _ops.flash_attention_tiles(tuple(chosen))
    return {name: options[name][i] for name, i in zip(("fwd", "dkdv", "dq"), before)}


def flash_attention_tile_options():
    """-> {"fwd": [names], "dkdv": [...], "dq": [...]}: the tile shapes flash_attention_tiles takes, option 0 first.
    "auto" (the default, flash_attention_tiles), then fwd: rows per warp x keys per block; dkdv: keys per warp x
    queries per step; dq (the deterministic backward's dq pass): queries per warp x keys per block; then each one's
    Hopper ("sm90") kernels, per CTA instead of per warp.
    Needs a build with CUDA."""
    fwd, dkdv, dq = _ops.flash_attention_tile_options()
    return {"fwd": list(fwd), "dkdv": list(dkdv), "dq": list(dq)}


def cross_entropy_forward(logits, targets):
    """logits (..., V), targets (...) -> (mean loss, losses (N,), lse (N,))."""
    d = _where(logits, targets)
    logits, targets = d.storage(logits, "logits"), d.ids(targets, "targets")
    if isinstance(d, _Device):
        d.check_vocab(_shape(logits)[-1], "targets")
    n = int(np.prod(_shape(logits)[:-1], dtype=np.int64))
    losses, lse = d.empty((n,)), d.empty((n,))
    _ops.cross_entropy_forward(d.arg(losses), d.arg(lse), d.arg(logits), d.arg(targets), d.stream)
    return _mean_loss(d, losses), losses, lse


def _mean_loss(d, losses):
    if not _shape(losses)[0]:
        return float("nan")
    if isinstance(d, _Device):  # reduced in the caller's framework, on its stream (NumPy cannot take CuPy arrays)
        return float(losses.double().mean() if d.module == "torch" else losses.astype("float64").mean())
    return float(to_numpy(losses, "losses").astype(np.float64).mean())


def cross_entropy_backward(logits, targets, lse, grad=1.0):
    """Gradient of grad * mean cross-entropy with respect to logits."""
    d = _where(logits, targets, lse)
    logits, targets, lse = d.storage(logits, "logits"), d.ids(targets, "targets"), d.f32(lse, "lse")
    if isinstance(d, _Device):
        d.check_vocab(_shape(logits)[-1], "targets")
    n = max(1, int(np.prod(_shape(logits)[:-1], dtype=np.int64)))
    dlogits = d.empty(_shape(logits), like=logits)
    _ops.cross_entropy_backward(d.arg(dlogits), d.arg(logits), d.arg(targets), d.arg(lse),
                                check_float(grad, "grad") / n, d.stream)
    return dlogits


def cross_entropy_forward_backward(logits, targets, grad=1.0):
    """The loss and its gradient in one pass over the logits (the training step's classifier, where the engine
    writes the gradient over the logits): -> (mean loss, losses (N,), dlogits), dlogits the gradient of
    grad * mean loss."""
    d = _where(logits, targets)
    logits, targets = d.storage(logits, "logits"), d.ids(targets, "targets")
    if isinstance(d, _Device):
        d.check_vocab(_shape(logits)[-1], "targets")
    n = int(np.prod(_shape(logits)[:-1], dtype=np.int64))
    losses = d.empty((n,))
    dlogits = d.empty(_shape(logits), like=logits)
    _ops.cross_entropy_forward_backward(d.arg(losses), d.arg(dlogits), d.arg(logits), d.arg(targets),
                                        check_float(grad, "grad") / max(n, 1), d.stream)
    return _mean_loss(d, losses), losses, dlogits


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
    """One torch.optim.AdamW update, in place on param, exp_avg and exp_avg_sq (float32, contiguous: NumPy arrays on
    the CPU, torch/CuPy arrays on a GPU). step counts updates including this one."""
    d = _where(param, grad, exp_avg, exp_avg_sq)
    for name, a in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if isinstance(d, _Host):
            ok = isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        else:
            ok = _on_cuda(a) and str(a.dtype) in ("torch.float32", "float32") and d._contiguous(a)
        if not ok:
            raise TypeError(f"{name} is updated in place: it must be a writeable contiguous float32 array "
                            "(NumPy on the CPU, torch or CuPy on a GPU)")
    _ops.adamw_update(d.arg(param), d.arg(d.f32(grad, "grad")), d.arg(exp_avg), d.arg(exp_avg_sq),
                      check_float(lr, "lr", 0.0), check_float(betas[0], "betas[0]", 0.0, 0.999999),
                      check_float(betas[1], "betas[1]", 0.0, 0.999999), check_float(eps, "eps", 0.0, low_open=True),
                      check_float(weight_decay, "weight_decay", 0.0), check_int(step, "step", 1, INT64_MAX), d.stream)


_CAST_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                "float32": "float32", "fp32": "float32"}


def cast(x, dtype, stochastic=False, seed=0, step=0):
    """x rounded to dtype "bfloat16" / "float16" (to nearest even, as torch's .to(); or, for bfloat16 with
    stochastic=True, stochastically as the optimizer writes bf16 weights: rounded up with probability equal to the
    dropped fraction, keyed by (seed, step, element index), so unbiased and reproducible), or a 16-bit x widened to
    "float32". CPU results are NumPy arrays (bfloat16 as ml_dtypes)."""
    name = str(dtype).replace("torch.", "").replace("numpy.", "")
    if name not in _CAST_DTYPES:
        raise ValueError(f"dtype must be 'bfloat16', 'float16' or 'float32', got {dtype!r}")
    name = _CAST_DTYPES[name]
    seed, step = check_int(seed, "seed", 0, 2**64 - 1), check_int(step, "step", 0, 2**64 - 1)
    if stochastic and name != "bfloat16":
        raise ValueError(f"stochastic rounding is for bfloat16 only, got dtype {dtype!r}")
    d = _where(x)
    if name == "float32":
        x = d.storage(x, "x")
        if str(x.dtype).replace("torch.", "") == "float32":
            raise TypeError("x is already float32: cast to 'float32' widens bfloat16 or float16 arrays")
        out = d.empty(_shape(x))
        _ops.widen(d.arg(out), d.arg(x), d.stream)
        return out
    x = d.f32(x, "x")
    if isinstance(d, _Host):
        out = np.empty(_shape(x), ml_dtypes.bfloat16 if name == "bfloat16" else np.float16)
    elif d.module == "torch":
        out = d.torch.empty(_shape(x), dtype=getattr(d.torch, name), device=d.device)
    elif name == "bfloat16":
        raise TypeError("CuPy has no bfloat16 arrays: pass torch tensors to cast to bfloat16 on a GPU")
    else:
        with d.device:
            out = d.cupy.empty(_shape(x), d.cupy.float16)
    _ops.narrow(d.arg(out), d.arg(x), bool(stochastic), seed, step, d.stream)
    return out
