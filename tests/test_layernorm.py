"""layernorm: fastgpt.ops forward and backward vs torch.nn.functional.layer_norm in float64."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

TOL = 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 32, 64), (3, 17, 48), (1, 1, 7), (2, 5, 768)])
def test_layernorm_forward_backward(rng, shape, device):
    C = shape[-1]
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    w = rng.standard_normal(C).astype(np.float32)
    b = rng.standard_normal(C).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)

    out, mean, rstd = ops.layernorm_forward(on(device, x), on(device, w), on(device, b))
    dx, dw, db = ops.layernorm_backward(on(device, dout), on(device, x), on(device, w), mean, rstd)
    out, mean, rstd, dx, dw, db = map(host, (out, mean, rstd, dx, dw, db))

    xt, wt, bt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    ref = F.layer_norm(xt, (C,), wt, bt, eps=1e-5)
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    assert out.shape == shape and out.dtype == np.float32
    assert rel_err(out, ref.detach()) < TOL
    assert rel_err(mean, xt.detach().mean(-1).reshape(-1)) < TOL
    assert rel_err(dx, xt.grad) < TOL
    assert rel_err(dw, wt.grad) < TOL
    assert rel_err(db, bt.grad) < TOL


@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_deterministic(rng, device):
    x = rng.standard_normal((5, 129, 64)).astype(np.float32)
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    x, w, b, dout = (on(device, a) for a in (x, w, b, dout))
    out, mean, rstd = ops.layernorm_forward(x, w, b)
    first = ops.layernorm_backward(dout, x, w, mean, rstd)
    second = ops.layernorm_backward(dout, x, w, mean, rstd)
    for a, c in zip(first, second):
        assert np.array_equal(host(a), host(c))
