"""Checkpoints: a fastgpt.GPT's weights as one safetensors file, and back.

Tensors keep build-nanogpt's names, so the file also loads into a PyTorch GPT-2 (tie lm_head to wte there).
'lm_head.weight' is not stored: it is the same storage as 'transformer.wte.weight', and saving both would double
the biggest tensor. The GPTConfig travels as string metadata, which is all load_checkpoint needs to rebuild the
model. Writes are atomic: a crash or error mid-save leaves whatever was at the path before untouched.
"""
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ._io import atomic_path
from .model import GPT, GPTConfig

MARKER = "fastgpt_checkpoint"  # metadata key that tells our files from other safetensors files
VERSION = "1"
CONFIG_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
TIED = "lm_head.weight"


def save_checkpoint(model, path, metadata=None):
    """Write model's weights (without the tied lm_head.weight) and config to path as safetensors, atomically.
    metadata: extra {key: value} pairs, stored as strings beside the config."""
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    ours = {MARKER: VERSION, "tied_weights": f"{TIED} = transformer.wte.weight (not stored)",
            **{f: str(getattr(model.config, f)) for f in CONFIG_FIELDS}}
    clash = sorted(set(meta) & set(ours))
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved for the checkpoint format")
    tensors = {k: np.ascontiguousarray(v) for k, v in model.state_dict().items() if k != TIED}

    path = os.fspath(path)
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={**meta, **ours})
    return path


def read_metadata(path):
    """The string metadata of a fastgpt checkpoint (config fields and whatever was saved with it)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error type for a damaged or foreign file
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    missing = [k for k in (MARKER,) + CONFIG_FIELDS if k not in meta]
    if missing:
        raise ValueError(f"{path}: not a fastgpt checkpoint (metadata lacks {missing})")
    return meta


def load_checkpoint(path, device="cpu", precision="fp32"):
    """Rebuild the fastgpt.GPT saved at path by save_checkpoint."""
    meta = read_metadata(path)
    try:
        config = GPTConfig(**{f: int(meta[f]) for f in CONFIG_FIELDS})
    except ValueError as e:
        raise ValueError(f"{path}: bad config in checkpoint metadata ({e})") from None
    with safe_open(os.fspath(path), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model = GPT(config, device=device, precision=precision)
    model.load_state_dict(tensors)  # checks every name and shape; lm_head.weight follows wte (shared storage)
    return model
