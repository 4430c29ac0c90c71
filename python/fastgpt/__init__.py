"""fastgpt: GPT-2 training as a compiled library.

    import fastgpt
    model = fastgpt.GPT(fastgpt.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=50304))
    opt = fastgpt.AdamW(model, lr=6e-4)
    loss = model.forward_backward(x, y); opt.clip_grad_norm(1.0); opt.step(); model.zero_grad()
    # or the whole step in one call, nothing waiting for the device: x, y (A, B, T) micro-batches
    stats = opt.train_step(x, y, max_norm=1.0); print(stats.loss, stats.norm)
    # or PyTorch's shape: logits, loss = model(x, y); model.backward(); ...

The C++ core (fastgpt._C) holds the model, optimizer and kernels; this package is a thin layer over it.
"""
import ctypes
import importlib.util
import os


def _preload_pip_nccl():
    """torch's wheels bring NCCL as the pip package nvidia-nccl-cu1x and load it by path. If fastgpt._C, linked
    against whichever libnccl.so.2 its build found (perhaps the CUDA toolkit's, older), were loaded first, its copy
    would become the process's libnccl.so.2 and a later `import torch` would fail on a symbol it lacks. Loading the
    pip package's library first makes it the one both use (one soname, one library; NCCL 2.x keeps its ABI)."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.isfile(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
            return


_preload_pip_nccl()

from . import _C, data, distributed, mfu, ops, resume, tokenizer  # noqa: E402
from .model import GPT, GPTConfig  # noqa: E402
from .optim import AdamW  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    # Modules that also run as `python -m fastgpt.<name>` load on first use: imported here, runpy would warn that
    # the module it is about to run as __main__ is already in sys.modules.
    if name in ("hellaswag", "sample", "train"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fastgpt' has no attribute {name!r}")


def cuda_available():
    """True when this build has the CUDA side and a GPU is visible."""
    return bool(_C.built_with_cuda) and _C.cuda_device_count() > 0


__all__ = ["GPT", "GPTConfig", "AdamW", "ops", "data", "distributed", "tokenizer", "cuda_available", "__version__"]
