"""The conversions between float32 and the 16-bit storage types (csrc/cpu/dtype.h, cast.cpp; cuda/cast.cu):
round to nearest even exactly as torch's .to() for every float16 / bfloat16 case class (normals, subnormals,
ties, overflow, inf; NaN narrows to the canonical 0x7FFF, where torch keeps sign or payload bits); the GPU's
hardware conversion bit for bit as the CPU's; widening exact for all 65536 bit patterns; and the stochastic rounding
that writes bf16 weights: deterministic for a seed, different across seeds and steps, only ever the two neighbours,
unbiased."""
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from fastgpt import ops
from devices import needs_cuda
from ptx import CSRC, compile_sass, nvdisasm

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def special_floats(rng):
    """Random normals of every scale, plus the edges: ties, subnormals, overflow thresholds, inf, NaN, zeros."""
    x = rng.standard_normal(20000) * np.exp2(rng.integers(-30, 20, 20000))
    edges = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.0, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
             2.0**-14, 2.0**-15 * 1.5, 3.4e38, 1.0 + 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-9, 1e-40]
    # Bit patterns at the edges of the integer rounding: bf16 ties among subnormals, the subnormal-to-normal carry,
    # the largest tie (rounds to inf) and the value below it, even and odd ties; fp16's last subnormal tie, the
    # largest value that stays finite, the smallest that rounds up to a subnormal.
    bits = np.array([0x00008000, 0x00018000, 0x007F8000, 0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F818000,
                     0x387FF000, 0x477FEFFF, 0x33000001], np.uint32).view(np.float32)
    return np.concatenate([x, edges, -np.array(edges), bits, -bits]).astype(np.float32)


def tie_floats():
    """Every bf16 tie and its neighbours (low halves 0x7FFF, 0x8000, 0x8001 under every upper half), NaNs included,
    and a stride through all 2^32 patterns: 1.2M floats, for the GPU's hardware conversion against the CPU's."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    ties = (hi[:, None] | np.array([0x7FFF, 0x8000, 0x8001], np.uint32)).ravel()
    stride = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([ties, stride]).view(np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_nearest_matches_torch(rng, dtype):
    x = special_floats(rng)
    ours = ops.cast(x, dtype)
    assert ours.dtype == (ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    ref = torch.from_numpy(x).to(TORCH[dtype]).view(torch.int16).numpy()
    assert np.array_equal(ours.view(np.int16), ref)
    nan = ops.cast(np.array([np.nan], np.float32), dtype).astype(np.float32)
    assert np.isnan(nan).all()


def nan_floats():
    """NaNs of both signs, quiet and signalling, with and without payload bits (a bit pattern each)."""
    bits = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5, 0xFFC0FFEE]
    return np.array(bits, np.uint32).view(np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nan_narrows_to_the_canonical_nan(dtype):
    # 0x7FFF, sign and payload dropped: what the GPU's cvt.rn makes of every NaN (dtype.h narrows with it on sm_80
    # and newer), and CUDA's own host conversions; the CPU and the GPU then agree on every bit pattern.
    assert np.array_equal(ops.cast(nan_floats(), dtype).view(np.uint16), np.full(8, 0x7FFF, np.uint16))


@pytest.mark.skipif(shutil.which("nvcc") is None or nvdisasm() is None,
                    reason="needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_gpu_narrowing_is_the_hardware_conversion(tmp_path, arch):
    """dtype.h's from_float in GPU code for sm_80 and newer, in cuda/cast.cu's narrow_kernel as in every kernel that
    stores 16-bit values: the pair conversion F2FP (cvt.rn.bf16x2 / f16x2 with 0 in the upper half), not the
    integer round to nearest even (its + 0x7FFF, seven to ten instructions a value: 52 in the bf16 kernel before)."""
    kernels = compile_sass(CSRC / "cuda" / "cast.cu", tmp_path / "cast.cubin", f"arch=compute_{arch},code=sm_{arch}")
    narrow = {n: v for n, v in kernels.items() if "narrow_kernel" in n}
    assert len(narrow) == 2, sorted(narrow)  # bf16 and f16
    for name, code in narrow.items():
        assert any(ins.startswith("F2FP.") for ins in code), f"{name}: no F2FP"
        assert not any("0x7fff" in ins.lower() for ins in code), f"{name}: the integer rounding"


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
    x = np.concatenate([special_floats(rng), nan_floats(), tie_floats()])
    for dtype in ("bfloat16", "float16"):
        gpu = ops.cast(torch.from_numpy(x).cuda(), dtype).cpu().view(torch.int16).numpy()
        assert np.array_equal(gpu, ops.cast(x, dtype).view(np.int16))
    g = ops.cast(torch.from_numpy(x).cuda(), "bfloat16", stochastic=True, seed=5, step=2)
    c = ops.cast(x, "bfloat16", stochastic=True, seed=5, step=2)
    assert np.array_equal(g.cpu().view(torch.int16).numpy(), c.view(np.int16))  # the same hash on both devices
