"""The trainer (fastgpt.train) and checkpoints (fastgpt.checkpoint): the learning-rate schedule against
build-nanogpt's formula, a short real run end to end (log, val loss going down, checkpoint round trip, sample),
gradient accumulation, atomic saves, and bad flags failing with messages that name them."""
import json
import math
import os

import numpy as np
import pytest

import fastgpt
from fastgpt import checkpoint
from fastgpt.checkpoint import load_checkpoint, save_checkpoint
from fastgpt.train import get_lr, main

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "-B", "4", "-T", "32", "--no-progress"]


def _nanogpt_lr(it, max_lr, min_lr, warmup_steps, max_steps):
    # build-nanogpt train_gpt2.py, verbatim but for the parameters
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it > max_steps:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (max_lr - min_lr)


def _read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---- learning-rate schedule ----

@pytest.mark.parametrize("max_lr, warmup, max_steps", [(6e-4, 10, 50), (1e-3, 715, 19073), (3e-4, 0, 7)])
def test_get_lr_matches_build_nanogpt(max_lr, warmup, max_steps):
    min_lr = 0.1 * max_lr
    checks = [0, warmup // 2, max(warmup - 1, 0), warmup, (warmup + max_steps) // 2, max_steps - 1, max_steps,
              max_steps + 5]
    for step in checks:
        assert get_lr(step, max_lr, min_lr, warmup, max_steps) == pytest.approx(
            _nanogpt_lr(step, max_lr, min_lr, warmup, max_steps), rel=1e-12, abs=1e-18), step
    if warmup:
        assert get_lr(warmup - 1, max_lr, min_lr, warmup, max_steps) == pytest.approx(max_lr)
    assert get_lr(max_steps, max_lr, min_lr, warmup, max_steps) == pytest.approx(min_lr)
    # cosine midpoint: exactly halfway between max_lr and min_lr
    if (max_steps - warmup) % 2 == 0:
        mid = warmup + (max_steps - warmup) // 2
        assert get_lr(mid, max_lr, min_lr, warmup, max_steps) == pytest.approx((max_lr + min_lr) / 2)
    after = [get_lr(s, max_lr, min_lr, warmup, max_steps) for s in range(warmup, max_steps + 3)]
    assert all(a >= b for a, b in zip(after, after[1:])), "lr must not rise after warmup"
    during = [get_lr(s, max_lr, min_lr, warmup, max_steps) for s in range(warmup)]
    assert all(a < b for a, b in zip(during, during[1:])), "lr must rise during warmup"


def test_get_lr_warmup_equals_max_steps():
    # build-nanogpt's formula divides by zero here at step == max_steps; ours gives min_lr
    assert get_lr(5, 1.0, 0.1, 5, 5) == 0.1
    assert get_lr(4, 1.0, 0.1, 5, 5) == 1.0


# ---- a real run ----

def test_short_run(shakespeare_txt, encoder_json, tmp_path, capsys):
    out = tmp_path / "run"
    result = main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "30",
                   "--eval-interval", "15", "--eval-steps", "4", "--sample-interval", "30",
                   "--sample-tokens", "32", "--out-dir", str(out)])
    printed = capsys.readouterr().out

    log = _read_log(out)
    assert log[0]["header"]["grad_accum"] == 1
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == list(range(30))
    for e in steps:
        assert math.isfinite(e["loss"]) and math.isfinite(e["norm"]) and e["dt_ms"] > 0 and e["tok_per_s"] > 0
        assert e["lr"] == pytest.approx(get_lr(e["step"], 1e-3, 1e-4, 10, 30))
    vals = [e for e in log if "val_loss" in e]
    assert [e["step"] for e in vals] == [0, 15, 30]
    assert all(math.isfinite(e["val_loss"]) for e in vals)
    assert vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert result["first_val_loss"] == vals[0]["val_loss"] and result["last_val_loss"] == vals[-1]["val_loss"]
    assert result["final_train_loss"] == steps[-1]["loss"] and result["mean_tok_per_s"] > 0
    assert "summary" in log[-1]

    # the checkpoint rebuilds the trained model exactly, and stores no lm_head (tied to wte)
    ckpt = out / "model.safetensors"
    assert result["checkpoint"] == str(ckpt) and str(ckpt) in printed
    loaded = load_checkpoint(ckpt)
    assert loaded.config == result["model"].config
    trained, back = result["model"].state_dict(), loaded.state_dict()
    assert trained.keys() == back.keys()
    for name in trained:
        np.testing.assert_array_equal(back[name], trained[name], err_msg=name)
    meta = checkpoint.read_metadata(ckpt)
    assert meta["n_layer"] == "2" and meta["n_embd"] == "64" and "lm_head.weight" in meta["tied_weights"]
    from safetensors.numpy import load_file
    assert "lm_head.weight" not in load_file(ckpt)

    assert len(result["samples"]) == 1 and result["samples"][0].strip()
    assert result["samples"][0] in printed
    assert "sample at step 30" in printed and "done:" in printed


