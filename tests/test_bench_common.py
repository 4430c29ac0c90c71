"""bench/_common.py's write_json, which every benchmark's --json goes through (and bench_gpu_train.py after each of
its variants, so that a device call cut short keeps what was measured): the file is replaced whole or not at all.
And autotune_summary, the few numbers bench_gpu_train.py and bench_ops.py print of matmul autotune's decisions."""
import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _common  # noqa: E402


def test_write_json_replaces_the_file_whole_or_not_at_all(tmp_path, rng, capsys):
    path = tmp_path / "sub" / "bench.json"
    first = {"rows": rng.standard_normal(5).tolist()}
    _common.write_json(str(path), first)
    assert json.loads(path.read_text()) == first
    assert "wrote" in capsys.readouterr().out
    # A payload that fails half-way through (json.dump writes as it goes): the previous file stays as it was and no
    # temporary file is left beside it.
    with pytest.raises(TypeError):
        _common.write_json(str(path), {"ok": 1.0, "bad": np.float32(rng.standard_normal())})
    assert json.loads(path.read_text()) == first
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]
    second = {"rows": rng.standard_normal(3).tolist(), "partial": True}
    _common.write_json(str(path), second, quiet=True)
    assert json.loads(path.read_text()) == second
    assert capsys.readouterr().out == ""


def test_autotune_summary_counts_the_timed_decisions(rng):
    def record(ms, chosen, skipped=""):
        return {"M": 8, "N": 8, "K": 8, "epilogue": "none", "candidates": len(ms), "chosen": chosen, "ms": ms,
                "reps": 0 if skipped else 3, "skipped": skipped}
    a, b, c = (float(v) for v in rng.uniform(0.1, 1.0, 3))
    records = [record([a, 0.5 * a, a], 1),            # changed: the second candidate, half the time
               record([b, 1.01 * b], 0),              # kept
               record([-1.0, c, 0.9 * c], 2),         # the heuristic's could not run: no baseline, left out
               record([-1.0, -1.0], 0, "first run recorded into a CUDA graph")]
    s = _common.autotune_summary(records)
    assert (s["problems"], s["timed"], s["changed"]) == (4, 2, 1)
    assert s["heuristic_ms"] == pytest.approx(a + b) and s["chosen_ms"] == pytest.approx(0.5 * a + b)
    assert s["saved"] == pytest.approx(0.5 * a / (a + b))
    assert s["records"] == records and s["records"] is not records
    assert _common.autotune_summary([])["saved"] == 0.0


def test_gpu_train_bench_records_the_device_commit(tmp_path, monkeypatch):
    # On the device machine the tree's .git may be stale: the commit the caller wrote to .device/COMMIT is the one.
    import bench_gpu_train
    monkeypatch.setattr(bench_gpu_train, "REPO", tmp_path)
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "COMMIT").write_text("abc1234\n")
    assert bench_gpu_train.git_commit() == "abc1234"
    (tmp_path / ".device" / "COMMIT").unlink()
    assert bench_gpu_train.git_commit() is None  # tmp_path is no git repository


def test_gpu_train_bench_runs_the_named_variants_in_order_and_refuses_unknown_ones(capsys):
    # --variants is what lets a short device call time only the variants it needs (gpu_check's BENCH_VARIANTS).
    import bench_gpu_train
    assert bench_gpu_train.parse_args([]).variants == bench_gpu_train.VARIANTS
    picked = bench_gpu_train.parse_args(["--variants", "torch compiled bf16, fastgpt bf16 graph"]).variants
    assert picked == ("fastgpt bf16 graph", "torch compiled bf16")  # the usual order, whatever the order given
    for bad, named in (("fastgpt bf16 graph,fastgpt bf17 graph", "got 'fastgpt bf17 graph'"), (" , ", "got none")):
        with pytest.raises(SystemExit):
            bench_gpu_train.parse_args(["--variants", bad])
        err = capsys.readouterr().err
        assert "--variants takes names from" in err and "torch compiled bf16" in err and named in err


