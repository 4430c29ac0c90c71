"""python -m fastgpt.sample: text from a train.py checkpoint (the file or its run folder) and from a Hugging Face
folder, streamed token by token; greedy output equals model.generate's tokens decoded; bad arguments are clear
errors (argparse's exit 2 with a message)."""
import io
import subprocess
import sys

import numpy as np
import pytest

import fastgpt
from fastgpt import sample
from fastgpt.checkpoint import save_checkpoint
from fastgpt.tokenizer import get_gpt2_encoding

CONFIG = fastgpt.GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


class Recorder(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


@pytest.fixture
def model(rng):
    return fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31)))


def _expected(model, enc, prompt, n):
    ids = model.generate(np.array(enc.encode(prompt)), n, temperature=0.0)
    return enc.decode(ids.tolist())


def test_greedy_sample_from_checkpoint_streams_generate(tmp_path, model, encoder_json):
    run = tmp_path / "run"
    save_checkpoint(model, run / "model.safetensors")
    enc = get_gpt2_encoding(encoder_json)
    want = _expected(model, enc, "To be or not", 40)
    for where in (run / "model.safetensors", run):  # the file, or the run folder train.py made
        out = Recorder()
        got = sample.main([str(where), "--prompt", "To be or not", "-n", "40", "--temperature", "0", "--stop", "",
                           "--encoder", str(encoder_json)], out=out)
        assert out.getvalue() == want + "\n"
        assert len(got) == 1 and len(got[0]) == 40
        assert len(out.writes) > 20  # printed as the tokens came, not at the end


def test_seeded_samples_from_a_hugging_face_folder(tmp_path, model, encoder_json):
    model.save_pretrained(tmp_path / "hf")
    args = [str(tmp_path / "hf"), "-n", "15", "--num-samples", "2", "--seed", "5", "--top-p", "0.9",
            "--encoder", str(encoder_json)]
    a, b = sample.main(args, out=io.StringIO()), sample.main(args, out=io.StringIO())
    assert a == b and a[0] != a[1]  # seed + i per sample
    expect = model.generate(np.array([50256]), 15, top_k=50, top_p=0.9, seed=5, stop_token=50256)[1:]
    assert a[0] == expect.tolist()


def test_command_line(tmp_path, model, encoder_json):
    save_checkpoint(model, tmp_path / "m.safetensors")
    r = subprocess.run([sys.executable, "-m", "fastgpt.sample", str(tmp_path / "m.safetensors"), "--prompt", "Hello",
                        "-n", "8", "--temperature", "0", "--stop", "", "--encoder", str(encoder_json)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _expected(model, get_gpt2_encoding(encoder_json), "Hello", 8) + "\n"
    bad = subprocess.run([sys.executable, "-m", "fastgpt.sample", str(tmp_path / "missing")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "checkpoint: no such folder or file" in bad.stderr


def test_bad_arguments(tmp_path, model, encoder_json, capsys):
    save_checkpoint(model, tmp_path / "m.safetensors")
    for extra, message in ((["--top-p", "1.5"], "top_p must be <= 1"), (["--stop", "two words"], "--stop must be one"),
                           (["-n", "-1"], "max_new_tokens must be >= 0"),
                           (["--num-samples", "0"], "--num-samples must be >= 1")):
        with pytest.raises(SystemExit) as e:
            sample.main([str(tmp_path / "m.safetensors"), "--encoder", str(encoder_json), *extra], out=io.StringIO())
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_device_and_damaged_files_are_named(tmp_path, model, encoder_json, capsys):
    save_checkpoint(model, tmp_path / "m.safetensors")
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / "m.safetensors"), "--device", "gpu"], out=io.StringIO())
    assert e.value.code == 2 and "--device/--precision: device must be 'cpu' or 'cuda'" in capsys.readouterr().err
    if not (fastgpt._C.built_with_cuda and fastgpt._C.cuda_device_count()):  # where no GPU is, say so
        with pytest.raises(SystemExit) as e:
            sample.main([str(tmp_path / "m.safetensors"), "--device", "cuda"], out=io.StringIO())
        assert e.value.code == 2 and "--device/--precision: device='cuda'" in capsys.readouterr().err
    # A run folder whose model.safetensors was cut short: said so, not "no config.json" of the Hugging Face reader.
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes()[:1000])
    with pytest.raises(SystemExit) as e:
        sample.main([str(run), "--encoder", str(encoder_json)], out=io.StringIO())
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not a readable safetensors file" in err and "config.json" not in err


