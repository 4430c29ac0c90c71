"""embedding (token + position, the model's encoder): fastgpt.ops forward and backward vs torch, with repeated
tokens so that the scatter-add of the backward is exercised."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

TOL = 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_forward_backward(rng, device):
    B, T, C, V, maxT = 4, 19, 24, 37, 32
    idx = rng.integers(0, V, (B, T))  # V small: many repeats
    wte = rng.standard_normal((V, C)).astype(np.float32)
    wpe = rng.standard_normal((maxT, C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)

    out = host(ops.embedding_forward(on(device, idx), on(device, wte), on(device, wpe)))
    dwte, dwpe = map(host, ops.embedding_backward(on(device, dout), on(device, idx), V, maxT))

    wt, pt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (wte, wpe))
    it = torch.tensor(idx)
    ref = F.embedding(it, wt) + F.embedding(torch.arange(T), pt)
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    assert rel_err(out, ref.detach()) < TOL
    assert rel_err(dwte, wt.grad) < TOL
    assert rel_err(dwpe, pt.grad) < TOL
