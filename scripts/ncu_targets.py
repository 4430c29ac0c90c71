"""What Nsight Compute (ncu) profiles in `scripts/gpu_check.sh ncu`: each flash attention kernel choice once at
GPT-2 124M's attention shape (bf16, d 64, T 1024, causal, 12 heads): the Hopper ones beside torch's cuDNN SDPA
backend, the one they race on an H100/H200 ("sm90": in a report of their own, which a trap or hang there cannot cost
the others), or the mma.sync ones beside torch's flash backend ("flash"); or one fastgpt bf16 training step of GPT-2
124M ("step"); or the step's memory-bound ops, each alone at the step's shapes, B 64 ("ops": OPS_LABELS).

Why: issue 10 asks for flash attention at Hopper speed and says "profile with ncu"; the benchmarks give each
kernel's time, not why it takes it (tensor-pipe use, issue slots, stalls, bank conflicts, spills). The sessions that
tune the kernels have no GPU: they work from what one ncu run brings back (scripts/ncu_summary.py's table and the
raw CSV of every metric).

Each profiled call runs once untimed first, then inside cudaProfilerStart/Stop (ncu --profile-from-start off: the
warm-up calls and torch's own set-up kernels stay out of the report) and an NVTX range named by its label
(ncu --nvtx, then --print-nvtx-rename kernel on import names the kernels by it). Labels and their order are printed.
A choice this GPU or build cannot run (the Hopper kernels elsewhere) is printed as skipped.

    ncu --profile-from-start off --nvtx --set full -o flash python3 scripts/ncu_targets.py flash
    python3 scripts/ncu_targets.py sm90 --list   # the labels (a build with CUDA; no GPU needed)

"ops" is there because the step's report (application replay: speed of light, launch, occupancy) cannot say why a
memory-bound kernel runs below the memory's rate, and the eighth run (H200) had the LayerNorm backward at 2.4 TB/s
where the residual LayerNorm forward moves as many bytes a row at 3.7: the full set, with SASS pages and stall
samples, of each such op at the training shapes.
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from flash_diagnose import base, choices, is_sm90  # noqa: E402  (the kernel choices, derived from the build's options)


def fastgpt_targets(options, sm90):
    """(label, tiles, pass) for each of flash_diagnose.choices(options), the Hopper ones (sm90) or the others: a
    forward choice times the forward, a dkdv or dq choice the deterministic backward (its two passes are separate
    kernels, so each is profiled with the other at its first kernel option; the fused dkdv options make dq
    themselves); the others add the atomic backward with the others' choice (flash_diagnose.base: 16x64)."""
    out = [(label, tiles, "fwd" if "fwd" in tiles else "bwd det") for label, tiles in choices(options)
           if is_sm90(tiles) == sm90]
    return out if sm90 else out + [("bwd atomic", {}, "bwd atomic")]


