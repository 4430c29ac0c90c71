"""Training throughput and memory of fastgpt in each precision against PyTorch's matching set-up, in one run.

Why: mixed precision exists to be faster and smaller, so each precision is timed against what a PyTorch user would
run for it (build-nanogpt's GPT, tests/reference_gpt.py): fp32 -> eager fp32; tf32 -> eager with TF32 matmuls
(GPU); bf16 -> bf16 autocast; fp16 -> fp16 autocast with GradScaler. A full step each (forward, backward, clip,
AdamW, zero_grad), the two sides alternating so both see the same machine load. Also printed: the engine's bytes
per precision (activations should halve in 16 bits). On a CPU the ratios are the result (tok/s is printed for
context, not as a claim); absolute times mean something on a GPU only.

    python3 bench/bench_precision.py                        # CPU: fp32, bf16, fp16; L4 H4 C128 T128 B8 V50304
    python3 bench/bench_precision.py --device cuda --gpt2   # GPU: every precision, GPT-2 124M, B16 T1024
"""
import argparse
import pathlib
import statistics
import sys
import time

from _common import OtherLoad, default_threads, environment, report_other_load, write_json

REPO = pathlib.Path(__file__).resolve().parent.parent
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precisions", default=None, help="comma list (default: fp32,bf16,fp16 on CPU; all on GPU)")
    p.add_argument("--gpt2", action="store_true", help="GPT-2 124M (L12 H12 C768), B16 T1024 unless given")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--T", type=int, default=None)
    p.add_argument("--B", type=int, default=None)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.gpt2:
        args.n_layer, args.n_head, args.n_embd = 12, 12, 768
    args.T = args.T or (1024 if args.gpt2 else 128)
    args.B = args.B or (16 if args.gpt2 else 8)
    default = "fp32,tf32,bf16,fp16" if args.device == "cuda" else "fp32,bf16,fp16"
    args.precisions = (args.precisions or default).split(",")
    return args


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import torch

    import fastgpt
    sys.path.insert(0, str(REPO / "tests"))
    from reference_gpt import ref_from_fastgpt

    threads = default_threads()
    torch.set_num_threads(threads)
    dev = args.device
    cfg = fastgpt.GPTConfig(block_size=args.T, vocab_size=args.vocab, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd)
    rng = np.random.default_rng(args.seed)
    n = args.warmup + args.steps
    toks = rng.integers(0, min(args.vocab, 50257), (n, args.B, args.T + 1))
    batches = [(np.ascontiguousarray(t[:, :-1], np.int32), np.ascontiguousarray(t[:, 1:], np.int32)) for t in toks]
    tb = [(torch.from_numpy(x).long().to(dev), torch.from_numpy(y).long().to(dev)) for x, y in batches]

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    print(f"bench_precision on {dev}: L{args.n_layer} H{args.n_head} C{args.n_embd} T{args.T} B{args.B} "
          f"V{args.vocab} | {args.warmup} warmup + {args.steps} timed steps | {environment(threads)['host_cpu']}")
    busy = OtherLoad()
    results = {}
    for prec in args.precisions:
        model = fastgpt.GPT(cfg, device=dev, precision=prec, seed=args.seed)
        opt = fastgpt.AdamW(model, lr=6e-4, weight_decay=0.1)
        ref = ref_from_fastgpt(model).to(dev)
        topt = ref.configure_optimizers(0.1, 6e-4)
        scaler = torch.amp.GradScaler(dev, enabled=prec == "fp16")
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"

        def fg(i):
            model.forward_backward(*batches[i])
            opt.clip_grad_norm(1.0)
            opt.step()
            model.zero_grad()

        def th(i):
            with torch.autocast(dev, dtype=getattr(torch, AUTOCAST.get(prec, "bfloat16")), enabled=prec in AUTOCAST):
                _, loss = ref(*tb[i])
            scaler.scale(loss).backward()
            scaler.unscale_(topt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            scaler.step(topt)
            scaler.update()
            topt.zero_grad(set_to_none=True)

        times = {"fastgpt": [], "torch": []}
        for i in range(n):
            for name, fn in (("fastgpt", fg), ("torch", th)):
                sync()
                t0 = time.perf_counter()
                fn(i)
                sync()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        results[prec] = {"fastgpt_tok_per_s": args.B * args.T / med["fastgpt"],
                         "torch_tok_per_s": args.B * args.T / med["torch"],
                         "ratio_fastgpt_over_torch": med["torch"] / med["fastgpt"], "memory": model.memory()}
        del model, opt, ref, topt
    other = busy.other_share()

    base = results.get("fp32", {}).get("memory")
    print(f"{'precision':<10}{'fastgpt tok/s':>15}{'torch tok/s':>13}{'fastgpt/torch':>15}{'activation MiB':>16}"
          f"{'vs fp32':>9}{'param+grad MiB':>16}")
    for prec, r in results.items():
        m = r["memory"]
        rel = f"{m['activations'] / base['activations']:.2f}x" if base else "-"
        print(f"{prec:<10}{r['fastgpt_tok_per_s']:>15.0f}{r['torch_tok_per_s']:>13.0f}"
              f"{r['ratio_fastgpt_over_torch']:>14.2f}x{m['activations'] / 2**20:>16.1f}{rel:>9}"
              f"{(m['parameters'] + m['gradients']) / 2**20:>16.1f}")
    print("torch side: fp32 eager | tf32: allow_tf32 | bf16: bf16 autocast | fp16: fp16 autocast + GradScaler")
    report_other_load(other)
    if args.json:
        write_json(args.json, {"benchmark": "bench_precision", "device": dev, "env": environment(threads),
                               "config": {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "T", "B",
                                                                        "vocab", "warmup", "steps")},
                               "results": results, "other_cpu_share": other})
    return 0


if __name__ == "__main__":
    sys.exit(main())
