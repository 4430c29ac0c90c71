"""Where flash attention goes wrong, kernel choice by kernel choice: each tile option of the 16-bit kernels
(fastgpt.ops.flash_attention_tiles) against float64 on small shapes, and for an output that is off, which rows,
columns and heads are wrong, whether they are NaN, and a map of the first head.

Why: the tests say that a kernel is wrong, not where; on a GPU lent for 30 minutes the next step after a failure is
a fix, and "rows 64-127 wrong in every head" (the second warpgroup) or "every column wrong from 32 on" (a
descriptor, a swizzle) says where to look. Each choice runs in its own process with a time limit, so a trap (the
Hopper kernels' 60 s wait limit) or a hang ends that choice alone; the Hopper choices, never run on a GPU yet, come
last.

    python3 scripts/flash_diagnose.py                  # every choice (the Hopper ones where they run)
    python3 scripts/flash_diagnose.py --only "sm90"     # the choices whose label has this text
    python3 scripts/flash_diagnose.py --device cpu      # the same checks of fastgpt's CPU kernels (no GPU)
"""
import argparse
import math
import subprocess
import sys

import numpy as np

# Of the tensor's largest |reference|: the flash algorithm's own bf16 roundings (scripts/flash_accuracy.py's float64
# emulation, outputs rounded to bf16) reach 0.64% of it at these shapes (18 cases, 2026-11-24), a third of this.
TOL = 2e-2


def choices(options):
    """The kernel choices of ops.flash_attention_tile_options() (passed in: {"fwd": [names], "dkdv": ..., "dq": ...})
    as (label, tiles): each fwd option, each dkdv option, each dq option but the first (it runs with every dkdv
    choice; never "auto"), the others at their first kernel option (base()); in running order: the Hopper ("sm90")
    choices last, the warp-specialised ones after them (if they hang, the caller's time limit cuts them, not the
    others). scripts/ncu_targets.py profiles the same list."""
    out = [(f"{key} {name}", {key: name}) for key in ("fwd", "dkdv", "dq")
           for name in kernels(options[key])[key == "dq":]]
    return sorted(out, key=lambda c: is_sm90(c[1]) + (" ws" in c[0]))


def kernels(names):
    """An option list less "auto" (option 0 of the build's: the Hopper kernels on an H100/H200, else the first
    kernel option), which names no kernel of its own."""
    return [name for name in names if name != "auto"]


def base(options):
    """The first kernel option of each (the mma.sync 16x64 kernels): the others' choice while one is checked, so that
    a dq choice is not lost in "auto"'s fused Hopper backward, which makes dq itself."""
    return {key: kernels(names)[0] for key, names in options.items()}


def is_sm90(tiles):
    return any(name.startswith("sm90") for name in tiles.values())


def ranges(idx):
    """Sorted ints -> '0-63, 128-191'."""
    out, start, prev = [], None, None
    for i in idx:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ", ".join(out)


