"""adamw: fastgpt.ops.adamw_update over several steps vs torch.optim.AdamW (same lr, betas, eps, decay)."""
import numpy as np
import pytest
import torch

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

TOL = 1e-5


@pytest.mark.parametrize("n,weight_decay", [(1000, 0.1), (4097, 0.0), (1, 0.5)])
@pytest.mark.parametrize("device", DEVICES)
def test_adamw_matches_torch(rng, n, weight_decay, device):
    lr, betas, eps = 1e-2, (0.9, 0.95), 1e-8
    p = rng.standard_normal(n).astype(np.float32)
    p, m, v = on(device, p), on(device, np.zeros(n, np.float32)), on(device, np.zeros(n, np.float32))
    pt = torch.nn.Parameter(torch.tensor(host(p)))
    opt = torch.optim.AdamW([pt], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for step in range(1, 6):
        g = rng.standard_normal(n).astype(np.float32)
        ops.adamw_update(p, on(device, g), m, v, step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        pt.grad = torch.tensor(g)
        opt.step()
        assert rel_err(host(p), pt.detach()) < TOL
        state = opt.state[pt]
        assert rel_err(host(m), state["exp_avg"]) < TOL
        assert rel_err(host(v), state["exp_avg_sq"]) < TOL


def test_adamw_rejects_non_writeable(rng):
    p = np.ones(4, np.float64)
    with pytest.raises(TypeError, match="param"):
        ops.adamw_update(p, p, np.zeros(4, np.float32), np.zeros(4, np.float32), 1)
