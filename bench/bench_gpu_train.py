"""GPU training throughput: fastgpt's CUDA engine against PyTorch on the same GPU, in one process, GPT-2 124M by
default. Variants, one after the other: fastgpt fp32; fastgpt bf16 fused (GPT(fused=True), the default: the chunked
classifier) and unfused (GPT(fused=False): one kernel per op, the full logits kept); torch eager fp32 (TF32 off);
torch eager TF32; torch compiled bf16 (build-nanogpt's set-up: TF32 matmuls, bf16 autocast, torch.compile, SDPA
attention, fused AdamW), each for --loss-steps steps (50) from the same weights on the same batches: with --data
(Tiny Shakespeare, as gpu_check.sh passes it) the last loss shows whether they train alike, issue 10's "loss after 50
steps". fastgpt's fused step is one AdamW.train_step call (the norm, clip and counters on the
device, one-launch AdamW), recorded as a CUDA graph and replayed in "fastgpt bf16 graph"; unfused it is
forward_backward, clip_grad_norm, step. The model keeps every activation (GPT(recompute=0), the default);
"fastgpt bf16 recompute=1" recomputes GELU in backward and "recompute=2" also the LayerNorms: the time and memory
of each setting ("fastgpt bf16 graph recompute=1": the graph step recomputing GELU, the default before). "fastgpt bf16
graph rows=16384" is the graph step with the classifier in chunks of 16384 rows (GPT.classifier_rows; 4096 is the
default): four lm_head products a step at B 64, T 1024, not sixteen, for 1.2 GB more logits. "fastgpt bf16 graph
sm90" is the graph step with Hopper's wgmma flash attention kernels (--sm90-tiles; H100/H200 only); "fastgpt bf16
graph bias-epilogue" the graph step with the linear layers' bias gradients from cuBLASLt's epilogue of the weight
gradient's product instead of the column-sum kernel, the default (fastgpt.ops.matmul_bias_grad_epilogue(True)):
which of the two to keep as the default; "fastgpt bf16 graph tuned" the graph step with every product's cuBLASLt
algorithm timed at its first run (fastgpt.ops.matmul_autotune(True); its results carry the decisions and the sum of
the chosen algorithms' times against the heuristic's): whether that becomes the default.

Why: what a user of a GPU trainer cares about is tokens per second of a whole training step (zero_grad, forward,
backward, clip, AdamW) at GPT-2 size, and how much of the GPU that uses (MFU). torch eager fp32 does the same
arithmetic as fastgpt's fp32 engine, so it is the like-for-like comparison; eager TF32 and compiled bf16 are what
build-nanogpt actually trains with, and fastgpt bf16 fused against compiled bf16 is issue 10's ratio. All variants
start from the same weights and see the same batches, so their step-0 losses must agree (closely for fp32, less for
TF32/bf16): a sanity line, not a test. The timed steps are steps warmup + 1 .. warmup + steps of those run; on random
tokens (no --data) a model learns nothing to speak of, and the last loss stays near ln V.

    python3 bench/bench_gpu_train.py                      # GPT-2 124M, T 1024, B 8, every variant
    python3 bench/bench_gpu_train.py --B 16 --json /tmp/gpu_train.json
    python3 bench/bench_gpu_train.py --B max              # each variant at the largest of B 64/32/16/8 that fits
    python3 bench/bench_gpu_train.py --no-compile         # skip torch.compile (about a minute of compiling)
    python3 bench/bench_gpu_train.py --n-layer 2 --T 256  # a quick smoke run
    python3 bench/bench_gpu_train.py --B max --profile    # and where each side's GPU time goes (gpu_check's run)
    python3 bench/bench_gpu_train.py --B 64 --variants "fastgpt bf16 graph,torch compiled bf16"  # just those two
    python3 bench/bench_gpu_train.py --B max --data ../shared/data/tinyshakespeare.txt \
        --encoder ../shared/data/gpt2/encoder.json       # on real text: the loss after 50 steps means something
"""
import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np
from fastgpt.tokenizer import N_VOCAB

