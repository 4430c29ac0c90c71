"""layernorm: fastgpt.ops forward and backward vs torch.nn.functional.layer_norm in float64."""
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, bits, check_cuda_switch, host, needs_cuda, on
from ptx import CSRC, compile_ptx, kernel_lines
from reference_gpt import rel_err

TOL = 1e-5


def wide(a):
    """A result (NumPy array, or torch tensor of any dtype on any device, bfloat16 included) as float64 NumPy."""
    return a.detach().double().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, np.float64)


# (3, 400, 24): 19 chunks of 64 rows for dweight/dbias, more than the 16 lanes their chunks are added in.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 32, 64), (3, 17, 48), (1, 1, 7), (2, 5, 768), (3, 400, 24)])
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


# dx_sum=True: also the column sums of dx, the bias gradient of a linear layer whose output's gradient dx is (the
# fused model's residual projections). Within float32 rounding of dx's float64 column sums, and the bits of
# matmul_backward's bias gradient of dout=dx where both take the same column-sum pass: on the CPU, and on a GPU in
# fp32. On a GPU in 16 bits the one-pass kernel sums dx as it writes it where its shared memory allows (an H100/H200
# at GPT-2's width), in its own order. dx,
# dweight and dbias are the bits of the call without it. (2, 700, 768): 22 chunks of 64 rows, 175 parts.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 700, 768), (3, 17, 40), (1, 1, 8)])
def test_layernorm_backward_dx_sum(rng, device, dtype, shape):
    C = shape[-1]
    make = lambda s, scale=1.0, shift=0.0: torch.tensor(rng.standard_normal(s) * scale + shift).to(dtype).to(device)
    x, w, b, dout = make(shape, 2.0, 0.5), make(C), make(C), make(shape)
    _, mean, rstd = ops.layernorm_forward(x, w, b)
    dx, dw, db, ds = ops.layernorm_backward(dout, x, w, mean, rstd, dx_sum=True)
    for got, want in zip((dx, dw, db), ops.layernorm_backward(dout, x, w, mean, rstd)):
        assert np.array_equal(bits(got), bits(want))
    ds = host(ds)
    assert ds.shape == (C,) and ds.dtype == np.float32
    exact = wide(dx).reshape(-1, C).sum(0)
    assert rel_err(ds, exact) < 1e-6
    inp = make((*shape[:-1], 5))
    _, _, want = ops.matmul_backward(dx, inp, make((C, 5)))
    if device == "cpu" or dtype == torch.float32:
        assert np.array_equal(bits(ds), bits(want)), "not the linear layer's column sums"
    with pytest.raises(TypeError, match="dx_sum must be True or False"):
        ops.layernorm_backward(dout, x, w, mean, rstd, dx_sum="yes")


def test_layernorm_one_pass_setting():
    check_cuda_switch(ops.layernorm_one_pass, True)


# On a GPU the forward keeps a row in registers where its width is a whole number of 16-byte packs, up to 1024
# (GPT-2 124M's 768, the widest 1024, a short row of 40), and reads it for each pass otherwise (1032: too wide; 100:
# not whole packs of 8 bf16 or fp16 values, whole packs of 4 fp32 ones), or when told. Both paths must match float64,
# and the fused residual + LayerNorm must give layernorm_forward's bits on its sum under either.
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(8, 1024, 768), (2, 33, 1024), (3, 67, 40), (3, 50, 1032), (2, 70, 100)])
def test_cuda_layernorm_forward_paths(rng, dtype, tol, shape):
    C = shape[-1]
    make = lambda s, scale=1.0, shift=0.0: torch.tensor(rng.standard_normal(s) * scale + shift).to(dtype).cuda()
    a, b, w, bias = make(shape, 2.0, 0.5), make(shape), make(C), make(C)
    res = (a.float() + b.float()).to(dtype)
    xt = res.double().cpu()
    ref = F.layer_norm(xt, (C,), w.double().cpu(), bias.double().cpu(), eps=1e-5)
    ref_mean = xt.mean(-1).reshape(-1)
    ref_rstd = (xt.var(-1, unbiased=False) + 1e-5).rsqrt().reshape(-1)
    for one_pass in (True, False):
        before = ops.layernorm_one_pass(one_pass)
        try:
            out, mean, rstd = ops.layernorm_forward(res, w, bias)
            fused = ops.residual_layernorm_forward(a, b, w, bias)
        finally:
            ops.layernorm_one_pass(before)
        assert rel_err(out.double().cpu(), ref) < tol, f"out, one_pass={one_pass}"
        assert rel_err(host(mean), ref_mean) < 1e-5 and rel_err(host(rstd), ref_rstd) < 1e-5, f"one_pass={one_pass}"
        for got, want, name in zip(fused, (res, out, mean, rstd), ("res", "out", "mean", "rstd")):
            assert np.array_equal(bits(got), bits(want)), \
                f"fused {name} differs from the unfused pair's, one_pass={one_pass}"


