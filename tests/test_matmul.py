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
