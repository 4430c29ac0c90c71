"""Exact resume (fastgpt.resume, train.py --save-every/--resume): a run killed (SIGKILL), interrupted (SIGINT,
SIGTERM) or resumed from an earlier checkpoint goes on with losses, norms, val losses and final weights bitwise
those of a run that never stopped, in every precision; checkpoints are written atomically, pruned, checked on
reading (a truncated or damaged one is refused, with the one before it named), and --resume keeps the run's flags."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import fastgpt
from fastgpt import resume
from fastgpt.train import main

from conftest import _data_file
from devices import needs_cuda

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "-B", "4", "-T", "32", "--no-progress",
        "--sample-tokens", "0", "--eval-steps", "2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # Tiny Shakespeare tokenized once for the module; every run reads these shards.
    encoder, text = _data_file("gpt2/encoder.json"), _data_file("tinyshakespeare.txt")
    folder = tmp_path_factory.mktemp("tok")
    fastgpt.data.tokenize_file(text, folder, encoder_json=encoder, val_fraction=0.1)
    return ["--shards", str(folder), "--encoder", str(encoder)]


def _log(run):
    with open(os.path.join(run, "log.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _trace(run):
    # What must repeat bitwise: every train step's loss, lr and norm (and fp16's scale), every val loss.
    out = []
    for e in _log(run):
        if "loss" in e:
            out.append(("train", e["step"], e["loss"], e["lr"], e["norm"], e.get("loss_scale")))
        elif "val_loss" in e:
            out.append(("val", e["step"], e["val_loss"]))
    return out


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def _same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("precision, accum, device", [
    ("fp32", 1, "cpu"), ("bf16", 2, "cpu"), ("fp16", 1, "cpu"),
    pytest.param("bf16", 2, "cuda", marks=needs_cuda), pytest.param("fp16", 1, "cuda", marks=needs_cuda)])
def test_resume_from_an_earlier_checkpoint_is_bitwise(precision, accum, device, shards, tmp_path):
    run = str(tmp_path / "run")
    flags = [*shards, *TINY, "--max-steps", "8", "--save-every", "3", "--eval-interval", "3", "--precision",
             precision, "--total-batch-size", str(accum * 4 * 32), "--device", device]
    main([*flags, "--out-dir", run])
    full, final = _trace(run), _weights(run)
    assert [s for s, _ in resume.list_checkpoints(run)] == [3, 6, 8]  # every 3 steps and at the end
    state = resume.read_state(os.path.join(run, "step_000003"))
    assert state["step"] == 3 and state["optimizer"]["step_count"] == 3 and state["loader"]["window_pos"] == 3 * accum
    assert (state["loss_scaler"] is not None) == (precision == "fp16")

    bits = None
    if precision != "fp32":
        bits = load_file(os.path.join(run, "step_000008", "compute_weights.safetensors"))["compute_weights"]
    result = main(["--resume", os.path.join(run, "step_000003")])
    assert result["resumed_from"] == os.path.join(run, "step_000003")
    assert _trace(run) == full  # steps 3.. again, bit for bit, and the log holds each step once
    _same_weights(_weights(run), final)
    # the later checkpoints were another history: set aside, not deleted
    assert any(name.startswith("step_000006.superseded") for name in os.listdir(run))
    # the 16-bit weights the kernels read are restored as they were: bf16's stochastic rounding is not what
    # rounding the masters to nearest gives back, so the checkpoint has to carry them
    if precision != "fp32":
        np.testing.assert_array_equal(result["model"]._engine.compute_params(), resume._from_bits(bits, precision))
        fresh = fastgpt.GPT(result["model"].config, device=device, precision=precision)
        fresh.load_state_dict(_weights(run))
        nearest = fresh._engine.compute_params()
        assert (np.count_nonzero(nearest != resume._from_bits(bits, precision)) > 0) == (precision == "bf16")


def _train_py(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kw)


def _wait_for_step(run, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"train.py ended before step {step}:\n{proc.stdout.read()}")
        try:
            if any(e.get("step", -1) >= step and "loss" in e for e in _log(run)):
                return
        except (OSError, ValueError):  # not there yet, or a line being written
            pass
        time.sleep(0.01)
    pytest.fail(f"no step {step} within {timeout} s")


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("full") / "run")
    proc = _train_py([*shards, *TINY, "--max-steps", "60", "--eval-interval", "20", "--save-every", "8",
                      "--out-dir", run])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return run


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_stopped_run_resumes_bitwise(sig, shards, uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    proc = _train_py([*shards, *TINY, "--max-steps", "60", "--eval-interval", "20", "--save-every", "8",
                      "--out-dir", run])
    _wait_for_step(run, 19, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    done = [e for e in _log(run) if "loss" in e][-1]["step"] + 1
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        assert resume.list_checkpoints(run)[-1][0] == 8 * (done // 8)  # the latest periodic one
    else:  # the step in flight finished, a checkpoint of it was written, the exit was clean
        assert proc.returncode == 128 + sig, out
        assert f"stopped by {signal.Signals(sig).name}" in out and f"--resume {run}" in out
        assert "Traceback" not in out
        assert resume.list_checkpoints(run)[-1][0] == done
        assert _log(run)[-1]["interrupted"]["steps_done"] == done
    assert done < 60, "the run finished before the signal: nothing was tested"
    assert not (tmp_path / "run" / "model.safetensors").exists()  # the final weights only at the end

    again = _train_py(["--resume", run])
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert _trace(run) == _trace(uninterrupted)
    _same_weights(_weights(run), _weights(uninterrupted))
    assert _weights(os.path.join(run, "step_000060")).keys() == _weights(run).keys()


def test_damaged_checkpoints_are_refused(shards, tmp_path, capsys):
    run = str(tmp_path / "run")
    main([*shards, *TINY, "--max-steps", "4", "--save-every", "2", "--out-dir", run])
    latest = os.path.join(run, "step_000004")
    good = {n: open(os.path.join(latest, n), "rb").read() for n in os.listdir(latest)}

    def refused(damage, *words):
        shutil.rmtree(latest)
        os.makedirs(latest)
        for n, data in good.items():
            with open(os.path.join(latest, n), "wb") as f:
                f.write(data)
        damage()
        with pytest.raises(SystemExit):
            main(["--resume", run])
        err = capsys.readouterr().err
        for w in words:
            assert w in err, err
        assert f"--resume {os.path.join(run, 'step_000002')}" in err  # the one before is named, not taken
        assert resume.list_checkpoints(run)[-1][0] == 4  # nothing was changed

    opt = os.path.join(latest, "optimizer.safetensors")
    refused(lambda: os.truncate(opt, os.path.getsize(opt) // 2), "optimizer.safetensors", "truncated")

    def flip():
        with open(opt, "r+b") as f:
            f.seek(os.path.getsize(opt) - 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    refused(flip, "optimizer.safetensors", "SHA-256")
    refused(lambda: os.unlink(os.path.join(latest, "state.json")), "incomplete", "state.json")
    refused(lambda: open(os.path.join(latest, "state.json"), "w").write('{"format": "fastgpt-train'), "damaged")

    def drop_args():  # JSON as it should be, but not all of it: a CheckpointError, not a KeyError's traceback
        state = json.loads(good["state.json"])
        del state["args"]
        open(os.path.join(latest, "state.json"), "w").write(json.dumps(state))
    refused(drop_args, "damaged (no 'args')")
    refused(lambda: os.unlink(os.path.join(latest, "model.safetensors")), "model.safetensors is missing")

    # a damaged copy under another name: refused with the same reasons (no step in its name to point before)
    shutil.copytree(latest, os.path.join(run, "best"))
    os.truncate(os.path.join(run, "best", "optimizer.safetensors"), 10)
    with pytest.raises(SystemExit):
        main(["--resume", os.path.join(run, "best")])
    assert "optimizer.safetensors" in capsys.readouterr().err
    shutil.rmtree(os.path.join(run, "best"))

    # asked for explicitly, the one before it is used
    result = main(["--resume", os.path.join(run, "step_000002")])
    assert result["resumed_from"].endswith("step_000002") and result["steps"] == 4


def _state(folder, precision="fp32", world_size=1, zero_stage=0):
    # state.json as resume.save writes it, over small stand-ins for the files it lists.
    names = ["model.safetensors"] + (["compute_weights.safetensors"] if precision != "fp32" else [])
    names += [f"optimizer_rank{r}.safetensors" for r in range(world_size)] if zero_stage else ["optimizer.safetensors"]
    files = {}
    for i, name in enumerate(names):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(bytes([i]) * (i + 3))
        files[name] = resume._digest(os.path.join(folder, name))
    loader = {"epoch": 0, "shard_pos": 0, "window_pos": 3, "B": 4, "T": 32, "world_size": world_size, "seed": 1,
              "files": ["a.bin"], "tokens": [100]}
    return {"format": resume.FORMAT, "version": resume.VERSION, "step": 3, "time": "", "world_size": world_size,
            "zero_stage": zero_stage, "precision": precision, "seed": 1,
            "optimizer": {"step_count": 3, "skipped_steps": 0},
            "loss_scaler": {"scale": 65536.0, "growth_tracker": 3} if precision == "fp16" else None,
            "loader": loader, "args": {"batch_size": 4}, "config": {}, "files": files,
            "history": {"first_val_loss": 10.9, "train_loss": None, "nonfinite_skips": 0}}


def _without(state, *keys):
    *path, last = keys
    for k in path:
        state = state[k]
    del state[last]


@pytest.mark.parametrize("damage, words", [
    (lambda s: _without(s, "files"), "no 'files'"),
    (lambda s: s.update(files=list(s["files"])), "'files' is [\"model.safetensors\""),
    (lambda s: s["files"].update({"model.safetensors": {"size": 3}}), "files: 'model.safetensors' is {\"size\": 3}"),
    (lambda s: _without(s, "files", "model.safetensors", "sha256"), "expected {\"bytes\": <integer>, \"sha256\""),
    (lambda s: s["files"].update({"../x": s["files"]["model.safetensors"]}), "'../x' is not a file name"),
    (lambda s: _without(s, "files", "optimizer.safetensors"), "files does not list optimizer.safetensors"),
    (lambda s: _without(s, "args"), "no 'args'"),
    (lambda s: s.update(args=["--batch-size", "4"]), "'args' is [\"--batch-size\""),
    (lambda s: s["loader"].update(epoch=None), "'loader.epoch' is null, expected an integer >= 0"),
    (lambda s: _without(s, "loader", "window_pos"), "no 'loader.window_pos'"),
    (lambda s: s.update(step=True), "'step' is true"),
    (lambda s: s["optimizer"].update(step_count="3"), "'optimizer.step_count' is \"3\""),
    (lambda s: _without(s, "history", "train_loss"), "no 'history.train_loss'"),
    (lambda s: s.update(precision="fp8"), "'precision' is \"fp8\""),
    (lambda s: s.update(loss_scaler={"scale": 1.0, "growth_tracker": 0}), "loss_scaler is {\"scale\""),
])
def test_state_json_of_the_wrong_shape_is_damaged(tmp_path, damage, words):
    # It parses, but lacks or mistypes what train.py and restore() read: refused by read_state, naming what.
    state = _state(tmp_path)
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert resume.read_state(tmp_path) == state  # the intact one is read, so the damage below is what is refused
    damage(state)
    (tmp_path / "state.json").write_text(json.dumps(state))
    with pytest.raises(resume.CheckpointError, match="damaged") as e:
        resume.read_state(tmp_path)
    assert f"{tmp_path / 'state.json'}: damaged" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("precision, world_size, zero_stage, damage, words", [
    ("fp16", 1, 0, lambda s: s.update(loss_scaler=None), "loss_scaler is null with precision fp16"),
    ("fp16", 1, 0, lambda s: s["loss_scaler"].update(scale=0), "'loss_scaler.scale' is 0"),
    ("bf16", 1, 0, lambda s: _without(s, "files", "compute_weights.safetensors"), "does not list compute_weights"),
    ("fp32", 2, 1, lambda s: _without(s, "files", "optimizer_rank1.safetensors"), "of ranks [0], expected 0 to 1"),
    ("fp32", 2, 1, lambda s: s.update(world_size=10**12), "expected 0 to 999999999999"),
])
def test_state_json_of_other_setups_is_checked_too(tmp_path, precision, world_size, zero_stage, damage, words):
    state = _state(tmp_path, precision, world_size, zero_stage)
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert resume.read_state(tmp_path) == state
    damage(state)
    (tmp_path / "state.json").write_text(json.dumps(state))
    with pytest.raises(resume.CheckpointError, match="damaged") as e:
        resume.read_state(tmp_path)
    assert words in str(e.value)


def test_resume_from_inside_the_run_folder(shards, tmp_path, monkeypatch):
    # --resume step_000002 given from the run's own folder goes on in that run, not in a new runs/<timestamp>.
    run = tmp_path / "run"
    main([*shards, *TINY, "--max-steps", "4", "--save-every", "2", "--out-dir", str(run)])
    monkeypatch.chdir(run)
    result = main(["--resume", "step_000002"])
    assert os.path.samefile(result["out_dir"], run) and result["steps"] == 4
    assert not (run / "runs").exists()
    assert any("resumed" in e for e in _log(str(run)))


def test_a_failed_save_leaves_the_previous_checkpoint(shards, tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    real, calls = resume.save_file, []

    def failing(tensors, path, **kw):  # the second checkpoint dies after writing half a file
        calls.append(path)
        if "step_000004" in path:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError("disk full (simulated)")
        return real(tensors, path, **kw)

    monkeypatch.setattr(resume, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        main([*shards, *TINY, "--max-steps", "6", "--save-every", "2", "--out-dir", run])
    assert [s for s, _ in resume.list_checkpoints(run)] == [2]
    assert sorted(os.listdir(run)) == ["log.jsonl", "step_000002"]  # no half-written folder left
    resume.read_state(os.path.join(run, "step_000002"))  # intact
    monkeypatch.setattr(resume, "save_file", real)
    os.makedirs(os.path.join(run, ".step_000004.abc.tmp"))  # what a SIGKILL mid-save would leave: cleared
    result = main(["--resume", run])
    assert result["steps"] == 6 and [s for s, _ in resume.list_checkpoints(run)] == [2, 4, 6]
    assert not any(n.endswith(".tmp") for n in os.listdir(run))


def test_keep_prunes_the_oldest(shards, tmp_path):
    run = str(tmp_path / "run")
    main([*shards, *TINY, "--max-steps", "9", "--save-every", "2", "--keep", "2", "--out-dir", run])
    assert [s for s, _ in resume.list_checkpoints(run)] == [8, 9]
    state = resume.read_state(os.path.join(run, "step_000009"))
    assert state["args"]["keep"] == 2 and state["config"]["n_layer"] == 2
    assert set(state["files"]) == {"model.safetensors", "optimizer.safetensors"}
    assert os.stat(os.path.join(run, "step_000009", "model.safetensors")).st_mode & 0o044  # not 0600


def test_resume_keeps_the_runs_flags(shards, tmp_path, capsys):
    run = str(tmp_path / "run")
    main([*shards, *TINY, "--max-steps", "3", "--save-every", "2", "--out-dir", run])
    for extra, named in [(["-B", "8"], "--batch-size 8 (was 4)"), (["--max-lr", "0.1"], "--max-lr 0.1"),
                         (["--out-dir", str(tmp_path / "x")], "--out-dir with --resume")]:
        with pytest.raises(SystemExit):
            main(["--resume", run, *extra])
        assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--resume", str(tmp_path)])  # a folder without checkpoints
    assert "no checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an existing run is never overwritten; the message says how to go on
        main([*shards, *TINY, "--max-steps", "3", "--out-dir", run])
    assert f"--resume {run}" in capsys.readouterr().err
    # flags that do not change training may be given again: here more evals, and no new checkpoint flags
    result = main(["--resume", os.path.join(run, "step_000002"), "--eval-interval", "1", "-B", "4"])
    assert result["steps"] == 3
    vals = [e["step"] for e in _log(run) if "val_loss" in e]
    assert vals == [0, 2, 3]  # step 0 from the first run, then every step after resuming


def test_adamw_state_round_trip(rng):
    cfg = fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    x = rng.integers(0, 64, (2, 16))
    a = fastgpt.GPT(cfg, seed=int(rng.integers(1 << 30)))
    opt_a = fastgpt.AdamW(a, lr=1e-2)
    for _ in range(3):
        a.zero_grad()
        a.forward(x, x)
        a.backward()
        opt_a.step()
    b = fastgpt.GPT(cfg, seed=1)
    b.load_state_dict(a.state_dict())
    opt_b = fastgpt.AdamW(b, lr=1e-2)
    opt_b.load_state_dict(opt_a.state_dict())
    assert opt_b.step_count == 3
    for m in (a, b):
        m.zero_grad()
        m.forward(x, x)
        m.backward()
    opt_a.step()
    opt_b.step()
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[k], v, err_msg=k)
    bad = opt_a.state_dict()
    bad["exp_avg"] = bad["exp_avg"][:-1]
    with pytest.raises(ValueError, match="exp_avg"):
        opt_b.load_state_dict(bad)


def test_resume_from_another_working_directory(shakespeare_txt, encoder_json, tmp_path, monkeypatch):
    # Relative --input and --encoder are saved with the run as absolute paths: --resume works from anywhere.
    monkeypatch.chdir(tmp_path)
    os.makedirs("w")
    shutil.copy(shakespeare_txt, "play.txt")
    main(["--input", "play.txt", "--encoder", os.path.relpath(encoder_json), *TINY, "--max-steps", "2",
          "--save-every", "1", "--out-dir", "w/run"])
    monkeypatch.chdir(tmp_path / "w")
    result = main(["--resume", os.path.join("run", "step_000001")])
    assert result["steps"] == 2 and result["resumed_from"].endswith("step_000001")
    assert resume.read_state(os.path.join("run", "step_000002"))["args"]["input"] == str(tmp_path / "play.txt")


def test_a_finished_run_is_not_run_again(shards, tmp_path, capsys):
    run = str(tmp_path / "run")
    main([*shards, *TINY, "--max-steps", "2", "--save-every", "1", "--out-dir", run])
    before = open(os.path.join(run, "log.jsonl")).read()
    with pytest.raises(SystemExit):
        main(["--resume", run])
    assert "finished (step 2 of 2" in capsys.readouterr().err
    assert open(os.path.join(run, "log.jsonl")).read() == before
    # Stopped during the final pass (killed after the weights were saved, before the summary): the resume does that
    # pass again, and its summary, with no step timed, holds nulls, not NaN (strict JSON).
    with open(os.path.join(run, "log.jsonl"), "w") as f:
        f.write("".join(before.splitlines(keepends=True)[:-1]))
    result = main(["--resume", run])
    assert result["mean_tok_per_s"] is None and os.path.isfile(os.path.join(run, "model.safetensors"))
    # Eval flags given again run the final pass on a finished run (a new HellaSwag file, more val batches).
    assert main(["--resume", run, "--eval-steps", "1"])["steps"] == 2

    def no_constants(name):
        raise ValueError(f"{name} in the log")

    with open(os.path.join(run, "log.jsonl")) as f:
        summary = [json.loads(line, parse_constant=no_constants) for line in f][-1]["summary"]
    assert summary["mean_tok_per_s"] is None and summary["steps"] == 2
