"""Shards (llm.c format), tokenize_file and DataLoader: round trips, every way a shard can be damaged, reuse of
existing shards, and the batch order across shards, ranks, seeds and epochs."""
import os

import numpy as np
import pytest

from fastgpt import data
from fastgpt.data import DataLoader, read_shard, tokenize_file, write_shard
from fastgpt.tokenizer import EOT, get_gpt2_encoding


def _random_tokens(rng, n=None):
    n = int(rng.integers(1, 20_000)) if n is None else n
    return rng.integers(0, 65536, size=n).astype(np.uint16)


def _shard(tmp_path, rng, name="s.bin", n=None):
    path = tmp_path / name
    write_shard(path, _random_tokens(rng, n))
    return path


# ---- shards ----

def test_round_trip(tmp_path, rng):
    tokens = _random_tokens(rng)
    path = tmp_path / "round.bin"
    write_shard(path, tokens.astype(np.int64))
    back = read_shard(path)
    assert back.dtype == np.uint16
    np.testing.assert_array_equal(back, tokens)
    assert not back.flags.writeable
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, len(tokens)]
    assert os.path.getsize(path) == 1024 + 2 * len(tokens)


def test_empty_shard(tmp_path):
    path = tmp_path / "empty.bin"
    write_shard(path, [])
    assert len(read_shard(path)) == 0


def test_atomic_write_leaves_no_temp(tmp_path, rng):
    path = _shard(tmp_path, rng, "a.bin")
    newer = _random_tokens(rng)
    write_shard(path, newer)  # overwriting goes through a temp file too
    assert os.listdir(tmp_path) == ["a.bin"]
    np.testing.assert_array_equal(read_shard(path), newer)


def test_failed_write_keeps_old_shard(tmp_path, rng, monkeypatch):
    path = _shard(tmp_path, rng, "keep.bin")
    old = np.array(read_shard(path))

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(data.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_shard(path, _random_tokens(rng))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["keep.bin"]
    np.testing.assert_array_equal(read_shard(path), old)


def test_missing_shard(tmp_path):
    with pytest.raises(FileNotFoundError, match="ghost.bin"):
        read_shard(tmp_path / "ghost.bin")


def test_truncated_shard(tmp_path, rng):
    path = _shard(tmp_path, rng, "cut.bin", n=int(rng.integers(100, 1000)))
    raw = path.read_bytes()
    path.write_bytes(raw[: -int(rng.integers(1, 8))])
    with pytest.raises(ValueError, match=r"cut\.bin.*expected \d+ bytes, found \d+"):
        read_shard(path)


def test_trailing_data(tmp_path, rng):
    path = _shard(tmp_path, rng, "long.bin")
    with open(path, "ab") as f:
        f.write(bytes(int(rng.integers(1, 8))))
    with pytest.raises(ValueError, match=r"long\.bin.*expected"):
        read_shard(path)


def test_short_header(tmp_path):
    path = tmp_path / "stub.bin"
    path.write_bytes(np.array([20240520, 1, 0], dtype="<i4").tobytes())
    with pytest.raises(ValueError, match=r"stub\.bin.*1024"):
        read_shard(path)


def test_bad_magic(tmp_path, rng):
    path = _shard(tmp_path, rng, "magic.bin")
    raw = bytearray(path.read_bytes())
    raw[0:4] = np.array(int(rng.integers(0, 20240520)), dtype="<i4").tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"magic\.bin.*magic.*20240520"):
        read_shard(path)


def test_bad_version(tmp_path, rng):
    path = _shard(tmp_path, rng, "version.bin")
    raw = bytearray(path.read_bytes())
    raw[4:8] = np.array(int(rng.integers(2, 100)), dtype="<i4").tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"version\.bin.*version"):
        read_shard(path)


@pytest.mark.parametrize("bad", [65536, -1])
def test_token_out_of_range(tmp_path, rng, bad):
    tokens = _random_tokens(rng).astype(np.int64)
    tokens[int(rng.integers(len(tokens)))] = bad
    path = tmp_path / "big.bin"
    with pytest.raises(ValueError, match=r"big\.bin.*uint16"):
        write_shard(path, tokens)
    assert os.listdir(tmp_path) == []