class _T4:
    """fastgpt._C as a build with CUDA on a machine with one T4 (sm_75) shows it."""
    built_with_cuda = True

    def __init__(self, real):
        self.cuda_precision_unsupported = real.cuda_precision_unsupported

    def cuda_device_count(self):
        return 1

    def cuda_device_name(self, index):
        assert index == 0
        return "Tesla T4 (sm_75)"


def test_a_precision_the_gpu_lacks_is_named_as_such(tmp_path, model, capsys, monkeypatch):
    # bf16 on a T4: the engine refuses it with a ValueError, which the CLI used to report as a damaged checkpoint.
    save_checkpoint(model, tmp_path / "m.safetensors")
    monkeypatch.setattr(fastgpt.model, "_C", _T4(fastgpt._C))
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / "m.safetensors"), "--device", "cuda", "--precision", "bf16"], out=io.StringIO())
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--device/--precision: Tesla T4 (sm_75): precision='bf16' needs a GPU of compute " \
        "capability 8.0 or newer" in err, err
    fastgpt.model._check_device("cuda:0", "fp16")  # what a T4 has: no complaint
    fastgpt.model._check_device("cuda:3", "bf16")  # a device that is not there: the engine names those there are


def test_a_data_parallel_ranks_cuda_is_its_local_gpu(monkeypatch):
    # Under torchrun 'cuda' is cuda:LOCAL_RANK: rank 1's precision is checked against GPU 1, not GPU 0.
    class TwoGPUs(_T4):
        def cuda_device_count(self):
            return 2

        def cuda_device_name(self, index):
            return ["Tesla T4 (sm_75)", "NVIDIA A100-SXM4-40GB (sm_80)"][index]

    monkeypatch.setattr(fastgpt.model, "_C", TwoGPUs(fastgpt._C))
    monkeypatch.setattr(fastgpt.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(fastgpt.distributed, "local_rank", lambda: 1)
    fastgpt.model._check_device("cuda", "bf16")  # rank 1's A100
    with pytest.raises(ValueError, match="Tesla T4"):
        fastgpt.model._check_device("cuda:0", "bf16")


def test_a_run_stopped_early_samples_from_its_latest_checkpoint(tmp_path, model, encoder_json, capsys):
    # train.py writes model.safetensors at the end only; a run stopped before has its step_NNNNNN checkpoints.
    run = tmp_path / "run"
    for step, seed in ((2, 1), (4, None)):
        (run / f"step_00000{step}").mkdir(parents=True)
        save_checkpoint(model if seed is None else fastgpt.GPT(CONFIG, seed=seed),
                        run / f"step_00000{step}" / "model.safetensors")
    out = io.StringIO()
    sample.main([str(run), "--prompt", "Hello", "-n", "6", "--temperature", "0", "--stop", "",
                 "--encoder", str(encoder_json)], out=out)
    assert out.getvalue() == _expected(model, get_gpt2_encoding(encoder_json), "Hello", 6) + "\n"
    note = capsys.readouterr().err
    assert "no final model.safetensors" in note and "step_000004" in note


def test_a_closed_stdout_ends_quietly(tmp_path, model, encoder_json):
    save_checkpoint(model, tmp_path / "m.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "fastgpt.sample", str(tmp_path / "m.safetensors"), "-n", "300",
                             "--stop", "", "--num-samples", "3", "--encoder", str(encoder_json)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head` that has read enough
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + 13 and "Traceback" not in err, err
