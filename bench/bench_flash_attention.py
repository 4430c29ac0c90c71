"""Flash attention benchmark (case `flash_attention`): fastgpt.ops.flash_attention_forward/backward against torch's
F.scaled_dot_product_attention with each of its fused backends, forward and backward timed separately.

Why: attention is the op whose cost grows with T^2, and torch's fused SDPA kernels (FlashAttention-2, memory-efficient,
cuDNN) are the bar a flash kernel has to meet. Throughput is reported in TFLOP/s as flash-attention counts it
(forward 4*B*H*T^2*d, halved when causal; backward 2.5x forward), so numbers compare with published ones.

On a GPU (torch sees one and fastgpt was built with CUDA): head dim --d 64,128 x --T 1024,2048,4096 x causal and
not, in --dtype bf16 (or fp16; or fp32: fastgpt's default "tf32x3" TF32 tensor-core kernels, the engine's fp32
attention, with rows "fastgpt tf32" (one TF32 product: the engine's tf32 attention) and "fastgpt simt" (CUDA
cores) beside it, each with its output's max difference from the default's). Shapes
follow flash-attention's own benchmark: --tokens 16384 per batch (B = 16384 / T) and model width --dim 2048 (H =
2048 / d), so every case does the same work per token and keeps an H100 busy. Inputs are fresh standard normals
(seeded, printed). Each implementation runs --warmup untimed calls, then --repeats calls timed with CUDA events; the
median is reported. torch runs under sdpa_kernel([backend]) for FLASH_ATTENTION,
EFFICIENT_ATTENTION and CUDNN_ATTENTION (a backend that refuses the case is listed as skipped), and once with no
restriction ("default", with the backend torch._fused_sdp_choice says it picks). The ratio compares fastgpt with the
fastest torch backend: torch ms / fastgpt ms, above 1 means fastgpt is faster. --deterministic adds fastgpt's
deterministic backward. --tiles adds, at d 64, a forward row for each other tile shape of the tensor-core kernels
and a deterministic backward row for each (dkdv, dq) pair (fastgpt.ops.flash_attention_tiles; the default, "auto",
is the plain rows), at d 128 a row for each choice of the Hopper ("sm90", wgmma) kernels, and prints the fastest
of each; the engine's GPT-2 attention is d 64 with this backward.
Without a GPU: one small CPU case (fp32, B 2, H 4, T 512, d 64, causal) against torch SDPA
on the CPU, reported as ratios only (absolute CPU times are not recorded in this project; see bench/README.md).

    python3 bench/bench_flash_attention.py
    python3 bench/bench_flash_attention.py --d 64 --T 2048 --deterministic --json /tmp/flash.json
    python3 bench/bench_flash_attention.py --d 64 --T 1024 --causal yes --tiles
"""
import argparse
import contextlib
import itertools
import os
import sys
import warnings