# ---- tokenize_file ----

def test_tokenize_shakespeare(tmp_path, shakespeare_txt, encoder_json):
    enc = get_gpt2_encoding(encoder_json)
    text = shakespeare_txt.read_text(encoding="utf-8")
    info = tokenize_file(shakespeare_txt, tmp_path, encoder_json=encoder_json)
    assert info["reused"] is False
    assert [os.path.basename(p) for p in info["val"]] == ["tinyshakespeare_val_000000.bin"]
    assert [os.path.basename(p) for p in info["train"]] == ["tinyshakespeare_train_000000.bin"]
    val, train = read_shard(info["val"][0]), read_shard(info["train"][0])
    assert (len(val), len(train)) == (info["val_tokens"], info["train_tokens"])
    total = len(val) + len(train)
    assert total > 0
    assert abs(len(val) / total - 0.1) < 1e-3
    assert val[0] == EOT  # the single document starts with EOT
    start = enc.decode(val[1:300].tolist())
    assert len(start) > 500 and text.startswith(start)
    np.testing.assert_array_equal(np.concatenate([val, train]), [EOT] + enc.encode_ordinary(text))


def test_tokenize_reuses_shards(tmp_path, shakespeare_txt, encoder_json, rng):
    text = tmp_path / "play.txt"
    text.write_text(shakespeare_txt.read_text(encoding="utf-8")[: int(rng.integers(5000, 20000))], encoding="utf-8")
    out = tmp_path / "out"
    first = tokenize_file(text, out, encoder_json=encoder_json)
    stamps = {p: os.stat(p).st_mtime_ns for p in first["train"] + first["val"]}
    second = tokenize_file(text, out, encoder_json=encoder_json)
    assert second["reused"] is True
    assert {k: v for k, v in second.items() if k != "reused"} == {k: v for k, v in first.items() if k != "reused"}
    assert {p: os.stat(p).st_mtime_ns for p in stamps} == stamps  # not rewritten

    later = max(stamps.values()) + 10**9
    os.utime(text, ns=(later, later))  # the text now looks edited after the shards were made
    assert tokenize_file(text, out, encoder_json=encoder_json)["reused"] is False


def test_tokenize_redoes_a_damaged_manifest(tmp_path, encoder_json):
    import json
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 40, encoding="utf-8")
    out = tmp_path / "out"
    first = tokenize_file(text, out, encoder_json=encoder_json)
    manifest_path = out / "t_shards.json"
    good = json.loads(manifest_path.read_text())
    for key, value in (("train_tokens", None), ("val_tokens", "12"), ("train", 3), ("val", None)):
        damaged = {**good, key: value} if value is not None else {k: v for k, v in good.items() if k != key}
        manifest_path.write_text(json.dumps(damaged))
        again = tokenize_file(text, out, encoder_json=encoder_json)
        assert again["reused"] is False, key
        assert {k: v for k, v in again.items() if k != "reused"} == {k: v for k, v in first.items() if k != "reused"}


def test_tokenize_documents_and_sharding(tmp_path, encoder_json, rng):
    enc = get_gpt2_encoding(encoder_json)
    words = [" ".join("ab"[int(b)] * int(rng.integers(1, 4)) for b in rng.integers(0, 2, size=50)) for _ in range(3)]
    text = tmp_path / "docs.txt"
    # The trailing separator ends the last document; it must not add an empty one (a lone EOT).
    text.write_text("<|endoftext|>".join(words) + "<|endoftext|>", encoding="utf-8")
    expected = np.concatenate([[EOT] + enc.encode_ordinary(w) for w in words])
    shard_tokens = int(rng.integers(5, 20))
    info = tokenize_file(text, tmp_path / "out", name="d", encoder_json=encoder_json, val_fraction=0.25,
                         shard_tokens=shard_tokens)
    n_val = int(len(expected) * 0.25)
    assert info["val_tokens"] == n_val
    assert [os.path.basename(p) for p in info["train"]][:2] == ["d_train_000000.bin", "d_train_000001.bin"]
    assert all(len(read_shard(p)) <= shard_tokens for p in info["train"] + info["val"])
    np.testing.assert_array_equal(np.concatenate([read_shard(p) for p in info["val"]]), expected[:n_val])
    np.testing.assert_array_equal(np.concatenate([read_shard(p) for p in info["train"]]), expected[n_val:])

    # Re-cut with bigger shards: the surplus small shards from before must not linger for a glob to find.
    again = tokenize_file(text, tmp_path / "out", name="d", encoder_json=encoder_json, val_fraction=0.25,
                          shard_tokens=10**6)
    assert again["reused"] is False and len(again["train"]) == 1
    assert sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".bin")) == ["d_train_000000.bin",
                                                                                   "d_val_000000.bin"]


