"""Every op of the model, forward and backward, in bfloat16 and float16 storage (the kernels the bf16/fp16 engine
runs), against PyTorch. Half precision has no fixed tolerance, so the rule is flash-attention's: on the same 16-bit
inputs, fastgpt's error against a float64 reference computed from those inputs must be at most twice PyTorch's own
error in that dtype against the same reference, plus a small slack (values near 0). Parameter gradients come back
in float32 from fastgpt (the engine accumulates them in fp32), so they are usually far better than torch's.
CPU here; the same cases run the CUDA kernels where a GPU is (torch CUDA tensors go through DLPack)."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import check_cuda_switch, needs_cuda
from reference_gpt import rel_err

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SLACK = {"bf16": 1e-4, "fp16": 1e-5}  # in relative-error units, well below one rounding (2^-8 and 2^-11)


def half(rng, shape, tdt, scale=1.0, device="cpu"):
    """Fresh random values rounded to tdt: the 16-bit inputs both sides share."""
    return torch.tensor(rng.standard_normal(shape) * scale, dtype=torch.float32).to(tdt).to(device)


def to_ours(t):
    """A 16-bit torch tensor as what fastgpt.ops takes: itself on a GPU, NumPy (ml_dtypes bfloat16) on the CPU."""
    if t.is_cuda or t.dtype == torch.float32:
        return t
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def f64(a):
    if isinstance(a, torch.Tensor):
        return a.detach().double().cpu()
    return torch.from_numpy(np.asarray(a).astype(np.float64))


def check(name, ours, torch_half, ref64, prec):
    e_ours, e_torch = rel_err(f64(ours), ref64), rel_err(f64(torch_half), ref64)
    assert e_ours <= 2 * e_torch + SLACK[prec], f"{name}: fastgpt {e_ours:.3e} vs torch {e_torch:.3e}"


def torch_both(fn, leaves, dy, prec):
    """fn on the leaves in the 16-bit dtype and in float64, backward with dy: {dtype: (out, *leaf grads)}."""
    res = {}
    for dtype in (DTYPES[prec], torch.float64):
        xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
        out = fn(*xs)
        out.backward(dy.to(dtype))
        res[dtype] = (out, *(t.grad for t in xs))
    return res


def check_all(names, ours, res, prec):
    for i, (name, o) in enumerate(zip(names, ours)):
        check(name, o, res[DTYPES[prec]][i], f64(res[torch.float64][i]), prec)


def device_cases():
    return [pytest.param("cpu"), pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_layernorm(rng, prec, device):
    tdt = DTYPES[prec]
    x, w, b = half(rng, (4, 33, 96), tdt, device=device), half(rng, (96,), tdt, device=device), \
        half(rng, (96,), tdt, 0.1, device=device)
    dy = half(rng, (4, 33, 96), tdt, device=device)
    out, mean, rstd = ops.layernorm_forward(to_ours(x), to_ours(w), to_ours(b))
    dx, dw, db = ops.layernorm_backward(to_ours(dy), to_ours(x), to_ours(w), mean, rstd)
    res = torch_both(lambda x, w, b: F.layer_norm(x, (96,), w, b, 1e-5), (x, w, b), dy, prec)
    check_all(("out", "dx", "dweight", "dbias"), (out, dx, dw, db), res, prec)
    assert str(np.asarray(out).dtype if device == "cpu" else out.dtype).endswith(
        "bfloat16" if prec == "bf16" else "float16")


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_residual_layernorm(rng, prec, device):
    tdt = DTYPES[prec]
    a, b = half(rng, (4, 33, 96), tdt, 2.0, device=device), half(rng, (4, 33, 96), tdt, device=device)
    w, bias = half(rng, (96,), tdt, device=device), half(rng, (96,), tdt, 0.1, device=device)
    dy = half(rng, (4, 33, 96), tdt, device=device)
    res, out, mean, rstd = ops.residual_layernorm_forward(to_ours(a), to_ours(b), to_ours(w), to_ours(bias))
    # The backward of the fused op is layernorm_backward on the res it kept; its dx reaches a and b alike.
    dx, dw, db = ops.layernorm_backward(to_ours(dy), res, to_ours(w), mean, rstd)
    check("res", res, a + b, f64(a) + f64(b), prec)
    both = torch_both(lambda a, b, w, bias: F.layer_norm(a + b, (96,), w, bias, 1e-5), (a, b, w, bias), dy, prec)
    check_all(("out", "da", "db", "dweight", "dbias"), (out, dx, dx, dw, db), both, prec)


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False])
def test_matmul(rng, prec, bias, device):
    tdt = DTYPES[prec]
    x, w = half(rng, (3, 40, 96), tdt, device=device), half(rng, (80, 96), tdt, 0.1, device=device)
    bvec = half(rng, (80,), tdt, 0.1, device=device) if bias else None
    dy = half(rng, (3, 40, 80), tdt, device=device)
    out = ops.matmul_forward(to_ours(x), to_ours(w), to_ours(bvec) if bias else None)
    dx, dw, db = ops.matmul_backward(to_ours(dy), to_ours(x), to_ours(w), bias=bias)
    res = torch_both(lambda x, w, *b: F.linear(x, w, *b), (x, w) + ((bvec,) if bias else ()), dy, prec)
    check_all(("out", "dx", "dweight", "dbias")[:3 + bias], (out, dx, dw, db), res, prec)


# (N, C, OC): a small shape, one whose sizes are no multiple of 8 (cuBLASLt's edge tiles), and on a GPU fc's of
# GPT-2 at B*T 4096 (the tiles, and perhaps the split of K, that the training step's product takes).
ACCUMULATE_CASES = [pytest.param(d, e, s, marks=m, id=f"{d}-{e}-{s[0]}x{s[1]}x{s[2]}")
                    for d, m, paths in (("cpu", (), (None,)), ("cuda", needs_cuda, ("epilogue", "kernel", "tuned")))
                    for e in paths
                    for s in ((256, 64, 192), (77, 40, 50)) + (((4096, 768, 3072),) if d == "cuda" else ())]


@pytest.mark.parametrize("device,path,shape", ACCUMULATE_CASES)
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_matmul_backward_accumulates(rng, prec, device, path, shape):
    # The engine's contract (cuda/ops.h): dweight and dbias accumulate in fp32 over micro-steps. On a GPU in 16-bit
    # the bias gradient is the column-sum kernel (the default), or cuBLASLt's epilogue of the weight gradient's
    # product, which writes its sum (fastgpt adds it; matmul_bias_grad_epilogue(True)); "tuned": the epilogue with
    # matmul_autotune, whose timing runs (the first call) must not add to dweight or dbias. Two micro-steps into
    # buffers already holding values: each increment must be the float64 one of the same 16-bit inputs within fp32
    # accumulation error, a bound that a lost increment, an overwrite or a gradient rounded to 16 bits (~1e-3) would
    # break.
    N, C, OC = shape
    tdt = DTYPES[prec]
    x, w = half(rng, (N, C), tdt, device=device), half(rng, (OC, C), tdt, 0.1, device=device)
    dys = [half(rng, (N, OC), tdt, device=device) for _ in range(2)]
    dw0, db0 = (torch.tensor(rng.standard_normal(s), dtype=torch.float32) for s in ((OC, C), (OC,)))
    dw, db = (t.clone().to(device) if device == "cuda" else t.numpy().copy() for t in (dw0, db0))
    dx = torch.empty_like(x)
    before = ops.matmul_bias_grad_epilogue(path != "kernel") if path else None
    tune_before = ops.matmul_autotune(path == "tuned") if path else None
    try:
        for dy in dys:
            d = ops._where(*(to_ours(t) for t in (dy, x, w)))
            ops._ops.matmul_backward(*(d.arg(a) for a in (to_ours(dx), dw, db, to_ours(dy), to_ours(x), to_ours(w))),
                                     d.stream)
    finally:
        if path:
            ops.matmul_bias_grad_epilogue(before)
            ops.matmul_autotune(tune_before)
    dy64 = sum(f64(dy) for dy in dys)
    rel = lambda a, a0, ref: rel_err(f64(a) - f64(a0), ref)  # the increment, against float64's
    assert rel(dw, dw0, dy64.T @ f64(x)) <= 2e-5, "dweight"
    assert rel(db, db0, dy64.sum(0)) <= 2e-5, "dbias"


def test_matmul_bias_grad_epilogue_setting():
    check_cuda_switch(ops.matmul_bias_grad_epilogue, False)


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False])
def test_matmul_gelu(rng, prec, bias, device):
    # The fused model's MLP: fc + GELU forward, fc_proj's backward through the GELU. On a GPU these are cuBLASLt
    # epilogues, which apply the GELU (and its derivative) to the fp32 accumulator before the one rounding.
    tdt = DTYPES[prec]
    x, w1 = half(rng, (3, 40, 64), tdt, device=device), half(rng, (128, 64), tdt, 0.2, device=device)
    w2 = half(rng, (64, 128), tdt, 0.1, device=device)
    b1, b2 = (half(rng, (128,), tdt, 0.1, device=device), half(rng, (64,), tdt, 0.1, device=device)) if bias else \
        (None, None)
    dh, dy = half(rng, (3, 40, 128), tdt, device=device), half(rng, (3, 40, 64), tdt, device=device)
    h, pre = ops.matmul_forward_gelu(to_ours(x), to_ours(w1), to_ours(b1) if bias else None)
    fwd = torch_both(lambda x, w, *b: F.gelu(F.linear(x, w, *b), approximate="tanh"),
                     (x, w1) + ((b1,) if bias else ()), dh, prec)
    check("out", h, fwd[tdt][0], f64(fwd[torch.float64][0]), prec)
    pre_half = F.linear(x, w1, b1)
    check("pre", pre, pre_half, F.linear(f64(x), f64(w1), f64(b1) if bias else None), prec)
    # backward from the pre-activation fastgpt kept, against torch's from the same values
    pre_t = torch.from_numpy(np.asarray(pre, dtype=np.float32)).to(tdt) if device == "cpu" else pre
    dpre, dw2, db2 = ops.matmul_backward_dgelu(to_ours(dy), h, to_ours(w2), pre, bias=bias)
    bwd = torch_both(lambda p, w, *b: F.linear(F.gelu(p, approximate="tanh"), w, *b),
                     (pre_t, w2) + ((b2,) if bias else ()), dy, prec)
    check_all(("y", "dpre", "dweight", "dbias")[1:3 + bias], (dpre, dw2, db2),
              {k: v[1:] for k, v in bwd.items()}, prec)


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_gelu(rng, prec, device):
    tdt = DTYPES[prec]
    x, dy = half(rng, (5000,), tdt, 2.0, device=device), half(rng, (5000,), tdt, device=device)
    out = ops.gelu_forward(to_ours(x))
    dx = ops.gelu_backward(to_ours(dy), to_ours(x))
    res = torch_both(lambda x: F.gelu(x, approximate="tanh"), (x,), dy, prec)
    check_all(("out", "dx"), (out, dx), res, prec)


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_embedding(rng, prec, device):
    tdt = DTYPES[prec]
    V, maxT, C, B, T = 300, 24, 48, 3, 20
    idx = torch.tensor(rng.integers(0, V, (B, T)), device=device)
    wte, wpe = half(rng, (V, C), tdt, device=device), half(rng, (maxT, C), tdt, device=device)
    dy = half(rng, (B, T, C), tdt, device=device)
    out = ops.embedding_forward(idx if device == "cuda" else idx.numpy(), to_ours(wte), to_ours(wpe))
    dwte, dwpe = ops.embedding_backward(to_ours(dy), idx if device == "cuda" else idx.numpy(), V, maxT)
    res = torch_both(lambda a, b: F.embedding(idx, a) + b[:T], (wte, wpe), dy, prec)
    check_all(("out", "dwte", "dwpe"), (out, dwte, dwpe), res, prec)


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
@pytest.mark.parametrize("T,NH,hs", [(37, 3, 16), (64, 2, 64)])
def test_attention(rng, prec, T, NH, hs, device):
    tdt = DTYPES[prec]
    B, C = 2, NH * hs
    qkv, dy = half(rng, (B, T, 3 * C), tdt, device=device), half(rng, (B, T, C), tdt, device=device)
    out, lse = ops.attention_forward(to_ours(qkv), NH)
    dqkv = ops.attention_backward(to_ours(dy), to_ours(qkv), out, lse, NH)
    def sdpa(a):
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in a.split(C, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)

    res = torch_both(sdpa, (qkv,), dy, prec)
    check_all(("out", "dqkv"), (out, dqkv), res, prec)


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cross_entropy(rng, prec, device):
    tdt = DTYPES[prec]
    N, V = 64, 1000  # 1/N exact in 16 bits: torch's half backward then starts from the exact mean gradient
    logits = half(rng, (N, V), tdt, 3.0, device=device)
    targets = torch.tensor(rng.integers(0, V, (N,)), device=device)
    tg = targets if device == "cuda" else targets.numpy()
    loss, losses, lse = ops.cross_entropy_forward(to_ours(logits), tg)
    dlogits = ops.cross_entropy_backward(to_ours(logits), tg, lse)
    res = torch_both(lambda a: F.cross_entropy(a, targets, reduction="none"), (logits,),
                     torch.full((N,), 1.0 / N, device=device), prec)  # backward of the mean
    assert str(losses.dtype).endswith("float32")  # statistics stay fp32
    check_all(("losses", "dlogits"), (losses, dlogits), res, prec)
    assert abs(loss - res[torch.float64][0].mean().item()) <= 1e-5 * res[torch.float64][0].mean().item() + \
        2 * abs(res[tdt][0].float().mean().item() - res[torch.float64][0].mean().item())


@pytest.mark.parametrize("device", device_cases())
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cross_entropy_forward_backward(rng, prec, device):
    tdt = DTYPES[prec]
    N, V = 64, 1000
    logits = half(rng, (N, V), tdt, 3.0, device=device)
    targets = torch.tensor(rng.integers(0, V, (N,)), device=device)
    tg = targets if device == "cuda" else targets.numpy()
    loss, losses, dlogits = ops.cross_entropy_forward_backward(to_ours(logits), tg)
    res = torch_both(lambda a: F.cross_entropy(a, targets, reduction="none"), (logits,),
                     torch.full((N,), 1.0 / N, device=device), prec)
    assert str(losses.dtype).endswith("float32")  # statistics stay fp32, the gradient is the logits' type
    assert str(dlogits.dtype).endswith({"bf16": "bfloat16", "fp16": "float16"}[prec])
    check_all(("losses", "dlogits"), (losses, dlogits), res, prec)


def test_mixed_dtypes_are_refused(rng):
    x = half(rng, (4, 8), torch.bfloat16)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="weight must have the same dtype as x"):
        ops.layernorm_forward(to_ours(x), w.numpy(), w.numpy())
    with pytest.raises(ValueError, match="must have the same dtype"):
        ops.matmul_forward(to_ours(x), to_ours(half(rng, (3, 8), torch.float16)))


def test_cpu_torch_half_tensors_are_taken(rng):
    # CPU torch bf16/fp16 tensors go in as they are (bits reinterpreted), and come back as NumPy of that dtype.
    for tdt, np_dtype in ((torch.bfloat16, ml_dtypes.bfloat16), (torch.float16, np.float16)):
        x = half(rng, (6, 16), tdt, 2.0)
        out = ops.gelu_forward(x)
        assert out.dtype == np_dtype
        ref = F.gelu(x.double(), approximate="tanh")
        assert rel_err(f64(out), ref) <= 2 * rel_err(f64(F.gelu(x, approximate="tanh")), ref) + SLACK[
            "bf16" if tdt == torch.bfloat16 else "fp16"]
