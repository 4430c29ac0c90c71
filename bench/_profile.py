"""Where a training step's GPU time goes: a few steps under torch.profiler, the GPU kernels (and copies, memsets) read
back from its Chrome trace, summed per kernel and per group of ops (matmul, attention, layernorm, ...), per step.

Why: a whole-step tok/s says how far fastgpt is from torch compiled, not which kernel to work on. CUPTI, under
torch.profiler, records every kernel of the process, fastgpt's own launches and CUDA-graph replays included, so both
sides are broken down alike in the same run. The trace's "kernel", "gpu_memcpy" and "gpu_memset" events are used
(the Chrome trace is the profiler's stable output across torch versions). Kernel time only: the gap to the step's
wall time is the GPU idling (host work, launches, syncs), which gaps() finds in the trace by the ops around it."""
import json
import os
import re
import tempfile

# First match wins, on the lower-cased kernel name; torch.compile's Triton kernels carry the ops they fuse in their
# names ("triton_per_fused_native_layer_norm_..."), cuBLAS/cuBLASLt's GEMMs are "sm90_xmma_gemm_...", "nvjet_...",
# "cutlass...", flash-attention's and cuDNN's attention "flash_...", "fmha...", "..._sdpa_..." (cuDNN's backward also
# runs cudnn::fusion's compute_dot_do_o before and convert_dq_to_16bits after: 2.4 ms of torch's step in the ninth
# run, filed under other and copy/fill before); fastgpt's elementwise kernels are map_kernel<type, functor> (Add,
# Gelu, GeluGrad).
GROUPS = (
    ("attention", r"flash|fmha|attention|sdpa|attn|dkdv|dq_kernel|delta_kernel|dot_do_o|convert_dq"),
    ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|gemv|splitk|matmul|bias|epilogue"),
    ("layernorm", r"layer_?norm"),
    ("cross-entropy", r"cross_entropy|softmax|nll|log_softmax"),
    ("gelu", r"gelu|tanh"),
    ("residual", r"residual|cuda::add\b|add_kernel|triton_poi_fused_add"),
    ("optimizer", r"adam|multi_tensor|foreach|sum_squares|sum_in_order|scale_kernel|norm|loss|clip|lerp|sqrt"),
    ("embedding", r"encoder|embedding|index|gather|scatter"),
    ("copy/fill", r"memcpy|memset|copy|cast|fill|convert|narrow|widen|elementwise_kernel"),
)
GROUP_NAMES = tuple(g for g, _ in GROUPS) + ("other",)
_PATTERNS = [(g, re.compile(p)) for g, p in GROUPS]


def group_of(name):
    """The op group of a GPU kernel (or copy) name."""
    low = name.lower()
    return next((g for g, pat in _PATTERNS if pat.search(low)), "other")


PRINTED = 15  # kernels a variant's table lists; its JSON `top` keeps 60 (a group's small kernels: a LayerNorm combine)
GAPS_PRINTED = 10  # pairs of ops around the GPU's idle gaps a variant's table lists; its JSON keeps 20


def breakdown(trace_events, steps, top=60):
    """GPU events of a Chrome trace ({"cat", "name", "dur" in us}) -> per-step sums: {"kernel_ms": total,
    "groups": {group: ms}, "top": [{"name", "group", "ms", "calls"}, ...] (the `top` largest by time)}."""
    per_name = {}
    for e in trace_events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        ms, calls = per_name.get(e["name"], (0.0, 0))
        per_name[e["name"]] = (ms + float(e["dur"]) / 1e3, calls + 1)
    groups = dict.fromkeys(GROUP_NAMES, 0.0)
    rows = []
    for name, (ms, calls) in per_name.items():
        g = group_of(name)
        groups[g] += ms / steps
        rows.append({"name": name, "group": g, "ms": ms / steps, "calls": calls / steps})
    rows.sort(key=lambda r: -r["ms"])
    return {"kernel_ms": sum(groups.values()), "groups": groups, "top": rows[:top], "kernels": len(rows),
            "gaps": gaps(trace_events, steps)}