# ---- DataLoader ----

def _position_shards(tmp_path, sizes):
    # Token value = its global position, so a batch tells exactly where it was read from.
    paths, offset = [], 0
    for i, n in enumerate(sizes):
        path = tmp_path / f"pos_train_{i:06d}.bin"
        write_shard(path, np.arange(offset, offset + n) % 65536)
        paths.append(str(path))
        offset += n
    return paths


def test_x_y_shifted(tmp_path, rng):
    tokens = _random_tokens(rng, 5000)
    path = tmp_path / "r_train_000000.bin"
    write_shard(path, tokens)
    B, T = int(rng.integers(1, 5)), int(rng.integers(2, 50))
    loader = DataLoader(str(path), B, T)
    for i in range(3):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int64
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        flat = tokens[i * B * T: (i + 1) * B * T + 1].astype(np.int64)
        np.testing.assert_array_equal(x.ravel(), flat[:-1])
        np.testing.assert_array_equal(y.ravel(), flat[1:])


def test_ranks_disjoint_and_cover_single_process(tmp_path, rng):
    B, T, W = 2, 8, 2
    strides = int(rng.integers(3, 8))
    files = _position_shards(tmp_path, [strides * B * T * W + 1])
    single = DataLoader(files, B, T)
    ranks = [DataLoader(files, B, T, rank=r, world_size=W) for r in range(W)]
    for _ in range(strides):
        got = [loader.next_batch()[0] for loader in ranks]
        assert not set(got[0].ravel()) & set(got[1].ravel())
        for g in got:
            np.testing.assert_array_equal(g, single.next_batch()[0])


def test_seeded_deterministic_and_disjoint(tmp_path, rng):
    B, T, W = 2, 4, 2
    files = _position_shards(tmp_path, [int(rng.integers(10, 20)) * B * T * W + 1 for _ in range(3)])
    seed = int(rng.integers(0, 2**31))

    def run(seed, rank=0, n=60):
        loader = DataLoader(files, B, T, rank=rank, world_size=W, seed=seed)
        return np.stack([loader.next_batch()[0] for _ in range(n)])

    a = run(seed)
    np.testing.assert_array_equal(a, run(seed))
    assert not np.array_equal(a, run(seed + 1))
    b = run(seed, rank=1)
    assert not set(a.ravel()) & set(b.ravel())
    # Ranks agree on the order: at every step they read neighbouring windows of the same stride.
    np.testing.assert_array_equal(b, a + B * T)
    plain = DataLoader(files, B, T, rank=0, world_size=W)
    sequential = np.stack([plain.next_batch()[0] for _ in range(10)])
    assert not np.array_equal(a[:10], sequential)  # shuffled, not the file order


