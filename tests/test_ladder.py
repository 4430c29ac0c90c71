"""bench/bench_ladder.py, the machinery of notebooks/02_speedup_progression.ipynb (whose run is checked in
test_notebooks.py): the PyTorch model before its flash rung computes what SDPA computes, the parameter count behind
MFU is the model's, every rung a CPU cannot run gets a reason, and the table shows skipped rows with it; a rung's
switches do not depend on the rungs run before it and a rung run again replaces its rows; a side that runs out of
memory is a skipped row with the reason, and fastgpt's memory counts its scratch."""
import pathlib
import sys
import weakref

import numpy as np
import pytest
import torch

import fastgpt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import bench_ladder as ladder  # noqa: E402
from reference_gpt import ref_from_fastgpt, rel_err  # noqa: E402


def test_attention_before_the_flash_rung_matches_sdpa():
    """build-nanogpt's explicit attention (scores, causal mask, softmax) against SDPA: logits and gradients."""
    model = fastgpt.GPT(fastgpt.GPTConfig(block_size=24, vocab_size=97, n_layer=2, n_head=3, n_embd=48),
                        seed=int(np.random.randint(1 << 30)))
    x = torch.randint(0, 97, (3, 24))
    outs = []
    for flash in (True, False):
        ref = ref_from_fastgpt(model, dtype=torch.float64, flash=flash)
        logits, loss = ref(x, x.roll(-1, 1))
        loss.backward()
        outs.append((logits.detach(), [p.grad.clone() for p in ref.parameters()]))
    assert rel_err(outs[1][0], outs[0][0]) < 1e-12
    for g_manual, g_sdpa in zip(outs[1][1], outs[0][1]):
        assert rel_err(g_manual, g_sdpa) < 1e-10
    fast_logits, _ = model(x.numpy())
    assert rel_err(torch.from_numpy(np.asarray(fast_logits)), outs[1][0]) < 1e-5


@pytest.mark.parametrize("shape", [(2, 4, 64, 64, 50257), (12, 12, 768, 1024, 50304), (3, 2, 10, 7, 11)])
def test_num_parameters_is_the_models(shape):  # fastgpt.mfu.num_parameters, the ladder's MFU count
    L, H, C, T, V = shape
    cfg = fastgpt.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C)
    expected = 124_475_904 if shape[1] == 12 else fastgpt.GPT(cfg).num_parameters()  # GPT-2 124M at vocab 50304
    assert fastgpt.mfu.num_parameters(cfg) == expected


def test_every_rung_a_cpu_cannot_run_has_a_reason():
    setup = ladder.Setup("cpu", 2, 4, 64, 64, 4, 1, 2, batches=[])
    reasons = {(r.name, side): ladder.why_not(r, side, setup) for r in ladder.RUNGS for side in ("torch", "fastgpt")}
    for name in ("tf32", "DDP"):
        assert reasons[(name, "torch")] and reasons[(name, "fastgpt")]
    assert "compile_on_cpu" in reasons[("compile", "torch")]
    for name in ("fp32", "bf16", "flash attention", "vocab 50304", "fused AdamW"):
        assert reasons[(name, "torch")] is None and reasons[(name, "fastgpt")] is None, name
    setup.compile_on_cpu = True
    assert ladder.why_not(ladder.RUNGS[3], "torch", setup) is None
    assert ladder.why_not(ladder.RUNGS[3], "fastgpt", setup) is None  # GPT(fused=True) runs anywhere


def test_table_shows_skipped_rows_with_their_reason():
    rows = [{"rung": "tf32", "side": "torch", "status": "skipped", "note": "needs a GPU"},
            {"rung": "fp32", "side": "fastgpt", "status": "ran", "note": "", "ms": 2.0, "tok_s": 128.0, "mfu": None,
             "memory": 3 * 2**20, "loss": 9.5}]
    lines = ladder.table(rows).splitlines()
    assert lines[2].split()[:3] == ["tf32", "torch", "skipped"] and lines[2].endswith("needs a GPU")
    assert lines[3].split() == ["fp32", "fastgpt", "2.00", "128", "n/a", "3", "9.5000"]


def fake_run(calls, ms=1.0):
    """A stand-in for run_torch/run_fastgpt that records the switches it was given (no training)."""
    def run(setup, settings):
        calls.append(dict(settings))
        return {"ms": ms, "losses": [2.0, 1.0], "memory": 0}
    return run