def diagnose(name, got, ref, tol=TOL, rows_per_char=16, cols_per_char=8):
    """got, ref: (B, H, T, D) or (B, H, T) arrays. -> (ok, lines): a line of where it is off and a map of head 0 of
    batch 0 ('.' right, 'x' off, 'N' NaN or inf; a character per rows_per_char rows x cols_per_char columns)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.ndim == 3:
        got, ref = got[..., None], ref[..., None]
    scale = max(np.abs(ref).max(), 1e-30)
    nonfinite = ~np.isfinite(got)
    bad = nonfinite | (np.abs(np.where(nonfinite, 0.0, got) - ref) > tol * scale)
    rel = np.linalg.norm(np.where(nonfinite, 0.0, got - ref)) / max(np.linalg.norm(ref), 1e-30)
    if not bad.any():
        return True, [f"{name}: ok (rel err {rel:.1e})"]
    B, H, T, D = got.shape
    lines = [f"{name}: {bad.mean():.1%} of elements off ({nonfinite.sum()} NaN/inf), rel err {rel:.2e}",
             f"  rows off: {ranges(np.flatnonzero(bad.any(axis=(0, 1, 3))))} (of 0-{T - 1})"]
    if D > 1:
        lines.append(f"  columns off: {ranges(np.flatnonzero(bad.any(axis=(0, 1, 2))))} (of 0-{D - 1})")
    lines.append(f"  heads off: {ranges(np.flatnonzero(bad.any(axis=(0, 2, 3))))} (of 0-{H - 1}); batches off: "
                 f"{ranges(np.flatnonzero(bad.any(axis=(1, 2, 3))))} (of 0-{B - 1})")
    b0, n0 = bad[0, 0], nonfinite[0, 0]
    lines.append(f"  head 0, a character per {rows_per_char} rows (down) x {cols_per_char} columns (across):")
    for r in range(0, T, rows_per_char):
        chars = []
        for c in range(0, D, cols_per_char):
            cell = (slice(r, r + rows_per_char), slice(c, c + cols_per_char))
            chars.append("N" if n0[cell].any() else "x" if b0[cell].any() else ".")
        lines.append(f"  {r:5d} {''.join(chars)}")
    return False, lines


def reference(q, k, v, dout, causal):
    """float64 out, lse, dq, dk, dv (torch autograd), as numpy arrays."""
    import torch
    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    out.backward(dout.double())
    return [x.detach().cpu().numpy() for x in (out, lse, q.grad, k.grad, v.grad)]


def check_choice(label, tiles, device, seed):
    """One choice over its cases, the tiles put back after; -> (ok, lines). A forward choice is checked on out and
    lse, a backward one on all three gradients (the other pass at its default is checked with it). Raises ValueError
    if the choice cannot run here."""
    import torch

    from fastgpt import ops
    before = ops.flash_attention_tiles(**dict(base(ops.flash_attention_tile_options()), **tiles))
    try:
        cases = [(64, T, causal) for T in (64, 130, 256) for causal in (True, False)]
        if is_sm90(tiles):
            cases += [(128, 200, True), (128, 200, False)]
        fwd = "fwd" in tiles
        ok, lines = True, []
        g = torch.Generator(device=device).manual_seed(seed)
        for d, T, causal in cases:
            B, H = 2, 3
            q, k, v, dout = (torch.randn(B, H, T, d, device=device, generator=g).to(torch.bfloat16)
                             for _ in range(4))
            ref = dict(zip(("out", "lse", "dq", "dk", "dv"), reference(q, k, v, dout, causal)))
            out, lse = ops.flash_attention_forward(q, k, v, causal=causal)
            got = {"out": out, "lse": lse} if fwd else dict(zip(("dq", "dk", "dv"), ops.flash_attention_backward(
                dout, q, k, v, out, lse, causal=causal, deterministic=True)))
            for name, x in got.items():
                good, text = diagnose(f"{label} d{d} T{T} {'causal' if causal else 'full'} {name}",
                                      x.float().cpu().numpy() if hasattr(x, "cpu") else x, ref[name])
                ok &= good
                if not good:
                    lines += text
        return ok, lines
    finally:
        ops.flash_attention_tiles(**before)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="the choices whose label contains this text")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=int, default=30,
                   help="seconds per choice (its own process; a normal one takes under 10 on an H100, and a hung\n"
                        "Hopper kernel traps only after 60)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one choice's label
    args = p.parse_args(argv)
    from fastgpt import ops
    listed = choices(ops.flash_attention_tile_options())
    if args.one:
        try:
            ok, lines = check_choice(args.one, dict(listed)[args.one], args.device, args.seed)
        except ValueError as e:  # not an sm_90 GPU, or a build without sm_90a code
            print(f"SKIPPED {e}")
            return 0
        print("\n".join(lines))
        print("OK" if ok else "WRONG")
        return 0
    results = []
    for label, _ in listed:
        if args.only not in label:
            continue
        cmd = [sys.executable, __file__, "--one", label, "--device", args.device, "--seed", str(args.seed)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out = r.stdout.strip().splitlines()
            verdict = out[-1] if r.returncode == 0 and out else f"CRASHED (rc {r.returncode})"
            if verdict.startswith("SKIPPED"):
                verdict = "skipped"
            body = out[:-1] if r.returncode == 0 else out + r.stderr.strip().splitlines()[-8:]
        except subprocess.TimeoutExpired:
            verdict, body = f"TIMEOUT ({args.timeout} s)", []
        results.append((label, verdict))
        print(f"== {label}: {verdict}", flush=True)
        for line in body[:60]:
            print(line)
    print("\nflash_diagnose: " + "; ".join(f"{label} {v}" for label, v in results))
    return 0 if all(v in ("OK", "skipped") for _, v in results) else 1


if __name__ == "__main__":
    sys.exit(main())
