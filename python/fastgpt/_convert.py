"""Input checks shared by the Python layer: turn user arrays (NumPy, torch CPU tensors, lists) into the exact
contiguous dtypes the compiled core takes, or raise an exception that names the argument and what was expected.
"""
import numpy as np


def to_numpy(x, name):
    """NumPy view of x; torch tensors are detached and brought to the CPU first."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):  # any other CPU array speaking DLPack
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass  # e.g. a dtype NumPy lacks: fall back to the array protocol
    try:
        return np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise TypeError(f"{name} must be an array, got {type(x).__name__}: {e}") from None


def as_float32(x, name):
    a = to_numpy(x, name)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return np.require(a, dtype=np.float32, requirements="C")  # (ascontiguousarray would make a 0-D array 1-D)


def as_ids(x, name, ndim=None):
    """int32 token ids; the compiled core checks the vocabulary range."""
    a = to_numpy(x, name)
    if not (np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_):
        raise TypeError(f"{name} must be an integer array of token ids, got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        raise ValueError(f"{name} holds ids outside the int32 range (min {a.min()}, max {a.max()})")
    return np.ascontiguousarray(a, dtype=np.int32)


def check_int(value, name, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return int(value)


_F32_MAX = float(np.finfo(np.float32).max)
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1  # the widest values the engine's int and int64_t arguments take


def check_float(value, name, low=None, high=None, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if abs(value) > _F32_MAX:  # the engine takes it as a float32: it would become inf there
        raise ValueError(f"{name} must be finite as a float32 (|{name}| <= {_F32_MAX:.4g}), got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value
