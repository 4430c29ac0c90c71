"""Three training steps of a small GPT(device="cuda") in every precision, for compute-sanitizer (memcheck, racecheck,
initcheck, synccheck): embedding, layernorm, cuBLASLt matmuls, attention, GELU, residual, cross-entropy, backward,
grad-norm clipping and AdamW, all on the model's own stream, one step through each classifier path (the full logits,
forward_backward's chunks of 37 rows, backward's recomputed chunks); then 20 tokens of generation through the KV
cache (prefill, decode steps, the window sliding past block_size). The fused model (the residual add with the
LayerNorm after it, the GELU in cuBLASLt epilogues in 16 bits) in every precision, then the unfused one in bf16 for
the kernels it alone runs (residual add, GELU); all at head size 32 (attention on CUDA cores, or widened to fp32),
then fp32, tf32 and bf16 again at head size 64 (attention on tensor cores: TF32 in fp32/tf32), and bf16 once more
with matmul autotune (every product's candidates timed at its first run, their outputs in scratch). fp16 runs with
recompute=2 (GELU and the LayerNorms remade in backward into one-layer buffers; the others keep every activation,
the default). It checks nothing
numerically (the tests do); it
exits non-zero only if a call raises or a loss is not finite.
Usage: compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/train_sanitize.py [--part K/N]
--part K/N runs only the models at places K, K + N, K + 2N, ... of that list (from 1): N processes side by side cover
them all, where one under racecheck hit its ~400 s timeout in the 2026-11-26 H200 run (gpu_check.sh splits
racecheck's in two). Each model's line gives its seconds."""
import argparse
import math
import time

import numpy as np

import fastgpt


def part(text):
    """K/N with 1 <= K <= N, as (K, N)."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N such as 1/2, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return k, n


def plan():
    """Every model: (precision, fused, config, matmul autotune)."""
    cfg = fastgpt.GPTConfig(block_size=64, vocab_size=211, n_layer=2, n_head=2, n_embd=64)
    cfg64 = fastgpt.GPTConfig(block_size=64, vocab_size=211, n_layer=2, n_head=2, n_embd=128)  # head size 64
    return [(p, True, cfg, False) for p in ("fp32", "tf32", "bf16", "fp16")] + [("bf16", False, cfg, False)] + [
        (p, True, cfg64, False) for p in ("fp32", "tf32", "bf16")] + [("bf16", True, cfg64, True)]


def name_of(precision, fused, cfg, tuned):
    return (precision if fused else f"{precision} unfused") + f" hs {cfg.n_embd // cfg.n_head}" + (
        " tuned" if tuned else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Training steps of small CUDA models, for compute-sanitizer.")
    ap.add_argument("--part", type=part, default=(1, 1), help="K/N: the models at K, K+N, ... of the list (from 1)")
    ap.add_argument("--list", action="store_true", help="print the part's models' names and run nothing")
    args = ap.parse_args(argv)
    k, n = args.part
    runs = plan()[k - 1::n]
    if args.list:
        print("\n".join(name_of(*r) for r in runs))
        return
    rng = np.random.default_rng(0)
    for precision, fused, cfg, tuned in runs:
        before = fastgpt.ops.matmul_autotune(tuned)
        try:
            run(precision, fused, cfg, rng, tuned)
        finally:
            fastgpt.ops.matmul_autotune(before)


def run(precision, fused, cfg, rng, tuned):
    """Three steps and a generation of one model: the caller sets matmul_autotune."""
    start = time.perf_counter()
    model = fastgpt.GPT(cfg, device="cuda", precision=precision, seed=1, fused=fused,
                        recompute=2 if precision == "fp16" else 0)
    name = name_of(precision, fused, cfg, tuned)
    opt = fastgpt.AdamW(model, lr=1e-3)
    model.classifier_rows = 37  # chunks that do not divide B*T = 96
    for step in range(3):
        tok = rng.integers(0, cfg.vocab_size, (2, 49))  # T not a multiple of any tile
        x, y = tok[:, :-1], tok[:, 1:]
        model.zero_grad()
        if step == 1:
            loss = model.forward_backward(x, y)
        else:
            _, loss = model(x, y, return_logits=step == 0)
            model.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        if not math.isfinite(loss):
            raise SystemExit(f"{name}: loss {loss}")
    out = model.generate(rng.integers(0, cfg.vocab_size, (3, 50)), 20, top_k=20, top_p=0.9, seed=0)
    print(f"train_sanitize {name}: 3 steps, last loss {loss:.4f}; generated {out.shape[1] - 50} tokens "
          f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
