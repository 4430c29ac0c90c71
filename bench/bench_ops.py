"""Per-op CPU benchmark: every kernel in fastgpt.ops, forward and backward, against the same computation in PyTorch.

Why: the training step is only as fast as its slowest kernel; timing each op on its own, beside PyTorch on the same
machine in the same process with the same thread count, shows where fastgpt stands and which op to work on next.
Shapes come from a small GPT-2 config (B 8, T 128, C 128, 4 heads, vocab 50304; flags change them). Inputs are
fresh random non-zero arrays each run (the seed is printed). This is a benchmark, not a test: it asserts nothing;
the max |fastgpt - torch| column is only there to show both sides computed the same thing.

    python3 bench/bench_ops.py                  # all cases
    python3 bench/bench_ops.py --case matmul --json /tmp/ops.json
    python3 bench/bench_ops.py --device cuda --case layernorm --B 16 --T 1024 --C 768   # on a GPU, bf16

On a GPU (--device cuda, with --dtype) the embedding, LayerNorm, matmul and cross-entropy cases run; the other ops have
their GPU benchmarks in bench_gpu_train.py (--profile: each kernel's time in the training step) and
bench_flash_attention.py. There the embedding's backward gets a second row, "bwd hot", with 12% of the ids one id
(as "\n" in Tiny Shakespeare): the sum over that token's rows is one long run.
There the LayerNorm forward and backward get second rows, "fwd2" and "bwd2": fastgpt's older kernels, which read a
row again for each pass (ops.layernorm_one_pass(False)), against the same torch calls, so one run shows what reading
each row once saves. Cross-entropy gets an "fb" row: the training step's kernel (the loss and its gradient from two
reads of the logits) against torch's forward and backward; its "fwd" and "fb" rows read the mean loss back on both
sides (fastgpt's ops return it as a float: one host sync per call on each side). The matmul case (GPT-2's linear
layers; --linears picks them) gets "fwd tuned" and "bwd tuned" rows: fastgpt with each product's cuBLASLt algorithm
timed at its first run (ops.matmul_autotune(True); the first call, before the timing, makes the decisions), and a
line summing the chosen algorithms' times against the heuristic's; the layers with a bias also a "bwd epilogue" row:
the bias gradient from cuBLASLt's epilogue of the weight gradient's product (ops.matmul_bias_grad_epilogue(True))
instead of the column-sum kernel, the default.
"""
import argparse
import os
import statistics
import sys
import time

from _common import OtherLoad, autotune_summary, default_threads, environment, report_other_load, write_json

CASES = ("embedding", "layernorm", "residual_layernorm", "matmul", "matmul_gelu", "attention", "gelu", "cross_entropy",
         "adamw")
GPU_CASES = ("embedding", "layernorm", "residual_layernorm", "matmul", "cross_entropy")
LINEARS = ("attn", "attn_proj", "fc", "fc_proj", "lm_head")  # every distinct nn.Linear shape of GPT-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", choices=CASES, help="run one case (default: all)")
    p.add_argument("--B", type=int, default=8, help="batch size")
    p.add_argument("--T", type=int, default=128, help="sequence length")
    p.add_argument("--C", type=int, default=128, help="embedding width n_embd")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4, help="only sizes the adamw case (parameter count)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--linears", default=",".join(LINEARS),
                   help=f"matmul shapes to time, comma-separated from {','.join(LINEARS)}")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each side before timing")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed calls of each side, alternating; the median is reported")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both fastgpt (OpenMP) and torch (default: $OMP_NUM_THREADS or os.cpu_count())")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh random)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the embedding, LayerNorm, matmul and cross-entropy cases on the GPU (CUDA events)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="storage type of both sides (default: fp32 on the CPU, bf16 on a GPU; the CPU takes fp32 only)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.device == "cpu" and args.dtype != "fp32":
        p.error("--dtype bf16/fp16 needs --device cuda (the CPU cases compare float32)")
    if args.device == "cuda" and args.case not in GPU_CASES:
        p.error(f"--device cuda runs --case {' or '.join(GPU_CASES)} (the other ops' GPU benchmarks are "
                "bench_gpu_train.py --profile and bench_flash_attention.py)")
    args.linears = [s.strip() for s in args.linears.split(",") if s.strip()]
    bad = [s for s in args.linears if s not in LINEARS]
    if bad:
        p.error(f"unknown --linears {bad}; choose from {LINEARS}")
    if args.C % args.n_head:
        p.error(f"--C ({args.C}) must be a multiple of --n-head ({args.n_head})")
    if min(args.B, args.T, args.C, args.n_head, args.vocab, args.repeats) < 1 or args.warmup < 0:
        p.error("sizes and --repeats must be >= 1, --warmup >= 0")
    return args


