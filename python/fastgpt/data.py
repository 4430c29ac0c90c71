"""Token shards and the batch loader that feeds training.

Shards use llm.c's format (a 256 x int32 little-endian header: magic 20240520, version 1, token count; then the
tokens as uint16), so files made here and by llm.c's scripts are interchangeable. tokenize_file turns a text file
into val/train shards once and reuses them afterwards; DataLoader cuts (B, T) batches from shards, split across
ranks the way build-nanogpt's DataLoaderLite does, sequentially or in a seeded shuffled order.
"""
import glob
import json
import os
import re

import numpy as np

from ._io import atomic_write_bytes

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
_HEADER_DTYPE = np.dtype("<i4")
_TOKEN_DTYPE = np.dtype("<u2")
_MANIFEST_VERSION = 1
# A shard's split is the last part of its name: llm.c writes fineweb_val_000000.bin and tiny_shakespeare_val.bin.
# Matching "_val_" anywhere would put a corpus named my_train_data's val shards into training.
_SPLIT_NAME = re.compile(r"_(train|val)(?:_[0-9]+)?\.bin$")


def write_shard(path, tokens):
    """Write tokens (integers in [0, 65535]) as an llm.c shard, atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > 65535):
        raise ValueError(
            f"{path}: tokens must fit uint16 [0, 65535], found range [{tokens.min()}, {tokens.max()}]"
        )
    header = np.zeros(HEADER_INTS, dtype=_HEADER_DTYPE)
    header[:3] = (MAGIC, VERSION, tokens.size)
    atomic_write_bytes(path, [header.tobytes(), tokens.astype(_TOKEN_DTYPE).tobytes()])


def read_shard(path):
    """The tokens of an llm.c shard as a read-only uint16 array (memory-mapped: shards can be gigabytes)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"shard not found: {path}")
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{path}: header too short: expected {HEADER_BYTES} bytes, found {len(raw)}")
    magic, version, count = np.frombuffer(raw, dtype=_HEADER_DTYPE)[:3].tolist()
    if magic != MAGIC:
        raise ValueError(f"{path}: bad magic number: expected {MAGIC}, found {magic}")
    if version != VERSION:
        raise ValueError(f"{path}: unsupported version: expected {VERSION}, found {version}")
    if count < 0:
        raise ValueError(f"{path}: bad token count in header: {count}")
    expected, size = HEADER_BYTES + 2 * count, os.path.getsize(path)
    if size != expected:
        raise ValueError(
            f"{path}: header says {count} tokens, so expected {expected} bytes, found {size} "
            f"({'truncated' if size < expected else 'trailing data'})"
        )
    if count == 0:  # numpy cannot map an empty range
        tokens = np.empty(0, dtype=np.uint16)
        tokens.flags.writeable = False
        return tokens
    return np.memmap(path, dtype=_TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def _manifest_path(out_dir, name):
    return os.path.join(out_dir, f"{name}_shards.json")


def _reusable(manifest_path, text_path, params):
    # The manifest is written last, so its presence means a complete set; the parameters guard against reusing
    # shards cut with another split or shard size, and the mtimes against a text file edited since.
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("params") != params:
        return None
    text_mtime = os.stat(text_path).st_mtime_ns
    folder = os.path.dirname(manifest_path)
    try:  # a damaged manifest (fields missing or of another type) is not reused: the text is tokenized again
        found = {split: [os.path.join(folder, f) for f in manifest[split]] for split in ("train", "val")}
        for key in ("train_tokens", "val_tokens"):
            if isinstance(manifest[key], bool) or not isinstance(manifest[key], int):
                return None
            found[key] = manifest[key]
        if any(os.stat(f).st_mtime_ns < text_mtime for f in found["val"] + found["train"] + [manifest_path]):
            return None
    except (OSError, KeyError, TypeError):
        return None
    return {**found, "reused": True}


def tokenize_file(text_path, out_dir, name=None, encoder_json=None, val_fraction=0.1, shard_tokens=100_000_000):
    """Tokenize a UTF-8 text file into GPT-2 shards {name}_val_NNNNNN.bin and {name}_train_NNNNNN.bin.

    Documents are separated by the literal "<|endoftext|>"; each becomes [EOT] + its tokens (llm.c's convention).
    The first val_fraction of all tokens is the val split, the rest train. Returns {"train": [paths], "val": [paths],
    "train_tokens": int, "val_tokens": int, "reused": bool}; reused is True when up-to-date shards were found.
    """
    from .tokenizer import EOT, get_gpt2_encoding  # deferred: reading shards needs no tokenizer

    text_path = os.fspath(text_path)
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"text file not found: {text_path}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if int(shard_tokens) != shard_tokens or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive integer, got {shard_tokens}")
    shard_tokens = int(shard_tokens)
    name = name or os.path.splitext(os.path.basename(text_path))[0]
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    manifest_path = _manifest_path(out_dir, name)
    params = {"version": _MANIFEST_VERSION, "val_fraction": float(val_fraction), "shard_tokens": shard_tokens,
              "text": os.path.abspath(text_path), "text_bytes": os.path.getsize(text_path)}
    found = _reusable(manifest_path, text_path, params)
    if found is not None:
        return found

    enc = get_gpt2_encoding(encoder_json)
    try:
        with open(text_path, encoding="utf-8") as f:
            docs = [d for d in f.read().split("<|endoftext|>") if d]  # a trailing separator is not a document
    except UnicodeDecodeError as e:
        raise ValueError(f"{text_path}: not UTF-8 text ({e})") from None
    # uint16 per token: the whole corpus must be held to know where the val split ends.
    parts = []
    for doc in docs:
        parts.append(np.array([EOT] + enc.encode_ordinary(doc), dtype=np.uint16))
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)
    n_val = int(len(tokens) * val_fraction)
    empty = "train" if len(tokens) == n_val else "val" if val_fraction > 0 and n_val == 0 else None
    if empty:  # no batch could be made from it; say so here rather than as a missing shard later
        raise ValueError(f"{text_path}: its {len(tokens)} tokens leave the {empty} split empty (val_fraction "
                         f"{val_fraction:g}): the text is too short")

    # Shards left from an earlier, larger run would otherwise be picked up by a DataLoader glob.
    for split in ("val", "train"):
        for old in glob.glob(os.path.join(glob.escape(out_dir), f"{glob.escape(name)}_{split}_{'[0-9]' * 6}.bin")):
            os.unlink(old)
    result = {"train": [], "val": [], "train_tokens": len(tokens) - n_val, "val_tokens": n_val, "reused": False}
    for split, part in (("val", tokens[:n_val]), ("train", tokens[n_val:])):
        for i, start in enumerate(range(0, len(part), shard_tokens)):
            path = os.path.join(out_dir, f"{name}_{split}_{i:06d}.bin")
            write_shard(path, part[start:start + shard_tokens])
            result[split].append(path)
    manifest = {"params": params, "train_tokens": result["train_tokens"], "val_tokens": result["val_tokens"],
                "train": [os.path.basename(p) for p in result["train"]],
                "val": [os.path.basename(p) for p in result["val"]]}
    atomic_write_bytes(manifest_path, [json.dumps(manifest, indent=1).encode()])
    return result