from _common import autotune_summary, environment, text_batches, write_json
from _profile import (CONFIG_KEYS, NOT_OURS, find_baseline, print_breakdown, print_comparison, profile_steps,
                      unlike)

REPO = pathlib.Path(__file__).resolve().parent.parent
# AdamW and clipping exactly as build-nanogpt's train_gpt2.py (constant lr: the schedule does not change the cost).
LR, BETAS, EPS, WD, CLIP = 6e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
# "... graph sm90" runs last: its kernels have never run on a GPU, and a trap (their 60 s wait limit) or a fault
# would leave the CUDA context unusable for every variant after it.
VARIANTS = ("fastgpt fp32", "fastgpt bf16 fused", "fastgpt bf16 graph", "fastgpt bf16 graph recompute=1",
            "fastgpt bf16 graph rows=16384", "fastgpt bf16 graph bias-epilogue", "fastgpt bf16 graph tuned",
            "fastgpt bf16 recompute=1", "fastgpt bf16 recompute=2", "fastgpt bf16 unfused", "torch eager fp32",
            "torch eager tf32", "torch compiled bf16", "fastgpt bf16 graph sm90")
B_MAX = (64, 32, 16, 8)  # --B max tries these in turn
# --profile's variants: issue 10's pair (and the graph), and fp32's like-for-like pair.
PROFILED = ("fastgpt bf16 fused", "fastgpt bf16 graph", "fastgpt bf16 graph recompute=1",
            "fastgpt bf16 graph rows=16384", "fastgpt bf16 graph bias-epilogue", "fastgpt bf16 graph sm90",
            "torch compiled bf16", "fastgpt fp32", "torch eager fp32")
PROFILE_STEPS = 2


def variant_options(name):
    """A variant's settings written into its name as key=integer words: {"recompute": 1} of "fastgpt bf16 graph
    recompute=1", {"rows": 16384} (classifier_rows) of "... rows=16384"."""
    return {k: int(v) for k, _, v in (w.partition("=") for w in name.split()) if _}


def steps_in_all(args):
    """Steps each variant runs: warmup, the timed ones, and more untimed ones up to --loss-steps."""
    return max(args.warmup + args.steps, args.loss_steps)


def timed(times, args):
    """The timed steps' times of a variant's steps_in_all: steps warmup + 1 .. warmup + steps."""
    return times[args.warmup:args.warmup + args.steps]


