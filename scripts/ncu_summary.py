"""One line per profiled kernel from Nsight Compute's raw CSV page (`ncu --import R --page raw --csv --print-units
base`): time, SM and memory throughput, tensor-pipe and issue-slot use, occupancy, registers, shared-memory bank
conflicts, local-memory (spill) traffic and the three largest stall reasons. scripts/gpu_check.sh's `ncu` part
prints it last, so it comes back in the device call's output; the raw CSV (every metric) comes back beside it.

Why a table of our own: the device call returns only the tail of its output and a few files, and the sessions that
tune kernels afterwards have no GPU and no ncu to open a report with. Metric names differ between GPUs and ncu
versions, so each column is found by a pattern and a missing one reads "-" rather than failing.

    python3 scripts/ncu_summary.py flash-raw.csv [--labels flash-labels.csv] [--json out.json]

--labels: the same report imported with --print-nvtx-rename kernel (scripts/ncu_targets.py's NVTX labels as kernel
names), matched by ID.
"""
import argparse
import csv
import json
import re
import sys

TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}  # -> microseconds
BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}

# column: (patterns tried in order, the first present wins; "max" or "sum" over every match where given)
COLUMNS = {
    "time_us": (["gpu__time_duration.sum"], None),
    "sm_pct": (["sm__throughput.avg.pct_of_peak_sustained_elapsed"], None),
    "mem_pct": (["gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"], None),
    "dram_pct": (["dram__throughput.avg.pct_of_peak_sustained_elapsed"], None),
    # mma.sync counts on the hmma pipe, wgmma on the gmma one (Hopper): the busier of them
    "tensor_pct": ([r"sm__pipe_tensor_op_\w+_cycles_active\.avg\.pct_of_peak_sustained_active",
                    r"sm__inst_executed_pipe_tensor_op_\w+\.avg\.pct_of_peak_sustained_active"], "max"),
    "issue_pct": (["smsp__issue_active.avg.pct_of_peak_sustained_active",
                   "sm__instruction_throughput.avg.pct_of_peak_sustained_active"], None),
    "occupancy_pct": (["sm__warps_active.avg.pct_of_peak_sustained_active"], None),
    "regs": (["launch__registers_per_thread"], None),
    "smem_bytes": ([r"launch__shared_mem_per_block_(dynamic|static)"], "sum"),
    "conflicts": (["l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
                   r"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_(ld|st)\.sum"], "sum"),
    "wavefronts": (["l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
                    r"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_(ld|st)\.sum"], "sum"),
    "local_bytes": ([r"l1tex__t_bytes_pipe_lsu_mem_local_op_(ld|st)\.sum"], "sum"),
}
# Stall reasons: warps stalled per issued instruction, by reason (the WarpStateStats section), else the sampled
# counts of the SourceCounters section (shares of their total then).
STALLS = [r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio",
          r"smsp__pcsamp_warps_issue_stalled_(\w+)"]


def number(text):
    """ncu's CSV value -> float, or None for an empty or non-numeric cell ("n/a"). Thousands separators go."""
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return None


def read(path):
    """-> (rows, units): one dict per kernel (column -> text) and the units row (column -> unit)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints "==PROF==" lines around the table
    reader = csv.DictReader(lines)
    rows = list(reader)
    units = {}
    if rows and not (rows[0].get("ID") or "").strip().isdigit():  # the line under the header: units
        units = rows.pop(0)
    return rows, units


def scaled(row, units, col):
    v = number(row.get(col, ""))
    if v is None:
        return None
    u = (units.get(col) or "").strip()
    if col == "gpu__time_duration.sum":
        return v * TIME_UNITS.get(u, 1e-3)  # base units: nanoseconds
    return v * BYTE_UNITS.get(u, 1) if u in BYTE_UNITS else v


def pick(row, units, patterns, how):
    for pat in patterns:
        cols = [c for c in row if re.fullmatch(pat, c)]
        vals = [v for v in (scaled(row, units, c) for c in cols) if v is not None]
        if vals:
            return max(vals) if how == "max" else sum(vals) if how == "sum" else vals[0]
    return None


def stalls(row):
    """-> [(reason, share)] largest first: each reason's part of all stalls (so rows compare across kernels)."""
    for pat in STALLS:
        found = {}
        for c in row:
            m = re.fullmatch(pat, c)
            # "selected" is the issuing warp, not a stall; pcsamp's "..._not_issued" duplicate each reason
            if m and m.group(1) != "selected" and not m.group(1).endswith("_not_issued"):
                v = number(row[c])
                if v is not None:
                    found[m.group(1)] = found.get(m.group(1), 0.0) + v
        total = sum(found.values())
        if total > 0:
            return sorted(((k, v / total) for k, v in found.items()), key=lambda kv: -kv[1])
    return []


def summarize(rows, units, labels=None):
    out = []
    for row in rows:
        r = {"id": row.get("ID", "").strip(), "kernel": row.get("Kernel Name", "").strip(),
             "grid": row.get("Grid Size", "").strip(), "block": row.get("Block Size", "").strip()}
        r["label"] = (labels or {}).get(r["id"], "")
        for name, (patterns, how) in COLUMNS.items():
            r[name] = pick(row, units, patterns, how)
        w, c = r.pop("wavefronts"), r.pop("conflicts")
        # shared-memory wavefronts that were bank conflicts (0: none; 0.5: every access took two)
        r["conflict_share"] = c / w if c is not None and w else None
        r["stalls"] = stalls(row)[:3]
        out.append(r)
    return out