def _short(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _shard_split(path):
    found = _SPLIT_NAME.search(os.path.basename(path))
    return found.group(1) if found else None


class DataLoader:
    """(B, T) batches of int64 tokens from shards: x and y = x shifted by one position.

    pattern_or_files: a glob, a directory, or a list of shard paths; split ("train"/"val") keeps only the shards
    whose name ends in _{split}_NNNNNN.bin or _{split}.bin (llm.c's names). Each rank reads its own B*T window of
    every B*T*world_size stride, so ranks never share data and together read what one process would. seed=None walks
    the shards in order and wraps around; with a seed the shard order and the stride order within each shard are
    reshuffled every epoch, identically on every rank.
    """

    def __init__(self, pattern_or_files, B, T, split=None, rank=0, world_size=1, seed=None):
        self.B = _positive_int(B, "B")
        self.T = _positive_int(T, "T")
        self.world_size = _positive_int(world_size, "world_size")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={self.world_size}), got {rank!r}")
        self.rank = int(rank)
        if split not in (None, "train", "val"):
            raise ValueError(f"split must be None, 'train' or 'val', got {split!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be None or a non-negative integer, got {seed!r}")
        self.seed = None if seed is None else int(seed)
        self.split = split
        self.files = self._find(pattern_or_files, split)

        self.stride = self.B * self.T * self.world_size
        self._strides = []  # whole B*T*world_size strides per shard; +1 token for the last target
        self._counts = []   # tokens per shard: what state_dict() records to recognise the data
        for path in self.files:
            n = len(read_shard(path))
            self._counts.append(n)
            if n < self.stride + 1:
                raise ValueError(
                    f"{path}: shard holds {n} tokens, needs at least B*T*world_size+1 = {self.stride + 1}"
                )
            self._strides.append((n - 1) // self.stride)
        self.reset()

    @staticmethod
    def _find(source, split):
        if isinstance(source, (str, os.PathLike)):
            source = os.fspath(source)
            if os.path.isdir(source):
                pattern = os.path.join(glob.escape(source), f"*_{split}*.bin" if split else "*.bin")
            else:
                pattern = source
            files = sorted(glob.glob(pattern))
        else:
            files = pattern = [os.fspath(p) for p in source]
            if not files:
                raise ValueError("the list of shards is empty")
            missing = [p for p in files if not os.path.isfile(p)]
            if missing:
                raise FileNotFoundError(f"shard not found: {missing[0]}")
        if split:
            files = [f for f in files if _shard_split(f) == split]
        if not files:
            raise FileNotFoundError(f"no shards match {pattern!r}" + (f" for split {split!r}" if split else ""))
        return files

    @property
    def batches_per_epoch(self):
        """This rank's batches before the data wraps around."""
        return sum(self._strides)

    def reset(self):
        """Back to the first batch of the first epoch."""
        self.epoch = 0
        self._start_epoch()

    def _start_epoch(self):
        if self.seed is None:
            self._order = list(range(len(self.files)))
        else:
            # Seeded by (seed, epoch) only, never by rank: all ranks must agree on the order to stay disjoint.
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.files)).tolist()
        self._shard_pos = 0
        self._open_shard()

    def _open_shard(self):
        index = self._order[self._shard_pos]
        self._tokens = read_shard(self.files[index])
        n = self._strides[index]
        if self.seed is None:
            self._windows = np.arange(n)
        else:
            self._windows = np.random.default_rng([self.seed, self.epoch, index]).permutation(n)
        self._window_pos = 0

    def state_dict(self):
        """The position in the data (epoch, shard, window; the orders follow from the seed), with what it is a
        position in: resuming from it gives the batches an uninterrupted loader would have given next."""
        return {"epoch": self.epoch, "shard_pos": self._shard_pos, "window_pos": self._window_pos,
                "B": self.B, "T": self.T, "world_size": self.world_size, "seed": self.seed,
                "files": [os.path.basename(f) for f in self.files], "tokens": list(self._counts)}

    def load_state_dict(self, state):
        """Moves to the position of state_dict(), after checking it was taken over the same shards (names and
        token counts) and the same B, T, world_size and seed: another layout would make it a different position."""
        mine = self.state_dict()
        for key in ("B", "T", "world_size", "seed", "files", "tokens"):
            if state.get(key) != mine[key]:
                raise ValueError(f"loader state was saved with {key}={_short(state.get(key))}, this loader has "
                                 f"{_short(mine[key])}: the data or the batch layout changed")
        epoch, shard_pos, window_pos = (int(state[k]) for k in ("epoch", "shard_pos", "window_pos"))
        if epoch < 0 or not 0 <= shard_pos < len(self.files):
            raise ValueError(f"loader state out of range: epoch {epoch}, shard {shard_pos} of {len(self.files)}")
        self.epoch = epoch
        self._start_epoch()
        self._shard_pos = shard_pos
        self._open_shard()
        if not 0 <= window_pos <= len(self._windows):
            raise ValueError(f"loader state out of range: window {window_pos} of {len(self._windows)}")
        self._window_pos = window_pos

    def next_batch(self):
        """The next (x, y), each int64 of shape (B, T)."""
        if self._window_pos == len(self._windows):
            self._shard_pos += 1
            if self._shard_pos == len(self._order):
                self.epoch += 1
                self._start_epoch()
            else:
                self._open_shard()
        bt = self.B * self.T
        start = int(self._windows[self._window_pos]) * self.stride + self.rank * bt
        self._window_pos += 1
        buf = np.asarray(self._tokens[start:start + bt + 1], dtype=np.int64)
        return buf[:-1].reshape(self.B, self.T), buf[1:].reshape(self.B, self.T)