def test_grad_accumulation(shakespeare_txt, encoder_json, tmp_path, capsys):
    out = tmp_path / "accum"
    result = main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "2",
                   "--total-batch-size", str(2 * 4 * 32), "--eval-steps", "1", "--sample-tokens", "0",
                   "--out-dir", str(out)])
    assert result["grad_accum"] == 2
    log = _read_log(out)
    assert log[0]["header"]["grad_accum"] == 2 and log[0]["header"]["total_batch_size"] == 256
    steps = [e for e in log if "loss" in e]
    assert len(steps) == 2 and all(math.isfinite(e["loss"]) for e in steps)
    assert "grad_accum=2" in capsys.readouterr().out

    # the shards just cut train through --shards too (a folder: *_train_* and *_val_* picked by split)
    again = main(["--shards", str(out / "data"), "--encoder", str(encoder_json), *TINY, "--max-steps", "1",
                  "--eval-steps", "1", "--sample-tokens", "0", "--out-dir", str(tmp_path / "from_shards")])
    assert math.isfinite(again["final_train_loss"]) and again["grad_accum"] == 1


def test_fp16_run_logs_the_loss_scale(shakespeare_txt, encoder_json, tmp_path, capsys):
    # --precision fp16 with gradient accumulation: every step logs the loss scale and whether it was skipped, the
    # summary counts skips, and the checkpoint holds the fp32 masters (loadable in any precision).
    out = tmp_path / "fp16"
    result = main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "4",
                   "--total-batch-size", str(2 * 4 * 32), "--eval-steps", "1", "--sample-tokens", "4",
                   "--precision", "fp16", "--out-dir", str(out)])
    steps = [e for e in _read_log(out) if "loss" in e]
    assert [e["loss_scale"] for e in steps] == [2.0**16] * 4 and not any(e["skipped"] for e in steps)
    assert result["precision"] == "fp16" and result["skipped_steps"] == 0
    assert steps[-1]["loss"] < steps[0]["loss"]
    back = load_checkpoint(out / "model.safetensors", precision="bf16")
    np.testing.assert_array_equal(back.state_dict()["transformer.wpe.weight"],
                                  result["model"].state_dict()["transformer.wpe.weight"])


def test_bad_precision_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--input", "x.txt", "--precision", "fp8", "--out-dir", str(tmp_path / "r")])
    assert "--precision" in capsys.readouterr().err


# ---- checkpoints ----