def gaps(trace_events, steps, top=20):
    """Where the GPU idles: the GPU events ({"ts", "dur"} in us) in time order, each one's gap being how long the
    GPU had nothing running before it started (after the latest end so far: events that overlap leave none), summed
    per step by the pair of ops around it (the one whose end opened the gap, the one that closed it) ->
    {"idle_ms": all gaps per step, "events": GPU events per step, "top": [{"before", "after", "ms", "count"} per
    step, ...] (the `top` largest pairs)}. The gaps between the profiled steps (the host's sync and launch) are in it
    too, as the pair that ends one step and starts the next. Why: the step's wall time less its kernels' (the table's
    "idle", 0.4 to 5 ms a graph step in the H100/H200 runs) says how much, not where: launch gaps between a graph's
    nodes, memsets (130 a step of 0.76 us each in the seventh run) and waits show up here by name."""
    events = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in trace_events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e and "ts" in e)
    pairs, total, end, before = {}, 0.0, None, None
    for ts, dur, name in events:
        if end is not None and ts > end:
            key = (before, name)
            ms, count = pairs.get(key, (0.0, 0))
            pairs[key] = (ms + (ts - end) / 1e3, count + 1)
            total += (ts - end) / 1e3
        if end is None or ts + dur >= end:
            end, before = ts + dur, name
    rows = [{"before": b, "after": a, "ms": ms / steps, "count": n / steps} for (b, a), (ms, n) in pairs.items()]
    rows.sort(key=lambda r: -r["ms"])
    return {"idle_ms": total / steps, "events": len(events) / steps, "top": rows[:top]}


def profile_steps(step, indices, sync, activity="CUDA", steps=None):
    """Runs step(i) for each i under torch.profiler (`activity`: a ProfilerActivity name), after sync();
    -> breakdown() per step. steps: how many steps those calls make in all (a generation's new tokens), by default
    one a call."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for i in indices:
            step(i)
        sync()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.remove(path)
    return breakdown(trace.get("traceEvents", []), steps or len(indices))


def short(name):
    """A kernel's demangled name without the namespaces every one of them carries."""
    for noise in ("void ", "fastgpt::cuda::", "(anonymous namespace)::", "at::native::"):
        name = name.replace(noise, "")
    return name


def print_breakdown(results, names, step_ms):
    """One table: op groups down, the profiled variants across (ms of GPU kernels per step), then the step's
    median wall time and the idle gap; then each variant's largest kernels."""
    names = [n for n in names if "profile" in results.get(n, {})]
    if not names:
        return
    width = max(12, *(len(n) for n in names))
    print("\nwhere the GPU time goes (ms per step of kernels, torch.profiler; each variant at its own B):")
    print(f"{'group':<14}" + "".join(f" {n:>{width}}" for n in names))
    for g in GROUP_NAMES:
        vals = [results[n]["profile"]["groups"].get(g, 0.0) for n in names]
        if any(v >= 0.005 for v in vals):
            print(f"{g:<14}" + "".join(f" {v:>{width}.2f}" for v in vals))
    print(f"{'kernels':<14}" + "".join(f" {results[n]['profile']['kernel_ms']:>{width}.2f}" for n in names))
    print(f"{'step (wall)':<14}" + "".join(f" {step_ms[n]:>{width}.2f}" for n in names))
    print(f"{'idle':<14}" + "".join(f" {step_ms[n] - results[n]['profile']['kernel_ms']:>{width}.2f}"
                                    for n in names))
    for n in names:
        p = results[n]["profile"]
        print(f"\n{n}: {p['kernels']} distinct kernels; the largest (ms per step, calls per step, group):")
        for r in p["top"][:PRINTED]:
            print(f"  {r['ms']:8.3f} {r['calls']:6.1f}  {r['group']:<13} {short(r['name'])[:90]}")
        g = p.get("gaps")
        if g and g["top"]:
            print(f"{n}: the GPU idle {g['idle_ms']:.2f} ms a step between its {g['events']:.0f} events; the largest "
                  f"gaps by the ops around them (ms per step, gaps per step):")
            for r in g["top"][:GAPS_PRINTED]:
                print(f"  {r['ms']:8.3f} {r['count']:6.1f}  {short(r['before'])[:50]} -> {short(r['after'])[:50]}")


