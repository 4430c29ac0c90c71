"""Shared fixtures: where the test data lives, and fresh random generators.

The data files (Tiny Shakespeare, GPT-2's encoder.json) are not in the repo. They are found through
FASTGPT_SHARED (a folder holding data/), else ../shared beside the repo root. A missing file skips the tests that
need it, unless FASTGPT_REQUIRE_DATA=1 (set by CI), where it fails them instead: CI must never pass by skipping.
"""
import inspect
import os
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _shared_dir():
    env = os.environ.get("FASTGPT_SHARED")
    return pathlib.Path(env) if env else REPO.parent / "shared"


def _data_file(rel):
    path = _shared_dir() / "data" / rel
    if not path.is_file():
        msg = f"test data {path} not found (set FASTGPT_SHARED to the folder holding data/)"
        if os.environ.get("FASTGPT_REQUIRE_DATA") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def encoder_json():
    return _data_file("gpt2/encoder.json")


@pytest.fixture
def shakespeare_txt():
    return _data_file("tinyshakespeare.txt")


@pytest.fixture
def rng():
    # Fresh inputs on every run (the seed is printed on failure through the fixture's repr in -l mode).
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def _runs_on_the_gpu(item):
    """A test that can touch a GPU: not the "cpu" case of a device parametrization; a name that says cuda or sm90, a
    needs_cuda mark (its skip names CUDA), a uses_gpu mark (code it runs picks the GPU where there is one, as the
    notebooks do), or a body that says cuda (a CUDA build's switches, graphs)."""
    if item.get_closest_marker("uses_gpu"):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("device") == "cpu":
        return False
    if "cuda" in item.nodeid.lower() or "sm90" in item.nodeid.lower():
        return True
    if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
        return True
    try:
        return "cuda" in inspect.getsource(item.function).lower()
    except (OSError, TypeError):
        return True


def pytest_configure(config):
    config.addinivalue_line("markers", "uses_gpu: runs on the GPU where there is one, though nothing in the test's "
                            "name, marks or body says so (FASTGPT_GPU_ONLY keeps it)")


def pytest_collection_modifyitems(config, items):
    # FASTGPT_GPU_ONLY=1 (scripts/gpu_check.sh on a lent GPU): only the cases that can touch the GPU. The CPU cases
    # are CI's, and on the device they cost minutes of its time (test_train_step and test_train_steps' CPU cases
    # took 255 s of an H200 call's 480 s beside the sanitizers, 2026-11-26).
    if os.environ.get("FASTGPT_GPU_ONLY") != "1":
        return
    keep, drop = [], []
    for i in items:
        (keep if _runs_on_the_gpu(i) else drop).append(i)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
