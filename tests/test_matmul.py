"""matmul (nn.Linear): fastgpt.ops forward and backward vs torch in float64, with and without bias, including
shapes that are not multiples of any block size (the GEMM's edge tiles), and the few-row shapes of generation
(up to 4 rows: the CPU forward's matrix-vector path; 5 rows: the GEMM again)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

TOL = 1e-5


@pytest.mark.parametrize("lead,C,OC", [((4, 32), 64, 192), ((3, 17), 48, 50), ((1, 1), 7, 3), ((2, 65), 129, 257),
                                       ((8, 16), 64, 50304), ((2, 2), 768, 2304), ((3,), 65, 50304), ((5,), 33, 70)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_matmul_forward_backward(rng, lead, C, OC, bias, device):
    x = rng.standard_normal(lead + (C,)).astype(np.float32)
    w = (rng.standard_normal((OC, C)) * 0.1).astype(np.float32)
    b = rng.standard_normal(OC).astype(np.float32) if bias else None
    dout = rng.standard_normal(lead + (OC,)).astype(np.float32)

    out = host(ops.matmul_forward(on(device, x), on(device, w), on(device, b)))
    dx, dw, db = map(host, ops.matmul_backward(on(device, dout), on(device, x), on(device, w), bias=bias))

    xt, wt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w))
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True) if bias else None
    ref = F.linear(xt, wt, bt)
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    assert out.shape == lead + (OC,)
    assert rel_err(out, ref.detach()) < TOL
    assert rel_err(dx, xt.grad) < TOL
    assert rel_err(dw, wt.grad) < TOL
    if bias:
        assert rel_err(db, bt.grad) < TOL
    else:
        assert db is None


# ---- the MLP's GELU fused into the products around it (matmul_forward_gelu, matmul_backward_dgelu): the fused
# model's fc + GELU forward, and fc_proj's backward through the GELU. On a GPU in 16-bit storage these are cuBLASLt
# epilogues (test_precision_ops.py checks them there); in float32 and on the CPU they are the two ops in turn.

@pytest.mark.parametrize("N,C,H", [(40, 32, 128), (17, 24, 52), (1, 8, 8), (130, 64, 256)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_matmul_gelu_forward_backward(rng, N, C, H, bias, device):
    # y = fc_proj(gelu(fc(x))): matmul_forward_gelu gives gelu(fc(x)) and fc(x); matmul_backward_dgelu, from dy,
    # gives the gradient of fc(x) and fc_proj's weight and bias gradients.
    x = rng.standard_normal((N, C)).astype(np.float32)
    w1, w2 = (rng.standard_normal((H, C)) * 0.3).astype(np.float32), (rng.standard_normal((C, H)) * 0.1).astype(
        np.float32)
    b1, b2 = (rng.standard_normal(H).astype(np.float32), rng.standard_normal(C).astype(np.float32)) if bias else (
        None, None)
    dy = rng.standard_normal((N, C)).astype(np.float32)
    h, pre = ops.matmul_forward_gelu(on(device, x), on(device, w1), on(device, b1))
    dpre, dw2, db2 = ops.matmul_backward_dgelu(on(device, dy), h, on(device, w2), pre, bias=bias)
    h, pre, dpre, dw2, db2 = map(host, (h, pre, dpre, dw2, db2))

    xt, w1t, w2t = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w1, w2))
    b1t, b2t = ((torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (b1, b2)) if bias else
                (None, None))
    ref_pre = F.linear(xt, w1t, b1t)
    ref_pre.retain_grad()
    ref_h = F.gelu(ref_pre, approximate="tanh")
    F.linear(ref_h, w2t, b2t).backward(torch.tensor(dy, dtype=torch.float64))
    assert h.shape == pre.shape == (N, H) and dpre.shape == (N, H)
    assert rel_err(pre, ref_pre.detach()) < TOL
    assert rel_err(h, ref_h.detach()) < TOL
    assert rel_err(dpre, ref_pre.grad) < TOL
    assert rel_err(dw2, w2t.grad) < TOL
    if bias:
        assert rel_err(db2, b2t.grad) < TOL
    else:
        assert db2 is None


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_gelu_is_the_two_ops_in_float32(rng, device):
    # float32 (the reference precision) never takes the epilogue: the results must be the unfused pair's bits.
    x, w1 = rng.standard_normal((33, 48)).astype(np.float32), (rng.standard_normal((96, 48)) * 0.2).astype(np.float32)
    b1, dy = rng.standard_normal(96).astype(np.float32), rng.standard_normal((33, 40)).astype(np.float32)
    w2 = (rng.standard_normal((40, 96)) * 0.2).astype(np.float32)
    x, w1, b1, w2, dy = (on(device, a) for a in (x, w1, b1, w2, dy))
    h, pre = ops.matmul_forward_gelu(x, w1, b1)
    pre2 = ops.matmul_forward(x, w1, b1)
    assert np.array_equal(host(pre), host(pre2))
    assert np.array_equal(host(h), host(ops.gelu_forward(pre2)))
    dpre, dw2, db2 = ops.matmul_backward_dgelu(dy, h, w2, pre)
    dh, dw2b, db2b = ops.matmul_backward(dy, h, w2)
    assert np.array_equal(host(dpre), host(ops.gelu_backward(dh, pre)))
    assert np.array_equal(host(dw2), host(dw2b)) and np.array_equal(host(db2), host(db2b))


def test_matmul_gelu_bad_input_names_the_argument():
    x, w = np.ones((4, 8), np.float32), np.ones((16, 8), np.float32)
    with pytest.raises(ValueError, match="x must have last dimension 8"):
        ops.matmul_forward_gelu(np.ones((4, 7), np.float32), w)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        ops.matmul_forward_gelu(x, w, np.ones(15, np.float32))
    h, pre = ops.matmul_forward_gelu(x, w)
    with pytest.raises(ValueError, match="pre and x must have the same shape"):
        ops.matmul_backward_dgelu(np.ones((4, 8), np.float32), h, np.ones((8, 16), np.float32), pre[:, :8])
    with pytest.raises(ValueError, match="pre must have the same dtype as x"):
        ops.matmul_backward_dgelu(np.ones((4, 8), np.float32), h, np.ones((8, 16), np.float32),
                                  pre.astype(np.float16))