# --- Against an earlier run (bench_gpu_train.py --baseline): what each kernel gained or lost since.
# Why: every GPU session first asks "did the kernels changed since the last run get faster?", and the answer was
# read by hand from two tables of 60 names each.
CHANGES_PRINTED = 15  # kernels the comparison lists per variant (the JSON keeps all it matched)


def kernel_key(name):
    """A kernel's name for matching across runs: short(name) without its parameter list (its template arguments
    kept), so that a kernel whose parameters changed is still the same kernel. Names of copies and memsets
    ("Memset (Unknown)": a space before the parenthesis) stay whole."""
    s, depth = short(name), 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and i > 0 and s[i - 1] != " " and depth == 0:
            return s[:i]
    return s


def _dict(x):
    return x if isinstance(x, dict) else {}


def compare(old, new):
    """Two breakdowns of one variant (an earlier run's, this run's) -> {"kernel_ms": [old, new], "groups": {group:
    [old, new]} (those above 0.005 ms in either), "kernels": [{"name", "old_ms", "new_ms", "old_calls",
    "new_calls"}, ...]}: first the kernels in both lists by the size of their change, largest first, then those in
    one list only (None on the other side: new, gone, renamed, or below that side's cut: `top` keeps 60, the first
    H200 run's 15), largest first; "cut": [old, new], whether each side's list left kernels out."""
    def by_key(profile):
        rows = {}
        for r in profile.get("top") or []:
            if not isinstance(r, dict) or "name" not in r:
                continue
            k = kernel_key(str(r["name"]))
            ms, calls = rows.get(k, (0.0, 0.0))
            # template instances that differ only in their parameters (overloads) are added
            rows[k] = (ms + float(r.get("ms") or 0.0), calls + float(r.get("calls") or 0.0))
        return rows

    old, new = _dict(old), _dict(new)
    o, n = by_key(old), by_key(new)
    kernels = [{"name": k, "old_ms": o[k][0] if k in o else None, "new_ms": n[k][0] if k in n else None,
                "old_calls": o[k][1] if k in o else None, "new_calls": n[k][1] if k in n else None}
               for k in list(o) + [k for k in n if k not in o]]
    kernels.sort(key=lambda r: (r["old_ms"] is None or r["new_ms"] is None,
                                -abs((r["new_ms"] or 0.0) - (r["old_ms"] or 0.0))))
    groups = {g: [float(_dict(old.get("groups")).get(g) or 0.0), float(_dict(new.get("groups")).get(g) or 0.0)]
              for g in GROUP_NAMES}
    # An earlier run's kernel that GROUPS now files elsewhere moves there (as far as its `top` lists it), so that a
    # change of GROUPS does not read as a change of speed.
    for r in old.get("top") or []:
        now = group_of(str(r.get("name", ""))) if isinstance(r, dict) else None
        if now is not None and r.get("group") in groups and now != r["group"]:
            ms = float(r.get("ms") or 0.0)
            groups[r["group"]][0] -= ms
            groups[now][0] += ms
    cut = [len(p.get("top") or []) < (p.get("kernels") or 0) for p in (old, new)]
    return {"kernel_ms": [old.get("kernel_ms"), new.get("kernel_ms")],
            "groups": {g: v for g, v in groups.items() if max(v) >= 0.005}, "kernels": kernels, "cut": cut}


CONFIG_KEYS = ("n_layer", "n_head", "n_embd", "T", "vocab")  # a run's model and sequence: what must match


