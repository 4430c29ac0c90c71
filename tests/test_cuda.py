"""The CUDA slot: what can be checked about it on any machine, and the GPU checks that skip without a GPU."""
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