def _model(seed):
    return fastgpt.GPT(fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16), seed=seed)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    save_checkpoint(_model(1), path, metadata={"note": "first"})
    before = path.read_bytes()

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # a partial file under the temp name, then the failure
            f.write(b"\0" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(_model(2), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"], "the temp file must be removed"
    assert checkpoint.read_metadata(path)["note"] == "first"

    monkeypatch.undo()
    second = _model(2)
    save_checkpoint(second, path)  # overwriting goes through a temp file too
    assert os.listdir(tmp_path) == ["model.safetensors"]
    np.testing.assert_array_equal(load_checkpoint(path).state_dict()["transformer.wte.weight"],
                                  second.state_dict()["transformer.wte.weight"])


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_checkpoint(junk)
    from safetensors.numpy import save_file
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": np.zeros(3, dtype=np.float32)}, str(foreign))
    with pytest.raises(ValueError, match="not a fastgpt checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(_model(0), tmp_path / "m.safetensors", metadata={"n_layer": 3})


# ---- bad flags ----

@pytest.mark.parametrize("flags, named", [
    (["--max-steps", "-5"], "--max-steps"),
    (["--max-steps", "ten"], "--max-steps"),
    (["--max-lr", "0"], "--max-lr"),
    (["-T", "64", "--block-size", "32"], "--block-size"),
    (["--total-batch-size", "200"], "--total-batch-size"),
    (["--n-embd", "65"], "--n-head"),
    (["--vocab-size", "1000"], "--vocab-size"),
    (["--model", "huge"], "--model"),
    (["--max-lr", "inf"], "--max-lr: must be a finite number"),
    (["--min-lr-ratio", "nan"], "--min-lr-ratio: must be a finite number"),
    (["--peak-tflops", "nan"], "--peak-tflops: must be a finite number"),
    (["--hellaswag-examples", "5"], "--hellaswag-examples needs --hellaswag"),
    (["--block-size", str(10**9)], "weights, gradients and AdamW moments alone"),  # terabytes: not the OOM killer
    (["--max-steps", "9" * 400], "--max-steps"),  # an int past float's range: no OverflowError traceback
])
def test_bad_flags(flags, named, shakespeare_txt, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--input", str(shakespeare_txt), *TINY, "--out-dir", str(tmp_path / "bad"), *flags])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_missing_input(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path / "missing.txt"), *TINY, "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert "--input" in err and "missing.txt" in err
    monkeypatch.delenv("FASTGPT_DATA", raising=False)
    with pytest.raises(SystemExit):
        main([*TINY, "--out-dir", str(tmp_path / "o")])
    assert "--input" in capsys.readouterr().err


def test_bad_shards(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--shards", str(tmp_path / "none_*.bin"), "--encoder", "unused.json", *TINY,
              "--out-dir", str(tmp_path / "o")])
    assert "no shards" in capsys.readouterr().err


def test_existing_run_is_not_overwritten(tmp_path, shakespeare_txt, encoder_json, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text("earlier run\n")
    with pytest.raises(SystemExit):
        main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), "--max-steps", "1",
                    "--out-dir", str(out), "--no-progress"])
    assert (out / "log.jsonl").read_text() == "earlier run\n"
    # nor a folder's weights (here a Hugging Face model's); --resume is suggested only where there is a checkpoint
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["--input", str(shakespeare_txt), *TINY, "--max-steps", "1", "--out-dir", str(hf)])
    err = capsys.readouterr().err
    assert "already holds a run (model.safetensors)" in err and f"--resume {hf}" not in err
    assert (hf / "model.safetensors").read_bytes() == b"weights"


def test_out_dir_errors_name_the_flag(tmp_path, shakespeare_txt, capsys):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["--input", str(shakespeare_txt), *TINY, "--out-dir", str(tmp_path / "afile" / "sub")])
    assert e.value.code == 2 and f"--out-dir {tmp_path / 'afile' / 'sub'}: cannot make the folder" in \
        capsys.readouterr().err


def test_refused_launches_make_no_run_folder(tmp_path, shakespeare_txt, monkeypatch, capsys):
    # Flags refused without the data are refused before runs/<timestamp> is made and the text tokenized into it.
    monkeypatch.chdir(tmp_path)
    for flags, named in ((["--zero-stage", "1"], "--zero-stage 1"), (["--device", "tpu"], "--device")):
        with pytest.raises(SystemExit):
            main(["--input", str(shakespeare_txt), *TINY, *flags])
        assert named in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_weights_are_saved_before_the_final_sample(tmp_path, shakespeare_txt, encoder_json, monkeypatch):
    # A failure in the final sample (or HellaSwag) comes after the weights are on disk.
    from fastgpt import train

    def failing(*args, **kwargs):
        raise RuntimeError("sampling failed (simulated)")

    monkeypatch.setattr(train.GPT, "generate", failing)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated"):
        main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "2",
              "--eval-steps", "1", "--out-dir", str(out)])
    assert load_checkpoint(out / "model.safetensors").config.n_embd == 64