# On a GPU the backward reads each row once where it can (C a whole number of 16-byte packs, <= 1024: GPT-2 124M's
# 768 and a short row) and in two passes otherwise (1032: too wide; 100: not whole packs of 8 bf16 or fp16 values,
# whole packs of 4 fp32 ones), or when told.
# Both paths must give the same dweight/dbias bits (the same parts summed in the same order) and match float64.
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(8, 1024, 768), (3, 67, 40), (3, 50, 1032), (2, 70, 100)])
def test_cuda_layernorm_backward_paths(rng, dtype, tol, shape):
    C = shape[-1]
    make = lambda s, scale=1.0, shift=0.0: torch.tensor(rng.standard_normal(s) * scale + shift).to(dtype).cuda()
    x, w, b, dout = make(shape, 2.0, 0.5), make(C), make(C), make(shape)
    _, mean, rstd = ops.layernorm_forward(x, w, b)
    xt, wt, bt = (t.double().cpu().requires_grad_(True) for t in (x, w, b))
    F.layer_norm(xt, (C,), wt, bt, eps=1e-5).backward(dout.double().cpu())
    grads = []
    for one_pass in (True, False):
        before = ops.layernorm_one_pass(one_pass)
        try:
            dx, dw, db = ops.layernorm_backward(dout, x, w, mean, rstd)
        finally:
            ops.layernorm_one_pass(before)
        # dx as float64 (numpy has no bfloat16); dweight and dbias are float32.
        dx = dx.detach().double().cpu() if isinstance(dx, torch.Tensor) else np.asarray(dx, dtype=np.float64)
        dw, db = host(dw), host(db)
        assert rel_err(dx, xt.grad) < tol, f"dx, one_pass={one_pass}"
        assert rel_err(dw, wt.grad) < 1e-5, f"dweight, one_pass={one_pass}"
        assert rel_err(db, bt.grad) < 1e-5, f"dbias, one_pass={one_pass}"
        grads.append((dw, db))
    for (a, b), name in zip(zip(*grads), ("dweight", "dbias")):
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), f"{name}: the two paths' bits differ"