def test_gpu_train_bench_variant_names_carry_their_settings():
    # "... recompute=1" must build GPT(recompute=1) and "... rows=16384" set classifier_rows, not the defaults.
    import bench_gpu_train
    assert bench_gpu_train.variant_options("fastgpt bf16 graph rows=16384") == {"rows": 16384}
    assert bench_gpu_train.variant_options("fastgpt bf16 graph recompute=1") == {"recompute": 1}
    assert bench_gpu_train.variant_options("fastgpt bf16 recompute=2") == {"recompute": 2}
    assert bench_gpu_train.variant_options("fastgpt bf16 graph sm90") == {}
    for name in bench_gpu_train.VARIANTS:  # every name parses (a stray "=" would raise here, not on the GPU)
        assert set(bench_gpu_train.variant_options(name)) <= {"recompute", "rows"}


def test_gpu_train_bench_runs_every_variant_to_its_loss_step_and_times_the_same_steps(capsys):
    # Issue 10 asks for the loss after 50 steps from the same weights: every variant runs max(warmup + steps,
    # --loss-steps) steps, and the timing still reads steps warmup + 1 .. warmup + steps only.
    import bench_gpu_train
    args = bench_gpu_train.parse_args([])
    assert (args.warmup, args.steps, args.loss_steps, args.data) == (3, 10, 50, None)
    assert bench_gpu_train.steps_in_all(args) == 50
    times = list(range(50))
    assert bench_gpu_train.timed(times, args) == list(range(3, 13))
    short = bench_gpu_train.parse_args(["--loss-steps", "5", "--warmup", "2", "--steps", "4"])
    assert bench_gpu_train.steps_in_all(short) == 6 and bench_gpu_train.timed(list(range(6)), short) == [2, 3, 4, 5]
    for bad, said in ((["--loss-steps", "0"], "--loss-steps must be >= 1"),
                      (["--data", "x.txt"], "--data and --encoder go together"),
                      (["--encoder", "e.json"], "--data and --encoder go together"),
                      (["--data", "x.txt", "--encoder", "e.json", "--vocab", "1000"], "--vocab must be >= 50257")):
        with pytest.raises(SystemExit):
            bench_gpu_train.parse_args(bad)
        assert said in capsys.readouterr().err


def test_gpu_train_bench_batches_are_shifted_windows_of_the_text_or_random_tokens(shakespeare_txt, encoder_json, rng):
    import bench_gpu_train
    from fastgpt.tokenizer import get_gpt2_encoding
    seed = int(rng.integers(2**31))
    batches, source = bench_gpu_train.make_batches(4, 3, 16, 50304, seed)
    assert source == "random tokens" and len(batches) == 4
    again, _ = bench_gpu_train.make_batches(4, 3, 16, 50304, seed)
    for (x, y), (x2, y2) in zip(batches, again):
        assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == np.int64
        assert (x[:, 1:] == y[:, :-1]).all() and 0 <= x.min() and max(x.max(), y.max()) < 50257
        assert (x == x2).all() and (y == y2).all()  # the seed decides them: every variant sees the same batches
    assert len({x.tobytes() for x, _ in batches}) == 4
    small, _ = bench_gpu_train.make_batches(2, 3, 16, 100, seed)
    assert max(int(x.max()) for x, _ in small) < 100  # a small --vocab bounds random tokens

    text = open(shakespeare_txt, encoding="utf-8").read()
    batches, source = bench_gpu_train.make_batches(3, 2, 32, 50304, seed, shakespeare_txt, encoder_json)
    assert source.startswith("tinyshakespeare.txt (") and "train tokens" in source
    enc = get_gpt2_encoding(encoder_json)
    flat = [(x.ravel(), y.ravel()) for x, y in batches]
    for i, (x, y) in enumerate(flat):
        assert (x[1:] == y[:-1]).all()  # y is x one token on, across the rows too: consecutive text
        assert enc.decode(x[8:].tolist())[:40] in text
        if i:
            assert x[0] == flat[i - 1][1][-1]  # the next window starts where the last one's targets ended
