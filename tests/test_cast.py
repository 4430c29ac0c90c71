"""The conversions between float32 and the 16-bit storage types (csrc/cpu/dtype.h, cast.cpp; cuda/cast.cu):
round to nearest even exactly as torch's .to() for every float16 / bfloat16 case class (normals, subnormals,
ties, overflow, inf, NaN); widening exact for all 65536 bit patterns; and the stochastic rounding that writes bf16
weights: deterministic for a seed, different across seeds and steps, only ever the two neighbours, unbiased."""
import ml_dtypes
import numpy as np
import pytest
import torch

from fastgpt import ops
from devices import needs_cuda

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def special_floats(rng):
    """Random normals of every scale, plus the edges: ties, subnormals, overflow thresholds, inf, NaN, zeros."""
    x = rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000))
    edges = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.0, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
             2.0**-14, 2.0**-15 * 1.5, 3.4e38, 1.0 + 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-9, 1e-40]
    return np.concatenate([x, edges, -np.array(edges)]).astype(np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_nearest_matches_torch(rng, dtype):
    x = special_floats(rng)
    ours = ops.cast(x, dtype)
    assert ours.dtype == (ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    ref = torch.from_numpy(x).to(TORCH[dtype]).view(torch.int16).numpy()
    assert np.array_equal(ours.view(np.int16), ref)
    nan = ops.cast(np.array([np.nan], np.float32), dtype).astype(np.float32)
    assert np.isnan(nan).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_widen_is_exact_for_every_bit_pattern(dtype):
    bits = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)
    x = bits.view(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    ours = ops.cast(x, "float32")
    ref = torch.from_numpy(bits.copy()).view(TORCH[dtype]).float().numpy()
    finite = np.isfinite(ref)
    assert np.array_equal(ours[finite], ref[finite])
    assert np.array_equal(np.isnan(ours), np.isnan(ref)) and np.array_equal(ours[np.isinf(ref)], ref[np.isinf(ref)])


def test_stochastic_rounding_is_deterministic_and_keyed(rng):
    x = rng.standard_normal(4096).astype(np.float32)
    a = ops.cast(x, "bfloat16", stochastic=True, seed=7, step=3)
    b = ops.cast(x, "bfloat16", stochastic=True, seed=7, step=3)
    assert np.array_equal(a.view(np.int16), b.view(np.int16))
    for other in (dict(seed=8, step=3), dict(seed=7, step=4)):
        c = ops.cast(x, "bfloat16", stochastic=True, **other)
        assert not np.array_equal(a.view(np.int16), c.view(np.int16))
    # Always one of the two bf16 neighbours of x: round-toward-zero and the next one up in magnitude.
    lo = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    hi = ((x.view(np.uint32) & 0xFFFF0000) + 0x10000).view(np.float32)
    got = a.astype(np.float32)
    assert np.all((got == lo) | (got == hi))
    assert np.any(got == hi) and np.any(got == lo)


def test_stochastic_rounding_is_unbiased(rng):
    # One value rounded many times (many elements of one step): the mean lands within 1e-3 relative of it, where
    # round-to-nearest is off by its whole rounding error for values between two bf16 numbers.
    n = 1 << 18
    for v in rng.uniform(0.5, 2.0, 3).astype(np.float32):
        v = np.float32(v)
        out = ops.cast(np.full(n, v, np.float32), "bfloat16", stochastic=True, seed=int(rng.integers(1 << 62)),
                       step=1).astype(np.float64)
        assert abs(out.mean() - v) <= 1e-3 * v * 0.1  # 10x inside the bound: the spread is ~2^-8 / sqrt(n)
        nearest = float(ops.cast(np.array([v]), "bfloat16").astype(np.float64)[0])
        if nearest != v:
            assert abs(out.mean() - v) < abs(nearest - v)


def test_bad_casts():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="dtype must be"):
        ops.cast(x, "int8")
    with pytest.raises(ValueError, match="stochastic rounding is for bfloat16 only"):
        ops.cast(x, "float16", stochastic=True)
    with pytest.raises(TypeError, match="already float32"):
        ops.cast(x, "float32")


@needs_cuda
def test_cuda_casts_match_cpu(rng):
    x = special_floats(rng)
    for dtype in ("bfloat16", "float16"):
        gpu = ops.cast(torch.from_numpy(x).cuda(), dtype).cpu().view(torch.int16).numpy()
        assert np.array_equal(gpu, ops.cast(x, dtype).view(np.int16))
    g = ops.cast(torch.from_numpy(x).cuda(), "bfloat16", stochastic=True, seed=5, step=2)
    c = ops.cast(x, "bfloat16", stochastic=True, seed=5, step=2)
    assert np.array_equal(g.cpu().view(torch.int16).numpy(), c.view(np.int16))  # the same hash on both devices