# dweight/dbias on a GPU are the CPU's bits, given the same inputs and the same mean and rstd: both sum the same
# floats in the same order (64-row chunks of 8-row parts, an fma a row; the chunks in double over 16 lanes of chunks,
# then the lanes in order). (8, 1024, 768): 128 chunks, one pass; (3, 400, 24): 19; (2, 70, 100): the two passes;
# (24, 1024, 768): 384 chunks, more than an H100's or H200's one-pass blocks (two an SM at this width in bf16, one in
# fp32), so that blocks take several in turn, their rows' ring running on from chunk to chunk. dx within rounding of
# the CPU's; in bf16 also with dx's column sums (the fused model's call), which change none of the bits.
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(8, 1024, 768), (3, 400, 24), (2, 70, 100), (24, 1024, 768)])
def test_cuda_layernorm_weight_grads_are_the_cpus_bits(rng, dtype, shape):
    C = shape[-1]
    make = lambda s, scale=1.0, shift=0.0: torch.tensor(rng.standard_normal(s) * scale + shift).to(dtype).cuda()
    x, w, b, dout = make(shape, 2.0, 0.5), make(C), make(C), make(shape)
    _, mean, rstd = ops.layernorm_forward(x, w, b)
    dx, dw, db = ops.layernorm_backward(dout, x, w, mean, rstd)
    cpu_dx, cpu_dw, cpu_db = ops.layernorm_backward(dout.cpu(), x.cpu(), w.cpu(), host(mean), host(rstd))
    for got, want, name in ((dw, cpu_dw, "dweight"), (db, cpu_db, "dbias")):
        got, want = host(got), np.asarray(want)
        assert rel_err(got, want) < 1e-6, name  # a gross difference first, then the bits
        assert np.array_equal(bits(got), bits(want)), f"{name}: the GPU's bits are not the CPU's"
    assert rel_err(wide(dx), wide(cpu_dx)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    if dtype == torch.bfloat16:
        *again, ds = ops.layernorm_backward(dout, x, w, mean, rstd, dx_sum=True)
        for got, want in zip(again, (dx, dw, db)):
            assert np.array_equal(bits(got), bits(want))
        assert rel_err(host(ds), wide(dx).reshape(-1, C).sum(0)) < 1e-6


# The one-pass backward at GPT-2's width in bf16 (three packs a lane), compiled for sm_90a, in its three forms. The
# ring kernels' rows come by cp.async, 9 a row (inp, dout and dinp, three packs each): two rows before the loop, one
# in it. In the loop, after the wait for all groups but the newest, the row and the weight are read from shared
# memory for the row's sums (9 16-byte loads before the sums' shuffles), read again with the row's dinp for the
# update (12 after them: the packs are not held in registers through the sums), and the row's dinp is stored (3)
# before the refill's first cp.async: the refill overwrites the slot those loads read, so the stores, which use
# every loaded value, must come first. No 16-byte
# global load but the weight's copy into shared memory. The form that also sums dinp (the fused model's projection
# bias gradients) adds each stored pack into the warp's sums in shared memory, two quarters a pack (6 16-byte loads
# and stores of floats), in the same stretch. The register kernel has no cp.async (it also runs before sm_80).
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_backward_ring_reads_rows_from_shared_memory_before_refilling(tmp_path):
    ptx = compile_ptx(CSRC / "cuda" / "layernorm.cu", tmp_path / "layernorm.ptx", "sm_90a", timeout=300)
    name = "layernorm_backward_one_pass_kernelINS_4bf16ELi3E"
    registers = kernel_lines(ptx, name + "Lb0ELb0E")
    for summed in (False, True):
        ring = kernel_lines(ptx, name + ("Lb1ELb1E" if summed else "Lb1ELb0E"))
        copies = [i for i, line in enumerate(ring) if line.startswith("cp.async.cg.shared.global")]
        assert len(copies) == 27, len(copies)
        waits = [i for i, line in enumerate(ring) if line.startswith("cp.async.wait_group")]
        assert [ring[i] for i in waits] == ["cp.async.wait_group 1;"], [ring[i] for i in waits]
        wait = waits[0]
        assert sum(i < wait for i in copies) == 18, "two rows fetched before the loop"
        refill = min(i for i in copies if i > wait)
        between = ring[wait:refill]
        count = lambda pattern: sum(bool(re.match(pattern, line)) for line in between)
        sums = [i for i, line in enumerate(between) if line.startswith("shfl.sync.bfly")]
        loads = [i for i, line in enumerate(between) if re.match(r"ld\.shared\.v(2\.u64|4\.u32)", line)]
        assert len(sums) == 10, "two warp sums of five shuffles"
        assert (sum(i < sums[0] for i in loads), sum(i > sums[-1] for i in loads), len(loads)) == (9, 12, 21)
        assert count(r"st\.global\.v(2\.u64|4\.u32)") == 3
        assert (count(r"ld\.shared\.v4\.f32"), count(r"st\.shared\.v4\.f32")) == ((6, 6) if summed else (0, 0))
        wide_global_loads = [line for line in ring if re.match(r"ld\.global(\.nc)?\.v(2\.u64|4\.u32)", line)]
        assert len(wide_global_loads) == 1, wide_global_loads
    assert not any("cp.async" in line for line in registers)
