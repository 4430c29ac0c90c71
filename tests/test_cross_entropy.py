"""cross_entropy: fastgpt.ops mean loss, per-row losses and logit gradient vs torch.nn.functional.cross_entropy in
float64, including large-magnitude logits (the log-sum-exp must not overflow) and -inf ones (masked: they add
nothing); forward_backward (the training step's one-pass kernel) against the same reference and against the two
separate kernels (the same bits). On a GPU: 16-bit logits, and views off 16-byte alignment, which take the same
order of sums through single loads (the same bits); forward_backward keeps a row in shared memory where two blocks'
rows fit on an SM (V 50304 in 16 bits on an H100/H200), and reads it twice where not (V 60000 on every GPU, fp32 at
50304), the same bits either way."""
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, bits, host, needs_cuda, on
from ptx import CSRC, compile_ptx, compile_sass, kernel_lines, nvdisasm, unpredicated
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
    # The same function as the two kernels, and the same bits: one lse routine (pass one of the GPU's kernels), one
    # gradient routine.
    _, losses2, lse = ops.cross_entropy_forward(on(device, logits), on(device, targets))
    dlogits2 = host(ops.cross_entropy_backward(on(device, logits), on(device, targets), lse, grad=grad))
    assert np.array_equal(losses, host(losses2)) and np.array_equal(dlogits, dlogits2)


@pytest.mark.parametrize("N,V", [(5, 5000), (4, 50257)])
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_inf_and_nan_logits(rng, N, V, device):
    """-inf logits (a causal or vocabulary mask) add nothing, even where a whole stretch of a row is -inf (the
    running max of the GPU's threads starts at -inf); a NaN logit makes its row's loss and gradient NaN, and only
    its row's."""
    logits, targets, grad = case(rng, N, V, 2.0)
    logits[0, :4096] = -np.inf
    logits[1:, ::7] = -np.inf
    logits[np.arange(N), targets] = rng.standard_normal(N)  # a finite loss
    logits[N - 1, 3] = np.nan
    loss, losses, dlogits = ops.cross_entropy_forward_backward(on(device, logits), on(device, targets), grad=grad)
    losses, dlogits = host(losses), host(dlogits)
    assert np.isnan(loss) and np.isnan(losses[-1]) and np.isnan(dlogits[-1]).all()
    lt = torch.tensor(logits[:-1], dtype=torch.float64, requires_grad=True)
    tt = torch.tensor(targets[:-1])
    ref = F.cross_entropy(lt, tt, reduction="none")
    (ref.sum() * grad / N).backward()
    assert rel_err(losses[:-1], ref.detach()) < TOL and rel_err(dlogits[:-1], lt.grad) < TOL
    assert (dlogits[:-1][np.isneginf(logits[:-1])] == 0).all()


# The GPU kernels walk a row in 16-byte units where V is a whole number of them and the rows are aligned, else in
# single loads in the same order: a view off alignment (or V = 50257) must give the aligned call's bits.
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, TOL)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("N,V", [(64, 50304), (17, 50257), (8, 1000), (4, 60000)])
def test_cuda_cross_entropy_any_alignment(rng, dtype, tol, N, V):
    logits, targets, grad = case(rng, N, V, 3.0)
    x = torch.tensor(logits).to(dtype).cuda()
    t = torch.tensor(targets).cuda()
    buf = torch.empty(N * V + 1, dtype=dtype, device="cuda")
    off = buf[1:].view(N, V)  # 2 or 4 bytes past a 16-byte boundary
    off.copy_(x)
    assert off.data_ptr() % 16 != 0
    (_, losses, dlogits), (_, losses2, lse) = (ops.cross_entropy_forward_backward(x, t, grad=grad),
                                               ops.cross_entropy_forward(x, t))
    _, losses_off, dlogits_off = ops.cross_entropy_forward_backward(off, t, grad=grad)
    _, losses2_off, lse_off = ops.cross_entropy_forward(off, t)
    assert np.array_equal(bits(losses), bits(losses2)), "forward's losses differ from forward_backward's"
    for a, b, name in ((losses, losses_off, "losses"), (dlogits, dlogits_off, "dlogits"),
                       (losses2, losses2_off, "forward's losses"), (lse, lse_off, "lse")):
        assert np.array_equal(bits(a), bits(b)), f"{name} differ on the unaligned view"
    dl = ops.cross_entropy_backward(off, t, lse, grad=grad)
    assert np.array_equal(bits(dl), bits(dlogits)), \
        "backward from forward's lse differs from forward_backward's gradient"
    xt = torch.as_tensor(x).double().cpu().requires_grad_(True)
    ref = F.cross_entropy(xt, t.cpu())
    (ref * grad).backward()
    assert rel_err(host(losses), F.cross_entropy(xt.detach(), t.cpu(), reduction="none")) < 1e-5
    assert rel_err(torch.as_tensor(dlogits).double().cpu(), xt.grad) < tol


