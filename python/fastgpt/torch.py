"""fastgpt.torch: fastgpt's flash attention as a differentiable PyTorch op, and a drop-in for build-nanogpt's
CausalSelfAttention, so fastgpt's attention kernels can run inside an ordinary PyTorch model and be compared with
F.scaled_dot_product_attention there. torch is optional for fastgpt, so `import fastgpt` does not import this module:

    from fastgpt.torch import flash_attention, use_flash_attention
    y = flash_attention(q, k, v, causal=True)   # (B, H, T, d), like F.scaled_dot_product_attention(is_causal=True)
    model = use_flash_attention(model)          # swap every build-nanogpt CausalSelfAttention for ours, same weights

CPU tensors run fastgpt's float32 CPU kernels; CUDA tensors (float32, bfloat16, float16) run the CUDA kernels on the
current stream. Results come back in the dtype and on the device of q.
"""
import torch
import torch.nn as nn

from . import ops

_SHAPES = {"bhtd": "(B, H, T, d)", "bthd": "(B, T, H, d)"}


def _tensor(a, like, dtype=None):
    # The CPU ops return NumPy float32 arrays; the CUDA ops already return torch tensors of the input dtype.
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
    return t.to(device=like.device, dtype=dtype or like.dtype)


def _check(q, k, v, layout):
    # Checked here, not only in the op, so errors name the argument before any conversion to NumPy or DLPack.
    if layout not in _SHAPES:
        raise ValueError(f"layout must be 'bhtd' or 'bthd', got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {_SHAPES[layout]}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all three must be on one device")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: all three must have one dtype")


class FlashAttentionFunction(torch.autograd.Function):
    """autograd around ops.flash_attention_forward/backward; saves q, k, v, out and the log-sum-exp (B, H, T)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, layout, deterministic):
        # Detached: DLPack (the CUDA path) refuses tensors that require grad; no copy is made.
        q, k, v = q.detach(), k.detach(), v.detach()
        out, lse = ops.flash_attention_forward(q, k, v, causal=causal, layout=layout)
        out, lse = _tensor(out, q), _tensor(lse, q, torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.layout, ctx.deterministic = causal, layout, deterministic
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # One kernel computes dq, dk and dv together, so it runs if any is needed; unneeded ones are dropped.
        grads = ops.flash_attention_backward(dout.detach().to(q.dtype), q, k, v, out, lse, causal=ctx.causal,
                                             layout=ctx.layout, deterministic=ctx.deterministic)
        return tuple(_tensor(g, q) if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])) + (
            None, None, None)


def flash_attention(q, k, v, causal=True, layout="bhtd", deterministic=None):
    """softmax(q k^T / sqrt(d)) v, differentiable. q, k, v: one shape, device and floating dtype; (B, H, T, d) as
    for F.scaled_dot_product_attention, or (B, T, H, d) with layout="bthd" (saves the head transposes). On a GPU,
    bfloat16/float16 need d 64 or 128; float32 runs as ops.flash_attention_forward's default fp32_math says (TF32
    tensor cores, three products per product: fp32-accurate, as torch's own float32 SDPA on these GPUs).
    deterministic (default: torch.are_deterministic_algorithms_enabled()) makes the GPU half-precision backward
    bit-reproducible; the CPU and float32 paths always are."""
    _check(q, k, v, layout)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return FlashAttentionFunction.apply(q, k, v, bool(causal), layout, bool(deterministic))


class CausalSelfAttention(nn.Module):
    """build-nanogpt's CausalSelfAttention (same constructor, submodule names and weights: state_dicts load both
    ways) with fastgpt's flash attention in place of F.scaled_dot_product_attention."""

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd ({config.n_embd}) must be a multiple of n_head ({config.n_head})")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        # The heads stay in (B, T, H, d) order (layout "bthd"): no transposes before or after the attention.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = flash_attention(q, k, v, causal=True, layout="bthd")
        return self.c_proj(y.reshape(B, T, C))


def _is_nanogpt_attention(m):
    return (type(m).__name__ == "CausalSelfAttention" and not isinstance(m, CausalSelfAttention)
            and all(hasattr(m, a) for a in ("c_attn", "c_proj", "n_head", "n_embd")))


def _check_replaceable(m, where):
    # The replacement computes c_proj(attention(c_attn(x))) and nothing else: a module that also drops out (nanoGPT's
    # attn_dropout / resid_dropout with dropout > 0) or holds other submodules would silently lose them.
    p = getattr(m, "dropout", 0.0)
    if isinstance(p, (int, float)) and p > 0:
        raise ValueError(f"{where} has dropout={p}: fastgpt's attention has none (build-nanogpt trains with 0); "
                         "build the model with dropout=0.0")
    for name, child in m.named_children():
        if name in ("c_attn", "c_proj") or (isinstance(child, nn.Dropout) and child.p == 0):
            continue
        what = f"dropout p={child.p}" if isinstance(child, nn.Dropout) else type(child).__name__
        raise ValueError(f"{where} has a submodule {name!r} ({what}) that fastgpt's attention would drop: only "
                         "c_attn, c_proj and dropouts of p=0 are replaced")


def _replacement(m):
    # Built without __init__ (which would allocate, and draw torch's RNG for, two Linears only to drop them): the
    # original Linear modules move over as they are, so weights, dtype, device and any bias=False survive, and the
    # Parameters stay the same objects: an optimizer built before the swap still updates the model.
    new = CausalSelfAttention.__new__(CausalSelfAttention)
    nn.Module.__init__(new)
    new.c_attn, new.c_proj, new.n_head, new.n_embd = m.c_attn, m.c_proj, m.n_head, m.n_embd
    return new.train(m.training)


def use_flash_attention(model):
    """Replace, in place, every build-nanogpt-style CausalSelfAttention in `model` (a module of a class by that name
    with c_attn, c_proj, n_head, n_embd) with fastgpt.torch.CausalSelfAttention on the same weights. Returns the
    model (the replacement itself if `model` is such a module). A module with dropout (nanoGPT's dropout > 0) or
    other submodules is refused with a ValueError, and the model is left as it was."""
    if _is_nanogpt_attention(model):
        _check_replaceable(model, "model")
        return _replacement(model)
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if _is_nanogpt_attention(child)]
    for parent, name, child in found:  # all checked before any is replaced: a refusal leaves the model as it was
        _check_replaceable(child, f"attention module {name!r} ({type(parent).__name__}.{name})")
    for parent, name, child in found:
        setattr(parent, name, _replacement(child))
    return model