def grouped(summary):
    """One row per kernel name (the training step runs each kernel once per layer): times summed, the percentages
    weighted by time, registers and sizes their largest, the label the count of launches."""
    groups = {}
    for r in summary:
        groups.setdefault(short_name(r["kernel"]), []).append(r)
    out = []
    for name, rs in groups.items():
        g = {"id": rs[0]["id"], "kernel": rs[0]["kernel"], "grid": rs[0]["grid"], "block": rs[0]["block"],
             "label": f"{len(rs)} launches", "stalls": rs[0]["stalls"]}
        times = [r["time_us"] or 0.0 for r in rs]
        g["time_us"] = sum(times)
        for key in ("sm_pct", "mem_pct", "dram_pct", "tensor_pct", "issue_pct", "occupancy_pct", "conflict_share"):
            pairs = [(r[key], t) for r, t in zip(rs, times) if r[key] is not None]
            weight = sum(t for _, t in pairs)
            g[key] = sum(v * t for v, t in pairs) / weight if weight > 0 else None
        for key in ("regs", "smem_bytes", "local_bytes"):
            vals = [r[key] for r in rs if r[key] is not None]
            g[key] = max(vals) if vals else None
        out.append(g)
    return out


def short_name(kernel):
    """'void ns::(anonymous namespace)::dkdv_kernel<__nv_bfloat16, 64, 1, 64, false>(ns::Params)' ->
    'dkdv_kernel<bf16,64,1,64,false>'."""
    name = re.sub(r"\([^()]*\)$", "", kernel.strip())  # the parameter list
    name = re.sub(r"^void ", "", name)
    head, _, args = name.partition("<")
    head = head.split("::")[-1]
    args = args.replace("__nv_bfloat16", "bf16").replace("__half", "fp16").replace(" ", "")
    return head + ("<" + args if args else "")


def fmt(v, spec, width):
    return f"{'-':>{width}}" if v is None else f"{v:{width}{spec}}"


def table(summary):
    lines = [f"{'label':<32} {'kernel':<44} {'us':>8} {'SM%':>5} {'mem%':>5} {'tens%':>5} {'iss%':>5} "
             f"{'occ%':>5} {'regs':>4} {'smemKB':>6} {'bconf':>5} {'localKB':>7}  top stalls"]
    for r in summary:
        st = ", ".join(f"{k} {v:.0%}" for k, v in r["stalls"])
        local = None if r["local_bytes"] is None else r["local_bytes"] / 1e3
        smem = None if r["smem_bytes"] is None else r["smem_bytes"] / 1024
        lines.append(f"{r['label'][:32]:<32} {short_name(r['kernel'])[:44]:<44} {fmt(r['time_us'], '.1f', 8)} "
                     f"{fmt(r['sm_pct'], '.0f', 5)} {fmt(r['mem_pct'], '.0f', 5)} {fmt(r['tensor_pct'], '.0f', 5)} "
                     f"{fmt(r['issue_pct'], '.0f', 5)} {fmt(r['occupancy_pct'], '.0f', 5)} {fmt(r['regs'], '.0f', 4)} "
                     f"{fmt(smem, '.0f', 6)} {fmt(r['conflict_share'], '.2f', 5)} {fmt(local, '.0f', 7)}  {st}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="ncu --import R --page raw --csv --print-units base > raw.csv")
    p.add_argument("--labels", help="the same with --print-nvtx-rename kernel: the NVTX labels, matched by ID")
    p.add_argument("--group", action="store_true", help="one row per kernel name (times summed)")
    p.add_argument("--top", type=int, default=0, metavar="N", help="only the N longest rows, longest first")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    rows, units = read(args.raw)
    if not rows:
        print(f"ncu_summary: no kernel rows in {args.raw}")
        return 1
    labels = None
    if args.labels:
        try:
            lrows, _ = read(args.labels)
            labels = {r.get("ID", "").strip(): r.get("Kernel Name", "").strip() for r in lrows}
            # a rename that did not happen gives the kernel names back: no labels then
            if all(labels.get(r.get("ID", "").strip()) == r.get("Kernel Name", "").strip() for r in rows):
                labels = None
        except OSError as e:
            print(f"ncu_summary: labels not read ({e})")
    summary = summarize(rows, units, labels)
    if args.group:
        summary = grouped(summary)
    total = sum(r["time_us"] or 0.0 for r in summary)
    if args.top > 0:
        summary = sorted(summary, key=lambda r: -(r["time_us"] or 0.0))[:args.top]
    print(table(summary))
    shown = sum(r["time_us"] or 0.0 for r in summary)
    print(f"{len(rows)} kernels, {total:.1f} us in all" + (f"; the rows above: {shown:.1f} us" if args.top else ""))
    print("us: kernel time; SM%/mem%: throughput of the busiest SM / memory unit, % of peak; tens%: tensor pipe "
          "busy; iss%: issue slots used; occ%: achieved warps; bconf: share of shared-memory wavefronts that were "
          "bank conflicts; localKB: local-memory (spill) traffic; stalls: share of warp stall cycles by reason")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