def test_sample_tokens_0_prints_no_samples(tmp_path, shakespeare_txt, encoder_json, capsys):
    result = main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "2",
                   "--eval-steps", "1", "--sample-interval", "1", "--sample-tokens", "0",
                   "--out-dir", str(tmp_path / "run")])
    assert result["samples"] == [] and "sample at step" not in capsys.readouterr().out


def test_a_closed_stdout_does_not_end_the_run(tmp_path, shakespeare_txt, encoder_json):
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(repo, "train.py"), "--input", str(shakespeare_txt),
                             "--encoder", str(encoder_json), *TINY, "--max-steps", "3", "--eval-steps", "1",
                             "--sample-tokens", "4", "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head` that has read enough, before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err, err
    assert (out / "model.safetensors").exists() and "summary" in _read_log(out)[-1]


def test_a_second_signal_waits_for_the_checkpoint_being_written():
    import signal
    from fastgpt.train import _StopSignal
    with _StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the first: noted
        assert stop.signum == signal.SIGINT
        stop.saving = True
        os.kill(os.getpid(), signal.SIGINT)  # the second, during the write: deferred
        stop.saving = False
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # after it (or a third): at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_cli_reports_a_second_ctrl_c_without_a_traceback(monkeypatch, capsys):
    from fastgpt import train

    def interrupted(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "main", interrupted)
    assert train.cli() == 130 and "stopped at once" in capsys.readouterr().err


def test_shards_are_read_even_with_fastgpt_data_set(tmp_path, shakespeare_txt, encoder_json, monkeypatch):
    # FASTGPT_DATA names the text only where no data is named: --shards is not overridden by it.
    from fastgpt.data import write_shard
    folder = tmp_path / "shards"
    folder.mkdir()
    rng = np.random.default_rng()
    for split in ("train", "val"):
        write_shard(str(folder / f"mine_{split}_000000.bin"), rng.integers(0, 100, 4000).astype(np.uint16))
    monkeypatch.setenv("FASTGPT_DATA", str(shakespeare_txt))
    out = tmp_path / "run"
    main(["--shards", str(folder), "--encoder", str(encoder_json), *TINY, "--max-steps", "1", "--eval-steps", "1",
          "--sample-tokens", "0", "--out-dir", str(out)])
    args = _read_log(out)[0]["header"]["args"]
    assert args["shards"] == str(folder) and args["input"] is None
    assert not (out / "data").exists()  # nothing was tokenized


def test_a_second_run_cannot_share_the_folder(tmp_path, monkeypatch):
    # Two runs started in the same second get two folders; an explicit folder in use is refused.
    from fastgpt import train
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train.time, "strftime", lambda fmt: "20260101-000000")
    held = []
    try:
        first = train._claim_out_dir(None, False, held)
        second = train._claim_out_dir(None, False, held)
        assert (first, second) == (os.path.join("runs", "20260101-000000"), os.path.join("runs", "20260101-000000-2"))
        with pytest.raises(ValueError, match="is in use by another run"):
            train._claim_out_dir(first, False, held)
    finally:
        for fd in held:
            os.close(fd)
    assert train._claim_out_dir(first, False, held) == first  # released: free again
    os.close(held.pop())


