"""CPU training throughput: fastgpt against PyTorch eager (build-nanogpt's GPT, tests/reference_gpt.py), same config,
same batches, same optimizer, in one process with the same thread count.

Why: the number that matters to a user is tokens per second of a whole training step, forward, backward, gradient
clipping, AdamW step and zero_grad, not of single kernels (bench_ops.py). Both models start from identical
weights and see identical batches, so their losses must agree step by step (to ~1e-5); the max difference over the
timed steps is printed as a sanity line (reported, not timed, not asserted: benchmarks are never tests).

    python3 bench/bench_train.py                                  # random tokens, L4 H4 C128 T128 B8 V50304
    python3 bench/bench_train.py --data /path/to/tinyshakespeare.txt --encoder /path/to/gpt2/encoder.json
    python3 bench/bench_train.py --data --json /tmp/train.json    # text from $FASTGPT_DATA, encoder from
                                                                  # $FASTGPT_GPT2_ENCODER
"""
import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

from _common import OtherLoad, default_threads, environment, report_other_load, write_json

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--T", type=int, default=128, help="sequence length (also block_size)")
    p.add_argument("--B", type=int, default=8, help="batch size")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (both models take them)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; tok/s is B*T / median step time")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both fastgpt (OpenMP) and torch (default: $OMP_NUM_THREADS or os.cpu_count())")
    p.add_argument("--data", nargs="?", const=os.environ.get("FASTGPT_DATA", ""), default=None, metavar="TEXT",
                   help="train on this UTF-8 text (Tiny Shakespeare) instead of random tokens; "
                        "--data alone uses $FASTGPT_DATA")
    p.add_argument("--encoder", default=None, metavar="JSON",
                   help="GPT-2 encoder.json for --data (default: $FASTGPT_GPT2_ENCODER)")
    p.add_argument("--seed", type=int, default=None, help="weights and data seed (default: fresh random)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.data is not None and args.vocab < 50257:
        p.error(f"--data needs --vocab >= 50257 (GPT-2's tokens), got {args.vocab}")
    if args.data == "":
        p.error("--data without a path needs $FASTGPT_DATA set to the text file")
    if args.data is not None and os.path.isdir(args.data):
        args.data = os.path.join(args.data, "tinyshakespeare.txt")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd ({args.n_embd}) must be a multiple of --n-head ({args.n_head})")
    if min(args.n_layer, args.n_head, args.n_embd, args.T, args.B, args.vocab, args.steps) < 1 or args.warmup < 0:
        p.error("sizes and --steps must be >= 1, --warmup >= 0")
    return args


def make_batches(args, rng):
    """warmup + steps (x, y) int64 (B, T) batches, all cut before any timing starts."""
    import numpy as np
    n = args.warmup + args.steps
    if args.data is None:
        toks = rng.integers(0, min(args.vocab, 50257), size=(n, args.B, args.T + 1), dtype=np.int64)
        return [(t[:, :-1].copy(), t[:, 1:].copy()) for t in toks], "random tokens"
    from fastgpt.data import DataLoader, tokenize_file
    with tempfile.TemporaryDirectory(prefix="fastgpt-bench-") as shards:
        info = tokenize_file(args.data, shards, encoder_json=args.encoder)
        loader = DataLoader(info["train"], args.B, args.T, seed=args.seed)
        batches = [loader.next_batch() for _ in range(n)]
    return ([(x.copy(), y.copy()) for x, y in batches],
            f"{os.path.basename(args.data)} ({info['train_tokens']:,} train tokens)")


def main(argv=None):
    args = parse_args(argv)
    threads = args.threads or default_threads()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before either library starts its OpenMP runtime
    import numpy as np
    import torch

    import fastgpt
    torch.set_num_threads(threads)
    sys.path.insert(0, str(REPO / "tests"))
    from reference_gpt import ref_from_fastgpt

    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(args.seed)
    env = environment(threads)
    batches, source = make_batches(args, rng)
    B, T = args.B, args.T
    hp = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    clip = 1.0

    cfg = fastgpt.GPTConfig(block_size=T, vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd)
    model = fastgpt.GPT(cfg, seed=args.seed)
    ref = ref_from_fastgpt(model)  # identical weights, copied before either side trains
    ref.train()
    opt_f = fastgpt.AdamW(model, **hp)  # weight decay on 2-D weights only, like configure_optimizers
    opt_t = ref.configure_optimizers(hp["weight_decay"], hp["lr"], betas=hp["betas"], eps=hp["eps"])

    fg_batches = [(np.ascontiguousarray(x, np.int32), np.ascontiguousarray(y, np.int32)) for x, y in batches]
    th_batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]

    def fg_step(i):
        x, y = fg_batches[i]
        return opt_f.train_step(x, y, max_norm=clip).loss  # zero_grad, forward, backward, clip, AdamW

    def th_step(i):
        x, y = th_batches[i]
        _, loss = ref(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt_t.step()
        opt_t.zero_grad(set_to_none=True)
        return loss.item()

    print(f"bench_train: L{args.n_layer} H{args.n_head} C{args.n_embd} T{T} B{B} V{args.vocab} "
          f"({model.num_parameters():,} params) | {source} | AdamW lr {hp['lr']} betas {hp['betas']} "
          f"wd {hp['weight_decay']} clip {clip}")
    print(f"threads {threads} (torch {torch.get_num_threads()}) | warmup {args.warmup}, {args.steps} timed steps, "
          f"alternating fastgpt/torch | seed {args.seed} | torch {env['torch']}, fastgpt {env['fastgpt']}, "
          f"{env['host_cpu']}")
    busy = OtherLoad()
    times = {"fastgpt": [], "torch": []}
    losses = {"fastgpt": [], "torch": []}
    # Steps alternate between the two models so both see the same machine load; each model's own sequence of
    # steps is unchanged by that (they share nothing).
    for i in range(args.warmup + args.steps):
        for name, step in (("fastgpt", fg_step), ("torch", th_step)):
            t0 = time.perf_counter()
            loss = step(i)
            dt = time.perf_counter() - t0
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(dt)
    other = busy.other_share()

    res = {}
    for name in ("fastgpt", "torch"):
        med = statistics.median(times[name])
        res[name] = {"tok_per_s": B * T / med, "step_ms_median": 1e3 * med,
                     "step_ms_mean": 1e3 * statistics.fmean(times[name]),
                     "step_ms": [1e3 * t for t in times[name]], "losses": losses[name]}
    ratio = res["fastgpt"]["tok_per_s"] / res["torch"]["tok_per_s"]
    diffs = [abs(a - b) for a, b in zip(losses["fastgpt"][args.warmup:], losses["torch"][args.warmup:])]
    max_diff = max(diffs)

    print(f"{'':<8} {'tok/s':>10} {'median step ms':>15} {'mean step ms':>13} {'last loss':>10}")
    for name in ("fastgpt", "torch"):
        r = res[name]
        print(f"{name:<8} {r['tok_per_s']:>10.0f} {r['step_ms_median']:>15.1f} {r['step_ms_mean']:>13.1f} "
              f"{r['losses'][-1]:>10.4f}")
    print(f"speed ratio fastgpt/torch: {ratio:.2f}x (above 1 means fastgpt is faster)")
    print(f"sanity: max |loss fastgpt - loss torch| over the {args.steps} timed steps = {max_diff:.2e} "
          f"(identical weights and batches; expect ~1e-5)")
    report_other_load(other)
    env["other_cpu_share"] = other

    if args.json:
        payload = {"benchmark": "bench_train", "env": env, "data": source,
                   "config": {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "T", "B", "vocab",
                                                            "warmup", "steps", "seed")},
                   "optimizer": {**hp, "betas": list(hp["betas"]), "clip": clip},
                   "results": res, "ratio_fastgpt_over_torch": ratio, "max_abs_loss_diff": max_diff}
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