# Every exponential of the GPU kernels is one multiply and ex2.approx.ftz (cuda/fast_exp.cuh): expf adds a range
# reduction (fma.rn, fma.rm, an add, a shift and a multiply: eight SASS instructions), which left the 16-bit kernels
# issue-bound at 1.9 TB/s in an H100's training step; exp2f wraps ex2.approx.f32 (no ftz) in a range test.
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_kernels_take_each_exponential_on_the_sfu_alone(tmp_path):
    ptx = compile_ptx(CSRC / "cuda" / "cross_entropy.cu", tmp_path / "cross_entropy.ptx", "sm_90a", timeout=300)
    for kernel in ("forward", "backward", "forward_backward", "forward_backward_smem"):
        for storage in ("f", "NS_4bf16E", "NS_3f16E"):
            name = f"{len('cross_entropy_' + kernel + '_kernel')}cross_entropy_{kernel}_kernelI{storage}"
            lines = kernel_lines(ptx, name)
            ex2 = [line for line in lines if line.startswith("ex2.")]
            assert ex2 and all(line.startswith("ex2.approx.ftz.f32") for line in ex2), (name, ex2[:3])
            ranged = [line for line in lines if re.match(r"fma\.rm\.", line)]
            assert not ranged, f"{name}: expf's range reduction ({len(ranged)} fma.rm)"


# The training step's kernel (forward_backward_smem) keeps the row in shared memory. On sm_80+ each thread asks for
# its whole share of the row by cp.async (LDGSTS, 16 units before its first wait: all of a 50,304-logit 16-bit row)
# instead of loading it through registers (LDG.E.128, kBatch units a thread in flight), which moved 2.6 TB/s in an
# H200's training step against a copy's 4.1. sm_75 has no cp.async (the helper traps there): registers.
@pytest.mark.skipif(shutil.which("nvcc") is None or nvdisasm() is None,
                    reason="needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("arch", ["90a", "75"])
def test_cuda_kept_row_goes_to_shared_memory_by_cp_async(tmp_path, arch):
    kernels = compile_sass(CSRC / "cuda" / "cross_entropy.cu", tmp_path / "ce.cubin",
                           f"arch=compute_{arch},code=sm_{arch}")
    smem = {name: ins for name, ins in kernels.items() if "forward_backward_smem_kernel" in name}
    assert len(smem) == 3, list(kernels)
    for name, ins in smem.items():
        ops = [unpredicated(i) for i in ins]
        wide_loads = [o for o in ops if o.startswith("LDG.") and ".128" in o]
        copies = [i for i, o in enumerate(ops) if o.startswith("LDGSTS")]
        if arch == "75":
            assert not copies and wide_loads, name
            continue
        assert not wide_loads, (name, wide_loads[:3])
        waits = [i for i, o in enumerate(ops) if o.startswith("DEPBAR.LE")]
        assert waits and ops[waits[0]].endswith("0x3"), (name, [ops[i] for i in waits])
        ahead = [i for i in copies if i < waits[0]]
        assert len(ahead) == 16 and all(".128" in ops[i] for i in copies), (name, len(ahead))
