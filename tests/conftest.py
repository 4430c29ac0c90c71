"""Shared fixtures: where the test data lives, and fresh random generators.

The data files (Tiny Shakespeare, GPT-2's encoder.json) are not in the repo. They are found through
FASTGPT_SHARED (a folder holding data/), else ../shared beside the repo root. A missing file skips the tests that
need it, unless FASTGPT_REQUIRE_DATA=1 (set by CI), where it fails them instead: CI must never pass by skipping.
"""
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
