"""matmul (nn.Linear): fastgpt.ops forward and backward vs torch in float64, with and without bias, including
shapes that are not multiples of any block size (the GEMM's edge tiles), and the few-row shapes of generation
(up to 4 rows: the CPU forward's matrix-vector path; 5 rows: the GEMM again)."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, bits, check_cuda_switch, host, needs_cuda, on
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


# ---- matmul_autotune: cuBLASLt's candidate algorithms timed at each problem's first run on a GPU, the fastest kept
# by csrc/cuda/matmul_tune.h's rules.

def test_autotune_rules(tmp_path):
    # The rules against a fake clock (tests/cpp/matmul_tune_test.cpp; no GPU): a clear winner is taken, a 1% one is
    # not, failing candidates and slow outliers, the repeat count and the order of the timings.
    gxx = shutil.which("g++")
    if not gxx:
        pytest.skip("needs g++")
    root = Path(__file__).resolve().parent.parent
    exe = tmp_path / "matmul_tune_test"
    build = subprocess.run([gxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{root / 'csrc'}",
                            str(root / "tests" / "cpp" / "matmul_tune_test.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "failures 0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_matmul_autotune_setting():
    check_cuda_switch(ops.matmul_autotune, False)  # off by default: the heuristic's choice, as PyTorch
    if ops._C.built_with_cuda:
        assert isinstance(ops.matmul_autotune_report(), list)
    else:
        with pytest.raises(RuntimeError, match="no CUDA"):
            ops.matmul_autotune_report()


@needs_cuda
def test_cuda_matmul_autotune_times_each_problem_once_and_writes_only_the_real_run(rng):
    # A bf16 linear layer at a shape no other test uses, so its three products are new problems: the forward (bias
    # epilogue), dx, and dW accumulated into fp32 with beta = 1 (with the bias gradient's epilogue, BGRADB, where
    # matmul_bias_grad_epilogue(True)). Each is
    # timed at its first run with its outputs in scratch: dW, which starts at zero, must be the product added once
    # (a timing run into it would add it again), and the outputs must be those of the float64 product of the same
    # bf16 inputs within bf16 rounding. A second call makes no new decision and gives the same bits.
    N, C, OC = 1000, 192, 320
    x, w, b, dy = (torch.tensor(rng.standard_normal(s) * sc, dtype=torch.float32).to("cuda", torch.bfloat16)
                   for s, sc in (((N, C), 1.0), ((OC, C), 0.1), ((OC,), 0.1), ((N, OC), 1.0)))
    before = ops.matmul_autotune(True)
    try:
        n0 = len(ops.matmul_autotune_report())
        first = (ops.matmul_forward(x, w, b), *ops.matmul_backward(dy, x, w))
        n1 = len(ops.matmul_autotune_report())
        second = (ops.matmul_forward(x, w, b), *ops.matmul_backward(dy, x, w))
        report = ops.matmul_autotune_report()
    finally:
        ops.matmul_autotune(before)
    assert len(report) == n1, "a problem was timed twice"
    new = {(r["M"], r["N"], r["K"], r["epilogue"]): r for r in report[n0:n1]}
    # dW's product carries the bias gradient where cuBLASLt takes BGRADB, else it is a plain product
    assert len(new) == 3 and {(N, OC, C, "bias"), (N, C, OC, "none")} <= set(new), list(new)
    assert (OC, C, N, "bgradb") in new or (OC, C, N, "none") in new, list(new)
    for r in new.values():
        assert r["skipped"] == "" and r["reps"] >= 1 and 0 <= r["chosen"] < r["candidates"] <= 8, r
        assert 0 < r["ms"][r["chosen"]] <= r["ms"][0] or r["ms"][0] < 0, r  # never slower than the heuristic's
    for a, b2 in zip(first, second):
        assert np.array_equal(bits(a), bits(b2))
    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    out, dx, dw, db = first
    assert rel_err(out, x64 @ w64.T + b64) < 1e-2
    assert rel_err(dx, dy64 @ w64) < 1e-2
    assert rel_err(dw, dy64.T @ x64) < 1e-5, "dW: the product added once, in fp32"
    assert rel_err(db, dy64.sum(0)) < 1e-5, "dbias"