def test_seeded_epoch_is_a_permutation(tmp_path, rng):
    B, T = 2, 4
    sizes = [int(rng.integers(5, 15)) * B * T + 1 for _ in range(3)]
    files = _position_shards(tmp_path, sizes)
    n = sum((s - 1) // (B * T) for s in sizes)
    seq = DataLoader(files, B, T)
    shuf = DataLoader(files, B, T, seed=int(rng.integers(0, 2**31)))
    epoch1 = [shuf.next_batch()[0][0, 0] for _ in range(n)]
    epoch2 = [shuf.next_batch()[0][0, 0] for _ in range(n)]
    every = [seq.next_batch()[0][0, 0] for _ in range(n)]
    assert sorted(epoch1) == sorted(epoch2) == sorted(every)
    assert epoch1 != epoch2  # reshuffled each epoch


def test_wrap_around(tmp_path, rng):
    B, T = int(rng.integers(1, 4)), int(rng.integers(2, 10))
    per_shard = [int(rng.integers(1, 5)) for _ in range(2)]
    files = _position_shards(tmp_path, [k * B * T + 1 + int(rng.integers(0, B * T)) for k in per_shard])
    loader = DataLoader(str(tmp_path / "pos_train_*.bin"), B, T)
    first = loader.next_batch()
    for _ in range(sum(per_shard) - 1):
        loader.next_batch()
    again = loader.next_batch()
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert loader.files == files


def test_second_shard_follows_first(tmp_path):
    B, T = 1, 4
    files = _position_shards(tmp_path, [2 * B * T + 1, 3 * B * T + 1])
    loader = DataLoader(files, B, T)
    starts = [loader.next_batch()[0][0, 0] for _ in range(5)]
    assert starts == [0, 4, 9, 13, 17]


def test_reset(tmp_path, rng):
    files = _position_shards(tmp_path, [1000])
    loader = DataLoader(files, 2, 8, seed=int(rng.integers(0, 2**31)))
    first = loader.next_batch()[0]
    for _ in range(int(rng.integers(1, 20))):
        loader.next_batch()
    loader.reset()
    np.testing.assert_array_equal(loader.next_batch()[0], first)


def test_directory_and_split(tmp_path):
    write_shard(tmp_path / "x_train_000000.bin", np.full(100, 1))
    write_shard(tmp_path / "x_val_000000.bin", np.full(100, 2))
    assert DataLoader(tmp_path, 2, 4, split="val").next_batch()[0].max() == 2
    assert DataLoader(str(tmp_path), 2, 4, split="train").next_batch()[0].max() == 1


def test_split_is_the_end_of_the_name(tmp_path):
    # A corpus named with "_train_" or "_val_" inside: only the last part of a name says its split. llm.c's
    # tiny_shakespeare_val.bin (no shard number) counts too.
    write_shard(tmp_path / "my_val_notes_train_000000.bin", np.full(100, 1))
    write_shard(tmp_path / "my_train_data_val_000000.bin", np.full(100, 2))
    write_shard(tmp_path / "tiny_shakespeare_val.bin", np.full(100, 3))
    write_shard(tmp_path / "tiny_shakespeare_train.bin", np.full(100, 4))
    write_shard(tmp_path / "validation_train_x.bin", np.full(100, 5))  # no split of its own
    for source in (tmp_path, str(tmp_path / "*.bin"), sorted(str(p) for p in tmp_path.iterdir())):
        train = DataLoader(source, 2, 4, split="train")
        val = DataLoader(source, 2, 4, split="val")
        assert [os.path.basename(f) for f in train.files] == ["my_val_notes_train_000000.bin",
                                                              "tiny_shakespeare_train.bin"]
        assert [os.path.basename(f) for f in val.files] == ["my_train_data_val_000000.bin", "tiny_shakespeare_val.bin"]


def test_no_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        DataLoader(str(tmp_path / "nothing_here_*.bin"), 2, 4)
    with pytest.raises(FileNotFoundError, match="val"):
        DataLoader(tmp_path, 2, 4, split="val")
    with pytest.raises(ValueError, match="the list of shards is empty"):
        DataLoader([], 2, 4)


def test_batches_per_epoch_is_where_the_data_wraps(tmp_path, rng):
    paths = [str(tmp_path / f"s_{i}.bin") for i in range(2)]
    for p, n in zip(paths, (int(rng.integers(50, 90)), int(rng.integers(50, 90)))):
        write_shard(p, rng.integers(0, 50257, n).astype(np.uint16))
    for world in (1, 2):
        loaders = [DataLoader(paths, 2, 4, rank=r, world_size=world) for r in range(world)]
        n = loaders[0].batches_per_epoch
        assert n == sum((len(read_shard(p)) - 1) // (8 * world) for p in paths)
        first = loaders[0].next_batch()[0]
        for _ in range(n - 1):
            loaders[0].next_batch()
        np.testing.assert_array_equal(loaders[0].next_batch()[0], first)  # batch n is batch 0 again


def test_tokenize_refuses_text_too_short_or_not_utf8(tmp_path, encoder_json):
    for text, say in (("", "0 tokens leave the train split empty"), ("hello world", "3 tokens leave the val split")):
        path = tmp_path / "short.txt"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=f"short.txt: its {say}"):
            tokenize_file(path, tmp_path / "out", encoder_json=encoder_json)
    path.write_bytes(b"caf\xe9 au lait")  # Latin-1
    with pytest.raises(ValueError, match="short.txt: not UTF-8 text"):
        tokenize_file(path, tmp_path / "out", encoder_json=encoder_json)


@pytest.mark.parametrize("kwargs, name", [
    ({"B": 0}, "B"), ({"B": 2.5}, "B"), ({"T": -3}, "T"), ({"T": 0}, "T"),
    ({"rank": 2, "world_size": 2}, "rank"), ({"rank": -1}, "rank"), ({"world_size": 0}, "world_size"),
    ({"split": "test"}, "split"),
])
def test_bad_arguments(tmp_path, rng, kwargs, name):
    files = [str(_shard(tmp_path, rng, n=10_000))]
    args = {"B": 2, "T": 8, **kwargs}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        DataLoader(files, **args)


def test_shard_too_small(tmp_path, rng):
    B, T, W = 2, 8, 2
    files = [str(_shard(tmp_path, rng, "ok.bin", n=1000)), str(_shard(tmp_path, rng, "tiny.bin", n=B * T * W))]
    with pytest.raises(ValueError, match=r"tiny\.bin"):
        DataLoader(files, B, T, world_size=W)
    DataLoader(files[:1], B, T, world_size=W)  # the bigger one alone is fine


@pytest.mark.parametrize("seed", [None, "random"])
def test_state_dict_resumes_the_same_batches(tmp_path, rng, seed):
    # A loader restored from state_dict() after k batches gives what the original gives next, across shard and
    # epoch boundaries, sequential or shuffled.
    B, T, W = 2, 4, 2
    files = _position_shards(tmp_path, [int(rng.integers(3, 8)) * B * T * W + 1 for _ in range(3)])
    seed = int(rng.integers(0, 2**31)) if seed else None
    per_epoch = sum((len(read_shard(f)) - 1) // (B * T * W) for f in files)
    for k in [0, 1, per_epoch - 1, per_epoch, per_epoch + int(rng.integers(1, per_epoch))]:
        a = DataLoader(files, B, T, rank=1, world_size=W, seed=seed)
        for _ in range(k):
            a.next_batch()
        state = a.state_dict()
        b = DataLoader(files, B, T, rank=1, world_size=W, seed=seed)
        b.next_batch()  # wherever it was, the state puts it back
        b.load_state_dict(state)
        for _ in range(per_epoch + 2):
            np.testing.assert_array_equal(b.next_batch()[0], a.next_batch()[0], err_msg=f"after {k}")


def test_state_dict_refuses_another_layout(tmp_path, rng):
    files = _position_shards(tmp_path, [200, 300])
    state = DataLoader(files, 2, 4).state_dict()
    for other, named in [(DataLoader(files, 4, 4), "B=2"), (DataLoader(files, 2, 4, seed=1), "seed=None"),
                         (DataLoader(files[:1], 2, 4), "files=")]:
        with pytest.raises(ValueError, match=named):
            other.load_state_dict(state)
    write_shard(files[1], np.arange(301) % 65536)  # the data changed under the same name
    with pytest.raises(ValueError, match="tokens="):
        DataLoader(files, 2, 4).load_state_dict(state)
