"""The CUDA slot: what can be checked about it on any machine, and the GPU checks that skip without a GPU."""
import numpy as np
import pytest

import fastgpt
from fastgpt import _C

needs_gpu = pytest.mark.skipif(not fastgpt.cuda_available(), reason="no CUDA GPU visible (or CPU-only build)")


def test_device_count_never_throws():
    n = _C.cuda_device_count()
    assert isinstance(n, int) and n >= 0
    assert fastgpt.cuda_available() == (bool(_C.built_with_cuda) and n > 0)


@needs_gpu
def test_smoke_kernel_runs_on_every_device():
    for d in range(_C.cuda_device_count()):
        assert "sm_" in _C.cuda_device_name(d)
        assert _C.cuda_smoke_test(d)


def test_torch_cpu_tensors_go_through_the_cpu_kernels(rng):
    # CPU tensors of another framework are accepted zero-copy (NumPy views) and give NumPy results.
    import numpy as np
    import torch
    from fastgpt import ops
    x = torch.randn(3, 5, 8)
    out = ops.gelu_forward(x)
    assert isinstance(out, np.ndarray)
    assert np.array_equal(out, ops.gelu_forward(x.numpy()))


@needs_gpu
def test_cuda_ops_run_on_the_callers_stream_and_return_torch_tensors():
    import torch
    from fastgpt import ops
    x = torch.randn(4, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x was written on the default stream
    with torch.cuda.stream(s):
        out = ops.gelu_forward(x)
    s.synchronize()
    assert isinstance(out, torch.Tensor) and out.is_cuda
    ref = torch.nn.functional.gelu(x.double(), approximate="tanh")
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@needs_gpu
def test_cuda_op_rejects_mixed_devices():
    import numpy as np
    import torch
    from fastgpt import ops
    with pytest.raises((ValueError, TypeError), match="weight"):
        ops.matmul_forward(torch.randn(2, 8, device="cuda"), np.ones((3, 8), np.float32))


@needs_gpu
def test_cuda_op_refuses_ids_out_of_range():
    # Checked on the host (one copy back of min and max) before any kernel indexes memory with them.
    import torch
    from fastgpt import ops
    logits = torch.randn(4, 9, device="cuda")
    for bad, say in ((torch.tensor([1, 2, 9, 0]), "targets must hold ids in \\[0, 9\\), found 9"),
                     (torch.tensor([1, -3, 2, 0]), r"targets holds ids outside \[0, 2\*\*31\) \(min -3, max 2\)")):
        with pytest.raises(ValueError, match=say):
            ops.cross_entropy_forward(logits, bad.cuda())
    loss, _, _ = ops.cross_entropy_forward(logits, torch.tensor([8, 0, 3, 5], device="cuda"))
    ref = torch.nn.functional.cross_entropy(logits.double(), torch.tensor([8, 0, 3, 5], device="cuda"))
    assert abs(float(loss) - ref.item()) < 1e-5 * abs(ref.item())


@needs_gpu
def test_running_out_of_device_memory_leaves_no_error_for_the_next_call():
    # A batch whose activations cannot fit raises "out of memory" from cudaMalloc; the runtime's record of that error
    # goes with the throw, so the next launch (a smaller batch on the same model, as bench_gpu_train's --B max
    # tries, and an op) does not report it again, and the model runs it in buffers it really took. The model stays
    # alive: deleting it would clear the error in its destructor, whatever check.h does.
    import torch
    from fastgpt import ops
    x = torch.randn(4, 64, device="cuda")  # before the failure: torch's own launch check would report it too
    cfg = fastgpt.GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    model = fastgpt.GPT(cfg, device="cuda")
    rng = np.random.default_rng()
    huge = rng.integers(0, cfg.vocab_size, size=(1024, 1024))  # ~0.45 MB of fp32 activations a token: ~470 GB
    with pytest.raises(RuntimeError, match="out of memory"):
        model.forward(huge, huge, return_logits=False)
    small = rng.integers(0, cfg.vocab_size, size=(2, 64))
    _, loss = model.forward(small, np.roll(small, -1, axis=1), return_logits=False)
    assert np.isfinite(loss) and abs(loss - np.log(cfg.vocab_size)) < 1.0, loss
    out = ops.gelu_forward(x)
    assert torch.isfinite(out).all()


POOL_SCRIPT = """
import gc, numpy as np, fastgpt
from fastgpt import _C
cfg = fastgpt.GPTConfig(block_size=1024, vocab_size=50304, n_layer=2, n_head=12, n_embd=768)
model = fastgpt.GPT(cfg, device="cuda", precision="bf16")
x = np.random.default_rng().integers(0, cfg.vocab_size, size=(8, 1024))
model.forward_backward(x, np.roll(x, -1, axis=1))
held = _C.cuda_pool_reserved(0)
del model
gc.collect()
print(held, _C.cuda_pool_reserved(0))
"""


@needs_gpu
def test_a_deleted_model_gives_its_scratch_memory_back():
    # The kernels' scratch comes from the stream-ordered pool, which keeps what is freed into it (so that steps
    # allocate nothing); a deleted model's must go back to the device, for torch or the next model of the process
    # (bench_ladder's rungs). A fresh process: nothing else holds pool memory there.
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    held, after = map(int, run.stdout.split()[-2:])
    assert held > 0 and after < held // 4, (held, after)  # before: all of it kept


@needs_gpu
def test_cuda_ops_wait_for_work_queued_on_the_callers_stream():
    # The input is written on a non-blocking stream behind ~20 ms of spinning: an op enqueued anywhere but that
    # stream would read it before it is written, and give a wrong answer.
    import torch
    from fastgpt import ops
    base = torch.randn(256, 1024, device="cuda") + 0.1
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(40_000_000)
        x = base * 2.0
        out = ops.gelu_forward(x)
        loss, losses, _ = ops.cross_entropy_forward(x, torch.randint(0, 1024, (256,), device="cuda"))
    s.synchronize()
    ref = torch.nn.functional.gelu((base * 2.0).double(), approximate="tanh")
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert losses.shape == (256,) and abs(loss - losses.double().mean().item()) < 1e-5 * max(1.0, abs(loss))


def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 (CuPy installed without a usable CUDA runtime)
        pytest.skip(f"CuPy cannot reach the GPU: {e}")
    return cupy


@needs_gpu
def test_cuda_ops_take_cupy_arrays_on_their_stream():
    cupy = _cupy()
    import numpy as np
    from fastgpt import ops
    spin = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}''', "spin")
    rng = np.random.default_rng()
    base = cupy.asarray(rng.standard_normal((64, 512)).astype(np.float32) + 0.1)
    w = cupy.asarray(rng.standard_normal((96, 512)).astype(np.float32) * 0.05)
    targets = cupy.asarray(rng.integers(0, 96, 64))
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        spin((1,), (1,), (np.int64(40_000_000),))
        x = base * 2
        out = ops.gelu_forward(x)
        logits = ops.matmul_forward(x, w)
        loss, losses, lse = ops.cross_entropy_forward(logits, targets)
    s.synchronize()
    assert isinstance(out, cupy.ndarray) and isinstance(logits, cupy.ndarray) and isinstance(losses, cupy.ndarray)
    x64 = cupy.asnumpy(base).astype(np.float64) * 2
    g = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    assert np.linalg.norm(cupy.asnumpy(out) - g) / np.linalg.norm(g) < 1e-5
    ref_logits = x64 @ cupy.asnumpy(w).astype(np.float64).T
    assert np.linalg.norm(cupy.asnumpy(logits) - ref_logits) / np.linalg.norm(ref_logits) < 1e-5
    m = ref_logits.max(1, keepdims=True)
    ref_lse = (m + np.log(np.exp(ref_logits - m).sum(1, keepdims=True)))[:, 0]
    ref_losses = ref_lse - ref_logits[np.arange(64), cupy.asnumpy(targets)]
    assert np.abs(cupy.asnumpy(losses) - ref_losses).max() < 1e-4
    assert abs(loss - ref_losses.mean()) < 1e-5 * max(1.0, abs(ref_losses.mean()))


@pytest.mark.skipif(not fastgpt.cuda_available() or _C.cuda_device_count() < 2, reason="needs two GPUs")
def test_ops_and_models_leave_the_callers_device_current():
    # Work on cuda:1 must not leave cuda:1 current: torch's "cuda" would silently become another GPU.
    import numpy as np
    import torch
    from fastgpt import ops
    torch.cuda.set_device(0)
    ops.gelu_forward(torch.randn(8, 64, device="cuda:1"))
    assert torch.cuda.current_device() == 0
    model = fastgpt.GPT(fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32),
                        device="cuda:1")
    tok = np.random.default_rng().integers(0, 64, (2, 17))
    model(tok[:, :-1], tok[:, 1:])
    model.backward()
    fastgpt.AdamW(model).step()
    assert torch.cuda.current_device() == 0


def test_cuda_tensors_are_exported_with_their_device_current(monkeypatch):
    # torch exports a CUDA tensor through DLPack only while its device is current (BufferError otherwise) and orders
    # the consumer's stream after the current device's stream: an op on cuda:1 tensors while cuda:0 is current must
    # export them with cuda:1 current, and leave cuda:0 current after. Checked here with stand-ins for torch's device
    # switch and a tensor that refuses as torch's does (the two-GPU test above runs the real thing).
    import contextlib

    import torch
    from fastgpt import ops
    current = [0]

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = before

    class Stream:
        cuda_stream = 1234

    class Tensor:
        __module__ = "torch"
        device = torch.device("cuda", 1)

        def detach(self):
            return self

        def __dlpack_device__(self):
            return 2, 1

        def __dlpack__(self, stream=None):
            if current[0] != self.device.index:
                raise BufferError("Can't export tensors on a different CUDA device index")
            return "capsule", stream

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    assert ops._Device(Tensor()).arg(Tensor()) == ("capsule", 1234)
    assert current[0] == 0


def test_set_device_refuses_a_device_that_is_not_visible():
    # distributed.py makes a rank's GPU current with it; a bad index is a clear error, not a CUDA one.
    n = _C.cuda_device_count()
    if _C.built_with_cuda:
        for bad in (-1, n):
            for call in (_C.cuda_set_device, _C.cuda_pool_reserved):
                with pytest.raises(ValueError, match=rf"device {bad} is not a visible CUDA device \({n} visible\)"):
                    call(bad)
    else:
        for call in (_C.cuda_set_device, _C.cuda_pool_reserved):
            with pytest.raises(RuntimeError, match="built without CUDA"):
                call(0)


@pytest.mark.skipif(not fastgpt.cuda_available() or _C.cuda_device_count() < 2 or not _C.built_with_nccl,
                    reason="needs two GPUs and NCCL")
def test_a_rank_on_another_gpu_makes_no_context_on_gpu_0():
    # A data-parallel rank with LOCAL_RANK 1 works on cuda:1 and never uses GPU 0. Its GPU is made the process's
    # current device (as torch.cuda.set_device(local_rank) in a DDP script); without that, every engine call's
    # device guard restored cudaGetDevice's default 0, and cudaSetDevice initialises that device's primary context:
    # a context (hundreds of MB) on GPU 0 from every rank. A fresh process, a world of one at LOCAL_RANK 1, trains a
    # step and asks the driver whether GPU 0 has a primary context.
    import os
    import socket
    import subprocess
    import sys
    code = """
import ctypes
import numpy as np
import fastgpt
model = fastgpt.GPT(fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32), device="cuda",
                    data_parallel=True)
assert model.device == "cuda:1", model.device
tok = np.random.default_rng(0).integers(0, 64, (2, 17))
fastgpt.AdamW(model).train_step(tok[:, :-1], tok[:, 1:], max_norm=1.0).loss
cuda = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
print("active", active.value)
"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["active", "0"], out.stdout
