"""bench/bench_ladder.py, the machinery of notebooks/02_speedup_progression.ipynb (whose run is checked in
test_notebooks.py): the PyTorch model before its flash rung computes what SDPA computes, the parameter count behind
MFU is the model's, every rung a CPU cannot run gets a reason, and the table shows skipped rows with it."""
import pathlib
import sys

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
def test_param_count_is_the_models(shape):
    L, H, C, T, V = shape
    cfg = fastgpt.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C)
    expected = 124_475_904 if shape[1] == 12 else fastgpt.GPT(cfg).num_parameters()  # GPT-2 124M at vocab 50304
    assert ladder.param_count(cfg) == expected


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
