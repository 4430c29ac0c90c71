"""The speed-up ladder of build-nanogpt, PyTorch and fastgpt side by side: fp32 -> tf32 -> bf16 -> compile -> flash
attention -> vocab 50304 -> fused AdamW -> DDP. Each rung adds its switch to those before it and is run on both sides
from the same weights on the same batches: ms/step, tok/s, MFU, peak memory and the losses. A rung a side cannot
run here (no GPU, no bf16, a fastgpt switch not implemented yet, not enough GPU memory) is a row with the reason,
never left out.

notebooks/02_speedup_progression.ipynb runs it rung by rung with the text; as a script it prints the table and writes
the results as JSON (scripts/gpu_check.sh keeps them under bench/results/):

    python bench/bench_ladder.py --data ../shared/data/tinyshakespeare.txt --encoder ../shared/data/gpt2/encoder.json
    python3 bench/bench_ladder.py --device cuda --preset gpt2 --data ... --encoder ... --json ladder.json
"""
import argparse
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import fastgpt  # noqa: E402
from fastgpt import _C  # noqa: E402
from fastgpt.mfu import flops_per_token, num_parameters, peak_tflops  # noqa: E402
from reference_gpt import ref_from_fastgpt  # noqa: E402  (build-nanogpt's GPT, with a fastgpt model's weights)
from _common import text_batches  # noqa: E402

LR, BETAS, EPS, WD, CLIP = 6e-4, (0.9, 0.95), 1e-8, 0.1, 1.0  # build-nanogpt's GPT-3 settings (constant lr here)


@dataclasses.dataclass
class Rung:
    name: str
    torch: dict  # the PyTorch switch this rung adds: tf32, autocast, compile, flash, vocab, fused_adamw, ddp
    fastgpt: dict  # fastgpt's: precision, fused, vocab, ddp; {} where fastgpt has nothing to switch (always on)
    note: str = ""  # the fastgpt row's note: what its switch does so far, or why it has none


RUNGS = [
    Rung("fp32", {}, {"precision": "fp32"}),
    Rung("tf32", {"tf32": True}, {"precision": "tf32"}),
    Rung("bf16", {"autocast": True}, {"precision": "bf16"}),
    Rung("compile", {"compile": True}, {"fused": True},
         note="GPT(fused=True): chunked classifier (no (B, T, V) logits), residual + LayerNorm fused, GELU "
              "epilogues (GPU, 16-bit), the step one train_step call (eager: torch.compile's default mode "
              "records no CUDA graph either)"),
    Rung("flash attention", {"flash": True}, {},
         note="fastgpt's attention is a flash kernel at every rung (only the log-sum-exp is kept for backward)"),
    Rung("vocab 50304", {"vocab": 50304}, {"vocab": 50304}),
    Rung("fused AdamW", {"fused_adamw": True}, {},
         note="fastgpt's AdamW is one pass over the one parameter buffer at every rung"),
    Rung("DDP", {"ddp": True}, {"ddp": True}),
]

PRESETS = {  # (n_layer, n_head, n_embd, T, B, warmup, steps)
    "tiny": (2, 4, 64, 64, 4, 1, 6),  # a CPU in a second or two per rung and side (what CI runs)
    "gpt2": (12, 12, 768, 1024, 16, 3, 12),  # GPT-2 124M, for a GPU
}


@dataclasses.dataclass
class Setup:
    """What every rung shares: the device, the model shape, the batches, and the step counts."""
    device: str
    n_layer: int
    n_head: int
    n_embd: int
    T: int
    B: int
    warmup: int
    steps: int
    batches: list  # (x, y) int32 arrays (B, T), warmup + steps of them
    compile_on_cpu: bool = False
    seed: int = 1337

    @property
    def gpu(self):
        return self.device.startswith("cuda")

    def config(self, vocab):
        return fastgpt.GPTConfig(block_size=self.T, vocab_size=vocab, n_layer=self.n_layer, n_head=self.n_head,
                                 n_embd=self.n_embd)


def make_setup(data, encoder, device="cpu", preset="tiny", steps=None, compile_on_cpu=False):
    """Tokenizes `data` (Tiny Shakespeare) and cuts the batches every rung trains on (held in memory: the token
    shards are removed again)."""
    n_layer, n_head, n_embd, T, B, warmup, default_steps = PRESETS[preset]
    steps = steps or default_steps
    batches, _ = text_batches(data, encoder, B, T, warmup + steps)
    return Setup(device, n_layer, n_head, n_embd, T, B, warmup, steps, batches, compile_on_cpu)