from _common import OtherLoad, cuda_median_ms, default_threads, environment, report_other_load, write_json
from bench_ops import max_diff, paired_timings

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
CPU_SHAPE = (2, 4, 512, 64)  # B, H, T, d of the CPU case


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d", type=ints, default=[64, 128], help="head dims, comma-separated (GPU)")
    p.add_argument("--T", type=ints, default=[1024, 2048, 4096], help="sequence lengths, comma-separated (GPU)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="GPU input dtype (fp32: each of fastgpt's fp32_math choices, the engine's fp32/tf32 attention)")
    p.add_argument("--tokens", type=int, default=16384, help="B*T per case: B = tokens // T (GPU)")
    p.add_argument("--dim", type=int, default=2048, help="model width H*d: H = dim // d (GPU)")
    p.add_argument("--deterministic", action="store_true", help="also time fastgpt's deterministic backward")
    p.add_argument("--tiles", action="store_true",
                   help="also time every tile shape (d 64; the sm90 kernels at d 128; implies --deterministic)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls of each implementation first")
    p.add_argument("--repeats", type=int, default=20, help="timed calls; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="CPU case: threads for fastgpt and torch")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh random)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.deterministic = args.deterministic or args.tiles
    if min(args.d + args.T + [args.tokens, args.dim, args.repeats]) < 1 or args.warmup < 0:
        p.error("sizes and --repeats must be >= 1, --warmup >= 0")
    return args


def gpu_rows(args, rows):
    """Appends the GPU rows to `rows` as they are measured, so that a caller keeps what ran before a fault."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastgpt import ops

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = torch.device("cuda", 0)
    causals = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]

    def median_ms(fn):
        return cuda_median_ms(fn, args.warmup, args.repeats)

    def run_case(d, T, causal):
        B, H = max(1, args.tokens // T), max(1, args.dim // d)
        fwd_flops = 4 * B * H * T * T * d / (2 if causal else 1)
        case = dict(op="flash_attention", d=d, T=T, B=B, H=H, causal=causal, dtype=args.dtype)
        g = torch.Generator(device=dev).manual_seed(args.seed + T * 1000 + d)
        q, k, v, dout = (torch.randn(B, H, T, d, device=dev, generator=g).to(dtype) for _ in range(4))
        qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))  # torch's side, with autograd
        fg_out = None

        def record(impl, fwd=None, bwd=None, out=None, **extra):
            r = dict(case, impl=impl, status="ok")
            r.update(extra)  # a row that could not run says so (status, error) and times nothing
            try:
                if fwd is not None:
                    r["fwd_ms"] = median_ms(fwd)
                    r["fwd_tflops"] = fwd_flops / r["fwd_ms"] / 1e9
                if bwd is not None:
                    r["bwd_ms"] = median_ms(bwd)
                    r["bwd_tflops"] = 2.5 * fwd_flops / r["bwd_ms"] / 1e9
                if out is not None and fg_out is not None:
                    r["max_abs_diff_vs_fastgpt"] = (out.float() - torch.as_tensor(fg_out).float()).abs().max().item()
            except Exception as e:  # out of memory, a kernel error: the other rows still run
                r.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            rows.append(r)
            print_row(r, flush=True)

        try:
            fg_out, fg_lse = ops.flash_attention_forward(q, k, v, causal=causal)
        except Exception as e:
            rows.append(dict(case, impl="fastgpt", status="failed", error=f"{type(e).__name__}: {e}"))
            print_row(rows[-1], flush=True)
        else:
            record("fastgpt", lambda: ops.flash_attention_forward(q, k, v, causal=causal),
                   lambda: ops.flash_attention_backward(dout, q, k, v, fg_out, fg_lse, causal=causal))
            if args.deterministic:
                record("fastgpt deterministic", None,
                       lambda: ops.flash_attention_backward(dout, q, k, v, fg_out, fg_lse, causal=causal,
                                                            deterministic=True))
            if args.dtype == "fp32":  # the other ways fastgpt multiplies float32 (ops' fp32_math)
                for math_ in ("tf32", "simt"):
                    o, l_ = ops.flash_attention_forward(q, k, v, causal=causal, fp32_math=math_)
                    record(f"fastgpt {math_}", lambda m=math_: ops.flash_attention_forward(q, k, v, causal=causal,
                                                                                          fp32_math=m),
                           lambda m=math_, o=o, l_=l_: ops.flash_attention_backward(dout, q, k, v, o, l_,
                                                                                   causal=causal, fp32_math=m),
                           out=o)
        for name in (None,) + BACKENDS:
            ctx = sdpa_kernel([getattr(SDPBackend, name)]) if name else contextlib.nullcontext()
            # A backend that cannot take the case warns why, then raises: the row says so, once.
            with ctx, warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                try:
                    th_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                except RuntimeError as e:
                    rows.append(dict(case, impl=f"torch {name}", status="skipped", error=str(e).splitlines()[0]))
                    print_row(rows[-1], flush=True)
                    continue
                extra = {}
                if name is None:
                    try:
                        extra["backend_picked"] = SDPBackend(torch._fused_sdp_choice(qt, kt, vt,
                                                                                     is_causal=causal)).name
                    except Exception:  # a private function: it may change
                        extra["backend_picked"] = "?"
                record(f"torch {name or 'default'}",
                       lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                       lambda: torch.autograd.grad(th_out, (qt, kt, vt), dout, retain_graph=True),
                       th_out.detach(), **extra)
        # The tensor-core kernels' other shapes last, after torch's rows: a fault in a kernel never run before (an
        # sm90 one) leaves the CUDA context unusable, and what ran by then must be on record.
        if fg_out is not None and args.tiles and args.dtype != "fp32":
            tile_rows(record, q, k, v, dout, causal, d)
        summarize(rows, case)

    for d in args.d:
        for T in args.T:
            for causal in causals:
                run_case(d, T, causal)
                torch.cuda.empty_cache()  # the case's tensors are gone with run_case's locals


# The dkdv options that make dq in the same kernel (dq's is unused).
FUSED = ("sm90 fused", "sm90 ws fused", "sm90 ws fused 128x128", "sm90 ws fused persistent",
         "sm90 ws fused 128x128 persistent")


def tile_rows(record, q, k, v, dout, causal, d):
    """fastgpt's tile shapes one by one (the plain rows run the default, "auto": the Hopper kernels on an H100/H200):
    a forward row per fwd kernel option (with its output's largest difference from the default's), a deterministic
    backward row per (dkdv, dq) pair (its forward from the default tiles: every option reads the same out and lse;
    dkdv "sm90 fused" and "sm90 ws fused ..." make dq themselves: one row each, with dq's first option), the other
    kernel at its first option (the mma.sync 16x64), the default put back. At d 128 only the first options and the
    Hopper ("sm90") kernels: d 128 has no other mma.sync shapes. An sm90 option this GPU or build cannot run is a
    skipped row."""
    from fastgpt import ops

    options = ops.flash_attention_tile_options()
    first = dict(fwd=options["fwd"][0], dkdv=options["dkdv"][0], dq=options["dq"][0])  # "auto"
    kernels = {kernel: [n for n in names if n != "auto"] for kernel, names in options.items()}
    base = {kernel: names[0] for kernel, names in kernels.items()}
    out, lse = ops.flash_attention_forward(q, k, v, causal=causal)

    def applies(tiles):  # at d 128 every kernel at its first option or an sm90 one
        return d == 64 or all(name == base[k] or name.startswith("sm90") for k, name in tiles.items())

    def choose(name, tiles):
        try:
            ops.flash_attention_tiles(**tiles)
            return True
        except ValueError as e:  # not an sm_90 GPU, or a build without sm_90a code
            record(name, tiles="/".join(tiles.values()), status="skipped", error=str(e))
            return False

    def hopper(*names):  # run last: the sm90 kernels have the least GPU time behind them
        return any(n.startswith("sm90") for n in names)

    try:
        for fwd in sorted(kernels["fwd"], key=hopper):
            name = f"fastgpt tiles fwd {fwd}"
            if applies(dict(base, fwd=fwd)) and choose(name, dict(base, fwd=fwd)):
                o, _ = ops.flash_attention_forward(q, k, v, causal=causal)
                record(name, lambda: ops.flash_attention_forward(q, k, v, causal=causal), out=o, tiles=fwd)
        for dkdv, dq in sorted(itertools.product(kernels["dkdv"], kernels["dq"]), key=lambda p: hopper(*p)):
            tiles, name = dict(base, dkdv=dkdv, dq=dq), f"fastgpt tiles bwd {dkdv}/{dq}"
            if not applies(tiles) or (dkdv in FUSED and dq != base["dq"]):
                continue  # fused ignores dq
            if choose(name, tiles):
                record(name, None, lambda: ops.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                        deterministic=True), tiles=f"{dkdv}/{dq}")
    finally:
        ops.flash_attention_tiles(**first)


def summarize(rows, case):
    """The ratio line of one case: fastgpt against the fastest torch backend (by forward + backward time)."""
    same = [r for r in rows if all(r.get(k) == case[k] for k in case) and r["status"] == "ok"]
    fg = next((r for r in same if r["impl"] == "fastgpt"), None)
    th = [r for r in same if r["impl"].startswith("torch ") and r["impl"] != "torch default"]
    if fg is None or not th:
        return
    best = min(th, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
    fg["vs"] = best["impl"]
    fg["fwd_ratio"], fg["bwd_ratio"] = best["fwd_ms"] / fg["fwd_ms"], best["bwd_ms"] / fg["bwd_ms"]
    print(f"  d{case['d']} T{case['T']} {'causal' if case['causal'] else 'full'}: fastgpt "
          f"{fg['fwd_tflops']:.0f}/{fg['bwd_tflops']:.0f} TFLOP/s fwd/bwd; vs fastest torch ({best['impl'][6:]}): "
          f"fwd {fg['fwd_ratio']:.2f}x, bwd {fg['bwd_ratio']:.2f}x (torch ms / fastgpt ms; above 1: fastgpt is "
          f"faster)", flush=True)
    fwd = [r for r in same if r["impl"] == "fastgpt" or r["impl"].startswith("fastgpt tiles fwd")]
    bwd = [r for r in same if r["impl"] == "fastgpt deterministic" or r["impl"].startswith("fastgpt tiles bwd")]
    if len(fwd) > 1:
        f = min(fwd, key=lambda r: r["fwd_ms"])
        print(f"  tiles: fastest forward {f.get('tiles', 'default')} ({f['fwd_tflops']:.0f} TFLOP/s, "
              f"{fg['fwd_ms'] / f['fwd_ms']:.2f}x the default)", flush=True)
    if len(bwd) > 1:
        b = min(bwd, key=lambda r: r["bwd_ms"])
        print(f"  tiles: fastest deterministic backward dkdv/dq {b.get('tiles', 'default')} ({b['bwd_tflops']:.0f} "
              f"TFLOP/s, {bwd[0]['bwd_ms'] / b['bwd_ms']:.2f}x the default)", flush=True)


HEADER = (f"{'d':>4} {'T':>5} {'B':>3} {'H':>3} {'causal':>6}  {'impl':<33} {'fwd ms':>8} {'TFLOP/s':>8} "
          f"{'bwd ms':>8} {'TFLOP/s':>8} {'max|diff|':>10}")


def print_row(r, flush=False):
    def num(key, fmt):
        return format(r[key], fmt) if key in r else format("-", ">" + fmt.split(".")[0])
    head = f"{r['d']:>4} {r['T']:>5} {r['B']:>3} {r['H']:>3} {'yes' if r['causal'] else 'no':>6}  "
    impl = r["impl"] + (f" ({r['backend_picked']})" if "backend_picked" in r else "")
    if r["status"] != "ok":
        print(f"{head}{impl:<33} {r['status'].upper()}: {r.get('error', '')[:90]}", flush=flush)
        return
    print(f"{head}{impl:<33} {num('fwd_ms', '8.3f')} {num('fwd_tflops', '8.1f')} {num('bwd_ms', '8.3f')} "
          f"{num('bwd_tflops', '8.1f')} {num('max_abs_diff_vs_fastgpt', '10.2e')}", flush=flush)


def cpu_rows(args):
    """The CPU case: fastgpt on NumPy float32 against torch SDPA on CPU tensors (fwd with autograd recording, bwd as
    torch.autograd.grad on a saved forward, as in bench_ops.py), calls alternating; only ratios are printed."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from fastgpt import ops

    B, H, T, d = CPU_SHAPE
    rng = np.random.default_rng(args.seed)
    q, k, v, dout = (rng.standard_normal((B, H, T, d)).astype(np.float32) for _ in range(4))
    out, lse = ops.flash_attention_forward(q, k, v)
    qt, kt, vt = (torch.from_numpy(x.copy()).requires_grad_(True) for x in (q, k, v))
    dout_t = torch.from_numpy(dout)

    def th_fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    th_out = th_fwd()
    rows = []
    for pas, fg, th in (("fwd", lambda: ops.flash_attention_forward(q, k, v)[0], th_fwd),
                        ("bwd", lambda: ops.flash_attention_backward(dout, q, k, v, out, lse),
                         lambda: torch.autograd.grad(th_out, (qt, kt, vt), dout_t, retain_graph=True))):
        diff = max_diff(fg(), th())
        (fg_ms, _), (th_ms, _) = paired_timings(fg, th, args.warmup, args.repeats)
        rows.append(dict(op="flash_attention", device="cpu", B=B, H=H, T=T, d=d, causal=True, dtype="fp32",
                         **{"pass": pas}, ratio=th_ms / fg_ms, max_abs_diff=diff))
        print(f"flash_attention {pas}  B{B} H{H} T{T} d{d} causal fp32   torch/fastgpt {th_ms / fg_ms:5.2f}x   "
              f"max|diff| {diff:.2e}", flush=True)
    print("ratio = torch time / fastgpt time, same process and threads, calls alternating: above 1 means fastgpt "
          "is faster. CPU absolute times are not reported.")
    return rows


def main(argv=None):
    args = parse_args(argv)
    threads = args.threads or default_threads()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before either library starts its thread pool
    import torch

    import fastgpt
    torch.set_num_threads(threads)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    on_gpu = torch.cuda.is_available() and fastgpt.cuda_available()
    env = environment(threads)
    rows = []
    try:
        _run(args, threads, on_gpu, env, rows, torch, fastgpt)
    finally:  # a kernel that faults ends the run: the rows measured before it are written all the same
        if args.json:
            config = {k: getattr(args, k) for k in ("d", "T", "causal", "dtype", "tokens", "dim", "deterministic",
                                                    "tiles", "warmup", "repeats", "seed")}
            write_json(args.json, {"benchmark": "bench_flash_attention", "case": "flash_attention", "device":
                                   "cuda" if on_gpu else "cpu", "env": env, "config": config, "results": rows})
    return 0


def _run(args, threads, on_gpu, env, rows, torch, fastgpt):
    if on_gpu:
        env.update(gpu=torch.cuda.get_device_name(0), cuda_torch=torch.version.cuda)
        print(f"bench_flash_attention: {env['gpu']} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
              f"fastgpt {fastgpt.__version__} | {args.dtype}, B = {args.tokens} // T, H = {args.dim} // d | "
              f"warmup {args.warmup}, median of {args.repeats} | seed {args.seed}")
        print("TFLOP/s as flash-attention counts: fwd 4*B*H*T^2*d (causal: half), bwd 2.5x fwd. max|diff|: torch "
              "output vs fastgpt's")
        print(HEADER)
        print("-" * len(HEADER))
        # All on one dedicated stream (events, fastgpt and torch alike): fastgpt.ops hands torch's current stream
        # to DLPack, and torch refuses __dlpack__(stream=0), the handle of the legacy default stream.
        with torch.cuda.stream(torch.cuda.Stream()):
            gpu_rows(args, rows)
    else:
        why = "no CUDA GPU visible to torch" if not torch.cuda.is_available() else "fastgpt built without CUDA"
        print(f"bench_flash_attention: {why}; running the CPU case only | threads {threads} | "
              f"warmup {args.warmup}, median of {args.repeats} | seed {args.seed}")
        print(f"torch {env['torch']}, fastgpt {env['fastgpt']}, {env['host_cpu']}, load average "
              f"{env['loadavg_1m']:.2f}")
        busy = OtherLoad()
        rows.extend(cpu_rows(args))
        env["other_cpu_share"] = busy.other_share()
        report_other_load(env["other_cpu_share"])


if __name__ == "__main__":
    sys.exit(main())