NOT_OURS = "not a bench_gpu_train run"  # unlike()'s only reason for a file that is no run of ours at all


def unlike(run, gpu, config):
    """Why an earlier run's JSON (parsed) is no baseline for this one: [] when it is a whole bench_gpu_train run of
    the same model and sequence (config: CONFIG_KEYS) on the GPU named `gpu`, else the reasons ([NOT_OURS] where it
    is not one at all)."""
    ours = isinstance(run, dict) and run.get("benchmark") == "bench_gpu_train"
    if not (ours and isinstance(run.get("results"), dict)):
        return [NOT_OURS]
    env, cfg = _dict(run.get("env")), _dict(run.get("config"))
    why = ["a partial run"] if run.get("partial") else []
    if env.get("gpu") != gpu:
        why.append(f"ran on {env.get('gpu')}, this run on {gpu}")
    why += [f"{k} {cfg.get(k)} there, {config.get(k)} here" for k in CONFIG_KEYS if cfg.get(k) != config.get(k)]
    return why


def find_baseline(paths, gpu, config, names):
    """The newest (by its env's date) of the bench_gpu_train JSON files `paths` that unlike() finds nothing against
    and that hold a profile of one of `names`; None if none does. Files that cannot be read are passed over."""
    best = None
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if unlike(d, gpu, config) or not any("profile" in _dict(d["results"].get(v)) for v in names):
            continue
        date = str(_dict(d.get("env")).get("date", ""))
        if best is None or date > best[0]:
            best = (date, str(p), d)
    return None if best is None else {"path": best[1], "json": best[2]}


def print_comparison(baseline, results, names):
    """For each of `names` profiled both now (results) and in the baseline run ({"path", "json"}, find_baseline's) at
    the same B: the step, the groups and the kernels that changed most, earlier -> now. -> {name: compare(...)} of
    the variants compared (for the JSON)."""
    old_res, env = _dict(_dict(baseline["json"]).get("results")), _dict(_dict(baseline["json"]).get("env"))
    out = {}
    for n in names:
        new, old = _dict(results.get(n)), _dict(old_res.get(n))
        if "profile" not in new or "profile" not in old:
            continue
        if new.get("B") != old.get("B"):
            print(f"\n{n}: not compared with {baseline['path']}: B {old.get('B')} there, {new.get('B')} here")
            continue
        c = compare(old["profile"], new["profile"])
        c["step_ms"] = [old.get("step_ms_median"), new.get("step_ms_median")]
        out[n] = c
        print(f"\n{n} against {baseline['path']} ({env.get('fastgpt_commit') or '?'}, {env.get('date', '?')}), "
              f"ms per step, earlier -> now (change):")
        rows = [("step (wall)", *c["step_ms"]), ("kernels", *c["kernel_ms"])]
        rows += [(g, *v) for g, v in c["groups"].items()]
        for label, a, b in rows:
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                print(f"  {label:<14} {a:9.2f} -> {b:9.2f} ({b - a:+.2f})")
        cut = " and ".join(w for w, c_ in zip(("that run's", "this run's"), c["cut"]) if c_)
        print(f"  the {CHANGES_PRINTED} kernels that changed most (ms per step, calls per step), then those in one "
              f"list only ('-'{'; ' + cut + ' list leaves kernels out' if cut else ''}):")
        for r in c["kernels"][:CHANGES_PRINTED]:
            a, b = r["old_ms"], r["new_ms"]
            calls = r["new_calls"] if r["new_calls"] is not None else r["old_calls"]
            print(f"  {'-' if a is None else f'{a:.3f}':>9} -> {'-' if b is None else f'{b:.3f}':>9} "
                  f"({(b or 0.0) - (a or 0.0):+.3f}) {calls:6.1f}  {r['name'][:80]}")
    if not out:
        print(f"\nnothing compared with {baseline['path']}: no variant profiled in both runs at the same B")
    return out
