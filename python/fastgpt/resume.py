"""Training checkpoints that resume exactly: everything a run needs to go on as if it had never stopped.

A checkpoint is a folder RUN_DIR/step_NNNNNN (NNNNNN optimizer steps done):
  model.safetensors            fp32 master weights and config (fastgpt.checkpoint's format: sample/load it as is)
  compute_weights.safetensors  bf16/fp16 only: the 16-bit weights the kernels read, as they are (bf16's are
                               stochastically rounded, so rounding the masters again would not give them back)
  optimizer.safetensors        AdamW moments; with ZeRO-1 one file per rank, optimizer_rankR.safetensors (its shard)
  state.json                   the step, AdamW's step count, the loader's position, the loss scaler, the seed (the
                               only randomness: weight init, bf16 rounding and sampling are keyed by it), the
                               config, the flags, and the size and SHA-256 of every file above
It is written in a hidden folder and renamed into place when complete (state.json last), so a crash mid-write
leaves the previous checkpoints as they were and no half-written one under a step_ name. Reading checks every
file against state.json: a truncated or damaged checkpoint is refused, never half loaded.
"""
import hashlib
import json
import os
import re
import shutil
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file, save_file

from . import distributed
from ._io import atomic_path, fsync_path, make_temp_folder
from .checkpoint import save_checkpoint