def test_a_rungs_switches_do_not_depend_on_the_rungs_run_before(monkeypatch):
    setup = ladder.Setup("cpu", 2, 4, 64, 64, 4, 1, 2, batches=[])
    expected = {  # on a CPU: tf32, torch's compile (without compile_on_cpu) and DDP are skipped and add nothing
        ("fp32", "torch"): {}, ("fp32", "fastgpt"): {"precision": "fp32"},
        ("bf16", "torch"): {"autocast": True}, ("bf16", "fastgpt"): {"precision": "bf16"},
        ("compile", "fastgpt"): {"precision": "bf16", "fused": True},
        ("fused AdamW", "torch"): {"autocast": True, "flash": True, "vocab": 50304, "fused_adamw": True},
        ("fused AdamW", "fastgpt"): {"precision": "bf16", "fused": True, "vocab": 50304},
    }
    for (name, side), want in expected.items():
        rung = next(r for r in ladder.RUNGS if r.name == name)
        assert ladder.settings_for(rung, side, setup) == want, (name, side)

    calls = {"torch": [], "fastgpt": []}
    monkeypatch.setattr(ladder, "run_torch", fake_run(calls["torch"]))
    monkeypatch.setattr(ladder, "run_fastgpt", fake_run(calls["fastgpt"]))
    state = {}
    by_name = {r.name: r for r in ladder.RUNGS}
    for name in ("fp32", "bf16", "vocab 50304"):
        ladder.run_rung(by_name[name], setup, state)
    monkeypatch.setattr(ladder, "run_torch", fake_run(calls["torch"], ms=2.0))  # the re-run's rows tell apart
    monkeypatch.setattr(ladder, "run_fastgpt", fake_run(calls["fastgpt"], ms=2.0))
    ladder.run_rung(by_name["fp32"], setup, state)  # a notebook cell run again after later ones
    assert calls["torch"][-1] == calls["torch"][0] == {}
    assert calls["fastgpt"][-1] == calls["fastgpt"][0] == {"precision": "fp32"}
    assert [(r["rung"], r["side"]) for r in state["rows"]] == [
        (n, s) for n in ("fp32", "bf16", "vocab 50304") for s in ("torch", "fastgpt")]
    assert [r["ms"] for r in state["rows"] if r["rung"] == "fp32"] == [2.0, 2.0]


class _Held:
    """Stands for a failed run's model: the test checks that nothing keeps it after the row is made."""


def test_a_side_out_of_memory_is_a_skipped_row_with_the_reason(monkeypatch):
    setup = ladder.Setup("cpu", 2, 4, 64, 64, 4, 1, 2, batches=[])
    held = []

    def raising(error, *args):
        def run(setup, settings):  # the error is made in the run, as a real one is: only its traceback holds it
            model = _Held()
            held.append(weakref.ref(model))
            raise error(*args)
        return run

    torch_oom = ("CUDA out of memory. Tried to allocate 3.07 GiB. GPU 0 has a total capacity of 14.74 GiB\nof which "
                 "1.2 GiB is free.")
    fastgpt_oom = ("cudaMalloc(&p, bytes > 0 ? bytes : 1) failed: out of memory at "
                   "csrc/engine/backend_cuda.cu:91")  # check.h's message for a failed cudaMalloc
    monkeypatch.setattr(ladder, "run_torch", raising(torch.cuda.OutOfMemoryError, torch_oom))
    monkeypatch.setattr(ladder, "run_fastgpt", raising(RuntimeError, fastgpt_oom))
    state = {}
    rows = ladder.run_rung(ladder.RUNGS[0], setup, state)
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert rows[0]["note"] == "out of memory: CUDA out of memory. Tried to allocate 3.07 GiB. GPU 0 has a total " \
                              "capacity of 14.74 GiB"  # the first line
    assert rows[1]["note"] == f"out of memory: {fastgpt_oom}"
    assert len(held) == 2 and all(ref() is None for ref in held), "a failed run's model is still held"
    lines = ladder.table(state["rows"]).splitlines()
    assert lines[2].split()[:3] == ["fp32", "torch", "skipped"] and "Tried to allocate 3.07 GiB" in lines[2]

    monkeypatch.setattr(ladder, "run_fastgpt", raising(MemoryError))  # std::bad_alloc on the CPU
    monkeypatch.setattr(ladder, "run_torch", fake_run([]))
    rows = ladder.run_rung(ladder.RUNGS[2], setup, state)  # the next rung runs
    assert [r["status"] for r in rows] == ["ran", "skipped"] and rows[1]["note"] == "out of memory: MemoryError"

    monkeypatch.setattr(ladder, "run_torch", raising(RuntimeError, "CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal memory access"):  # only running out of memory is a row
        ladder.run_rung(ladder.RUNGS[0], setup, state)


def test_fastgpt_memory_counts_its_scratch(monkeypatch):
    """On a GPU model.memory()['total'] leaves out the kernels' scratch workspace, which torch's allocator peak
    counts; the ladder adds it (here a stand-in memory(), since a CPU model has no scratch)."""
    x = np.random.default_rng(0).integers(0, 50257, (2, 8), dtype=np.int32)
    setup = ladder.Setup("cpu", 1, 2, 16, 8, 2, 0, 1, batches=[(x, np.roll(x, -1, 1))])
    monkeypatch.setattr(fastgpt.GPT, "memory", lambda self: {"total": 5 * 2**20, "scratch": 3 * 2**20})
    assert ladder.run_fastgpt(setup, {"precision": "fp32"})["memory"] == 8 * 2**20
