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
