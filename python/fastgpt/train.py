"""The fastgpt trainer: `python train.py ...` and the console script `fastgpt-train` both run main().

build-nanogpt's training loop over the compiled engine: GPT-2 BPE tokens from a text file (or llm.c shards), AdamW
with a linear-warmup + cosine learning rate, gradient accumulation up to --total-batch-size tokens per step,
gradient clipping, periodic val loss (and HellaSwag accuracy with --hellaswag) and samples, MFU on GPUs. Every step
goes to <out-dir>/log.jsonl (one JSON object a line) and the final weights to <out-dir>/model.safetensors.

Stopping and going on: --save-every N writes a resumable checkpoint (fastgpt.resume) every N steps and at the end;
Ctrl-C or SIGTERM finishes the current step, writes one and exits (status 128 + the signal's number); `--resume
RUN_DIR` continues from the latest with the run's own flags, and its losses are bitwise those of a run that never
stopped. A non-finite loss or gradient norm stops the run before it touches the weights, naming the step (or the
step is skipped with --skip-nonfinite).

Data parallel, unchanged: `torchrun --nproc_per_node=N train.py --device cuda ...` or `mpiexec -n N python train.py
--device cpu ...`. The total batch is B*T*grad_accum*world_size tokens; each rank reads its own slice of every
batch; gradients are averaged over ranks once per step (on the last micro-step); the loss printed is the mean over
ranks; val loss is sharded over ranks and reduced; only rank 0 prints, samples and writes the log and checkpoint.
"""
import argparse
import json
import math
import os
import signal
import sys
import threading
import time

import numpy as np
from tqdm import tqdm

from . import _C, distributed, hellaswag, resume
from . import mfu as mfu_
from ._convert import INT32_MAX, INT64_MAX
from ._io import atomic_write_bytes, stdout_to_devnull
from .checkpoint import save_checkpoint
from .data import DataLoader, tokenize_file
from .model import GPT, GPTConfig, _check_device
from .optim import AdamW
from .tokenizer import EOT, N_VOCAB, get_gpt2_encoding