def gpu_capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def why_not(rung, side, setup):
    """The reason `side` cannot run `rung` on this machine, or None."""
    cc = gpu_capability() if setup.gpu else None
    switch = rung.torch if side == "torch" else rung.fastgpt
    if switch.get("ddp"):
        n = torch.cuda.device_count() if setup.gpu else 0
        if n < 2:
            return (f"data parallel over GPUs needs 2 or more ({n} visible)" if setup.gpu else
                    "DDP over GPUs needs 2 or more CUDA GPUs (fastgpt's CPU data parallel runs under mpiexec)")
    if switch.get("tf32") or switch.get("precision") == "tf32":
        if not setup.gpu:
            return "TF32 is a tensor-core format: it needs a CUDA GPU of sm_80 or newer"
        if cc < (8, 0):
            return f"this GPU (sm_{cc[0]}{cc[1]}) has no TF32 tensor cores"
    if (switch.get("autocast") or switch.get("precision") == "bf16") and setup.gpu and cc < (8, 0):
        return f"this GPU (sm_{cc[0]}{cc[1]}) has no bf16 tensor cores (fp16 with loss scaling is its half precision)"
    if switch.get("compile") and not setup.gpu and not setup.compile_on_cpu:
        return ("torch.compile on a CPU spends about 45 s compiling even this tiny model on 2 cores; it is a GPU rung "
                "(pass compile_on_cpu=True to run it here)")
    if switch.get("fused_adamw") and side == "torch":
        try:
            torch.optim.AdamW([torch.zeros(1, device=setup.device, requires_grad=True)], fused=True)
        except (RuntimeError, ValueError) as e:
            return f"torch.optim.AdamW(fused=True) is not available here: {e}"
    return None


def _median_ms(times):
    return 1000 * statistics.median(times)


