"""fastgpt.torch: flash_attention as a differentiable torch op, the drop-in CausalSelfAttention and
use_flash_attention, checked where they are meant to be used: against F.scaled_dot_product_attention (float64,
forward and gradients), against build-nanogpt's CausalSelfAttention on the same weights, and in 20 AdamW steps of the
reference GPT-2 (tests/reference_gpt.py) with and without fastgpt's attention from the same init (CPU float32; on a
GPU, bf16 autocast).
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt.torch import CausalSelfAttention, flash_attention, use_flash_attention
from devices import needs_cuda
from reference_gpt import CausalSelfAttention as RefAttention, RefConfig, RefGPT, rel_err

TOL = 1e-5


def randn(rng, *shape, dtype=torch.float32, requires_grad=False):
    a = rng.standard_normal(shape)
    a[a == 0] = 1e-3  # never zeros
    return torch.tensor(a, dtype=dtype, requires_grad=requires_grad)


@pytest.mark.parametrize("shape", [(2, 3, 17, 12), (1, 2, 70, 64), (1, 1, 1, 32)], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_sdpa_forward_and_gradients(rng, shape, causal):
    q, k, v = (randn(rng, *shape, requires_grad=True) for _ in range(3))
    dout = randn(rng, *shape)
    out = flash_attention(q, k, v, causal=causal)
    out.backward(dout)
    assert out.dtype == torch.float32 and out.shape == shape

    refs = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*refs, is_causal=causal)
    ref.backward(dout.double())
    assert rel_err(out.detach(), ref.detach()) < TOL
    for name, x, r in zip("qkv", (q, k, v), refs):
        if name in "qk" and shape[2] == 1:  # softmax over one key has no gradient: dq, dk are rounding noise
            assert x.grad.abs().max() < 1e-5
        else:
            assert rel_err(x.grad, r.grad) < TOL, name


def test_bthd_layout_and_partial_grads(rng):
    # (B, T, H, d) input gives the (B, T, H, d) transpose of the bhtd result; only the inputs that need a
    # gradient get one.
    q, k, v = (randn(rng, 2, 20, 3, 16) for _ in range(3))
    q.requires_grad_(True)
    out = flash_attention(q, k, v, layout="bthd")
    out.sum().backward()
    assert k.grad is None and v.grad is None and q.grad is not None
    qh = q.detach().transpose(1, 2).double().requires_grad_(True)
    ref = F.scaled_dot_product_attention(qh, k.transpose(1, 2).double(), v.transpose(1, 2).double(), is_causal=True)
    ref.sum().backward()
    assert rel_err(out.detach(), ref.detach().transpose(1, 2)) < TOL
    assert rel_err(q.grad, qh.grad.transpose(1, 2)) < TOL


def test_bfloat16_on_cpu_comes_back_bfloat16(rng):
    q, k, v = (randn(rng, 1, 2, 9, 8, dtype=torch.bfloat16) for _ in range(3))
    out = flash_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2  # bf16 rounding of the output: ~4e-3


def config(n_embd=64, n_head=4, **kw):
    return RefConfig(**{"block_size": 64, "vocab_size": 64, "n_layer": 2, "n_head": n_head, "n_embd": n_embd, **kw})


def test_causal_self_attention_is_a_drop_in(rng):
    torch.manual_seed(int(rng.integers(2**31)))
    ref, ours = RefAttention(config()), CausalSelfAttention(config())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    RefAttention(config()).load_state_dict(ours.state_dict())  # and back
    ref = ref.double()

    x = randn(rng, 3, 33, 64, requires_grad=True)
    xr = x.detach().double().requires_grad_(True)
    dy = randn(rng, 3, 33, 64)
    y, yr = ours(x), ref(xr)
    y.backward(dy)
    yr.backward(dy.double())
    assert rel_err(y.detach(), yr.detach()) < TOL
    assert rel_err(x.grad, xr.grad) < TOL
    for (name, p), pr in zip(ours.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, pr.grad) < TOL, name


def test_use_flash_attention_swaps_modules_and_keeps_parameters():
    torch.manual_seed(0)
    model = RefGPT(config())
    params = [id(p) for p in model.parameters()]
    assert use_flash_attention(model) is model
    kinds = [type(m) for m in model.modules() if type(m).__name__ == "CausalSelfAttention"]
    assert kinds == [CausalSelfAttention] * 2
    assert [id(p) for p in model.parameters()] == params  # the same Parameter objects: optimizers still apply
    alone = RefAttention(config())
    swapped = use_flash_attention(alone)  # a module that is itself the attention comes back replaced
    assert type(swapped) is CausalSelfAttention and swapped.c_attn is alone.c_attn and swapped.n_head == 4


def _nanogpt_style(dropout, extra=None):
    # nanoGPT's attention module keeps its dropout rate and two Dropout submodules beside c_attn and c_proj.
    class CausalSelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
            self.attn_dropout, self.resid_dropout = torch.nn.Dropout(dropout), torch.nn.Dropout(dropout)
            self.n_head, self.n_embd, self.dropout = 2, 16, dropout
            if extra is not None:
                self.extra = extra
    return torch.nn.Sequential(CausalSelfAttention())


def test_use_flash_attention_refuses_what_it_would_drop():
    # The replacement has no dropout and no other submodules: a module with them is refused, nothing is replaced.
    for model, say in ((_nanogpt_style(0.2), "dropout=0.2"),
                       (_nanogpt_style(0.0, torch.nn.LayerNorm(16)), "submodule 'extra' \\(LayerNorm\\)")):
        with pytest.raises(ValueError, match=say):
            use_flash_attention(model)
        assert type(model[0]) is not CausalSelfAttention  # left as it was
    model = _nanogpt_style(0.0)  # dropout 0 (nanoGPT's default, build-nanogpt's setting) is a no-op: replaced
    assert type(use_flash_attention(model)[0]) is CausalSelfAttention


def train(model, batches, steps, autocast=False):
    """build-nanogpt's step: AdamW (its two groups), clip 1.0, optionally bf16 autocast; -> every step's loss."""
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3)
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def random_batches(rng, n, B, T, vocab, device="cpu"):
    # A few fixed batches, revisited, so the loss really falls (the model memorizes them) within 20 steps.
    ids = torch.from_numpy(rng.integers(0, vocab, (n, B, T + 1))).to(device)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]


def test_twenty_training_steps_match_sdpa_cpu(rng):
    torch.manual_seed(int(rng.integers(2**31)))
    sdpa = RefGPT(config())
    flash = use_flash_attention(copy.deepcopy(sdpa))
    batches = random_batches(rng, 2, 8, 64, 64)
    ls, lf = train(sdpa, batches, 20), train(flash, batches, 20)
    print("per-step |loss difference|:", np.abs(lf - ls))
    assert ls[-1] < ls[0] - 0.3  # it learned (4.18 -> 3.62 typically), so the comparison means something
    # Measured over seeds: at most 4.8e-7 (float32 rounding: the two attentions sum in different orders, and the
    # optimizer carries it on). 1e-5 leaves 20x margin yet catches a real error in any gradient.
    assert np.abs(lf - ls).max() < 1e-5
    # All parameters as one vector (measured 1.4e-6 to 4.2e-6). Not per tensor: the key part of c_attn.bias has an
    # exactly zero gradient (softmax ignores a constant added to a row of scores), so both runs drive it with
    # rounding noise that AdamW normalizes to full-size steps; that slice differs by ~3e-4 relative in any pair.
    flat = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (flash, sdpa)]
    assert rel_err(*flat) < 5e-5


@needs_cuda
def test_twenty_training_steps_match_sdpa_bf16_autocast(rng):
    torch.manual_seed(int(rng.integers(2**31)))
    cfg = config(n_embd=256, n_head=4, block_size=256, vocab_size=512)  # head dim 64, as GPT-2's
    sdpa = RefGPT(cfg).cuda()
    flash = use_flash_attention(copy.deepcopy(sdpa))
    batches = random_batches(rng, 2, 8, 256, 512, device="cuda")
    ls, lf = train(sdpa, batches, 20, autocast=True), train(flash, batches, 20, autocast=True)
    print("per-step |loss difference|:", np.abs(lf - ls))
    assert ls[-1] < ls[0] - 0.3
    assert np.abs(lf - ls).max() < 2e-2  # bf16 rounding, which differs between the two kernels, grows with steps


# ---- bad input

def test_q_not_4d(rng):
    q = randn(rng, 2, 8, 4)
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attention(q, q, q)


def test_k_shape_mismatch(rng):
    q = randn(rng, 1, 2, 8, 4)
    with pytest.raises(ValueError, match="k must have q's shape"):
        flash_attention(q, q[:, :1], q)


def test_v_on_another_device(rng):
    q = randn(rng, 1, 2, 8, 4)
    with pytest.raises(ValueError, match="v is on meta but q is on cpu"):
        flash_attention(q, q, q.to("meta"))


def test_dtypes_mismatch(rng):
    q = randn(rng, 1, 2, 8, 4)
    with pytest.raises(TypeError, match="k has dtype torch.float64"):
        flash_attention(q, q.double(), q)


def test_integer_v(rng):
    q = randn(rng, 1, 2, 8, 4)
    with pytest.raises(TypeError, match="v must be a floating-point tensor"):
        flash_attention(q, q, q.long())


def test_not_a_tensor(rng):
    q = randn(rng, 1, 2, 8, 4)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attention(q, q.numpy(), q)


def test_bad_layout(rng):
    q = randn(rng, 1, 2, 8, 4)
    with pytest.raises(ValueError, match="layout must be"):
        flash_attention(q, q, q, layout="bhdt")
