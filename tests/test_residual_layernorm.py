"""residual_layernorm: the residual add fused with the LayerNorm after it (res = a + b, out = layernorm(res)), the
op the fused model runs at every skip connection. Checked against PyTorch in float64, forward and backward (its
backward is layernorm_backward into the residual gradient), and for giving the bits of the two ops it replaces on
each device: res is a + b rounded once, and out, mean and rstd are layernorm_forward's on that res."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, bits, host, on
from reference_gpt import rel_err

TOL = 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 32, 64), (3, 17, 48), (1, 1, 7), (2, 5, 768)])
def test_residual_layernorm_forward_backward(rng, shape, device):
    C = shape[-1]
    a = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    w, bias = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    dres, dout = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)

    res, out, mean, rstd = ops.residual_layernorm_forward(*(on(device, t) for t in (a, b, w, bias)))
    # The residual stream's gradient reaches res from above (dres) and through the LayerNorm (dx): both flow on to
    # a and b unchanged.
    dx, dw, db = ops.layernorm_backward(on(device, dout), res, on(device, w), mean, rstd)
    res, out, mean, rstd, dx, dw, db = map(host, (res, out, mean, rstd, dx, dw, db))
    da = dres + dx

    at, bt, wt, biast = (torch.tensor(t, dtype=torch.float64, requires_grad=True) for t in (a, b, w, bias))
    ref_res = at + bt
    ref_out = F.layer_norm(ref_res, (C,), wt, biast, eps=1e-5)
    torch.autograd.backward([ref_res, ref_out], [torch.tensor(dres, dtype=torch.float64),
                                                 torch.tensor(dout, dtype=torch.float64)])
    assert res.shape == out.shape == shape and res.dtype == out.dtype == np.float32
    assert rel_err(res, ref_res.detach()) < TOL
    assert rel_err(out, ref_out.detach()) < TOL
    assert rel_err(mean, ref_res.detach().mean(-1).reshape(-1)) < TOL
    assert rel_err(da, at.grad) < TOL and rel_err(da, bt.grad) < TOL
    assert rel_err(dw, wt.grad) < TOL
    assert rel_err(db, biast.grad) < TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_residual_layernorm_gives_the_unfused_bits(rng, dtype, device):
    # What the fused model computes must be what the unfused one does, rounding for rounding: res is a + b summed in
    # float and rounded once to the storage type, and the LayerNorm is layernorm_forward's on that res. Torch
    # tensors go in (the CPU takes 16-bit CPU tensors too), so the same inputs reach either device.
    shape, C = (3, 37, 96), 96
    a, b = (torch.tensor(rng.standard_normal(s) * k, dtype=torch.float32).to(dtype).to(device)
            for s, k in ((shape, 3.0), (shape, 1.0)))
    w, bias = (torch.tensor(rng.standard_normal(C), dtype=torch.float32).to(dtype).to(device) for _ in range(2))
    res, out, mean, rstd = ops.residual_layernorm_forward(a, b, w, bias)
    want_res = (a.float() + b.float()).to(dtype)
    assert np.array_equal(bits(res), bits(want_res))
    out2, mean2, rstd2 = ops.layernorm_forward(want_res, w, bias)
    assert np.array_equal(bits(out), bits(out2))
    assert np.array_equal(bits(mean), bits(mean2)) and np.array_equal(bits(rstd), bits(rstd2))


@pytest.mark.parametrize("device", DEVICES)
def test_residual_layernorm_deterministic(rng, device):
    a, b = rng.standard_normal((5, 129, 64)).astype(np.float32), rng.standard_normal((5, 129, 64)).astype(np.float32)
    w, bias = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    args = [on(device, t) for t in (a, b, w, bias)]
    first, second = ops.residual_layernorm_forward(*args), ops.residual_layernorm_forward(*args)
    for x, y in zip(first, second):
        assert np.array_equal(host(x), host(y))


def test_residual_layernorm_bad_input_names_the_argument():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="b and a must have the same shape"):
        ops.residual_layernorm_forward(x, np.ones((2, 5), np.float32), np.ones(4, np.float32), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="last dimension 5"):
        ops.residual_layernorm_forward(x, x, np.ones(5, np.float32), np.ones(5, np.float32))
    with pytest.raises(ValueError, match="weight and bias must be 1-D of the same length"):
        ops.residual_layernorm_forward(x, x, np.ones(4, np.float32), np.ones(3, np.float32))
    with pytest.raises(ValueError, match="b must have the same dtype as a"):
        ops.residual_layernorm_forward(x, x.astype(np.float16), np.ones(4, np.float32), np.ones(4, np.float32))