def make_batches(n, B, T, V, seed, data=None, encoder=None):
    """n (x, y) batches of int64 (B, T) tokens, y = x shifted by one: `data`'s train split in order
    (_common.text_batches), or uniform random tokens below min(V, 50257) from `seed`. -> (batches, a few words on
    where they came from)."""
    if data is None:
        rng = np.random.default_rng(seed)
        toks = rng.integers(0, min(V, N_VOCAB), size=(n, B, T + 1), dtype=np.int64)
        return [(t[:, :-1], t[:, 1:]) for t in toks], "random tokens"
    batches, train_tokens = text_batches(data, encoder, B, T, n)
    return batches, f"{os.path.basename(data)} ({train_tokens:,} train tokens, in order)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--T", type=int, default=1024, help="sequence length (also block_size)")
    p.add_argument("--B", default="8",
                   help="batch size (micro-batch; no gradient accumulation), or 'max': each variant at the largest\n"
                        f"of {'/'.join(map(str, B_MAX))} whose steps fit in GPU memory (an out-of-memory error moves "
                        "to the next)")
    p.add_argument("--vocab", type=int, default=50304, help="vocab size (50304: GPT-2's 50257 padded, as nanoGPT)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first, per variant (they include torch.compile's compilation; keep >= 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; tok/s is B*T / median step time")
    p.add_argument("--loss-steps", type=int, default=50,
                   help="steps each variant runs in all (at least warmup + steps): the table's last loss is that\n"
                        "of this step, from the same weights on the same batches")
    p.add_argument("--data", help="a UTF-8 text file to train on (Tiny Shakespeare), tokenized with --encoder; its\n"
                                  "train split in order, wrapping around (default: uniform random tokens)")
    p.add_argument("--encoder", help="GPT-2's encoder.json, for --data")
    p.add_argument("--seed", type=int, default=None, help="weights and data seed (default: fresh random)")
    p.add_argument("--no-compile", action="store_true", help="skip the 'torch compiled bf16' variant")
    p.add_argument("--variants", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
                   default=VARIANTS, metavar="NAME,NAME",
                   help="run only these variants, in the usual order (a short device call), e.g.\n"
                        "'fastgpt bf16 graph,torch compiled bf16'; default: all of\n" +
                        ",\n".join(", ".join(VARIANTS[i:i + 4]) for i in range(0, len(VARIANTS), 4)))
    p.add_argument("--sm90-tiles", type=lambda v: tuple(x.strip() for x in v.split(",")),
                   default=("sm90 ws 128x128 persistent", "sm90 ws fused 128x128 persistent", "16x64"),
                   metavar="FWD,DKDV,DQ",
                   help="flash attention tiles of 'fastgpt bf16 graph sm90' (fastgpt.ops.flash_attention_tiles;\n"
                        "the Hopper kernels, which only an H100/H200 runs: elsewhere that variant fails, saying why;\n"
                        "default: the warp-specialised forward and fused backward, FlashAttention-3's design, in\n"
                        "the persistent forms that bench_flash_attention.py found fastest at d 64 on an H200)")
    p.add_argument("--profile", action="store_true",
                   help=f"{PROFILE_STEPS} more steps of each of these variants under torch.profiler after its timing,\n"
                        f"and a table of their GPU time per op group and largest kernels:\n{', '.join(PROFILED)}")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the GPU's peak for MFU, in TFLOPS (default 989: H100 SXM bf16 dense; H200 is the same).\n"
                        "Every variant, fp32 ones included, is judged against this one peak, as nanoGPT does")
    p.add_argument("--baseline", metavar="PATH|auto",
                   help="with --profile: compare each profiled variant with an earlier run's JSON (its step, groups\n"
                        "and the kernels that changed most); 'auto': the newest under bench/results/ from this GPU\n"
                        "with the same model and a profile of one of these variants")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.baseline and not args.profile:
        p.error("--baseline compares profiles: it needs --profile")
    if args.B != "max" and not (args.B.isdigit() and int(args.B) >= 1):
        p.error(f"--B must be a positive integer or 'max', got {args.B!r}")
    args.batches = B_MAX if args.B == "max" else (int(args.B),)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd ({args.n_embd}) must be a multiple of --n-head ({args.n_head})")
    if min(args.n_layer, args.n_head, args.n_embd, args.T, args.vocab, args.steps, args.loss_steps) < 1 or \
            args.warmup < 0:
        p.error("sizes, --steps and --loss-steps must be >= 1, --warmup >= 0")
    if (args.data is None) != (args.encoder is None):
        p.error("--data and --encoder go together (the text and GPT-2's encoder.json to tokenize it)")
    if args.data is not None and args.vocab < N_VOCAB:
        p.error(f"--vocab must be >= {N_VOCAB} with --data (GPT-2's tokens), got {args.vocab}")
    if args.peak_tflops <= 0:
        p.error("--peak-tflops must be > 0")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants takes names from: {', '.join(VARIANTS)}; got {', '.join(map(repr, unknown)) or 'none'}")
    args.variants = tuple(v for v in VARIANTS if v in args.variants)
    return args


def flops_per_token(L, H, C, T, V):
    """nanoGPT's estimate_mfu (PaLM appendix B): 6N for the weight matmuls (forward 2N, backward 4N) plus
    12*L*H*Q*T for attention's QK^T and PV, with N the parameters without wpe (a lookup does no FLOPs; wte is tied
    to lm_head and counted once, as the lm_head matmul). Returns (flops per token, N)."""
    Q = C // H
    N = V * C + L * (12 * C * C + 13 * C) + 2 * C  # wte; per layer 4 linears (12C^2 + 9C) + 2 LayerNorms (4C); ln_f
    return 6 * N + 12 * L * H * Q * T, N


