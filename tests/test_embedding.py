"""embedding (token + position, the model's encoder): fastgpt.ops forward and backward vs torch, with repeated
tokens so that the scatter-add of the backward is exercised; on a GPU, the backward against the CPU's bits."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, needs_cuda, on
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


PIECE = 256  # cpu::kEncoderPiece (csrc/cpu/kernels.h): the sorted indices of a piece of dwte's order


def dwte_in_pieces(dwte, dout, idx):
    """dwte (V, C) float32 += dout's rows (N, C) by token idx (N,), in the documented order: positions sorted by
    token, stably; a run's rows in its first piece of PIECE sorted indices added one by one onto the row, each later
    piece summed from +0 and added onto the row in turn. float32 adds, one row at a time."""
    dwte = dwte.copy()
    order = np.argsort(idx, kind="stable")
    toks = idx[order]
    partial = {}
    start = 0
    for i, pos in enumerate(order):
        if i and toks[i] != toks[i - 1]:
            start = i
        row = dout[pos].astype(np.float32)
        if i // PIECE == start // PIECE:
            dwte[toks[i]] += row
        else:
            partial[i // PIECE] = partial.get(i // PIECE, np.zeros_like(row)) + row
    for p in sorted(partial):
        dwte[toks[p * PIECE]] += partial[p]
    return dwte


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_dwte_order_is_the_documented_pieces(rng, prec):
    """The CPU's dwte is the bits of the order cpu/kernels.h documents (the GPU's too: the warp emulator and
    test_cuda_backward_gives_the_cpus_bits hold the GPU to the CPU's bits). One token takes 45% of 2 x 700 positions:
    a run of about 630 rows over three or four pieces, begun mid-piece; one chain of adds in position order would
    differ in the last bits."""
    B, T, C, V = 2, 700, 24, 40
    idx = rng.integers(0, V, (B, T))
    idx[rng.random((B, T)) < 0.45] = V // 2
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    if prec == "bf16":
        dout = dout.astype(ml_dtypes.bfloat16)
    dwte0 = np.zeros((V, C), np.float32)  # embedding_backward's start
    want = dwte_in_pieces(dwte0, dout.reshape(-1, C), idx.reshape(-1))
    got = ops.embedding_backward(dout, idx, V, T)[0]
    assert np.array_equal(got, want), np.abs(got - want).max()
    # One chain a token in position order: the same sums, but (in fp32) not these bits, else the pieces went untested.
    # (bf16 rows have 8 significant bits: about 630 of them add exactly in float32, in any order.)
    flat = dwte0.copy()
    for pos, t in enumerate(idx.reshape(-1)):
        flat[t] += dout.reshape(-1, C)[pos].astype(np.float32)
    assert np.abs(flat - want).max() < 1e-4
    assert prec == "bf16" or not np.array_equal(flat, want)


@needs_cuda
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,T,C,V,offset", [(8, 1024, 768, 50304, 0), (2, 300, 33, 1000, 0), (2, 300, 64, 500, 1)],
                         ids=["gpt2", "odd-C", "2-byte-aligned"])
def test_cuda_backward_gives_the_cpus_bits(rng, prec, B, T, C, V, offset):
    """dwte and dwpe on the GPU are the CPU's bits: every (token, channel) is its token's rows in position order, in
    pieces of 256 sorted indices (the GPU sorts the positions by token, stably, then a warp adds a piece of a token's
    run in registers, and a second kernel adds the pieces after a run's first onto its row). One token takes 12% of
    the positions, as "\\n" does in Tiny Shakespeare: a run of about 1000 here, over four or five pieces.
    odd-C and a dout 2 bytes into its buffer take the one-value-per-lane path of the 16-bit kernels."""
    idx = rng.integers(0, V, (B, T))
    idx[rng.random((B, T)) < 0.12] = V // 3
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
    flat = torch.tensor(rng.standard_normal(B * T * C + offset), dtype=torch.float32).to(dt)
    dout = flat[offset:].view(B, T, C)
    cpu_dout = dout.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if prec == "bf16" else dout.numpy()
    want = ops.embedding_backward(cpu_dout, idx, V, T)
    gpu_dout = flat.cuda()[offset:].view(B, T, C)  # sliced on the GPU: the offset survives
    got = ops.embedding_backward(gpu_dout, torch.from_numpy(idx).cuda(), V, T)
    for name, g, w in zip(("dwte", "dwpe"), got, want):
        assert np.array_equal(host(g), w), f"{name}: {np.abs(host(g) - w).max()} from the CPU's"
    assert np.abs(want[0][V // 3]).sum() > 0
