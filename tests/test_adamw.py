"""adamw: fastgpt.ops.adamw_update over several steps vs torch.optim.AdamW (same lr, betas, eps, decay)."""
import numpy as np
import pytest
import torch

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

TOL = 1e-5


def err_over(out, ref, scale):
    """||out - ref|| / ||scale||: rel_err judged against the size of what was summed, not of the sum. A lone element
    of m can cancel to 1e-4 of its terms, and one rounding apart between two correct fp32 orders is then 2e-5 of it."""
    diff = torch.as_tensor(host(out)).double() - torch.as_tensor(ref).double()
    return (diff.norm() / torch.as_tensor(scale).double().norm()).item()


@pytest.mark.parametrize("n,weight_decay", [(1000, 0.1), (4097, 0.0), (1, 0.5)])
@pytest.mark.parametrize("device", DEVICES)
def test_adamw_matches_torch(rng, n, weight_decay, device):
    lr, betas, eps = 1e-2, (0.9, 0.95), 1e-8
    p = rng.standard_normal(n).astype(np.float32)
    p, m, v = on(device, p), on(device, np.zeros(n, np.float32)), on(device, np.zeros(n, np.float32))
    pt = torch.nn.Parameter(torch.tensor(host(p)))
    opt = torch.optim.AdamW([pt], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    m_size = np.zeros(n)  # float64: m's recurrence on |m| and |g|, the size of the terms m sums
    for step in range(1, 6):
        g = rng.standard_normal(n).astype(np.float32)
        ops.adamw_update(p, on(device, g), m, v, step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        pt.grad = torch.tensor(g)
        opt.step()
        m_size = betas[0] * m_size + (1 - betas[0]) * np.abs(g)
        # p moves by at most about lr a step, so a p that sits near 0 is judged against lr.
        assert err_over(p, pt.detach(), np.abs(pt.detach().numpy()) + lr) < TOL
        state = opt.state[pt]
        assert err_over(m, state["exp_avg"], m_size) < TOL
        assert rel_err(host(v), state["exp_avg_sq"]) < TOL  # v sums squares: nothing cancels


def test_adamw_rejects_non_writeable(rng):
    p = np.ones(4, np.float64)
    with pytest.raises(TypeError, match="param"):
        ops.adamw_update(p, p, np.zeros(4, np.float32), np.zeros(4, np.float32), 1)