def host_ms(fn):
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def cuda_ms(fn, inner=20):
    """ms per call from CUDA events around `inner` back-to-back calls: a kernel of tens of microseconds is not lost in
    the host's launch and synchronisation."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / inner


def paired_timings(fg, th, warmup, repeats, clock=host_ms):
    """[(median ms, min ms) of fg, (median ms, min ms) of th]. The calls alternate (fg, th, fg, th, ...) so that both
    sides see the same load when the machine is shared; warm-up calls of each come first and are not timed."""
    for _ in range(warmup):
        fg()
        th()
    times = ([], [])
    for _ in range(repeats):
        for fn, out in ((fg, times[0]), (th, times[1])):
            out.append(clock(fn))
    return [(statistics.median(t), min(t)) for t in times]


def max_diff(a, b):
    import numpy as np
    import torch
    if isinstance(a, (tuple, list)):
        return max(max_diff(x, y) for x, y in zip(a, b))
    wide = lambda t: t.detach().double().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)
    a, b = wide(a), wide(b)
    return float(np.max(np.abs(a - b))) if b.size else 0.0


def run_cases(args):
    import numpy as np
    import torch
    import torch.nn.functional as F

    from fastgpt import ops

    rng = np.random.default_rng(args.seed)
    B, T, C, NH, V = args.B, args.T, args.C, args.n_head, args.vocab
    N = B * T
    gpu = args.device == "cuda"
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    clock = cuda_ms if gpu else host_ms

    def randn(*shape, scale=1.0):  # NumPy float32 on the CPU; a torch tensor of --dtype on a GPU
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        a[a == 0] = 1e-3  # non-zero everywhere
        return torch.from_numpy(a).to("cuda", tdt) if gpu else a

    def ids(*shape):
        return rng.integers(0, V, size=shape, dtype=np.int64)

    def tt(a):  # a leaf torch tensor with a's values (its own copy: nothing shares memory across the two sides)
        return (a.clone() if gpu else torch.from_numpy(a.copy())).requires_grad_(True)

    def dt(a):  # a torch tensor of a's values, for a torch-side gradient
        return a.clone() if gpu else torch.from_numpy(a)

    rows = []

    def bench(op, shape, fg_fwd, fg_bwd, th_fwd, th_bwd, passes=("fwd", "bwd")):
        """fg_*/th_* are zero-argument callables returning their outputs; *_bwd reuse a saved forward."""
        for pas, fg, th in zip(passes, (fg_fwd, fg_bwd), (th_fwd, th_bwd)):
            if fg is None:
                continue
            diff = max_diff(fg(), th())
            (fg_ms, fg_min), (th_ms, th_min) = paired_timings(fg, th, args.warmup, args.repeats, clock)
            rows.append(dict(op=op, shape=shape, **{"pass": pas}, fastgpt_ms=fg_ms, torch_ms=th_ms,
                             ratio=th_ms / fg_ms, max_abs_diff=diff, fastgpt_min_ms=fg_min, torch_min_ms=th_min))
            print_row(rows[-1], flush=True)

    selected = [args.case] if args.case else list(CASES)
    print_header()

    if "embedding" in selected:
        wte, wpe, dout = randn(V, C, scale=0.02), randn(T, C, scale=0.02), randn(B, T, C)
        wte_t, wpe_t, dout_t = tt(wte), tt(wpe), dt(dout)
        pos_t = torch.arange(T, device="cuda" if gpu else "cpu")
        # Random ids, then (a GPU's "bwd hot" row) 12% of them one id, as "\n" is in Tiny Shakespeare: the
        # backward's sum over a token's rows is a run of about 0.12 B T rows for that id.
        for pas, hot in (("", 0.0),) + ((("hot", 0.12),) if gpu else ()):
            idx = ids(B, T)
            if hot:
                idx[rng.random((B, T)) < hot] = V // 3
            idx_t = torch.from_numpy(idx).to(pos_t.device)
            idx_fg = idx_t.int() if gpu else idx  # int32 already: fastgpt's calls time no conversion of the ids

            def th_fwd():
                return F.embedding(idx_t, wte_t) + F.embedding(pos_t, wpe_t)
            th_out = th_fwd()
            bench("embedding", f"idx({B},{T}) wte({V},{C})",
                  None if pas else (lambda: ops.embedding_forward(idx_fg, wte, wpe)),
                  lambda: ops.embedding_backward(dout, idx_fg, V, T),
                  th_fwd,
                  lambda: torch.autograd.grad(th_out, (wte_t, wpe_t), dout_t, retain_graph=True),
                  passes=("fwd", "bwd " + pas if pas else "bwd"))

    def switched(setting, value):  # fn with one of fastgpt.ops' process-wide GPU switches set, then put back
        def wrap(fn):
            def run():
                before = setting(value)
                try:
                    return fn()
                finally:
                    setting(before)
            return run
        return wrap
    # On a GPU: fastgpt's LayerNorm kernels that read a row again ("fwd2"/"bwd2" rows), its products with
    # matmul autotune ("fwd tuned"/"bwd tuned"), and its bias gradients from cuBLASLt's epilogue ("bwd epilogue").
    rereading, tuned = switched(ops.layernorm_one_pass, False), switched(ops.matmul_autotune, True)
    bias_epilogue = switched(ops.matmul_bias_grad_epilogue, True)

    if "layernorm" in selected:
        x, w, b, dout = randn(B, T, C), randn(C), randn(C), randn(B, T, C)
        _, mean, rstd = ops.layernorm_forward(x, w, b)
        x_t, w_t, b_t, dout_t = tt(x), tt(w), tt(b), dt(dout)

        def th_fwd():
            return F.layer_norm(x_t, (C,), w_t, b_t, 1e-5)
        th_out = th_fwd()
        fg_bwd = lambda: ops.layernorm_backward(dout, x, w, mean, rstd)
        th_bwd = lambda: torch.autograd.grad(th_out, (x_t, w_t, b_t), dout_t, retain_graph=True)
        fg_fwd = lambda: ops.layernorm_forward(x, w, b)[0]
        bench("layernorm", f"x({B},{T},{C})", fg_fwd, fg_bwd, th_fwd, th_bwd)
        if gpu:
            bench("layernorm", f"x({B},{T},{C})", rereading(fg_fwd), rereading(fg_bwd), th_fwd, th_bwd,
                  passes=("fwd2", "bwd2"))

    if "residual_layernorm" in selected:  # the fused model's skip connection: the add and the LayerNorm after it
        a, b, w, bias, dout = randn(B, T, C), randn(B, T, C), randn(C), randn(C), randn(B, T, C)
        res, _, mean, rstd = ops.residual_layernorm_forward(a, b, w, bias)
        a_t, b_t, w_t, bias_t, dout_t = tt(a), tt(b), tt(w), tt(bias), dt(dout)

        def th_fwd():
            return F.layer_norm(a_t + b_t, (C,), w_t, bias_t, 1e-5)
        th_out = th_fwd()
        fg_bwd = lambda: ops.layernorm_backward(dout, res, w, mean, rstd)  # the fused op's backward
        th_bwd = lambda: torch.autograd.grad(th_out, (a_t, w_t, bias_t), dout_t, retain_graph=True)  # b's = a's
        fg_fwd = lambda: ops.residual_layernorm_forward(a, b, w, bias)[1]
        bench("residual_layernorm", f"a,b({B},{T},{C})", fg_fwd, fg_bwd, th_fwd, th_bwd)
        if gpu:
            bench("residual_layernorm", f"a,b({B},{T},{C})", rereading(fg_fwd), rereading(fg_bwd), th_fwd, th_bwd,
                  passes=("fwd2", "bwd2"))

    if "matmul" in selected:
        shapes = {"attn": (C, 3 * C, True), "attn_proj": (C, C, True), "fc": (C, 4 * C, True),
                  "fc_proj": (4 * C, C, True), "lm_head": (C, V, False)}
        tuned0 = len(ops.matmul_autotune_report()) if gpu else 0
        for name in args.linears:
            cin, cout, has_bias = shapes[name]
            x, w = randn(B, T, cin), randn(cout, cin, scale=0.02)
            bias = randn(cout, scale=0.02) if has_bias else None
            dout = randn(B, T, cout)
            x_t, w_t, dout_t = tt(x), tt(w), dt(dout)
            b_t = tt(bias) if has_bias else None
            inputs_t = (x_t, w_t, b_t) if has_bias else (x_t, w_t)

            def th_fwd(x_t=x_t, w_t=w_t, b_t=b_t):
                return F.linear(x_t, w_t, b_t)
            th_out = th_fwd()
            shape = f"{name}: ({N},{cin})@({cout},{cin})^T" + ("+b" if has_bias else "")
            fg_fwd = lambda x=x, w=w, bias=bias: ops.matmul_forward(x, w, bias)
            fg_bwd = lambda dout=dout, x=x, w=w, hb=has_bias: [g for g in ops.matmul_backward(dout, x, w, hb)
                                                               if g is not None]
            th_bwd = lambda th_out=th_out, inputs_t=inputs_t, dout_t=dout_t: torch.autograd.grad(
                th_out, inputs_t, dout_t, retain_graph=True)
            bench("matmul", shape, fg_fwd, fg_bwd, th_fwd, th_bwd)
            if gpu:
                bench("matmul", shape, tuned(fg_fwd), tuned(fg_bwd), th_fwd, th_bwd, passes=("fwd tuned", "bwd tuned"))
                if has_bias:
                    bench("matmul", shape, None, bias_epilogue(fg_bwd), th_fwd, th_bwd, passes=("", "bwd epilogue"))
        if gpu:
            t = autotune_summary(ops.matmul_autotune_report()[tuned0:])
            print(f"matmul autotune: {t['problems']} problems, {t['timed']} timed, {t['changed']} changed; one run of "
                  f"each: heuristic {t['heuristic_ms']:.3f} ms, chosen {t['chosen_ms']:.3f} ms "
                  f"({100 * t['saved']:.1f}% less)", flush=True)
            rows[-1]["matmul_autotune"] = t  # the decisions, with the case's last row

    if "attention" in selected:
        qkv, dout = randn(B, T, 3 * C), randn(B, T, C)
        out, lse = ops.attention_forward(qkv, NH)
        qkv_t, dout_t = tt(qkv), torch.from_numpy(dout)
        hs = C // NH

        def th_fwd():
            q, k, v = qkv_t.split(C, dim=2)
            q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return y.transpose(1, 2).contiguous().view(B, T, C)
        th_out = th_fwd()
        bench("attention", f"qkv({B},{T},{3 * C}) heads {NH} causal",
              lambda: ops.attention_forward(qkv, NH)[0],
              lambda: ops.attention_backward(dout, qkv, out, lse, NH),
              th_fwd,
              lambda: torch.autograd.grad(th_out, qkv_t, dout_t, retain_graph=True)[0])

    if "matmul_gelu" in selected:  # the fused model's MLP: fc + GELU forward, fc_proj's backward through the GELU
        x, w1, b1 = randn(B, T, C), randn(4 * C, C, scale=0.02), randn(4 * C)
        w2, b2, dy = randn(C, 4 * C, scale=0.02), randn(C), randn(B, T, C)
        h, pre = ops.matmul_forward_gelu(x, w1, b1)
        x_t, w1_t, b1_t, w2_t, b2_t = tt(x), tt(w1), tt(b1), tt(w2), tt(b2)
        pre_t, dy_t = tt(pre), torch.from_numpy(dy)

        def th_fwd():
            return F.gelu(F.linear(x_t, w1_t, b1_t), approximate="tanh")
        th_y = F.linear(F.gelu(pre_t, approximate="tanh"), w2_t, b2_t)
        bench("matmul_gelu", f"fc x({B},{T},{C}) | fc_proj dy",
              lambda: ops.matmul_forward_gelu(x, w1, b1)[0],
              lambda: ops.matmul_backward_dgelu(dy, h, w2, pre),
              th_fwd,
              lambda: torch.autograd.grad(th_y, (pre_t, w2_t, b2_t), dy_t, retain_graph=True))

    if "gelu" in selected:
        x, dout = randn(B, T, 4 * C), randn(B, T, 4 * C)
        x_t, dout_t = tt(x), torch.from_numpy(dout)

        def th_fwd():
            return F.gelu(x_t, approximate="tanh")
        th_out = th_fwd()
        bench("gelu", f"x({B},{T},{4 * C}) tanh",
              lambda: ops.gelu_forward(x),
              lambda: ops.gelu_backward(dout, x),
              th_fwd,
              lambda: torch.autograd.grad(th_out, x_t, dout_t, retain_graph=True)[0])

    if "cross_entropy" in selected:
        logits, targets = randn(N, V), ids(N)
        targets_t = torch.from_numpy(targets).to(args.device)
        if gpu:
            targets = targets_t
        _, _, lse = ops.cross_entropy_forward(logits, targets)
        logits_t = tt(logits)

        def th_fwd():
            return F.cross_entropy(logits_t, targets_t)
        th_out = th_fwd()
        shape = f"logits({N},{V}) mean"
        bench("cross_entropy", shape,
              lambda: ops.cross_entropy_forward(logits, targets)[0],
              lambda: ops.cross_entropy_backward(logits, targets, lse),
              lambda: th_fwd().item(),
              lambda: torch.autograd.grad(th_out, logits_t, retain_graph=True)[0])
        if gpu:  # the training step's classifier: loss and gradient together

            def th_fb():
                loss = F.cross_entropy(logits_t, targets_t)
                return loss.item(), torch.autograd.grad(loss, logits_t)[0]
            bench("cross_entropy", shape, lambda: ops.cross_entropy_forward_backward(logits, targets)[::2], None,
                  th_fb, None, passes=("fb",))

    if "adamw" in selected:
        L = args.n_layer
        n = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C  # the parameter count of that GPT-2 config
        hp = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        p0, g = randn(n, scale=0.02), randn(n, scale=1e-2)
        param, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        p_t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        p_t.grad = torch.from_numpy(g.copy())
        opt = torch.optim.AdamW([p_t], **hp)  # foreach=None: torch's default implementation for this device
        state = {"step": 0}

        def fg_step():
            state["step"] += 1
            ops.adamw_update(param, g, m, v, state["step"], **hp)
            return param

        def th_step():
            opt.step()
            return p_t
        bench("adamw", f"flat param {n:,} (L{L} C{C} V{V}) wd 0.1", fg_step, None, th_step, None,
              passes=("step",))
        rows[-1]["note"] = "max_abs_diff is after the first update (both from the same param, grad)"
    return rows


HEADER = (f"{'op':<18} {'pass':<9} {'shape':<42} {'fastgpt ms':>11} {'torch ms':>10} {'torch/fastgpt':>14} "
          f"{'max|diff|':>10}")


def print_header():
    print(HEADER)
    print("-" * len(HEADER))


def print_row(r, flush=False):
    print(f"{r['op']:<18} {r['pass']:<9} {r['shape']:<42} {r['fastgpt_ms']:>11.3f} {r['torch_ms']:>10.3f} "
          f"{r['ratio']:>13.2f}x {r['max_abs_diff']:>10.2e}", flush=flush)


def main(argv=None):
    args = parse_args(argv)
    threads = args.threads or default_threads()
    # Before importing either library, so fastgpt's OpenMP runtime and torch start with the same count.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    torch.set_num_threads(threads)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    env = environment(threads)
    print(f"bench_ops: B={args.B} T={args.T} C={args.C} n_head={args.n_head} vocab={args.vocab} | "
          f"threads {threads} (torch {torch.get_num_threads()}) | warmup {args.warmup}, median of {args.repeats} | "
          f"seed {args.seed}")
    print(f"torch {env['torch']}, fastgpt {env['fastgpt']}, {env['host_cpu']}, load average {env['loadavg_1m']:.2f}")
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        print(f"device cuda ({env['gpu']}), {args.dtype}; each timing is CUDA events around 20 calls")
    busy = OtherLoad()
    rows = run_cases(args)
    print("ratio = torch ms / fastgpt ms: above 1 means fastgpt is faster.")
    env["other_cpu_share"] = busy.other_share()
    report_other_load(env["other_cpu_share"])
    if args.json:
        payload = {"benchmark": "bench_ops", "env": env,
                   "config": {k: getattr(args, k) for k in ("B", "T", "C", "n_head", "n_layer", "vocab", "linears",
                                                            "warmup", "repeats", "seed", "device", "dtype")},
                   "results": rows}
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
