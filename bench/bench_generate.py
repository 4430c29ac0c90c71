"""Generation speed: tokens/s of greedy decoding, fastgpt with its KV cache against fastgpt recomputing the whole
context for every token (what generate did before the cache), and against PyTorch: transformers' GPT2LMHeadModel
.generate with its own KV cache (use_cache=True), from the same weights, same prompts, same thread count, one run.

Why: without a cache each new token costs a forward over the whole context (quadratic in the length); with it, one
position per layer, so decoding is bound by reading the weights once per token. All variants decode greedily from
identical weights, so they must produce the same tokens: the `same tokens` column says whether they did (reported,
not asserted: benchmarks are never tests). GPT-2 124M by default (L12 H12 C768, vocab 50257, block 1024).

    python3 bench/bench_generate.py                              # 124M, B 1, prompt 32, 32 new tokens
    python3 bench/bench_generate.py --prompt-len 128 --new-tokens 64 --B 4 --json /tmp/gen.json
    python3 bench/bench_generate.py --device cuda --precision bf16 --new-tokens 256   # on a GPU (torch in bf16 too)
    python3 bench/bench_generate.py --device cuda --precision bf16 --profile  # and each fastgpt variant's kernels

--profile runs one more generation of each fastgpt variant under torch.profiler (bench/_profile.py) and prints the GPU
kernel time per token beside the wall time per token (the rest is the host: launches, the logits' copy, sampling),
with the largest kernels: where the cache's time goes (it was slower than recomputing on an H200, 2026-11-26).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from _common import OtherLoad, default_threads, environment, report_other_load, write_json
from _profile import print_breakdown, profile_steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--B", type=int, default=1, help="prompts decoded together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed generations per variant (median), after one warmup")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"))
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: $OMP_NUM_THREADS or all)")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers variant")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--profile", action="store_true",
                   help="one more generation of each fastgpt variant under torch.profiler: kernels per token")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.prompt_len + args.new_tokens > args.block_size:
        p.error("--prompt-len + --new-tokens must fit in --block-size (past it every variant recomputes)")
    if min(args.B, args.prompt_len, args.new_tokens, args.repeats) < 1:
        p.error("--B, --prompt-len, --new-tokens and --repeats must be >= 1")
    return args


def timed(fn, repeats):
    fn()  # warmup: allocations, page faults, lazy initialisation
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None):
    args = parse_args(argv)
    threads = args.threads or default_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import numpy as np
    import torch

    import fastgpt
    torch.set_num_threads(threads)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}, threads {threads}")
    rng = np.random.default_rng(seed)
    config = fastgpt.GPTConfig(block_size=args.block_size, vocab_size=args.vocab, n_layer=args.n_layer,
                               n_head=args.n_head, n_embd=args.n_embd)
    model = fastgpt.GPT(config, device=args.device, precision=args.precision, seed=seed)
    prompt = rng.integers(0, args.vocab, (args.B, args.prompt_len))
    n = args.new_tokens
    load = OtherLoad()
    rows = []

    def add(name, seconds, tokens):
        rows.append({"variant": name, "seconds": seconds, "tok_s": args.B * n / seconds, "ms_per_token": 1e3 * seconds / n,
                     "tokens": np.asarray(tokens)[:, -n:]})

    for use_cache in (True, False):
        s, out = timed(lambda: model.generate(prompt, n, temperature=0.0, use_cache=use_cache), args.repeats)
        add("fastgpt, KV cache" if use_cache else "fastgpt, full recompute", s, out)
        if args.profile:  # after the timing: the profiler's overhead is in no timed run
            gpu = args.device.startswith("cuda")
            # one generation, its kernels per new token (n steps)
            rows[-1]["profile"] = profile_steps(lambda _: model.generate(prompt, n, temperature=0.0,
                                                                         use_cache=use_cache),
                                                range(1), torch.cuda.synchronize if gpu else (lambda: None),
                                                activity="CUDA" if gpu else "CPU", steps=n)
    if not args.no_torch:
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            print("transformers not installed: torch variant skipped")
        else:
            with tempfile.TemporaryDirectory() as d:
                model.save_pretrained(d)
                dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
                device = "cuda" if args.device.startswith("cuda") else "cpu"
                try:
                    hf = GPT2LMHeadModel.from_pretrained(d, dtype=dtype)
                except TypeError:  # transformers before 4.56 names it torch_dtype
                    hf = GPT2LMHeadModel.from_pretrained(d, torch_dtype=dtype)
                hf = hf.to(device).eval()
            x = torch.tensor(prompt, device=device)
            mask = torch.ones_like(x)

            def hf_generate():
                with torch.no_grad():
                    out = hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      use_cache=True, pad_token_id=0)
                return out.cpu().numpy()

            s, out = timed(hf_generate, args.repeats)
            add("torch (transformers), KV cache", s, out)
    share = load.other_share()

    base = rows[1]["seconds"]
    print(f"\nGPT-2 L{args.n_layer} H{args.n_head} C{args.n_embd} V{args.vocab}, {args.device} {args.precision}, "
          f"B {args.B}, prompt {args.prompt_len}, {n} new tokens (greedy), median of {args.repeats}")
    print(f"{'variant':34s} {'tok/s':>9s} {'ms/token':>9s} {'speed-up vs recompute':>22s} {'same tokens':>12s}")
    for r in rows:
        same = bool(np.array_equal(r["tokens"], rows[0]["tokens"]))
        print(f"{r['variant']:34s} {r['tok_s']:9.1f} {r['ms_per_token']:9.2f} {base / r['seconds']:21.2f}x "
              f"{str(same):>12s}")
    if len(rows) == 3:
        print(f"fastgpt with cache / torch with cache: {rows[2]['seconds'] / rows[0]['seconds']:.2f}x")
    if args.profile:
        prof = {r["variant"]: {"profile": r["profile"]} for r in rows if "profile" in r}
        print("\n(--profile: a step below is one new token, the prompt's forward shared out among them)")
        print_breakdown(prof, list(prof), {r["variant"]: r["ms_per_token"] for r in rows if "profile" in r})
    report_other_load(share)
    if args.json:
        write_json(args.json, {"benchmark": "generate", "args": vars(args), "seed": seed,
                               "environment": environment(threads), "other_load": share,
                               "results": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]})
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
