"""AdamW over GPT-2 124M's parameters on a GPU: fastgpt's fused update against torch.optim.AdamW (fused=True and
foreach), in GB/s against a measured device-to-device copy of the same buffer.

Why: the optimizer step is pure memory traffic (per parameter it reads param, grad, exp_avg, exp_avg_sq and writes
param, exp_avg, exp_avg_sq: 28 bytes in fp32), so its ceiling is the copy bandwidth, and the ratio to a copy says how
close to that ceiling it runs. Times are CUDA-event medians over several buffers in turn (rotating keeps the 50 MB
L2 from serving repeats). Inputs are fresh random non-zero values (the seed is printed).

    python3 bench/bench_adamw.py --json /tmp/adamw.json
"""
import argparse

from _common import cuda_median_ms, environment, write_json

N_124M = 124_475_904  # GPT-2 124M with vocab 50304 (wte tied), the model the speed-up progression trains


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=N_124M, help="parameters (default: GPT-2 124M)")
    p.add_argument("--buffers", type=int, default=3, help="parameter sets rotated between calls")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    import torch

    from fastgpt import ops
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw needs a CUDA GPU")
    seed = args.seed if args.seed is not None else torch.seed() % 2**31
    print(f"seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, hp = args.n, dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def randn(scale):
        return torch.randn(n, device="cuda", generator=g) * scale + 1e-4  # + 1e-4: no exact zeros

    sets = [dict(p=randn(0.02), g=randn(1e-2), m=randn(1e-3), v=randn(1e-3).abs()) for _ in range(args.buffers)]
    state = {"i": 0, "step": 0}

    def rotate():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]

    def fastgpt_step():
        s = rotate()
        state["step"] += 1
        ops.adamw_update(s["p"], s["g"], s["m"], s["v"], state["step"], **hp)

    def torch_opt(**kw):
        params = [torch.nn.Parameter(s["p"].clone()) for s in sets]
        opts = []
        for prm, s in zip(params, sets):
            prm.grad = s["g"].clone()
            opts.append(torch.optim.AdamW([prm], **hp, **kw))
        k = {"i": 0}

        def step():
            k["i"] = (k["i"] + 1) % len(opts)
            opts[k["i"]].step()
        return step

    dst = [torch.empty_like(s["p"]) for s in sets]

    def copy():
        s = rotate()
        dst[state["i"]].copy_(s["p"])

    rows = []
    copy_ms = cuda_median_ms(copy, args.warmup, args.repeats)
    copy_gbs = 8 * n / copy_ms / 1e6
    rows.append(dict(name="device-to-device copy", ms=copy_ms, bytes_per_param=8, gbs=copy_gbs))
    for name, fn in (("fastgpt adamw_update", fastgpt_step), ("torch AdamW fused", torch_opt(fused=True)),
                     ("torch AdamW foreach", torch_opt(foreach=True))):
        ms = cuda_median_ms(fn, args.warmup, args.repeats)
        rows.append(dict(name=name, ms=ms, bytes_per_param=28, gbs=28 * n / ms / 1e6))
    print(f"AdamW over {n:,} fp32 parameters on {torch.cuda.get_device_name()}")
    print(f"{'':24} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        r["of_copy"] = r["gbs"] / copy_gbs
        print(f"{r['name']:24} {r['ms']:8.3f} {r['gbs']:8.0f} {r['of_copy']:8.2f}")
    fg = rows[1]["ms"]
    for r in rows[2:]:
        print(f"adamw: {r['name']} / fastgpt time ratio {r['ms'] / fg:.2f}")
    if args.json:
        write_json(args.json, dict(benchmark="adamw", environment=environment(None), n=n, seed=seed, rows=rows))


if __name__ == "__main__":
    main()
