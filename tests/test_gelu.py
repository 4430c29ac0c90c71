"""gelu (tanh approximation): fastgpt.ops forward and backward vs torch in float64."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on

TOL = 1e-5


@pytest.mark.parametrize("shape", [(4, 32, 256), (3, 17, 5), (1,), (1000,)])
@pytest.mark.parametrize("device", DEVICES)
def test_gelu_forward_backward(rng, shape, device):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)
    out = host(ops.gelu_forward(on(device, x)))
    dx = host(ops.gelu_backward(on(device, dout), on(device, x)))
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ref = F.gelu(xt, approximate="tanh")
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    assert out.shape == shape
    # Relative to the reference, with a floor of 1e-9 per element: below x ~ -7 GELU and its gradient are ~1e-13 and
    # fp32's 1 + tanh(u) cancels to a few ulps of 1 (torch's fp32 GELU too), so a lone such element (shape (1,))
    # has a relative error of 1e-3 that says nothing of the kernel.
    floor = 1e-9 * np.sqrt(x.size)
    for got, want in ((out, ref.detach()), (dx, xt.grad)):
        want = want.numpy()
        assert np.linalg.norm(np.asarray(got, np.float64) - want) <= TOL * np.linalg.norm(want) + floor