# torch's SDPA backends per report: cuDNN's Hopper kernels beside ours, FlashAttention-2 beside the mma.sync ones.
TORCH_TARGETS = {report: [(f"torch {backend.lower()} {what}", backend, what) for what in ("fwd", "bwd")]
                 for report, backend in (("sm90", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION"))}


def torch_targets(args):
    """The report's torch SDPA targets: its own backend's, and for "flash --cudnn" cuDNN's as well."""
    return TORCH_TARGETS[args.what] + (TORCH_TARGETS["sm90"] if args.what == "flash" and args.cudnn else [])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", nargs="?", choices=("flash", "sm90", "step", "ops"), default="flash")
    p.add_argument("--list", action="store_true", help="print the labels and exit (no GPU needed)")
    p.add_argument("--B", type=int, default=None, help="batch (default: 16, step 8, ops 64)")
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--d", type=int, default=64, help="flash: head dim")
    p.add_argument("--n-layer", type=int, default=12, help="step: layers")
    p.add_argument("--n-embd", type=int, default=768, help="step, ops: width (a multiple of --n-head)")
    p.add_argument("--vocab", type=int, default=50304, help="step, ops: vocab size")
    p.add_argument("--device", default="cuda", help="cpu: the same calls without a GPU or profiler (a smoke test)")
    p.add_argument("--cudnn", action="store_true",
                   help="flash: torch's cuDNN backend too (ncu_profile.sh, when it leaves the sm90 report out)")
    args = p.parse_args(argv)
    if args.B is None:
        args.B = {"step": 8, "ops": 64}.get(args.what, 16)
    if min(args.B, args.T, args.n_head, args.d, args.n_layer, args.n_embd, args.vocab) < 1:
        p.error("sizes must be >= 1")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd ({args.n_embd}) must be a multiple of --n-head ({args.n_head})")
    return args


class Profiled:
    """Runs fn once (warm-up), then once more inside the profiler's window and an NVTX range named label."""

    def __init__(self, torch):
        self.torch, self.labels = torch, []

    def __call__(self, label, fn):
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(label)
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
        self.labels.append(label)
        print(f"profiled: {label}", flush=True)


class Plain:
    """--device cpu: each call once, no profiler."""

    def __init__(self):
        self.labels = []

    def __call__(self, label, fn):
        fn()
        self.labels.append(label)
        print(f"ran: {label}", flush=True)


def flash(args, torch, run):
    """fastgpt's choices (the Hopper ones for "sm90", the others for "flash"), then the report's torch SDPA
    backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastgpt import ops

    B, H, T, d = args.B, args.n_head, args.T, args.d
    g = torch.Generator(device=args.device).manual_seed(1234)
    q, k, v, dout = (torch.randn(B, H, T, d, device=args.device, generator=g, dtype=torch.bfloat16)
                     for _ in range(4))
    options = ops.flash_attention_tile_options()
    first = {name: names[0] for name, names in options.items()}  # "auto", put back after
    try:
        for label, tiles, what in fastgpt_targets(options, args.what == "sm90"):
            try:
                ops.flash_attention_tiles(**dict(base(options), **tiles))
            except ValueError as e:  # not an sm_90 GPU, or a build without sm_90a code
                print(f"skipped: {label}: {e}", flush=True)
                continue
            out, lse = ops.flash_attention_forward(q, k, v, causal=True)
            if what == "fwd":
                run(label, lambda: ops.flash_attention_forward(q, k, v, causal=True))
            else:
                run(label, lambda: ops.flash_attention_backward(dout, q, k, v, out, lse, causal=True,
                                                                deterministic=what == "bwd det"))
    finally:
        ops.flash_attention_tiles(**first)
    qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))
    for label, backend, what in torch_targets(args):
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            try:
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            except RuntimeError as e:
                print(f"skipped: {label}: {str(e).splitlines()[0]}", flush=True)
                continue
            if what == "fwd":
                run(label, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
            else:
                run(label, lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True))


def step(args, torch, run):
    """One fastgpt bf16 training step of GPT-2 124M (by default; vocab 50304), the fused model's one train_step
    call, eager (a CUDA graph's kernels are the same ones)."""
    import numpy as np

    import fastgpt

    cfg = fastgpt.GPTConfig(block_size=args.T, vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd)
    model = fastgpt.GPT(cfg, device=args.device, precision="bf16", seed=1234)
    opt = fastgpt.AdamW(model, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(1234)
    toks = rng.integers(0, min(args.vocab, 50257), size=(args.B, args.T + 1), dtype=np.int32)
    x, y = np.ascontiguousarray(toks[:, :-1]), np.ascontiguousarray(toks[:, 1:])
    run(STEP_LABELS[0], lambda: float(opt.train_step(x, y, max_norm=1.0).loss))


# The "step" and "ops" reports' labels, in the order they run (step above, memory_ops below).
STEP_LABELS = ["step fastgpt bf16"]
OPS_LABELS = ["layernorm_backward dx_sum", "residual_layernorm_forward", "matmul_backward fc (bias)",
              "cross_entropy_forward_backward", "embedding_backward text"]


def memory_ops(args, torch, run):
    """The step's memory-bound ops in bf16 at its shapes (B T rows of width C; one classifier chunk of 4096 rows),
    each alone: the fused model's LayerNorm backward with the residual projection's bias sums (dx_sum), the residual
    add + LayerNorm forward, the MLP projection's backward (its bias gradient's column-sum pass beside the two
    products), the classifier's fused cross-entropy, and the embedding backward on ids like Tiny Shakespeare's (one
    token 12% of them, as "\\n": a run over many warps)."""
    from fastgpt import ops as F

    B, T, C, V = args.B, args.T, args.n_embd, args.vocab
    N = B * T
    g = torch.Generator(device=args.device).manual_seed(1234)

    def randn(*shape):
        return torch.randn(*shape, device=args.device, generator=g).to(torch.bfloat16)

    x, dout, w, b = randn(N, C), randn(N, C), randn(C), randn(C)
    _, mean, rstd = F.layernorm_forward(x, w, b)
    run(OPS_LABELS[0], lambda: F.layernorm_backward(dout, x, w, mean, rstd, dx_sum=True))
    run(OPS_LABELS[1], lambda: F.residual_layernorm_forward(x, dout, w, b))
    dh, h, wfc = randn(N, C), randn(N, 4 * C), randn(C, 4 * C)  # c_proj: (N, 4C) -> (N, C), weight (C, 4C)
    run(OPS_LABELS[2], lambda: F.matmul_backward(dh, h, wfc))
    rows = min(4096, N)
    logits = randn(rows, V)
    targets = torch.randint(0, V, (rows,), device=args.device, generator=g)
    run(OPS_LABELS[3], lambda: F.cross_entropy_forward_backward(logits, targets))
    idx = torch.randint(0, V, (B, T), device=args.device, generator=g)
    idx[torch.rand(B, T, device=args.device, generator=g) < 0.12] = min(198, V - 1)  # GPT-2's "\\n"
    run(OPS_LABELS[4], lambda: F.embedding_backward(dout.view(B, T, C), idx, V, T))


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        if args.what in ("step", "ops"):
            print("\n".join({"step": STEP_LABELS, "ops": OPS_LABELS}[args.what]))
            return 0
        from fastgpt import ops
        targets = fastgpt_targets(ops.flash_attention_tile_options(), args.what == "sm90")
        print("\n".join(label for label, _, _ in targets + torch_targets(args)))
        return 0
    import torch
    if args.device == "cpu":
        run = Plain()
    elif not torch.cuda.is_available():
        print("ncu_targets: no CUDA GPU visible to torch; nothing to profile")
        return 0
    else:
        run = Profiled(torch)
    {"step": step, "ops": memory_ops}.get(args.what, flash)(args, torch, run)
    print(f"ncu_targets {args.what}: {len(run.labels)} labels, in order: {'; '.join(run.labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