def _tensors_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def torch_cpu_memory(model, opt, x, y, autocast):
    """Bytes PyTorch holds at the top of a CPU step (it keeps no allocator statistics there): the weights, the
    gradients, AdamW's moments and every tensor autograd saved for backward, counted once per storage."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        _, loss = model(x, y)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    total = _tensors_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + state + saved + [loss])
    return total


def run_torch(setup, s, wrap=None):
    """build-nanogpt's training step with the switches in `s`; returns the measurements. wrap: DDP for the DDP
    rung."""
    dev = setup.device
    fast = fastgpt.GPT(setup.config(s.get("vocab", 50257)), seed=setup.seed)
    model = ref_from_fastgpt(fast, flash=s.get("flash", False)).to(dev)
    del fast
    opt = model.configure_optimizers(WD, LR, BETAS, EPS, fused=True if s.get("fused_adamw") else None)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if s.get("tf32") else "highest")
    step_model = wrap(model) if wrap else model
    step_model = torch.compile(step_model) if s.get("compile") else step_model
    dev_type = "cuda" if setup.gpu else "cpu"
    autocast = lambda: torch.autocast(dev_type, torch.bfloat16) if s.get("autocast") else contextlib.nullcontext()  # noqa: E731
    if setup.gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    try:
        for x, y in setup.batches:
            xt, yt = torch.from_numpy(x).long().to(dev), torch.from_numpy(y).long().to(dev)
            t0 = time.perf_counter()
            with autocast():
                _, loss = step_model(xt, yt)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())  # waits for the step, as a training loop that logs its loss does
            times.append(time.perf_counter() - t0)
        if setup.gpu:
            memory = torch.cuda.max_memory_allocated()
        elif s.get("compile"):
            memory = None  # saved-tensor hooks do not see inside a compiled graph
        else:
            x, y = setup.batches[0]
            memory = torch_cpu_memory(model, opt, torch.from_numpy(x).long(), torch.from_numpy(y).long(), autocast())
    finally:
        torch.set_float32_matmul_precision(previous)
    return {"ms": _median_ms(times[setup.warmup:]), "losses": losses, "memory": memory}


def run_fastgpt(setup, s):
    """fastgpt's training step with the switches in `s`: unfused (one kernel per op, the full logits kept;
    forward_backward, clip, AdamW, zero_grad: four calls into the engine) until the compile rung switches fused on,
    which also takes the whole step as one AdamW.train_step call (the loss read back inside the timer, as torch's).
    memory: the engine's buffers and, on a GPU, its scratch workspace (GEMM workspace, partial sums, flash
    attention's backward; model.memory()'s 'total' leaves it out), so that it compares with torch's allocator peak,
    which counts such temporaries too."""
    model = fastgpt.GPT(setup.config(s.get("vocab", 50257)), device=setup.device,
                        precision=s.get("precision", "fp32"), seed=setup.seed, fused=bool(s.get("fused")))
    opt = fastgpt.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, times = [], []
    for x, y in setup.batches:
        t0 = time.perf_counter()
        if model.fused:
            loss = opt.train_step(x, y, lr=LR, max_norm=CLIP).loss  # read: the step has finished
        else:
            loss = model.forward_backward(x, y)  # a float: the step has finished
            opt.clip_grad_norm(CLIP)
            opt.step(lr=LR)
            model.zero_grad()
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    memory = model.memory()
    return {"ms": _median_ms(times[setup.warmup:]), "losses": losses, "memory": memory["total"] + memory["scratch"]}


def run_ddp(setup, s, side):
    """The DDP rung: this script again under torchrun, one process per GPU, each with its own batches. Only on a
    machine with 2+ GPUs (not yet run: see BENCHMARKS.md)."""
    n = torch.cuda.device_count()
    fields = {f.name: getattr(setup, f.name) for f in dataclasses.fields(setup) if f.name != "batches"}
    with tempfile.TemporaryDirectory() as tmp:
        batches = pathlib.Path(tmp) / "batches.npy"
        np.save(batches, np.stack([np.stack(b) for b in setup.batches]))
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--ddp-worker", side, "--ddp-batches", str(batches), "--ddp-out", str(out),
               "--ddp-settings", json.dumps({**s, "setup": fields})]
        subprocess.run(cmd, check=True, timeout=1800)
        result = json.loads(out.read_text())
    return result


def ddp_worker(side, batches_path, out_path, settings):
    """One rank of the DDP rung: rank r trains on every world-th batch, so the job sees world x the tokens per step."""
    fields = settings.pop("setup")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    every = np.load(batches_path)  # (steps, 2, B, T)
    fields["batches"] = [tuple(every[(rank + world * k) % len(every)]) for k in range(len(every))]
    fields["device"] = f"cuda:{local}"
    torch.cuda.set_device(local)
    setup = Setup(**fields)
    if side == "torch":
        from torch.nn.parallel import DistributedDataParallel
        torch.distributed.init_process_group("nccl")
        result = run_torch(setup, settings, wrap=lambda m: DistributedDataParallel(m, device_ids=[local]))
        ms = torch.tensor([result["ms"]], device="cuda")
        torch.distributed.all_reduce(ms)
        result["ms"] = float(ms.item()) / world  # the ranks' mean, as fastgpt's below
    else:
        fastgpt.distributed.init()
        result = run_fastgpt(setup, settings)
        result["ms"] = float(fastgpt.distributed.all_reduce(result["ms"], op="avg"))
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps({**result, "world": world}))


def device_name(setup):
    return _C.cuda_device_name(torch.cuda.current_device()) if setup.gpu else "CPU"


def settings_for(rung, side, setup):
    """The switches `side` runs `rung` with: those of every rung up to it in RUNGS order that the side can run here
    (a rung skipped for a reason adds none). Computed from RUNGS, not from the rungs run so far, so that a rung run
    again after later ones (a notebook cell re-run) runs as it did the first time."""
    settings = {}
    for r in RUNGS[:[r.name for r in RUNGS].index(rung.name) + 1]:
        if why_not(r, side, setup) is None:
            settings.update(r.torch if side == "torch" else r.fastgpt)
    return settings


def out_of_memory(error):
    """The skipped row's reason when `error` is a side running out of memory, else None. torch raises
    torch.cuda.OutOfMemoryError; fastgpt a RuntimeError naming the failed CUDA call with CUDA's message, "out of
    memory" (csrc/cuda/check.h), and MemoryError for a failed host allocation."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
            isinstance(error, RuntimeError) and "out of memory" in str(error)):
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"out of memory: {first[:200]}"
    return None


def _free_memory(setup, settings):
    """After a side ran out of memory: its model and activations (the locals of the failed run) are collected and
    torch's cached blocks go back to the device, so that the next rung, on either side, finds the memory free."""
    if settings.get("compile"):
        torch.compiler.reset()  # dynamo's caches keep the compiled model alive
    gc.collect()
    if setup.gpu:
        torch.cuda.empty_cache()


def _run_side(setup, settings, side):
    """-> (the run's measurements, None), or (None, the reason) when it ran out of memory."""
    try:
        if settings.get("ddp"):
            return run_ddp(setup, settings, side), None
        return (run_torch if side == "torch" else run_fastgpt)(setup, settings), None
    except Exception as e:  # anything but running out of memory is raised again
        reason = out_of_memory(e)
        if reason is None:
            raise
    return None, reason  # outside the handler: the traceback, which holds the failed run's locals, is gone


