"""Where op tests run: the CPU always, a CUDA GPU when one is visible and fastgpt was built with CUDA. Inputs are
made as NumPy arrays; `on` moves them to the device under test as torch tensors (through DLPack inside
fastgpt.ops), `host` brings results back for comparison with the float64 reference."""
import numpy as np
import pytest
import torch

import fastgpt

HAVE_CUDA = fastgpt.cuda_available() and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU and a fastgpt built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def sm90_device():
    """Whether the GPU here runs fastgpt's Hopper ("sm90") kernels: compute capability 9.0 (a build on this machine
    compiles for the GPU it sees, architecture 90, so it has their sm_90a code)."""
    return HAVE_CUDA and torch.cuda.get_device_capability() == (9, 0)


def on(device, a):
    if device == "cpu" or a is None:
        return a
    return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")


def host(a):
    if a is None or isinstance(a, np.ndarray):
        return a
    return a.detach().cpu().numpy()


def bits(x):
    """The raw bits of a float32/bfloat16/float16 result, a NumPy array or a torch tensor on any device, as unsigned
    integers of its width: equal arrays of them are the same bits, NaN or not."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return x.view(torch.int16 if x.element_size() == 2 else torch.int32).numpy().view(
            np.uint16 if x.element_size() == 2 else np.uint32)
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def check_cuda_switch(switch, default):
    """One of fastgpt.ops' process-wide CUDA switches (layernorm_one_pass, matmul_bias_grad_epilogue,
    matmul_autotune): its default, a set returning the previous setting, a refused value (not a bool) changing
    nothing, the setting put back; without CUDA in the build, a RuntimeError saying so."""
    from fastgpt import ops
    if not ops._C.built_with_cuda:
        with pytest.raises(RuntimeError, match="no CUDA"):
            switch()
        return
    before = switch()
    assert before is default
    try:
        assert switch(not before) is before
        assert switch() is (not before)
        for bad in (1, "yes"):
            with pytest.raises(TypeError, match="enabled must be True, False or None"):
                switch(bad)
        assert switch() is (not before)  # a refused value changes nothing
    finally:
        switch(before)
    assert switch() is before
