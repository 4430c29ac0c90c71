"""Atomic writes (fastgpt._io), which shards, checkpoints, Hugging Face folders and train.py's log go through: the
mode a new file gets comes from the kernel (the umask is never set, not even for a moment), a file replaced keeps
its mode, a symlink keeps pointing at the file that was written, and a final name as long as the file system allows
still gets a temp file beside it."""
import os
import re
import stat

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fastgpt import _io, resume


@pytest.fixture
def umask_027(monkeypatch):
    # A umask other than the usual 022, so that a mode computed from a guess would show; and os.umask unusable
    # while the test runs: reading it means setting it, which changes the mode other threads' new files get.
    old = os.umask(0o027)

    def no_umask(mask):
        raise AssertionError("os.umask called: for that moment other threads' files get this mask")

    monkeypatch.setattr(os, "umask", no_umask)
    yield
    monkeypatch.undo()
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_get_a_plain_files_mode_without_touching_the_umask(tmp_path, umask_027):
    _io.atomic_write_bytes(tmp_path / "a.bin", [b"abc"])
    assert (tmp_path / "a.bin").read_bytes() == b"abc" and _mode(tmp_path / "a.bin") == 0o640
    with _io.atomic_path(tmp_path / "w.safetensors") as tmp:
        save_file({"x": np.arange(3, dtype=np.float32)}, tmp)  # which makes its file anew, 0600
    assert _mode(tmp_path / "w.safetensors") == 0o640
    folder = _io.make_temp_folder(str(tmp_path), ".step_000003.", ".tmp")
    assert _mode(folder) == 0o750
    # the name resume's clean-up of what a crash mid-save left behind looks for
    assert re.match(r"^\.step_\d+\..*\.(tmp|old)$", os.path.basename(folder))
    assert sorted(os.listdir(tmp_path)) == sorted(["a.bin", "w.safetensors", os.path.basename(folder)])


def test_a_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "private.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o600)
    _io.atomic_write_bytes(path, [b"new"])
    assert path.read_bytes() == b"new" and _mode(path) == 0o600
    os.chmod(path, 0o444)  # read-only: still replaced (the folder is writable), and still read-only
    with _io.atomic_path(path) as tmp:
        save_file({"x": np.ones(2, dtype=np.float32)}, tmp)
    assert _mode(path) == 0o444 and load_file(path)["x"].tolist() == [1.0, 1.0]


def test_writing_through_a_symlink_replaces_its_target(tmp_path):
    (tmp_path / "disk").mkdir()
    target = tmp_path / "disk" / "model.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    link = tmp_path / "model.bin"
    os.symlink(target, link)
    _io.atomic_write_bytes(link, [b"new"])
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert target.read_bytes() == b"new" and _mode(target) == 0o600
    assert sorted(os.listdir(tmp_path / "disk")) == ["model.bin"]  # its temp file was beside the target


def test_a_final_name_of_255_bytes_is_written(tmp_path):
    name = "m" * 243 + ".safetensors"  # NAME_MAX: the longest name most file systems take
    assert len(name) == 255
    _io.atomic_write_bytes(tmp_path / name, [b"abc"])
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_bytes() == b"abc"
    wide = "é" * 120 + ".bin"  # 244 bytes in UTF-8, in 124 characters
    _io.atomic_write_bytes(tmp_path / wide, [b"xyz"])
    assert (tmp_path / wide).read_bytes() == b"xyz"

    # a failure midway removes the temp file (shortened name and all) and leaves the old file
    with pytest.raises(OSError, match="disk full"):
        with _io.atomic_path(tmp_path / name) as tmp:
            assert len(os.path.basename(tmp)) < 100
            raise OSError("disk full")
    assert sorted(os.listdir(tmp_path)) == sorted([name, wide]) and (tmp_path / name).read_bytes() == b"abc"


def test_resume_checkpoint_files_get_plain_modes(tmp_path, umask_027):
    # resume.save's folder and safetensors files: the modes a plain mkdir/open gives, without reading the umask
    import fastgpt
    from fastgpt.data import DataLoader, write_shard
    model = fastgpt.GPT(fastgpt.GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=1, n_embd=8), seed=0)
    opt = fastgpt.AdamW(model, lr=1e-3)
    write_shard(tmp_path / "train_000000.bin", np.arange(200) % 64)
    loader = DataLoader([str(tmp_path / "train_000000.bin")], 2, 8)
    info = {"args": {}, "history": {"first_val_loss": None, "train_loss": None, "nonfinite_skips": 0}}
    (tmp_path / "run").mkdir()
    ckpt = resume.save(str(tmp_path / "run"), 1, model, opt, loader, info)
    assert _mode(ckpt) == 0o750
    assert {n: _mode(os.path.join(ckpt, n)) for n in os.listdir(ckpt)} == {
        "model.safetensors": 0o640, "optimizer.safetensors": 0o640, "state.json": 0o640}
    resume.read_state(ckpt)