def git_commit():
    # The device machine's copy of the tree may carry a stale .git: gpu_check.sh's caller writes the commit there.
    device_commit = REPO / ".device" / "COMMIT"
    if device_commit.is_file() and device_commit.read_text().strip():
        return device_commit.read_text().strip()
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                           timeout=10)
        return (r.stdout.strip() or None) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None):
    args = parse_args(argv)
    # torch is imported only now so that --help works anywhere, fast.
    import torch
    if not torch.cuda.is_available():
        print("bench_gpu_train: no CUDA GPU visible to torch (torch.cuda.is_available() is False); nothing measured")
        return 0

    import fastgpt
    from fastgpt import ops
    sys.path.insert(0, str(REPO / "tests"))
    from reference_gpt import RefConfig, RefGPT

    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    B, T, V = max(args.batches), args.T, args.vocab  # batches are made at the largest B, each variant slices them
    L, H, C = args.n_layer, args.n_head, args.n_embd
    dev = torch.device("cuda", 0)  # fastgpt's device="cuda" is device 0 of the visible ones: the same GPU
    fpt, n_params_mfu = flops_per_token(L, H, C, T, V)
    peak_flops = args.peak_tflops * 1e12

    # Batches: made once on the host; fastgpt takes int32 host arrays every step (its forward uploads them, part
    # of its step), torch gets them on the GPU once, before any timing, as a data loader with prefetch would.
    n = steps_in_all(args)
    batches, source = make_batches(n, B, T, V, args.seed, args.data, args.encoder)
    np_batches = [(np.ascontiguousarray(x, np.int32), np.ascontiguousarray(y, np.int32)) for x, y in batches]
    th_batches = [(torch.from_numpy(np.ascontiguousarray(x)).to(dev), torch.from_numpy(np.ascontiguousarray(y)).to(dev))
                  for x, y in batches]
    del batches

    # Weights: one fastgpt init (on the CPU, so it exists even when fastgpt's CUDA side fails), copied to host
    # arrays; every variant loads these, so all start from identical weights.
    cfg = fastgpt.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C)
    init = fastgpt.GPT(cfg, device="cpu", seed=args.seed)
    weights = {k: v.copy() for k, v in init.state_dict().items()}
    n_params = init.num_parameters()
    del init

    gpu = torch.cuda.get_device_name(dev)
    cc = torch.cuda.get_device_capability(dev)
    env = environment(torch.get_num_threads())
    env.update(gpu=gpu, gpu_capability=f"sm_{cc[0]}{cc[1]}", gpu_memory_gib=torch.cuda.mem_get_info(dev)[1] / 2**30,
               cuda_torch=torch.version.cuda, fastgpt_commit=git_commit(),
               fastgpt_built_with_cuda=bool(fastgpt._C.built_with_cuda))
    print(f"bench_gpu_train: L{L} H{H} C{C} T{T} B {args.B} V{V} ({n_params:,} params; {n_params_mfu:,} without wpe "
          f"for MFU) | {source} | AdamW lr {LR} betas {BETAS} eps {EPS} wd {WD} (2-D weights only) clip {CLIP}")
    print(f"{gpu} ({env['gpu_capability']}, {env['gpu_memory_gib']:.0f} GiB) | torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}) | fastgpt {fastgpt.__version__} @ {env['fastgpt_commit'] or '?'} | "
          f"warmup {args.warmup}, {args.steps} timed steps per variant, {n} in all (the last loss is step {n}'s) | "
          f"seed {args.seed}")
    print(f"MFU: {fpt / 1e9:.3f} GFLOP/token (nanoGPT's 6N + 12*L*H*Q*T) against --peak-tflops {args.peak_tflops:g}; "
          f"that is a bf16 dense peak and the fp32/tf32 variants are judged against the same bf16 peak, as nanoGPT "
          f"does, so their MFU reads low by construction", flush=True)

    def run_steps(step, after=None):
        """All steps of one variant (steps_in_all: warmup, timed, then on to --loss-steps). Each step is bracketed by
        torch.cuda.synchronize(), which is a device-wide sync: it also waits for fastgpt's own stream (train_step
        and the AdamW step are asynchronous; only the loss read-back in forward_backward and the norm in
        clip_grad_norm sync by themselves)."""
        times, losses = [], []
        for i in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            # torch: .item() here, outside the timer (the step is already synced); fastgpt fused: StepStats.loss
            losses.append(float(getattr(loss, "loss", loss)))
            if after is not None:
                after()
        return times, losses

    def profiled(name, step):
        """--profile: PROFILE_STEPS more steps of a PROFILED variant under torch.profiler (after its timing, so the
        profiler's overhead is in no timed step), as {"profile": breakdown} for its results; a failure is recorded,
        not raised (the timing stands)."""
        if not args.profile or name not in PROFILED:
            return {}
        try:
            return {"profile": profile_steps(step, range(PROFILE_STEPS), torch.cuda.synchronize)}
        except Exception as e:
            return {"profile_error": f"{type(e).__name__}: {e}"}

    def fastgpt_variant(name, b):
        # fastgpt allocates outside torch's allocator: the only view of all its memory is the driver's free-memory
        # figure. Free before model creation minus the lowest free seen after creation and after every step: rough
        # (another process on the GPU changes it; scratch freed within a call is missed). The engine's own buffers
        # (weights, gradients, moments, activations) are exact: model.memory()["total"].
        precision = name.split()[1]
        free0 = torch.cuda.mem_get_info(dev)[0]
        options = variant_options(name)
        model = fastgpt.GPT(cfg, device="cuda", precision=precision, seed=args.seed, fused=not name.endswith("unfused"),
                            recompute=options.get("recompute"))
        if "rows" in options:
            model.classifier_rows = options["rows"]
        model.load_state_dict(weights)
        opt = fastgpt.AdamW(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        free_min = [torch.cuda.mem_get_info(dev)[0]]
        tuned0 = len(ops.matmul_autotune_report())  # "... tuned": this attempt's decisions come after these

        def step(i):
            x, y = (a[:b] for a in np_batches[i])  # leading rows of a C-contiguous array: contiguous
            if model.fused:  # nothing in it waits for the device; run_steps' synchronize does
                return opt.train_step(x, y, lr=LR, max_norm=CLIP, graph="graph" in name.split())
            model.zero_grad()
            loss = model.forward_backward(x, y)  # returns after reading the loss back: synced
            opt.clip_grad_norm(CLIP)
            opt.step(LR)
            return loss

        times, losses = run_steps(step, after=lambda: free_min.append(min(free_min[-1],
                                                                          torch.cuda.mem_get_info(dev)[0])))
        prof = profiled(name, step)
        tuned = {}
        if ops.matmul_autotune():
            tuned = {"matmul_autotune": autotune_summary(ops.matmul_autotune_report()[tuned0:])}
            t = tuned["matmul_autotune"]
            print(f" [matmul autotune: {t['problems']} problems, {t['timed']} timed, {t['changed']} changed; one run "
                  f"of each: heuristic {t['heuristic_ms']:.2f} ms, chosen {t['chosen_ms']:.2f} ms "
                  f"({100 * t['saved']:.1f}% less)]", end="", flush=True)
        return times, losses, {"peak_mem_bytes": free0 - free_min[-1], "peak_driver_bytes": free0 - free_min[-1],
                               **prof, **tuned,
                               "engine_bytes": model.memory()["total"],
                               "activation_bytes": model.memory()["activations"],
                               "classifier_rows": model.classifier_rows if model.fused else None,
                               "recompute": model.recompute,
                               "graph_counts": opt.graph_counts, "graph_error": opt.graph_error,
                               "peak_mem_how": "torch.cuda.mem_get_info: free before model creation minus lowest "
                                               "free after creation/steps (rough, driver-level)"}

    def torch_variant(name, b):
        compiled = name == "torch compiled bf16"
        # Global matmul precision per variant (set before the model exists; torch.compile reads it when it traces).
        # 'highest' = true fp32 GEMMs; 'high' = TF32 for fp32 GEMMs. cudnn's flag is set too, for completeness.
        tf32 = name != "torch eager fp32"
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        free0 = torch.cuda.mem_get_info(dev)[0]  # measured as fastgpt's is, for peak_driver_bytes
        free_min = [free0]
        # ref_from_fastgpt's loading, from the shared host weights; built directly on the GPU (the init there is
        # overwritten, so doing it on the GPU is only faster). Tied wte/lm_head both load the same values.
        with dev:
            raw = RefGPT(RefConfig(T, V, L, H, C))
        raw.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        raw.train()
        if compiled:
            # configure_optimizers' two groups (decay on 2-D weights only), with the fused CUDA kernel as
            # build-nanogpt uses when available.
            params = [p for p in raw.parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
            model = torch.compile(raw)
        else:
            opt = raw.configure_optimizers(WD, LR, BETAS, EPS)  # torch.optim.AdamW defaults (foreach on CUDA)
            model = raw

        def step(i):
            x, y = (a[:b] for a in th_batches[i])
            opt.zero_grad(set_to_none=True)
            if compiled:
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16):  # forward only, as build-nanogpt
                    _, loss = model(x, y)
            else:
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(raw.parameters(), CLIP)
            opt.step()
            return loss.detach()

        times, losses = run_steps(step, after=lambda: free_min.append(min(free_min[-1],
                                                                          torch.cuda.mem_get_info(dev)[0])))
        prof = profiled(name, step)
        return times, losses, {"peak_mem_bytes": torch.cuda.max_memory_allocated(dev), **prof,
                               "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                               "peak_driver_bytes": free0 - free_min[-1],
                               "peak_mem_how": "torch.cuda.max_memory_allocated",
                               "float32_matmul_precision": torch.get_float32_matmul_precision()}

    @contextlib.contextmanager
    def variant_settings(name):
        """The "... sm90" variant runs with --sm90-tiles chosen (a ValueError off sm_90: the variant fails, saying
        why), "... bias-epilogue" with the bias-gradient epilogue, "... tuned" with matmul autotune; the previous
        settings come back after it."""
        if name.endswith("sm90"):
            before = ops.flash_attention_tiles(**dict(zip(("fwd", "dkdv", "dq"), args.sm90_tiles)))
            restore = lambda: ops.flash_attention_tiles(**before)
        elif name.endswith("bias-epilogue"):
            before_bias = ops.matmul_bias_grad_epilogue(True)
            restore = lambda: ops.matmul_bias_grad_epilogue(before_bias)
        elif name.endswith("tuned"):
            before_tune = ops.matmul_autotune(True)
            restore = lambda: ops.matmul_autotune(before_tune)
        else:
            yield
            return
        try:
            yield
        finally:
            restore()

    def payload(results, **summary):
        """The JSON: written after every variant with "partial": true (a run cut short keeps what it measured), and
        at the end with the summary (base, loss_reference, sanity)."""
        return {"benchmark": "bench_gpu_train", "env": env, "partial": not summary,
                "config": {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "T", "B", "batches", "vocab",
                                                         "warmup", "steps", "loss_steps", "data", "encoder", "seed",
                                                         "no_compile", "peak_tflops", "profile", "variants")},
                "data": source, "steps_in_all": n,
                "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "clip": CLIP},
                "num_parameters": n_params, "mfu_params_without_wpe": n_params_mfu, "flops_per_token": fpt,
                **summary, "results": results}

    res = {}
    for name in args.variants:
        if name == "torch compiled bf16" and args.no_compile:
            res[name] = {"status": "skipped", "error": "--no-compile"}
            continue
        tried = []
        for b in args.batches:
            # Each attempt starts from an empty cache and fresh peak counters; the previous one's model, optimizer
            # and activations are gone (they were locals of its function).
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            print(f"  {name} B{b}: running ...", end="", flush=True)
            try:
                with variant_settings(name):
                    times, losses, extra = (fastgpt_variant(name, b) if name.startswith("fastgpt") else
                                            torch_variant(name, b))
            except Exception as e:  # out of memory, a CUDA error, no CUDA in this fastgpt build, a compile failure
                msg = f"{type(e).__name__}: {e}".strip()
                oom = "out of memory" in msg.lower()
                print(f" {'out of memory' if oom else 'FAILED: ' + msg.splitlines()[0][:200]}", flush=True)
                res[name] = {"status": "failed", "error": msg, "B": b}
                tried.append(b)
                if oom and b != args.batches[-1]:
                    continue
            else:
                timed_times = timed(times, args)
                med = statistics.median(timed_times)
                res[name] = {"status": "ok", "B": b, "B_out_of_memory": tried, "step_ms_median": 1e3 * med,
                             "step_ms_mean": 1e3 * statistics.fmean(timed_times), "step_ms_min": 1e3 * min(timed_times),
                             "tok_per_s": b * T / med, "mfu": fpt * b * T / med / peak_flops,
                             "first_step_s": times[0], "step_ms": [1e3 * t for t in timed_times],
                             "warmup_step_ms": [1e3 * t for t in times[:args.warmup]], "losses": losses,
                             "first_loss": losses[0], "last_loss": losses[-1], **extra}
                print(f" {1e3 * med:.1f} ms/step median, first step {times[0]:.1f} s", flush=True)
            finally:
                if name == "torch compiled bf16":
                    torch.compiler.reset()  # drop dynamo's caches, which keep the compiled model alive
            break
        if args.json:
            write_json(args.json, payload(res), quiet=True)
    gc.collect()
    torch.cuda.empty_cache()

    ok = [k for k in args.variants if res[k]["status"] == "ok"]
    base = next((k for k in ("torch compiled bf16", "torch eager fp32") if k in ok), None)
    ref = next((k for k in ("fastgpt fp32", "torch eager fp32") if k in ok), None)

    # Sanity: same weights and batches, so step-0 losses agree to rounding: ~1e-5 between fp32 variants, ~1e-3 for
    # TF32, ~1e-2 for bf16; later steps drift further apart as the rounding compounds. Reported, never asserted.
    sanity = {}
    if ref is not None:
        parts = []
        for k in ok:
            if k != ref and res[k]["B"] == res[ref]["B"]:  # the same batches only at the same B
                d0 = abs(res[k]["first_loss"] - res[ref]["first_loss"])
                d1 = abs(res[k]["last_loss"] - res[ref]["last_loss"])
                sanity[k] = {"first_loss_abs_diff": d0, "last_loss_abs_diff": d1}
                parts.append(f"{k} {d0:.1e} (last step {d1:.1e})")
        print(f"sanity: step-0 loss of {ref} = {res[ref]['first_loss']:.5f} (ln V = {math.log(V):.5f}); "
              f"|difference| from it: {'; '.join(parts) or 'no other variant ran'}. Expect ~1e-5 fp32, ~1e-3 tf32, "
              f"~1e-2 bf16 at step 0")

    print(f"\n{'variant':<24} {'B':>3} {'median ms':>10} {'tok/s':>9} {'MFU':>6} {'peak mem':>9} {'first loss':>10} "
          f"{f'loss @{n}':>10} {'tok/s vs base':>14} {'mem vs base':>12}")
    for k in args.variants:
        r = res[k]
        if r["status"] != "ok":
            print(f"{k:<24} {r.get('B', '-'):>3} {r['status'].upper()}: "
                  f"{r['error'].splitlines()[0][:90] if r['error'] else ''}")
            continue
        ratio = r["tok_per_s"] / res[base]["tok_per_s"] if base is not None else None
        r["tok_per_s_vs_base"] = ratio
        # Issue 10 asks fastgpt bf16 fused for <= 0.7 of torch compiled's peak: both measured alike, from the
        # driver's free memory (torch's own allocated peak is smaller than what it holds from the driver).
        base_mem = res[base]["peak_driver_bytes"] if base is not None else 0
        mem_ratio = r["peak_driver_bytes"] / base_mem if base_mem > 0 else None
        r["peak_driver_vs_base"] = mem_ratio
        mem = f"{r['peak_mem_bytes'] / 2**30:.2f}G" + ("*" if k.startswith("fastgpt") else "")
        print(f"{k:<24} {r['B']:>3} {r['step_ms_median']:>10.1f} {r['tok_per_s']:>9.0f} {100 * r['mfu']:>5.1f}% "
              f"{mem:>9} "
              f"{r['first_loss']:>10.4f} {r['last_loss']:>10.4f} {f'{ratio:.2f}x' if ratio is not None else '-':>14} "
              f"{f'{mem_ratio:.2f}x' if mem_ratio is not None else '-':>12}")
    if base is not None:
        print(f"base: {base} (tok/s ratio above 1: faster than it). MFU against {args.peak_tflops:g} TFLOPS bf16 "
              f"dense for every variant. Peak mem: torch.cuda.max_memory_allocated; *fastgpt: rough, from "
              f"torch.cuda.mem_get_info (driver free memory before model creation minus the lowest seen after). "
              f"Mem vs base: that driver-level figure on both sides (torch's includes its allocator's cache)")

    if args.profile:
        print_breakdown(res, PROFILED, {k: res[k]["step_ms_median"] for k in ok})
        for k in PROFILED:
            if "profile_error" in res.get(k, {}):
                print(f"{k}: the profile failed: {res[k]['profile_error'][:200]}")

    versus = {}
    if args.profile and args.baseline:
        versus = against_baseline(args, env, res)

    if args.json:
        write_json(args.json, payload(res, base=base, loss_reference=ref, sanity=sanity, **versus))
    return 0


