"""cross_entropy: fastgpt.ops mean loss, per-row losses and logit gradient vs torch.nn.functional.cross_entropy in
float64, including large-magnitude logits (the log-sum-exp must not overflow); forward_backward (the training
step's one-pass kernel) against the same reference and against the two separate kernels."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

TOL = 1e-5


def case(rng, N, V, scale):
    """Fresh logits (N, V) times scale, targets and a loss gradient."""
    return ((rng.standard_normal((N, V)) * scale).astype(np.float32), rng.integers(0, V, N),
            float(rng.uniform(0.5, 2.0)))


def check_against_torch(logits, targets, grad, loss, losses, dlogits):
    lt = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    tt = torch.tensor(targets)
    ref = F.cross_entropy(lt, tt)
    (ref * grad).backward()
    assert abs(loss - ref.item()) / abs(ref.item()) < TOL
    assert rel_err(losses, F.cross_entropy(lt.detach(), tt, reduction="none")) < TOL
    assert rel_err(dlogits, lt.grad) < TOL


@pytest.mark.parametrize("N,V,scale", [(64, 50304, 1.0), (17, 50257, 3.0), (1, 2, 1.0), (33, 1000, 40.0)])
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_forward_backward(rng, N, V, scale, device):
    logits, targets, grad = case(rng, N, V, scale)
    loss, losses, lse = ops.cross_entropy_forward(on(device, logits), on(device, targets))
    dlogits = host(ops.cross_entropy_backward(on(device, logits), on(device, targets), lse, grad=grad))
    check_against_torch(logits, targets, grad, loss, host(losses), dlogits)


def test_cross_entropy_batched_shape(rng):
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    loss, losses, _ = ops.cross_entropy_forward(logits, targets)
    ref = F.cross_entropy(torch.tensor(logits).view(-1, 11).double(), torch.tensor(targets).view(-1))
    assert losses.shape == (10,)
    assert abs(loss - ref.item()) < 1e-5 * abs(ref.item())


@pytest.mark.parametrize("N,V,scale", [(64, 50304, 1.0), (17, 50257, 3.0), (1, 2, 1.0), (33, 1000, 40.0)])
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_forward_backward_in_one_pass(rng, N, V, scale, device):
    logits, targets, grad = case(rng, N, V, scale)
    loss, losses, dlogits = ops.cross_entropy_forward_backward(on(device, logits), on(device, targets), grad=grad)
    losses, dlogits = host(losses), host(dlogits)
    check_against_torch(logits, targets, grad, loss, losses, dlogits)
    # The same function as the two kernels: on the CPU the same bits (one lse routine, one gradient routine); on a
    # GPU the running (max, sum) is merged in another order.
    _, losses2, lse = ops.cross_entropy_forward(on(device, logits), on(device, targets))
    dlogits2 = host(ops.cross_entropy_backward(on(device, logits), on(device, targets), lse, grad=grad))
    if device == "cpu":
        assert np.array_equal(losses, losses2) and np.array_equal(dlogits, dlogits2)
    else:
        assert rel_err(losses, host(losses2)) < 1e-6 and rel_err(dlogits, dlogits2) < 1e-6
