"""scripts/flash_diagnose.py: its error maps on arrays with errors planted where a broken kernel would put them, and
its per-choice processes on the CPU kernels (no GPU needed; on a GPU, gpu_check's `ncu` part runs it for real)."""
import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("flash_diagnose", REPO / "scripts" / "flash_diagnose.py")
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def test_choices_cover_every_option_hopper_last():
    """choices() from an options table like the build's: every option once (dq's first runs with every dkdv
    choice; "auto" names no kernel), each choice changing one kernel, the Hopper ones after the others, the
    warp-specialised last; base() the first kernel options, the others' choice meanwhile."""
    options = {"fwd": ["auto", "16x64", "32x64", "sm90 128x128", "sm90 ws 128x128"],
               "dkdv": ["auto", "16x64", "sm90 ws fused", "sm90 fused"],
               "dq": ["auto", "16x64", "32x64", "sm90 128x64"]}
    assert diag.base(options) == {"fwd": "16x64", "dkdv": "16x64", "dq": "16x64"}
    got = diag.choices(options)
    assert [label for label, _ in got] == ["fwd 16x64", "fwd 32x64", "dkdv 16x64", "dq 32x64", "fwd sm90 128x128",
                                           "dkdv sm90 fused", "dq sm90 128x64", "fwd sm90 ws 128x128",
                                           "dkdv sm90 ws fused"]
    assert all(tiles == {label.split()[0]: label.split(" ", 1)[1]} for label, tiles in got)


def test_ranges():
    assert diag.ranges([]) == ""
    assert diag.ranges([3]) == "3"
    assert diag.ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


@pytest.mark.parametrize("plant", ["rows", "columns", "nan"])
def test_a_planted_error_is_placed(plant):
    rng = np.random.default_rng()
    B, H, T, D = 2, 3, 200, 64
    ref = rng.standard_normal((B, H, T, D))
    got = ref + 1e-3 * rng.standard_normal(ref.shape)  # a bf16 kernel's rounding: passes
    ok, lines = diag.diagnose("x", got, ref)
    assert ok and lines[0].startswith("x: ok")
    h = int(rng.integers(H))
    if plant == "rows":  # a warpgroup's rows in one head: what a wrong row offset does
        got[:, h, 64:128, :] += 0.5 + rng.random((B, 64, D))
        want = ("rows off: 64-127 (of 0-199)", "columns off: 0-63", f"heads off: {h} ")
    elif plant == "columns":  # the second half of d in every head: a descriptor or swizzle
        got[:, :, :, 32:] *= -1
        want = ("columns off: 32-63", "heads off: 0-2", "batches off: 0-1")
    else:
        got[1, h, 7, 5] = np.nan
        got[0, 0, 40, 20] = np.inf
        want = ("(2 NaN/inf)", "rows off: 7, 40 (of", "columns off: 5, 20 (of", "batches off: 0-1 ",
                f"heads off: {'0' if h == 0 else f'0, {h}' if h == 2 else '0-1'} ")
    ok, lines = diag.diagnose("x", got, ref)
    text = "\n".join(lines)
    assert not ok
    for w in want:
        assert w in text, (w, text)
    grid = [line.split()[1] for line in lines[lines.index(next(x for x in lines if "a character per" in x)) + 1:]]
    assert len(grid) == (T + 15) // 16 and all(len(row) == D // 8 for row in grid)
    if plant == "rows" and h == 0:
        assert [row.count("x") for row in grid] == [0, 0, 0, 0, 8, 8, 8, 8] + [0] * 5
    if plant == "columns":
        assert all(row == "...." + "xxxx" for row in grid)
    if plant == "nan":  # batch 0's inf in head 0's map; batch 1's NaN is not in it
        assert grid[2] == "..N....." and sum(row.count("N") for row in grid) == 1
        assert all(set(row) == {"."} for i, row in enumerate(grid) if i != 2)


def test_lse_shaped_outputs():
    rng = np.random.default_rng()
    ref = rng.standard_normal((1, 2, 70)) + 5
    got = ref.copy()
    got[0, 1, 66:] = 0  # rows past the last full tile never written
    ok, lines = diag.diagnose("lse", got, ref)
    assert not ok and "rows off: 66-69 (of 0-69)" in "\n".join(lines)
    assert not any("columns off" in line for line in lines)


def test_a_choice_runs_in_its_own_process_on_the_cpu():
    """The CPU kernels are right: --only picks the choices and each runs in a child process; a Hopper choice says it
    cannot run here (ValueError, reported as skipped)."""
    fastgpt = pytest.importorskip("fastgpt")
    if not fastgpt._C.built_with_cuda:
        pytest.skip("fastgpt built without CUDA: no tile options")
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "flash_diagnose.py"), "--device", "cpu", "--only",
                        "dq 32x32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "flash_diagnose: dq 32x32 OK"
    from fastgpt import ops
    before = ops.flash_attention_tiles()
    ok, lines = diag.check_choice("dkdv 32x32", {"dkdv": "32x32"}, "cpu", 0)
    assert ok and lines == [] and ops.flash_attention_tiles() == before  # the tiles put back
    if fastgpt.cuda_available():
        return  # a GPU machine may run the Hopper choice
    with pytest.raises(ValueError, match="sm90"):
        diag.check_choice("dq sm90 128x64", {"dq": "sm90 128x64"}, "cpu", 0)
    assert ops.flash_attention_tiles() == before