def test_eval_steps_past_the_val_split_are_cut_to_it(shakespeare_txt, encoder_json, tmp_path, capsys):
    # B*T = 8192 tokens per batch: Tiny Shakespeare's val split (~33.8k tokens) holds 4 batches; asking for 9 would
    # count some twice.
    runs = []
    for steps in (9, 4):
        out = tmp_path / f"e{steps}"
        main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), "--n-layer", "1", "--n-head", "2",
              "--n-embd", "32", "-B", "32", "-T", "256", "--no-progress", "--max-steps", "1", "--sample-tokens", "0",
              "--eval-steps", str(steps), "--out-dir", str(out)])
        runs.append([e["val_loss"] for e in _read_log(out) if "val_loss" in e])
    assert "--eval-steps 9 is more than the val split's 4 batches" in capsys.readouterr().out
    assert runs[0] == runs[1]


# ---- non-finite losses, MFU ----

def test_a_nonfinite_loss_stops_the_run(shakespeare_txt, encoder_json, tmp_path, monkeypatch, capsys):
    # An absurd learning rate wrecks the weights at step 0, so step 1's loss is NaN: the run stops there, naming
    # the step, before an update, and what was saved before stays as it was.
    out = tmp_path / "nan"
    flags = ["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "5",
             "--max-lr", "1e30", "--warmup-steps", "0", "--eval-steps", "1", "--sample-tokens", "0",
             "--save-every", "1", "--out-dir", str(out)]
    from fastgpt import resume
    from fastgpt.train import NonFiniteError
    with pytest.raises(NonFiniteError, match=r"step 1: loss nan"):
        main(flags)
    log = _read_log(out)
    assert log[-1] == {"step": 1, "nonfinite": log[-1]["nonfinite"], "stopped": True}
    assert [s for s, _ in resume.list_checkpoints(out)] == [1]
    resume.read_state(out / "step_000001")  # intact
    assert not (out / "model.safetensors").exists()
    # from the shell: a message, exit status 1, no traceback
    monkeypatch.setattr("sys.argv", ["train.py", *flags[:-1], str(tmp_path / "nan2")])
    assert fastgpt.train.cli() == 1
    err = capsys.readouterr().err
    assert "error: step 1: loss nan" in err and "--skip-nonfinite" in err and "Traceback" not in err


@pytest.mark.parametrize("skip", [False, True])
def test_a_nonfinite_step_is_stopped_or_skipped(skip, shakespeare_txt, encoder_json, tmp_path, monkeypatch):
    # One NaN in ln_f's weight during step 2 (the third train_step) makes that step's loss and norm NaN: without
    # --skip-nonfinite the run stops there; with it, the device skipped the update (the weights are exactly as
    # before it, so putting the weight back leaves them finite) and training goes on.
    calls = []

    class Poisoned(fastgpt.AdamW):
        def train_step(self, *a, **k):  # train.py's training step call
            calls.append(1)
            if len(calls) != 3:
                return super().train_step(*a, **k)
            w = self.model.state_dict()["transformer.ln_f.weight"]  # a zero-copy view on the CPU
            saved, before = w[0], np.array(self.model._engine.params)
            w[0] = np.nan
            stats = super().train_step(*a, **k)
            assert math.isnan(stats.loss) and not stats.applied  # read now: the step has finished
            w[0] = saved
            np.testing.assert_array_equal(np.nan_to_num(self.model._engine.params), np.nan_to_num(before))
            return stats

    monkeypatch.setattr(fastgpt.train, "AdamW", Poisoned)
    flags = ["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "5",
             "--eval-steps", "1", "--sample-tokens", "0", "--out-dir", str(tmp_path / "run")]
    if not skip:
        with pytest.raises(fastgpt.train.NonFiniteError, match="step 2: loss nan and gradient norm nan"):
            main(flags)
        return
    result = main(flags + ["--skip-nonfinite"])
    log = _read_log(tmp_path / "run")
    assert [e["step"] for e in log if "loss" in e] == [0, 1, 3, 4]
    bad = [e for e in log if "nonfinite" in e]
    assert len(bad) == 1 and bad[0]["step"] == 2 and bad[0]["skipped"] and "gradient norm nan" in bad[0]["nonfinite"]
    assert result["nonfinite_skips"] == 1 and math.isfinite(result["final_train_loss"])
    assert all(np.isfinite(v).all() for v in result["model"].state_dict().values())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_graph_and_recompute_flags_train_the_same_weights(shakespeare_txt, encoder_json, tmp_path, precision):
    # --graph records the step and replays it (the CPU's recording here; fp16's loss scale read from memory at each
    # replay), --recompute 2 remakes the LayerNorms and GELU in backward: the same losses and weights as without.
    common = ["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "4",
              "--eval-interval", "2", "--eval-steps", "1", "--sample-tokens", "0", "--total-batch-size", "256",
              "--precision", precision]
    runs = [main(common + ["--out-dir", str(tmp_path / name)] + flags)
            for name, flags in (("eager", ["--recompute", "0"]), ("graph", ["--graph", "--recompute", "2"]))]
    assert (runs[0]["model"].recompute, runs[1]["model"].recompute) == (0, 2)
    logs = [[e["loss"] for e in _read_log(tmp_path / name) if "loss" in e] for name in ("eager", "graph")]
    assert logs[0] == logs[1] and len(logs[0]) == 4
    a, b = (r["model"].state_dict() for r in runs)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert runs[0]["grad_accum"] == 2 and runs[0]["graph_counts"] == [0, 0]
    assert runs[1]["graph_counts"] == [1, 3], "recorded on the second step, replayed on the rest"


