"""attention: fastgpt.ops forward and backward on the fused qkv (B, T, 3C) vs torch's scaled_dot_product_attention
in float64, causal and not, odd head counts and lengths; lse checked against logsumexp of the scores."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, bits, host, needs_cuda, on
from reference_gpt import lse_err, rel_err

TOL = 1e-5


def torch_attention(qkv, n_head, causal):
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scores = q @ k.transpose(-1, -2) / math.sqrt(C // n_head)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return y.transpose(1, 2).reshape(B, T, C), torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("B,T,n_head,hs", [(2, 32, 4, 16), (3, 17, 3, 8), (1, 1, 1, 4), (2, 100, 5, 12),
                                           (1, 64, 12, 64)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_attention_forward_backward(rng, B, T, n_head, hs, causal, device):
    C = n_head * hs
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)

    out, lse = ops.attention_forward(on(device, qkv), n_head, causal=causal)
    dqkv = ops.attention_backward(on(device, dout), on(device, qkv), out, lse, n_head, causal=causal)
    out, lse, dqkv = map(host, (out, lse, dqkv))

    qt = torch.tensor(qkv, dtype=torch.float64, requires_grad=True)
    ref, ref_lse = torch_attention(qt, n_head, causal)
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    assert out.shape == (B, T, C) and lse.shape == (B, n_head, T) and dqkv.shape == qkv.shape
    assert rel_err(out, ref.detach()) < TOL
    assert lse_err(lse, ref_lse.detach()) < TOL
    assert rel_err(dqkv, qt.grad) < TOL


def test_attention_is_causal(rng):
    # Changing a future token must not change earlier outputs.
    qkv = rng.standard_normal((1, 10, 3 * 8)).astype(np.float32)
    out1, _ = ops.attention_forward(qkv, 2)
    qkv[0, 7:] = rng.standard_normal((3, 24)).astype(np.float32)
    out2, _ = ops.attention_forward(qkv, 2)
    assert np.array_equal(out1[0, :7], out2[0, :7])
    assert not np.array_equal(out1[0, 7:], out2[0, 7:])



@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=needs_cuda),
                                          pytest.param("cuda", torch.float16, marks=needs_cuda)])
def test_attention_backward_bias_grad(rng, device, dtype):
    # bias_grad: the fused model's qkv bias gradient, the column sums of dqkv. On an H100/H200 in 16 bits the K and V
    # thirds come from the attention kernel's tiles (kv_sums): within fp32 summation of float64's sums of the dqkv
    # returned (a missing scale, head, warp or key block is off by far more), and the Q third, summed by the
    # column-sum kernel over rows 3C apart, matmul_backward's bits. Elsewhere all of it is matmul_backward's bits.
    # Head size 64 (the Hopper kernel's), T not a whole number of its 128-key blocks, several (b, h).
    B, T, n_head, hs = 2, 300, 3, 64
    C = n_head * hs

    def arr(a):  # float32 NumPy on the CPU, a dtype tensor on the GPU
        return a if device == "cpu" else torch.from_numpy(a).to(device="cuda", dtype=dtype)

    qkv = arr(rng.standard_normal((B, T, 3 * C)).astype(np.float32))
    dout = arr(rng.standard_normal((B, T, C)).astype(np.float32))
    out, lse = ops.attention_forward(qkv, n_head)
    dqkv, db = ops.attention_backward(dout, qkv, out, lse, n_head, bias_grad=True)
    plain = ops.attention_backward(dout, qkv, out, lse, n_head)
    ones = np.ones((B * T, 8), np.float32)
    _, _, db_ref = ops.matmul_backward(dqkv.reshape(B * T, 3 * C), arr(ones), arr(ones[: 3 * C]))
    assert np.array_equal(bits(dqkv), bits(plain))  # asking for the sums changes nothing else
    # (a bf16 tensor has no NumPy twin: widened on its device)
    d64 = host(dqkv.double() if isinstance(dqkv, torch.Tensor) else dqkv.astype(np.float64)).reshape(-1, 3 * C)
    db, db_ref = host(db), host(db_ref)
    assert db.dtype == np.float32 and db.shape == (3 * C,)
    assert np.max(np.abs(db - d64.sum(0)) / (np.abs(d64).sum(0) + 1.0)) < 1e-5
    assert np.array_equal(db[:C], db_ref[:C])
    if device == "cpu":
        assert np.array_equal(db, db_ref)
