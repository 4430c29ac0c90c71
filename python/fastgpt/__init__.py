"""fastgpt: GPT-2 training as a compiled library.

    import fastgpt
    model = fastgpt.GPT(fastgpt.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=50304))
    opt = fastgpt.AdamW(model, lr=6e-4)
    logits, loss = model.forward(x, y); model.backward(); opt.clip_grad_norm(1.0); opt.step(); model.zero_grad()

The C++ core (fastgpt._C) holds the model, optimizer and kernels; this package is a thin layer over it.
"""
from . import _C, data, distributed, ops, tokenizer
from .model import GPT, GPTConfig
from .optim import AdamW

__version__ = "0.1.0"


def cuda_available():
    """True when this build has the CUDA side and a GPU is visible."""
    return bool(_C.built_with_cuda) and _C.cuda_device_count() > 0


__all__ = ["GPT", "GPTConfig", "AdamW", "ops", "data", "distributed", "tokenizer", "cuda_available", "__version__"]