def test_mfu_in_the_log(shakespeare_txt, encoder_json, tmp_path):
    out = tmp_path / "mfu"
    common = ["--input", str(shakespeare_txt), "--encoder", str(encoder_json), *TINY, "--max-steps", "3",
              "--eval-steps", "1", "--sample-tokens", "0"]
    result = main(common + ["--peak-tflops", "0.25", "--out-dir", str(out)])
    log = _read_log(out)
    header = log[0]["header"]
    n = result["num_parameters"] - 32 * 64  # nanoGPT leaves the position embeddings out
    assert header["flops_per_token"] == 6 * n + 12 * 2 * 2 * 32 * 32 and header["peak_tflops"] == 0.25
    for e in (e for e in log if "loss" in e):
        assert e["mfu"] == pytest.approx(header["flops_per_token"] * e["tok_per_s"] / 0.25e12, rel=1e-12)
    assert result["mean_mfu"] > 0
    plain = main(common + ["--out-dir", str(tmp_path / "plain")])  # the CPU has no entry in the table
    assert plain["mean_mfu"] is None and not any("mfu" in e for e in _read_log(tmp_path / "plain"))


def test_peak_table_and_gpt2_flops():
    from fastgpt import mfu
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989
    assert mfu.peak_tflops("NVIDIA H200", "tf32") == 494
    assert mfu.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756
    assert mfu.peak_tflops("NVIDIA H100 NVL", "bf16") == mfu.peak_tflops("NVIDIA H200 NVL", "bf16") == 835
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert mfu.peak_tflops("NVIDIA L40S", "bf16") == 362 and mfu.peak_tflops("NVIDIA L4", "bf16") == 121
    assert mfu.peak_tflops("Tesla T4", "bf16") is None and mfu.peak_tflops("Tesla T4", "fp16") == 65
    assert mfu.peak_tflops("NVIDIA A10G", "bf16") is None  # not the A10's numbers
    assert mfu.peak_tflops("Some Future GPU", "bf16") is None
    # GPT-2 124M with the padded vocab (124,475,904 parameters): about 0.855 GFLOP per token at T 1024
    gpt2 = fastgpt.GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    assert mfu.flops_per_token(gpt2, 1024, 124_475_904) == pytest.approx(0.855e9, rel=1e-3)


def test_the_stop_message_names_the_command_that_ran(monkeypatch):
    from fastgpt import train
    for argv0, want in ((train.__file__, "python -m fastgpt.train"),
                        ("../fastgpt/train.py", "python ../fastgpt/train.py"),
                        ("/usr/local/bin/fastgpt-train", "fastgpt-train")):
        monkeypatch.setattr("sys.argv", [argv0])
        assert train._prog() == want
