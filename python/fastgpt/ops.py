"""fastgpt.ops: each kernel of the engine, forward and backward, on arrays, so every op can be checked against
PyTorch on its own. Inputs may be NumPy arrays or CPU torch tensors; outputs are NumPy float32 arrays.
Gradients of parameters are returned fresh (the engine accumulates them; here they start from zero).
"""
import numpy as np

from . import _C
from ._convert import as_float32, as_ids, check_float, check_int

_ops = _C.ops


def embedding_forward(idx, wte, wpe):
    """Token + position embedding: idx (B, T) -> (B, T, C)."""
    return _ops.encoder_forward(as_ids(idx, "idx", ndim=2), as_float32(wte, "wte"), as_float32(wpe, "wpe"))


def embedding_backward(dout, idx, vocab_size, block_size):
    """-> (dwte (vocab_size, C), dwpe (block_size, C))."""
    return _ops.encoder_backward(as_float32(dout, "dout"), as_ids(idx, "idx", ndim=2),
                                 check_int(vocab_size, "vocab_size", 1), check_int(block_size, "block_size", 1))


def layernorm_forward(x, weight, bias):
    """x (..., C) -> (out (..., C), mean (N,), rstd (N,)), eps 1e-5."""
    return _ops.layernorm_forward(as_float32(x, "x"), as_float32(weight, "weight"), as_float32(bias, "bias"))


def layernorm_backward(dout, x, weight, mean, rstd):
    """-> (dx, dweight, dbias)."""
    return _ops.layernorm_backward(as_float32(dout, "dout"), as_float32(x, "x"), as_float32(weight, "weight"),
                                   as_float32(mean, "mean"), as_float32(rstd, "rstd"))


def matmul_forward(x, weight, bias=None):
    """nn.Linear: x (..., in) @ weight (out, in)^T + bias (out) -> (..., out)."""
    return _ops.matmul_forward(as_float32(x, "x"), as_float32(weight, "weight"),
                               None if bias is None else as_float32(bias, "bias"))


def matmul_backward(dout, x, weight, bias=True):
    """-> (dx, dweight, dbias or None)."""
    return _ops.matmul_backward(as_float32(dout, "dout"), as_float32(x, "x"), as_float32(weight, "weight"),
                                bool(bias))


def gelu_forward(x):
    """GELU, tanh approximation."""
    return _ops.gelu_forward(as_float32(x, "x"))


def gelu_backward(dout, x):
    return _ops.gelu_backward(as_float32(dout, "dout"), as_float32(x, "x"))


def attention_forward(qkv, n_head, causal=True):
    """Scaled dot-product attention on the fused projection qkv (B, T, 3C) = q | k | v, n_head heads.
    -> (out (B, T, C), lse (B, n_head, T)): lse is all backward needs besides the inputs."""
    return _ops.attention_forward(as_float32(qkv, "qkv"), check_int(n_head, "n_head", 1), bool(causal))


def attention_backward(dout, qkv, out, lse, n_head, causal=True):
    """-> dqkv (B, T, 3C)."""
    return _ops.attention_backward(as_float32(dout, "dout"), as_float32(qkv, "qkv"), as_float32(out, "out"),
                                   as_float32(lse, "lse"), check_int(n_head, "n_head", 1), bool(causal))


def cross_entropy_forward(logits, targets):
    """logits (..., V), targets (...) -> (mean loss, losses (N,), lse (N,))."""
    losses, lse = _ops.cross_entropy_forward(as_float32(logits, "logits"), as_ids(targets, "targets"))
    return float(np.mean(losses, dtype=np.float64)) if losses.size else float("nan"), losses, lse


def cross_entropy_backward(logits, targets, lse, grad=1.0):
    """Gradient of grad * mean cross-entropy with respect to logits."""
    logits = as_float32(logits, "logits")
    n = max(1, logits.size // max(1, logits.shape[-1]))
    return _ops.cross_entropy_backward(logits, as_ids(targets, "targets"), as_float32(lse, "lse"),
                                       check_float(grad, "grad") / n)


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
    """One torch.optim.AdamW update, in place on param, exp_avg and exp_avg_sq (float32 contiguous NumPy arrays).
    step counts updates including this one."""
    for name, a in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable):
            raise TypeError(f"{name} is updated in place: it must be a writeable C-contiguous float32 NumPy array")
    _ops.adamw_update(param, as_float32(grad, "grad"), exp_avg, exp_avg_sq, check_float(lr, "lr", 0.0),
                      check_float(betas[0], "betas[0]", 0.0, 0.999999), check_float(betas[1], "betas[1]", 0.0, 0.999999),
                      check_float(eps, "eps", 0.0, low_open=True), check_float(weight_decay, "weight_decay", 0.0),
                      check_int(step, "step", 1))