def run_rung(rung, setup, state):
    """Runs one rung on both sides with settings_for's switches. state["rows"] holds the rows of the rungs run so
    far, in RUNGS order; this rung's replace any it had. Returns this rung's two rows."""
    rows = []
    for side in ("torch", "fastgpt"):
        reason = why_not(rung, side, setup)
        row = {"rung": rung.name, "side": side, "status": "skipped" if reason else "ran", "note": reason or "",
               "settings": {}}
        if not reason:
            settings = settings_for(rung, side, setup)
            row["settings"] = dict(settings)
            result, reason = _run_side(setup, settings, side)
            if reason:
                _free_memory(setup, settings)
                row.update(status="skipped", note=reason)
            else:
                if side == "fastgpt":
                    row["note"] = rung.note
                world = result.get("world", 1)
                row.update(result)
                row["tok_s"] = setup.B * setup.T * world / (result["ms"] / 1000)
                row["loss"] = result["losses"][-1]
                cfg = setup.config(settings.get("vocab", 50257))
                peak = _peak(setup)
                row["mfu"] = (flops_per_token(cfg, setup.T, num_parameters(cfg)) * row["tok_s"] / (peak * 1e12 * world)
                              if peak else None)
        rows.append(row)
    order = [r.name for r in RUNGS]
    kept = [r for r in state.get("rows", []) if r["rung"] != rung.name]
    state["rows"] = sorted(kept + rows, key=lambda r: order.index(r["rung"]))  # stable: torch before fastgpt
    return rows


def _peak(setup):
    """nanoGPT judges every precision against the GPU's bf16 peak (fp16 where there is no bf16); no MFU on a CPU."""
    if not setup.gpu:
        return None
    name = device_name(setup)
    return peak_tflops(name, "bf16") or peak_tflops(name, "fp16")


def table(rows):
    """The rows as a text table: one line per rung and side."""
    head = f"{'rung':<16} {'side':<8} {'ms/step':>9} {'tok/s':>10} {'MFU':>6} {'mem MiB':>8} {'loss':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"{r['rung']:<16} {r['side']:<8} {'skipped':>9} {'':>10} {'':>6} {'':>8} {'':>8}  {r['note']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['memory'] / 2**20:.0f}" if r["memory"] is not None else "n/a"
        lines.append(f"{r['rung']:<16} {r['side']:<8} {r['ms']:9.2f} {r['tok_s']:10.0f} {mfu:>6} {mem:>8} "
                     f"{r['loss']:8.4f}  {r['note']}")
    return "\n".join(lines)


def chart(rows, path=None):
    """A bar chart of tok/s per rung, PyTorch and fastgpt side by side (skipped bars are absent and labelled)."""
    import matplotlib
    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rungs = list(dict.fromkeys(r["rung"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, side in enumerate(("torch", "fastgpt")):
        vals = {r["rung"]: r for r in rows if r["side"] == side}
        xs = [k + (i - 0.5) * 0.4 for k in range(len(rungs))]
        heights = [vals[n]["tok_s"] if vals[n]["status"] == "ran" else 0 for n in rungs]
        ax.bar(xs, heights, width=0.4, label="PyTorch" if side == "torch" else "fastgpt")
        for x, n in zip(xs, rungs):
            if vals[n]["status"] != "ran":
                ax.text(x, 0, "skipped", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rungs)), rungs, rotation=20)
    ax.set_ylabel("tokens / s")
    ax.set_title("build-nanogpt's speed-up ladder: tok/s per rung")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="Tiny Shakespeare (a UTF-8 text file)")
    p.add_argument("--encoder", help="GPT-2's encoder.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="tiny (CPU default) or gpt2 (GPU default)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per rung and side")
    p.add_argument("--compile-on-cpu", action="store_true", help="run torch.compile on a CPU too (slow to compile)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--chart", metavar="PNG", help="save the bar chart (needs matplotlib)")
    p.add_argument("--ddp-worker", choices=("torch", "fastgpt"), help=argparse.SUPPRESS)
    p.add_argument("--ddp-batches", help=argparse.SUPPRESS)
    p.add_argument("--ddp-out", help=argparse.SUPPRESS)
    p.add_argument("--ddp-settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.ddp_worker and not (args.data and args.encoder):
        p.error("--data and --encoder are required")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.ddp_worker:
        return ddp_worker(args.ddp_worker, args.ddp_batches, args.ddp_out, json.loads(args.ddp_settings))
    preset = args.preset or ("gpt2" if args.device.startswith("cuda") else "tiny")
    setup = make_setup(args.data, args.encoder, args.device, preset, args.steps, args.compile_on_cpu)
    print(f"fastgpt ladder on {device_name(setup)}: preset {preset}, B {setup.B}, T {setup.T}, "
          f"{setup.steps} timed steps after {setup.warmup}", flush=True)
    state = {}
    for rung in RUNGS:
        print(table(run_rung(rung, setup, state)).split("\n", 2)[2], flush=True)
    print(table(state["rows"]))
    if args.json:
        payload = {"device": device_name(setup), "preset": preset, "B": setup.B, "T": setup.T,
                   "steps": setup.steps, "warmup": setup.warmup, "rows": state["rows"]}
        pathlib.Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.chart:
        chart(state["rows"], args.chart)


if __name__ == "__main__":
    main()