def against_baseline(args, env, res):
    """--baseline: prints the variants profiled in this run against an earlier run's and returns {"baseline":
    {"path", "variants": {name: comparison}}} for the JSON ({} where there is nothing to compare with). A failure
    here is printed, never raised: the run's own results are still written."""
    try:
        names = [n for n in PROFILED if isinstance(res.get(n), dict) and "profile" in res[n]]
        cfg = {k: getattr(args, k) for k in CONFIG_KEYS}
        if args.baseline == "auto":
            mine = pathlib.Path(args.json).resolve() if args.json else None
            paths = [p for p in sorted((REPO / "bench" / "results").glob("*/bench_gpu_train.json"))
                     if p.resolve() != mine]
            found = find_baseline(paths, env.get("gpu"), cfg, names)
            if found is not None:  # named relative to the repository, as the ledger names runs
                found["path"] = os.path.relpath(found["path"], REPO)
            else:
                print(f"\n--baseline auto: no earlier run of this model on {env.get('gpu')} with a profile of "
                      f"{', '.join(names) or 'any variant'} under {REPO / 'bench' / 'results'}")
                return {}
        else:
            try:
                with open(args.baseline) as f:
                    found = {"path": args.baseline, "json": json.load(f)}
            except (OSError, ValueError) as e:
                print(f"\n--baseline: cannot read {args.baseline}: {e}")
                return {}
            why = unlike(found["json"], env.get("gpu"), cfg)
            if why == [NOT_OURS]:
                print(f"\n--baseline: {args.baseline} is {NOT_OURS} (no results)")
                return {}
            if why:  # named: compared all the same, saying how it differs
                print(f"\n--baseline: {args.baseline} is not like for like: {'; '.join(why)}")
        return {"baseline": {"path": str(found["path"]), "variants": print_comparison(found, res, names)}}
    except Exception as e:  # noqa: BLE001 (a comparison must not cost the run its JSON)
        print(f"\n--baseline {args.baseline}: the comparison failed: {type(e).__name__}: {e}")
        return {}


if __name__ == "__main__":
    sys.exit(main())