PRESETS = {"tiny": (4, 4, 128), "small": (6, 6, 384), "gpt2": (12, 12, 768)}  # (n_layer, n_head, n_embd)
# Flags --resume takes from the command line over the checkpoint's: none of them changes what is trained.
RESUME_OVERRIDES = {"resume", "input", "shards", "encoder", "device", "no_progress", "save_every", "keep",
                    "skip_nonfinite", "peak_tflops", "hellaswag", "hellaswag_examples", "eval_interval",
                    "eval_steps", "sample_interval", "sample_tokens", "graph"}


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is not finite stopped the run (train.py --skip-nonfinite skips such steps)."""


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    """build-nanogpt's schedule: linear warmup to max_lr, then cosine decay to min_lr at max_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:  # build-nanogpt says `>`; at == the cosine gives min_lr too, and this avoids 0/0
        return min_lr
    decay_ratio = (step - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def _number(kind, low, low_open=False, high=None):
    # argparse type: its error names the flag ("argument --max-steps: must be >= 1, got -5").
    def parse(text):
        value = kind(text)
        if kind is float and not math.isfinite(value):  # "nan" and "inf" parse, and nan passes every comparison
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse's message for unparsable text: "invalid int value"
    return parse


def build_parser():
    p = argparse.ArgumentParser(prog="fastgpt-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Counts and sizes fit the engine's int; the seed its uint64; the tokens of a step an int64.
    pos, nonneg = _number(int, 1, high=INT32_MAX), _number(int, 0, high=INT32_MAX)
    posf = _number(float, 0.0, low_open=True)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", help="UTF-8 text file (default: env FASTGPT_DATA, unless --shards is given)")
    src.add_argument("--shards", help="glob or folder of llm.c shards (*_train_NNNNNN.bin or *_train.bin, and val)")
    p.add_argument("--encoder", help="GPT-2 encoder.json (default: env FASTGPT_GPT2_ENCODER, else tiktoken)")
    p.add_argument("--model", choices=PRESETS, default="tiny", help="size preset, L/H/C: " +
                   ", ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in PRESETS.items()))
    p.add_argument("--n-layer", type=pos)
    p.add_argument("--n-head", type=pos)
    p.add_argument("--n-embd", type=pos)
    p.add_argument("--block-size", type=pos, help="max context (default: --seq-len)")
    p.add_argument("--vocab-size", type=_number(int, N_VOCAB), default=50304, help="50304: GPT-2's padded up")
    p.add_argument("-B", "--batch-size", type=pos, default=8)
    p.add_argument("-T", "--seq-len", type=pos, default=128)
    p.add_argument("--total-batch-size", type=_number(int, 1, high=INT64_MAX),
                   help="tokens per optimizer step (default: B*T)")
    p.add_argument("--max-steps", type=pos, default=200)
    p.add_argument("--max-lr", type=posf, default=1e-3)
    p.add_argument("--min-lr-ratio", type=_number(float, 0.0, high=1.0), default=0.1)
    p.add_argument("--warmup-steps", type=nonneg, default=10)
    p.add_argument("--weight-decay", type=_number(float, 0.0), default=0.1)
    p.add_argument("--grad-clip", type=posf, default=1.0)
    p.add_argument("--eval-interval", type=pos, default=50, help="steps between val losses (also at the end)")
    p.add_argument("--eval-steps", type=pos, default=10, help="val batches per estimate")
    p.add_argument("--sample-interval", type=pos, default=100, help="steps between samples (also at the end)")
    p.add_argument("--sample-tokens", type=nonneg, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"),
                   help="fp32; tf32 (GPU); bf16 or fp16 mixed precision: 16-bit activations and weights, fp32 "
                        "masters, gradients and moments; fp16 with dynamic loss scaling")
    p.add_argument("--zero-stage", type=int, choices=(0, 1), default=0,
                   help="data parallel: 1 shards the AdamW moments over ranks (ZeRO-1)")
    p.add_argument("--seed", type=_number(int, 0, high=2**64 - 1), default=1337)
    p.add_argument("--out-dir", help="default: runs/<timestamp>")
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    g = p.add_argument_group("checkpoints and resuming")
    g.add_argument("--save-every", type=nonneg, default=0,
                   help="write a resumable checkpoint <out-dir>/step_NNNNNN every N steps and at the end (0: only "
                        "when stopped by Ctrl-C/SIGTERM)")
    g.add_argument("--keep", type=nonneg, default=3, help="checkpoints kept, the newest (0: all)")
    g.add_argument("--resume", metavar="PATH",
                   help="continue a run: its folder (the latest checkpoint) or one checkpoint, RUN_DIR/step_NNNNNN; "
                        "the run's own flags are used (those that do not change training may be given again)")
    g = p.add_argument_group("evaluation and health")
    g.add_argument("--hellaswag", metavar="JSONL", help="HellaSwag accuracy at every eval, from this local file "
                                                         "(the official hellaswag_val.jsonl format)")
    g.add_argument("--hellaswag-examples", type=pos, help="score only the first N examples")
    g.add_argument("--peak-tflops", type=posf, help="peak TFLOP/s of one device for the MFU (default: a table of "
                                                      "GPUs by name and precision; no MFU on the CPU)")
    g.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradient norm is inf/NaN instead of stopping the run")
    p.add_argument("--recompute", type=int, choices=(0, 1, 2), default=None,
                   help="activations backward makes again instead of keeping: 0 none (the default: fastest), 1 GELU, "
                        "2 GELU and the LayerNorms (least memory)")
    p.add_argument("--graph", action="store_true",
                   help="record the training step once and replay it (a CUDA graph on a GPU: one launch per step; "
                        "the same weights); data parallel runs step eagerly anyway")
    return p


def _explicit(parser, argv):
    """The flags given on the command line (not defaults): what --resume checks against the checkpoint's."""
    defaults = [(a, a.default) for a in parser._actions]
    for a, _ in defaults:
        a.default = argparse.SUPPRESS
    try:
        return vars(parser.parse_args(argv))
    finally:
        for a, d in defaults:
            a.default = d


def _claim_out_dir(out_dir, resuming, held):
    """The run folder, made and held: a lock on the folder itself (flock on its descriptor, appended to `held`
    for main() to release; the kernel releases it if the process dies), so a second run cannot write into it at the
    same time, and a fresh run never writes into one that holds a run. The default folder is runs/<timestamp>, with
    -2, -3, ... when another run took that second."""
    named = out_dir or "runs/<timestamp> (the default)"
    try:
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
        else:
            base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
            os.makedirs("runs", exist_ok=True)
            for n in range(1, 1000):
                out_dir = base if n == 1 else f"{base}-{n}"
                try:
                    os.mkdir(out_dir)  # atomic: exactly one run makes it
                    break
                except FileExistsError:
                    continue
    except OSError as e:  # a file of that name, no permission, a read-only file system
        raise ValueError(f"--out-dir {named}: cannot make the folder ({e.strerror or e})") from None
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): the log check below still guards a finished run
        fcntl = None
    if fcntl:
        fd = os.open(out_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(f"--out-dir {out_dir} is in use by another run") from None
        held.append(fd)
    # A fresh run never writes over an earlier run's log, weights or checkpoints (nor a Hugging Face model's weights).
    found = [n for n in ("log.jsonl", "model.safetensors") if os.path.exists(os.path.join(out_dir, n))]
    checkpoints = resume.list_checkpoints(out_dir)
    if not resuming and (found or checkpoints):
        what = ", ".join(found + ([f"{len(checkpoints)} step_NNNNNN checkpoints"] if checkpoints else []))
        go_on = f", or continue it with --resume {out_dir}" if checkpoints else ""
        raise ValueError(f"--out-dir {out_dir} already holds a run ({what}); choose another folder{go_on}")
    return out_dir


def _resume_args(parser, argv, args, state):
    """The checkpoint's flags, with those given again on the command line where they may differ."""
    given = _explicit(parser, argv)
    saved = dict(state["args"])
    if "out_dir" in given:
        parser.error("--out-dir with --resume: the run goes on in its own folder")
    changed = [k for k, v in given.items() if k not in RESUME_OVERRIDES and saved.get(k) != v]
    if changed:
        parser.error("--resume goes on with the run's own flags; these differ from the checkpoint's: " +
                     ", ".join(f"--{k.replace('_', '-')} {given[k]} (was {saved.get(k)})" for k in changed))
    if "input" in given:
        saved["shards"] = None
    if "shards" in given:
        saved["input"] = None
    saved.update({k: v for k, v in given.items() if k in RESUME_OVERRIDES})
    return argparse.Namespace(**{**vars(args), **saved})


class _StopSignal:
    """Ctrl-C (SIGINT) or SIGTERM: noted, and the run stops after the current step with a checkpoint; a second one
    stops at once, except while a checkpoint is being written (`saving`): cut there, the run would end with none, so
    it waits for the write (a third stops at once). Only the main thread may own handlers; elsewhere the signals
    keep theirs."""

    def __init__(self):
        self.signum, self._previous, self.saving, self._deferred = None, {}, False, False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum is not None and self.saving and not self._deferred:
            self._deferred = True  # once: the next one stops at once
            os.write(2, b"\nwriting the checkpoint; the run stops once it is on disk (again to stop at once)\n")
            return
        if self.signum is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.signum = signum
        os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                    f"(again to stop at once)\n".encode())


def main(argv=None):
    """Train; returns a dict of the run's numbers (final losses, tok/s, the model; "interrupted": the signal's
    number when Ctrl-C or SIGTERM stopped it after a checkpoint)."""
    held = []  # the run folder's lock, released however the run ends
    try:
        return _main(argv, held)
    finally:
        for fd in held:
            os.close(fd)


def _main(argv, held):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rank, world_size, _ = distributed.init()
    except RuntimeError as e:
        parser.error(f"launch: {e}")
    master = rank == 0
    if world_size > 1 and args.device == "cpu" and distributed.launcher() != "mpi":
        parser.error(f"--device cpu with {world_size} ranks reduces gradients over MPI: launch with "
                     f"mpiexec -n {world_size} python train.py ... ({distributed.launcher()} started this job)")
    say = (lambda *a, **k: _print(*a, write=tqdm.write, **k)) if master else (lambda *a, **k: None)  # rank 0 only

    def agreed(check):
        # Work only rank 0 does (the file system, the tokenizer): its result on rank 0, and its verdict on every
        # rank, so all of them stop together instead of some waiting forever in a collective.
        result = error = None
        if master:
            try:
                result = check()
            except (OSError, ValueError, RuntimeError) as e:
                error = str(e)
        return result, distributed.broadcast_object(error)

    # ---- resuming: the checkpoint's flags replace the defaults before anything is checked or built
    ckpt_dir = state = None
    if args.resume:
        def read_checkpoint():
            path = resume.find(args.resume)
            try:
                return path, resume.read_state(path)
            except resume.CheckpointError as e:
                named = resume.STEP_DIR.match(os.path.basename(path))  # a copy elsewhere has no step in its name
                earlier = [p for s, p in resume.list_checkpoints(os.path.dirname(path)) if p != path and
                           s < int(named.group(1))] if named else []
                hint = f"; the one before it: --resume {earlier[-1]}" if earlier else ""
                raise resume.CheckpointError(f"{e}{hint}") from None

        found, error = agreed(read_checkpoint)
        if error:
            parser.error(f"--resume: {error}")
        ckpt_dir, state = distributed.broadcast_object(found)
        if state["world_size"] != world_size:
            parser.error(f"--resume: {ckpt_dir} was written by {state['world_size']} ranks, this job has "
                         f"{world_size}: launch as many (the batches each rank reads depend on it)")
        args = _resume_args(parser, argv, args, state)
        args.out_dir = os.path.dirname(os.path.abspath(ckpt_dir))  # "step_000004" alone: the current folder's run

    # ---- flags that depend on each other: checked up front, so no mistake surfaces deep inside a run
    n_layer, n_head, n_embd = (o if o is not None else d for o, d in
                               zip((args.n_layer, args.n_head, args.n_embd), PRESETS[args.model]))
    B, T = args.batch_size, args.seq_len
    block_size = args.block_size or T
    if T > block_size:
        parser.error(f"-T/--seq-len {T} exceeds --block-size {block_size}")
    if n_embd % n_head:
        parser.error(f"--n-embd {n_embd} must be a multiple of --n-head {n_head}")
    total = args.total_batch_size or B * T * world_size
    if total % (B * T * world_size):
        parser.error(f"--total-batch-size {total} must be a multiple of B*T*world_size = {B}*{T}*{world_size}")
    grad_accum = total // (B * T * world_size)
    if not args.shards and not args.input:  # the environment's file only where no data was named
        args.input = os.environ.get("FASTGPT_DATA") or None
    if not args.shards and not args.input:
        parser.error("no data: pass --input TEXT_FILE (or set FASTGPT_DATA), or --shards GLOB")
    # Saved with the run as absolute paths: --resume from another working directory finds the same files.
    for name in ("input", "shards", "encoder", "hellaswag"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(os.path.expanduser(getattr(args, name))))
    if args.input and not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: file not found")
    if args.hellaswag_examples and not args.hellaswag:
        parser.error("--hellaswag-examples needs --hellaswag JSONL")
    # What can be refused without the data is refused before the run folder is made and the text tokenized into it.
    if args.zero_stage and world_size == 1:
        parser.error("--zero-stage 1 shards the optimizer over data-parallel ranks: launch more than one")
    try:
        _check_device(args.device, args.precision)
    except (ValueError, RuntimeError) as e:
        parser.error(f"--device/--precision: {e}")
    config = GPTConfig(block_size=block_size, vocab_size=args.vocab_size, n_layer=n_layer, n_head=n_head,
                       n_embd=n_embd)
    if not args.device.startswith("cuda"):  # a GPU's allocator says so itself; the CPU's would end in the OOM killer
        need, have = 16 * mfu_.num_parameters(config), _physical_memory()
        if have and need > have:
            parser.error(f"the model (L{n_layer} C{n_embd}, block size {block_size}, vocab {args.vocab_size}: "
                         f"{mfu_.num_parameters(config):,} parameters) needs about {need / 2**30:.1f} GiB for its "
                         f"weights, gradients and AdamW moments alone; this machine has {have / 2**30:.1f} GiB")
    examples = None
    if args.hellaswag:
        try:
            examples = hellaswag.load(args.hellaswag, args.hellaswag_examples)
        except (OSError, ValueError) as e:
            parser.error(f"--hellaswag: {e}")

    # Rank 0 claims the run folder (the others' clocks may read another second) and tokenizes first; the others
    # then reuse its cached tokens.
    out_dir, error = agreed(lambda: _claim_out_dir(args.out_dir, bool(state), held))
    if error:
        parser.error(error)
    out_dir = distributed.broadcast_object(out_dir)

    # ---- tokenizer, data, model
    def tokenize():
        return tokenize_file(args.input, os.path.join(out_dir, "data"), encoder_json=args.encoder, val_fraction=0.1)

    files, error = agreed(tokenize) if args.input else (None, None)
    if error:
        parser.error(f"data: {error}")
    try:
        if args.input:
            files = files or tokenize()  # the other ranks find rank 0's tokens cached
            train_src, val_src = files["train"], files["val"]
        else:
            train_src = val_src = args.shards
        train_loader = DataLoader(train_src, B, T, split="train" if args.shards else None, rank=rank,
                                  world_size=world_size)
        val_loader = DataLoader(val_src, B, T, split="val" if args.shards else None, rank=rank,
                                world_size=world_size)
    except (OSError, ValueError) as e:
        parser.error(f"data: {e}")
    # Past the val split's batches the loader would wrap around and count batches twice in the mean.
    eval_steps = min(args.eval_steps, val_loader.batches_per_epoch * world_size)
    if eval_steps < args.eval_steps:
        say(f"note: --eval-steps {args.eval_steps} is more than the val split's {eval_steps} batches of B*T; "
            f"evaluating on those {eval_steps}")
    try:
        enc = get_gpt2_encoding(args.encoder)
    except (OSError, ValueError, RuntimeError) as e:
        if args.input or args.encoder or args.hellaswag:
            parser.error(f"--encoder: {e}")
        enc = None  # shards train without a tokenizer; samples then print as token ids
        say(f"warning: no GPT-2 tokenizer ({e}); samples will be token ids")
    try:
        model = GPT(config, device=args.device, precision=args.precision, seed=args.seed, recompute=args.recompute)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        parser.error(f"--device/--precision: {e}")
    except MemoryError as e:
        parser.error(f"the model ({config}) does not fit in memory: {e}")
    opt = AdamW(model, lr=args.max_lr, weight_decay=args.weight_decay, zero_stage=args.zero_stage)
    min_lr = args.max_lr * args.min_lr_ratio
    start, history = 0, {"first_val_loss": None, "train_loss": None, "nonfinite_skips": 0}
    if state:
        try:
            resume.restore(ckpt_dir, state, model, opt, train_loader)
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--resume: {e}")
        start, history = state["step"], state["history"]
        # A run whose log has its summary is done: resumed with no other flag, there is nothing to do (with eval
        # flags, e.g. a new --hellaswag, the final pass runs again on its weights). A run stopped during the final
        # pass (its weights saved, no summary yet) finishes it.
        if start >= args.max_steps and set(_explicit(parser, argv)) == {"resume"} and _finished(out_dir):
            parser.error(f"--resume: the run in {out_dir} finished (step {start} of {args.max_steps}; its weights "
                         f"are {os.path.join(out_dir, 'model.safetensors')}): nothing to do (give eval flags, "
                         f"e.g. --hellaswag, to evaluate it again)")

    # ---- MFU: nanoGPT's FLOPs per token over the device's peak
    token_flops = mfu_.flops_per_token(config, T, model.num_parameters())
    peak = args.peak_tflops
    if peak is None and model.device.startswith("cuda"):
        gpu = _C.cuda_device_name(int(model.device.partition(":")[2] or 0))
        peak = mfu_.peak_tflops(gpu, args.precision)
        if peak is None:
            say(f"note: no peak TFLOP/s known for {gpu} in {args.precision}, so no MFU (give --peak-tflops)")

    # ---- the log: a resumed run keeps what came before its checkpoint and goes on from there
    log = None
    if master:
        path = os.path.join(out_dir, "log.jsonl")
        if state:
            kept = _log_before(path, start)
            atomic_write_bytes(path, [line.encode("utf-8") for line in kept])
            moved = resume.set_aside_later(out_dir, start)
        log = open(path, "a" if state else "w", encoding="utf-8")

    def record(entry):
        if log:
            log.write(json.dumps(entry) + "\n")
            log.flush()  # a run killed midway still leaves every finished step on disk

    if state:
        record({"resumed": {"checkpoint": ckpt_dir, "step": start, "set_aside": moved if master else []}})
    else:
        header = {"config": vars(config), "num_parameters": model.num_parameters(), "grad_accum": grad_accum,
                  "total_batch_size": total, "world_size": world_size, "flops_per_token": token_flops,
                  "peak_tflops": peak, "args": vars(args)}
        record({"header": header})
    ranks = f", {world_size} ranks" + (" (ZeRO-1)" if args.zero_stage else "") if world_size > 1 else ""
    say(f"fastgpt: {model.num_parameters():,} parameters (L{n_layer} H{n_head} C{n_embd}), "
        f"B={B} T={T}, grad_accum={grad_accum} ({total} tokens/step{ranks}), {args.max_steps} steps -> {out_dir}" +
        (f"\nresumed from {ckpt_dir} at step {start}" if state else ""))

    def evaluate():
        # Sharded over ranks: rank r takes batches r, r+world, ... of the first eval_steps (its loader's own
        # slices), and the sums meet in one reduction: the same batches, the same mean as one process.
        val_loader.reset()  # the same val batches every time, so estimates are comparable across steps
        mine = len(range(rank, eval_steps, world_size))
        local = sum(model.forward(*val_loader.next_batch(), return_logits=False)[1] for _ in range(mine))
        return distributed.all_reduce(local) / eval_steps

    def sample():
        prompt = np.array([[EOT]], dtype=np.int64)  # start as a new document
        out = model.generate(prompt, args.sample_tokens, top_k=min(50, config.vocab_size), seed=args.seed)
        ids = out[0, 1:].tolist()
        if enc is None:
            return " ".join(map(str, ids))
        return enc.decode([t for t in ids if t < N_VOCAB])  # padded ids (>= 50257) have no text

    def save_state(done):
        info = {"args": {**vars(args), "resume": None}, "config": vars(config), "history": history}
        stop_signal.saving = True
        try:
            return resume.save(out_dir, done, model, opt, train_loader, info, keep=args.keep)
        finally:
            stop_signal.saving = False

    # ---- training: step == max_steps is the extra pass that evaluates and samples the final weights
    val_losses, samples, times, losses, mfus, swag = [], [], [], [], [], None
    last_ckpt = ckpt_dir
    interrupted = None
    bar = tqdm(total=args.max_steps, initial=start, disable=args.no_progress or not master, unit="step",
               dynamic_ncols=True)
    try:
        with _StopSignal() as stop_signal:
            for step in range(start, args.max_steps + 1):
                last = step == args.max_steps
                if step % args.eval_interval == 0 or last:
                    val_loss = evaluate()
                    val_losses.append(val_loss)
                    if history["first_val_loss"] is None:
                        history["first_val_loss"] = val_loss
                    record({"step": step, "val_loss": val_loss})
                    say(f"step {step:5d} | val loss {val_loss:.4f}")
                    if last and master:  # the weights first: a failing HellaSwag or sample below cannot lose them
                        ckpt = save_checkpoint(model, os.path.join(out_dir, "model.safetensors"), metadata={
                            "step": args.max_steps, "train_loss": history["train_loss"], "val_loss": val_loss})
                        say(f"saved {ckpt}")
                    if examples:
                        swag = hellaswag.evaluate(model, examples, enc, rank, world_size)
                        record({"step": step, "hellaswag": swag["accuracy"], "hellaswag_correct": swag["correct"],
                                "hellaswag_total": swag["total"]})
                        say(f"step {step:5d} | hellaswag {swag['correct']}/{swag['total']} = {swag['accuracy']:.4f}")
                if master and args.sample_tokens > 0 and ((step > 0 and step % args.sample_interval == 0) or last):
                    text = sample()
                    samples.append(text)
                    say(f"---- sample at step {step} ----\n{text}\n----")
                if last:
                    break

                t0 = time.perf_counter()
                lr = get_lr(step, args.max_lr, min_lr, args.warmup_steps, args.max_steps)
                batch = [train_loader.next_batch() for _ in range(grad_accum)]
                # The whole step in one call (the micro-steps' mean loss, gradients reduced over ranks with the last,
                # the clip folded into AdamW); a non-finite loss or norm leaves the weights as they were.
                stats = opt.train_step(np.stack([x for x, _ in batch]), np.stack([y for _, y in batch]), lr=lr,
                                       max_norm=args.grad_clip, graph=args.graph)
                loss, norm, applied = stats.loss, stats.norm, stats.applied
                stop = stop_signal.signum is not None
                if world_size > 1:  # one collective: the mean loss, and whether a signal reached any rank
                    loss_sum, stops = distributed.all_reduce([loss, float(stop)])
                    loss, stop = loss_sum / world_size, stops > 0
                # fp16 overflows are the loss scaler's to skip; anything else non-finite is a broken run
                bad = [f"loss {loss}"] if not math.isfinite(loss) else []
                bad += [f"gradient norm {norm}"] if not math.isfinite(norm) and args.precision != "fp16" else []
                if bad and not args.skip_nonfinite:
                    record({"step": step, "nonfinite": " and ".join(bad), "stopped": True})
                    raise NonFiniteError(
                        f"step {step}: {' and '.join(bad)}. The run stopped before this step's update; "
                        f"{'the last checkpoint is ' + last_ckpt if last_ckpt else 'no checkpoint was written'}. "
                        "--skip-nonfinite skips such steps instead")
                if bad:
                    history["nonfinite_skips"] += 1
                    record({"step": step, "nonfinite": " and ".join(bad), "skipped": True, "lr": lr})
                    say(f"step {step:5d} | skipped: {' and '.join(bad)}")
                else:
                    if not applied:  # fp16: the gradients overflowed at this loss scale; the weights were left as they were
                        say(f"step {step:5d} | skipped: inf/NaN gradients, loss scale now {model.loss_scale:g}")
                    dt = time.perf_counter() - t0
                    tok_per_s = total / dt
                    losses.append(loss)
                    history["train_loss"] = loss
                    times.append(dt)
                    entry = {"step": step, "loss": loss, "lr": lr, "norm": norm, "dt_ms": dt * 1e3,
                             "tok_per_s": tok_per_s}
                    if peak:
                        entry["mfu"] = mfu_.mfu(token_flops, tok_per_s, peak, world_size)
                        mfus.append(entry["mfu"])
                    if args.precision == "fp16":
                        entry.update(loss_scale=model.loss_scale, skipped=not applied)
                    record(entry)
                    shown = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "norm": f"{norm:.3f}", "ms": f"{dt * 1e3:.1f}",
                             "tok/s": f"{tok_per_s:.0f}", **({"mfu": f"{100 * entry['mfu']:.1f}%"} if peak else {})}
                    if args.no_progress and master:
                        _print(f"step {step:5d} | " + " | ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
                    else:
                        bar.set_postfix(shown, refresh=False)
                bar.update(1)

                done = step + 1
                stop = stop or (world_size == 1 and stop_signal.signum is not None)  # alone: a signal during the update too
                if stop or (args.save_every and (done % args.save_every == 0 or done == args.max_steps)):
                    last_ckpt = save_state(done)
                    if args.no_progress or stop:
                        say(f"step {step:5d} | checkpoint {last_ckpt}")
                if stop:
                    interrupted = stop_signal.signum or signal.SIGTERM
                    name = signal.Signals(interrupted).name
                    record({"interrupted": {"signal": name, "steps_done": done, "checkpoint": last_ckpt}})
                    again = f" (launched as this job was, {world_size} ranks)" if world_size > 1 else ""
                    say(f"stopped by {name} after step {step}; go on with: {_prog()} --resume {out_dir}{again}")
                    break
    except BaseException:
        if log:
            log.close()
        raise
    finally:
        bar.close()

    if interrupted is not None:
        distributed.barrier()
        if log:
            log.close()
        return {"interrupted": int(interrupted), "checkpoint": last_ckpt, "out_dir": out_dir, "steps": done,
                "model": model, "rank": rank}

    # ---- the end: the summary (the weights were saved at the last step)
    ckpt = os.path.join(out_dir, "model.safetensors")
    steady = times[1:] or times  # the first step pays one-off costs (allocations, page faults)
    # None, not NaN, where no step was timed (a resume at the last step): NaN is not JSON for strict readers
    mean_tok_per_s = total * len(steady) / sum(steady) if steady else None
    result = {"final_train_loss": history["train_loss"], "first_val_loss": history["first_val_loss"],
              "last_val_loss": val_losses[-1], "mean_tok_per_s": mean_tok_per_s,
              "mean_ms_per_step": 1e3 * sum(steady) / len(steady) if steady else None,
              "mean_mfu": float(np.mean(mfus[1:] or mfus)) if mfus else None,
              "hellaswag": swag["accuracy"] if swag else None, "nonfinite_skips": history["nonfinite_skips"],
              "grad_accum": grad_accum, "steps": args.max_steps, "num_parameters": model.num_parameters(),
              "precision": args.precision, "skipped_steps": opt.skipped_steps, "world_size": world_size,
              "rank": rank, "grad_syncs": model.grad_sync_count, "resumed_from": ckpt_dir, "last_checkpoint": last_ckpt,
              "graph_counts": list(opt.graph_counts), "samples": samples, "checkpoint": ckpt, "out_dir": out_dir,
              "model": model}
    record({"summary": {k: v for k, v in result.items() if k != "model"}})
    # Everyone leaves together, after rank 0's checkpoint: a rank that exits alone waits at most
    # FASTGPT_DIST_TIMEOUT for the others before it aborts the job (fastgpt.distributed), and the final
    # evaluation, sample and save must not count against that.
    distributed.barrier()
    if not master:
        return result
    log.close()
    train_loss = f"{history['train_loss']:.4f}" if history["train_loss"] is not None else "-"
    speed = f" | {mean_tok_per_s:.0f} tok/s | {result['mean_ms_per_step']:.1f} ms/step" if steady else ""
    _print(f"done: train loss {train_loss} | val loss {history['first_val_loss']:.4f} -> {val_losses[-1]:.4f}" +
           speed + (f" | MFU {100 * result['mean_mfu']:.1f}%" if mfus else ""))
    return result


def _print(*args, write=None, **kwargs):
    """print (or tqdm.write, above a live progress bar) that outlives its reader: a closed stdout (`| head`, a
    terminal gone) must not end a run, whose log and checkpoints are on disk; what follows goes to /dev/null."""
    try:
        (write or print)(*args, **kwargs)
    except BrokenPipeError:
        stdout_to_devnull()


def _prog():
    """How this trainer was started, for the message that says how to go on: `python -m fastgpt.train` (argv[0] is
    this file), `python <path>/train.py` (the repository's script) or the console script."""
    if os.path.abspath(sys.argv[0]) == os.path.abspath(__file__):
        return "python -m fastgpt.train"
    return f"python {sys.argv[0]}" if sys.argv[0].endswith(".py") else "fastgpt-train"


def _finished(out_dir):
    """Whether the run's log ends with its summary (written after the final pass)."""
    try:
        with open(os.path.join(out_dir, "log.jsonl"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        return bool(lines) and "summary" in json.loads(lines[-1])
    except (OSError, ValueError, TypeError):  # no log, a line cut short, a line that is not an object
        return False


def _physical_memory():
    """Bytes of RAM, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _log_before(path, step):
    """The lines of a run's log that come before `step` (header, evals and steps < step; not the summary): what
    a run resumed at `step` keeps. A line cut short by a kill is dropped."""
    kept = []
    if not os.path.isfile(path):
        return kept
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if "summary" in entry or entry.get("step", -1) >= step:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def cli():
    """Entry point of `python train.py` and the console script: exit status 0 on success, 1 when a non-finite
    loss stopped the run, 128 + the signal's number when Ctrl-C/SIGTERM did (after a checkpoint)."""
    try:
        result = main()
    except NonFiniteError as e:
        if distributed.rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, as asked; no traceback for it
        print("stopped at once (no checkpoint of the step in flight)", file=sys.stderr)
        return 128 + signal.SIGINT
    return 128 + result["interrupted"] if result.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(cli())