FORMAT, VERSION = "fastgpt-train-state", 1
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: missing, incomplete, damaged or from another set-up."""


def step_dir(run_dir, step):
    return os.path.join(run_dir, f"step_{step:06d}")


def list_checkpoints(run_dir):
    """(step, path) of the complete-looking checkpoint folders in run_dir, oldest first."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def find(path):
    """The checkpoint to resume from: path itself if it is one (RUN_DIR/step_NNNNNN), else the latest in the run
    folder path."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: no such run folder or checkpoint")
    if os.path.isfile(os.path.join(path, "state.json")) or STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return os.path.normpath(path)
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"--resume {path}: no checkpoint in this run folder (train.py writes step_NNNNNN "
                              "folders with --save-every N, and when stopped by Ctrl-C or SIGTERM)")
    return found[-1][1]


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def read_state(ckpt):
    """state.json of a checkpoint folder, after checking every file it lists (size and SHA-256)."""
    ckpt = os.fspath(ckpt)
    path = os.path.join(ckpt, "state.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt}: incomplete checkpoint (no state.json)")
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: damaged ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a fastgpt training checkpoint")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {state.get('version')!r}, this fastgpt reads {VERSION}")
    _check_fields(state, path)
    for name, want in state["files"].items():
        file = os.path.join(ckpt, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{ckpt}: damaged checkpoint: {name} is missing")
        size = os.path.getsize(file)
        if size != want["bytes"]:
            raise CheckpointError(f"{ckpt}: damaged checkpoint: {name} has {size} bytes, expected {want['bytes']}"
                                  f"{' (truncated)' if size < want['bytes'] else ''}")
        if _digest(file)["sha256"] != want["sha256"]:
            raise CheckpointError(f"{ckpt}: damaged checkpoint: {name} does not match its SHA-256")
    return state


def _count(v, low=0):
    return type(v) is int and v >= low  # type(), not isinstance: JSON's true/false are no counts


def _number(v):
    return type(v) in (int, float)


SHA256 = re.compile(r"^[0-9a-f]{64}$")
OPTIMIZER_SHARD = re.compile(r"^optimizer_rank(\d+)\.safetensors$")
# What train.py and restore() read from a state, each a check and what it expects: a state.json that parses but
# lacks one of them, or holds another type, is a damaged checkpoint, not a KeyError or TypeError mid-resume.
FIELDS = {
    "": {"step": (_count, "an integer >= 0"), "world_size": (lambda v: _count(v, 1), "an integer >= 1"),
         "zero_stage": (lambda v: v in (0, 1) and _count(v), "0 or 1"),
         "precision": (lambda v: v in ("fp32", "tf32", "bf16", "fp16"), "fp32, tf32, bf16 or fp16"),
         "args": (lambda v: isinstance(v, dict), "an object (the run's flags)"),
         "history": (lambda v: isinstance(v, dict), "an object"),
         "optimizer": (lambda v: isinstance(v, dict), "an object"),
         "loader": (lambda v: isinstance(v, dict), "an object"),
         "loss_scaler": (lambda v: v is None or isinstance(v, dict), "null or an object"),
         "files": (lambda v: isinstance(v, dict) and v, "an object naming the checkpoint's files")},
    "history": {"first_val_loss": (lambda v: v is None or _number(v), "null or a number"),
                "train_loss": (lambda v: v is None or _number(v), "null or a number"),
                "nonfinite_skips": (_count, "an integer >= 0")},
    "optimizer": {"step_count": (_count, "an integer >= 0"), "skipped_steps": (_count, "an integer >= 0")},
    "loader": {"epoch": (_count, "an integer >= 0"), "shard_pos": (_count, "an integer >= 0"),
               "window_pos": (_count, "an integer >= 0")},
    "loss_scaler": {"scale": (lambda v: _number(v) and v > 0, "a number > 0"),
                    "growth_tracker": (_count, "an integer >= 0")},
}


def _check_fields(state, path):
    def damaged(what):
        return CheckpointError(f"{path}: damaged ({what})")

    for section, fields in FIELDS.items():
        obj = state[section] if section else state  # a section: already checked to be an object (or null)
        if obj is None:
            continue
        for key, (ok, expected) in fields.items():
            name = f"{section}.{key}" if section else key
            if key not in obj:
                raise damaged(f"no {name!r}")
            if not ok(obj[key]):
                raise damaged(f"{name!r} is {json.dumps(obj[key]):.60}, expected {expected}")
    for name, entry in state["files"].items():
        if name in ("", ".", "..") or os.path.basename(name) != name:  # files of this folder, by their names
            raise damaged(f"files: {name!r} is not a file name")
        if not (isinstance(entry, dict) and _count(entry.get("bytes")) and isinstance(entry.get("sha256"), str)
                and SHA256.match(entry["sha256"])):
            raise damaged(f"files: {name!r} is {json.dumps(entry):.80}, expected "
                          '{"bytes": <integer>, "sha256": <64 hex digits>}')
    if (state["loss_scaler"] is None) == (state["precision"] == "fp16"):  # fp16's scale goes on where it was
        raise damaged(f"loss_scaler is {json.dumps(state['loss_scaler']):.60} with precision {state['precision']}")
    # restore() reads these files: each must be listed, so that none is loaded unchecked
    needed = ["model.safetensors"] + (["compute_weights.safetensors"] if state["precision"] in ("bf16", "fp16") else [])
    needed += ["optimizer.safetensors"] if state["zero_stage"] == 0 else []
    for name in needed:
        if name not in state["files"]:
            raise damaged(f"files does not list {name}")
    if state["zero_stage"] == 1:  # one optimizer shard a rank; counted, not listed (world_size may be damaged too)
        ranks = {int(m.group(1)) for m in map(OPTIMIZER_SHARD.match, state["files"]) if m}
        if ranks != set(range(len(ranks))) or len(ranks) != state["world_size"]:
            raise damaged(f"files lists the optimizer shards of ranks {sorted(ranks)}, expected 0 to "
                          f"{state['world_size'] - 1}")


def _optimizer_file(opt):
    return f"optimizer_rank{opt.model.rank}.safetensors" if opt.zero_stage == 1 else "optimizer.safetensors"


def _compute_bits(model):
    # The 16-bit weights, exactly: bf16 as the high half of each float32, fp16 as float16 (both lossless).
    wide = np.ascontiguousarray(model._engine.compute_params(), dtype=np.float32)
    if model.precision == "bf16":
        return (wide.view(np.uint32) >> 16).astype(np.uint16)
    return wide.astype(np.float16)


def _from_bits(bits, precision):
    if precision == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.astype(np.float32)


def save(run_dir, step, model, opt, loader, info, keep=0):
    """Writes RUN_DIR/step_{step} (a collective in a data-parallel job: every rank calls it) and returns its path.
    info: the JSON-able rest (flags, config, history); keep > 0 removes all but the newest keep checkpoints."""
    run_dir = os.fspath(run_dir)
    rank, world = distributed.rank(), distributed.world_size()
    tmp, error = None, None
    if rank == 0:
        tmp = make_temp_folder(run_dir, f".step_{step:06d}.", ".tmp")  # a leftover: set_aside_later removes it
    tmp = distributed.broadcast_object(tmp)
    written = {}
    try:
        if opt.zero_stage == 1 or rank == 0:  # moments: each rank's shard, or rank 0's (identical on all)
            name = _optimizer_file(opt)
            m, v = opt.moments()  # views on the CPU, host copies from a GPU: written as they are
            with atomic_path(os.path.join(tmp, name)) as part:  # fsynced; a plain mode, not 0600
                save_file({"exp_avg": m, "exp_avg_sq": v}, part)
            written[name] = _digest(os.path.join(tmp, name))
        if rank == 0:
            save_checkpoint(model, os.path.join(tmp, "model.safetensors"), metadata={"step": step})
            written["model.safetensors"] = _digest(os.path.join(tmp, "model.safetensors"))
            if model.precision in ("bf16", "fp16"):
                with atomic_path(os.path.join(tmp, "compute_weights.safetensors")) as part:
                    save_file({"compute_weights": _compute_bits(model)}, part)
                written["compute_weights.safetensors"] = _digest(os.path.join(tmp, "compute_weights.safetensors"))
    except OSError as e:
        error = f"rank {rank}: {e}"
    files, errors = {}, []
    for r in range(world):  # every rank's files (and errors) reach rank 0
        got = distributed.broadcast_object((written, error), root=r)
        files.update(got[0])
        errors += [got[1]] if got[1] else []
    final = step_dir(run_dir, step)
    if rank == 0:
        try:
            if errors:
                raise OSError("; ".join(errors))
            scaler = None
            if model.precision == "fp16":
                scaler = {"scale": model.loss_scale,
                          "growth_tracker": int(model._engine.loss_scale_growth_tracker)}
            state = {"format": FORMAT, "version": VERSION, "step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "world_size": world, "zero_stage": opt.zero_stage, "precision": model.precision,
                     "seed": int(model._engine.seed),
                     "optimizer": {"step_count": opt.step_count, "skipped_steps": opt.skipped_steps},
                     "loss_scaler": scaler, "loader": loader.state_dict(), **info, "files": files}
            with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
                json.dump(state, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp)
            if os.path.exists(final):  # the same step again (resumed there, then stopped): the new one replaces it
                old = tempfile.mkdtemp(prefix=f".step_{step:06d}.", suffix=".old", dir=run_dir)
                os.replace(final, os.path.join(old, "ckpt"))
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_path(run_dir)
            if keep:
                for _, path in list_checkpoints(run_dir)[:-keep]:
                    shutil.rmtree(path, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"saving checkpoint {final}: {e}"
    error = distributed.broadcast_object(error if rank == 0 else None)
    if error:
        raise OSError(error)
    return final


def restore(ckpt, state, model, opt, loader):
    """Puts a checkpoint read by read_state into a model, optimizer and loader built with its flags."""
    for key, have in (("world_size", distributed.world_size()), ("zero_stage", opt.zero_stage),
                      ("precision", model.precision)):
        if state[key] != have:
            raise CheckpointError(f"{ckpt}: written with {key} {state[key]!r}, this run has {have!r}")
    model.load_state_dict(load_file(os.path.join(ckpt, "model.safetensors")))
    if model.precision in ("bf16", "fp16"):
        bits = load_file(os.path.join(ckpt, "compute_weights.safetensors"))["compute_weights"]
        model._engine.load_compute_params(np.ascontiguousarray(_from_bits(bits, model.precision)))
    moments = load_file(os.path.join(ckpt, _optimizer_file(opt)))
    opt.load_state_dict({**moments, **state["optimizer"], "zero_stage": opt.zero_stage,
                         "moments_begin": opt.moments_begin})
    if state["loss_scaler"] is not None:
        model.set_loss_scaler(init_scale=state["loss_scaler"]["scale"],
                              growth_tracker=state["loss_scaler"]["growth_tracker"])
    loader.load_state_dict(state["loader"])


def set_aside_later(run_dir, step):
    """Renames checkpoints after `step` (resuming from an earlier one makes them another history) to
    step_NNNNNN.superseded-<time>, where neither --resume nor --keep looks; returns the new names."""
    moved = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for s, path in list_checkpoints(run_dir):
        if s > step:
            os.rename(path, f"{path}.superseded-{stamp}")
            moved.append(f"{path}.superseded-{stamp}")
    for name in os.listdir(run_dir):  # what a crash mid-save left behind
        if re.match(r"^\.step_\d+\..*\.(tmp|old)$", name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    return moved
