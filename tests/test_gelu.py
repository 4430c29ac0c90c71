"""gelu (tanh approximation): fastgpt.ops forward and backward vs torch in float64."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

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
    assert rel_err(out, ref.detach()) < TOL
    assert rel_err(dx, xt.grad) < TOL
