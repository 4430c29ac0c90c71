"""scripts/ncu_summary.py (the table gpu_check's `ncu` part prints from Nsight Compute's raw CSV) on CSV written
here in ncu's layout: a header of metric names, a units row, one row per kernel, "==PROF==" lines around it; and
scripts/ncu_targets.py's list of what it profiles against the tile options the build has. No GPU needed."""
import csv
import importlib.util
import io
import json
import os
import pathlib
import random
import subprocess
import sys
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


summary = load("ncu_summary")
targets = load("ncu_targets")

KERNEL = "void fastgpt::cuda::flash::(anonymous namespace)::dkdv_kernel<__nv_bfloat16, 64, 1, 64, false>" \
         "(fastgpt::cuda::flash::Params)"
BASE = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size",
        "Device", "CC"]


def write_csv(path, metrics, units, rows):
    """ncu's raw page: every cell quoted, the units row under the header, ==PROF== lines before and after."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(BASE + list(metrics))
    w.writerow([""] * len(BASE) + [units.get(m, "") for m in metrics])
    for i, (kernel, values) in enumerate(rows):
        w.writerow([str(i), "4242", "python3", "127.0.0.1", kernel, "1", "7", "(128, 1, 1)", "(192, 16, 1)", "0",
                    "9.0"] + [values.get(m, "n/a") for m in metrics])
    path.write_text("==PROF== Connected to process 4242\n" + buf.getvalue() + "==PROF== Disconnected\n")


def fresh_values(rng):
    """A kernel's metrics at random, with what the summary should make of them."""
    ns = rng.uniform(1e4, 9e5)
    hmma, gmma = rng.uniform(1, 90), rng.uniform(1, 90)
    ld_c, st_c, ld_w, st_w = (rng.randint(1, 10**6) for _ in range(4))
    loc_ld, loc_st = rng.randint(0, 5000), rng.randint(0, 5000)
    stall = {r: rng.uniform(0.01, 5) for r in ("barrier", "long_scoreboard", "math_pipe_throttle", "mio_throttle",
                                              "wait", "short_scoreboard")}
    values = {
        "gpu__time_duration.sum": f"{ns:,.2f}",  # thousands separators, as ncu prints them
        "sm__throughput.avg.pct_of_peak_sustained_elapsed": f"{rng.uniform(1, 99):.2f}",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": f"{hmma:.2f}",
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": f"{gmma:.2f}",
        "launch__registers_per_thread": str(rng.randint(32, 255)),
        "launch__shared_mem_per_block_dynamic": f"{rng.randint(1, 200) * 1024:,}",
        "launch__shared_mem_per_block_static": "0",
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": f"{ld_c:,}",
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": f"{st_c:,}",
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": f"{ld_c + ld_w:,}",
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": f"{st_c + st_w:,}",
        "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum": str(loc_ld),
        "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": str(loc_st),
        "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": "9.99",  # issuing, not a stall
    }
    values.update({f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio": f"{v:.4f}"
                   for r, v in stall.items()})
    want = {"time_us": float(f"{ns:.2f}") / 1e3, "tensor_pct": max(float(f"{hmma:.2f}"), float(f"{gmma:.2f}")),
            "regs": float(values["launch__registers_per_thread"]),
            "smem_bytes": float(values["launch__shared_mem_per_block_dynamic"].replace(",", "")),
            "conflict_share": (ld_c + st_c) / (ld_c + ld_w + st_c + st_w), "local_bytes": loc_ld + loc_st}
    rounded = {r: float(f"{v:.4f}") for r, v in stall.items()}
    total = sum(rounded.values())
    want["stalls"] = sorted(((r, v / total) for r, v in rounded.items()), key=lambda kv: -kv[1])[:3]
    return values, want


def test_summary_reads_ncus_raw_csv(tmp_path):
    rng = random.Random()
    vals = [fresh_values(rng) for _ in range(3)]
    metrics = sorted(set().union(*(v for v, _ in vals)))
    units = {m: "nsecond" if m == "gpu__time_duration.sum" else "byte" if "bytes" in m or "shared_mem" in m else "%"
             for m in metrics}
    units["launch__registers_per_thread"] = "register/thread"
    kernels = [KERNEL, "void at::native::vectorized_elementwise_kernel<4>(int)",
               KERNEL.replace("64, false", "32, true")]
    write_csv(tmp_path / "raw.csv", metrics, units, list(zip(kernels, (v for v, _ in vals))))
    rows, got_units = summary.read(tmp_path / "raw.csv")
    assert len(rows) == 3 and got_units["gpu__time_duration.sum"] == "nsecond"
    out = summary.summarize(rows, got_units)
    for r, (_, want) in zip(out, vals):
        for key in ("time_us", "tensor_pct", "regs", "smem_bytes", "conflict_share", "local_bytes"):
            assert r[key] == pytest.approx(want[key], rel=1e-9), key
        assert [k for k, _ in r["stalls"]] == [k for k, _ in want["stalls"]]
        assert [v for _, v in r["stalls"]] == pytest.approx([v for _, v in want["stalls"]], rel=1e-9)
        assert r["mem_pct"] is None and r["dram_pct"] is None  # not in this CSV: "-" in the table
    text = summary.table(out)
    assert "dkdv_kernel<bf16,64,1,64,false>" in text and text.count("\n") == 3
    assert " - " in text  # the missing columns


def test_units_other_than_base_are_converted(tmp_path):
    rng = random.Random()
    us, kb = rng.uniform(1, 900), rng.randint(1, 200)
    write_csv(tmp_path / "raw.csv", ["gpu__time_duration.sum", "launch__shared_mem_per_block_dynamic"],
              {"gpu__time_duration.sum": "usecond", "launch__shared_mem_per_block_dynamic": "Kbyte"},
              [(KERNEL, {"gpu__time_duration.sum": f"{us:.3f}", "launch__shared_mem_per_block_dynamic": str(kb)})])
    (r,) = summary.summarize(*summary.read(tmp_path / "raw.csv"))
    assert r["time_us"] == pytest.approx(float(f"{us:.3f}")) and r["smem_bytes"] == kb * 1000
    assert r["stalls"] == [] and r["conflict_share"] is None


def test_sampled_stalls_when_the_ratios_are_missing(tmp_path):
    rng = random.Random()
    counts = {r: rng.randint(1, 10**5) for r in ("barrier", "dispatch_stall", "long_scoreboard", "wait")}
    values = {f"smsp__pcsamp_warps_issue_stalled_{r}": f"{c:,}" for r, c in counts.items()}
    values.update({f"smsp__pcsamp_warps_issue_stalled_{r}_not_issued": "7" for r in counts})  # not counted twice
    write_csv(tmp_path / "raw.csv", sorted(values), {}, [(KERNEL, values)])
    (r,) = summary.summarize(*summary.read(tmp_path / "raw.csv"))
    total = sum(counts.values())
    want = sorted(((k, c / total) for k, c in counts.items()), key=lambda kv: -kv[1])[:3]
    assert [k for k, _ in r["stalls"]] == [k for k, _ in want]
    assert [v for _, v in r["stalls"]] == pytest.approx([v for _, v in want])


def test_labels_are_matched_by_id_and_a_missing_rename_is_ignored(tmp_path):
    metrics = ["gpu__time_duration.sum"]
    rows = [(KERNEL, {"gpu__time_duration.sum": "1000"}), ("void other(int)", {"gpu__time_duration.sum": "2000"})]
    write_csv(tmp_path / "raw.csv", metrics, {}, rows)
    write_csv(tmp_path / "labels.csv", metrics, {}, [("bwd det 16x64/16x64", v) for _, v in rows[:1]] +
              [("fwd sm90 ws 128x128", rows[1][1])])
    write_csv(tmp_path / "same.csv", metrics, {}, rows)  # --print-nvtx-rename did nothing
    json_path = tmp_path / "s.json"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "ncu_summary.py"), str(tmp_path / "raw.csv"),
                          "--labels", str(tmp_path / "labels.csv"), "--json", str(json_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("bwd det 16x64/16x64") and lines[2].startswith("fwd sm90 ws 128x128")
    assert "dkdv_kernel" in lines[1] and "other" in lines[2]
    assert json_path.exists()
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "ncu_summary.py"), str(tmp_path / "raw.csv"),
                          "--labels", str(tmp_path / "same.csv")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[1].startswith(" " * 32)  # no label column text


def test_an_empty_report_is_an_error(tmp_path):
    (tmp_path / "raw.csv").write_text("==PROF== No kernels were profiled.\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "ncu_summary.py"), str(tmp_path / "raw.csv")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no kernel rows" in out.stdout


def test_targets_split_the_choices_into_two_reports():
    """ncu_targets.py's two flash reports between them hold every choice of flash_diagnose.choices once, the Hopper
    ones alone in "sm90", each timing the pass its choice changes, each report with its torch backend (cuDNN beside
    the Hopper kernels), and --list prints them in running order."""
    options = {"fwd": ["auto", "16x64", "sm90 ws 128x128"], "dkdv": ["auto", "16x64", "sm90 fused"],
               "dq": ["auto", "16x64", "32x64"]}
    flash, sm90 = targets.fastgpt_targets(options, False), targets.fastgpt_targets(options, True)
    assert flash == [("fwd 16x64", {"fwd": "16x64"}, "fwd"), ("dkdv 16x64", {"dkdv": "16x64"}, "bwd det"),
                     ("dq 32x64", {"dq": "32x64"}, "bwd det"), ("bwd atomic", {}, "bwd atomic")]
    assert sm90 == [("dkdv sm90 fused", {"dkdv": "sm90 fused"}, "bwd det"),
                    ("fwd sm90 ws 128x128", {"fwd": "sm90 ws 128x128"}, "fwd")]
    assert [label for label, _, _ in targets.TORCH_TARGETS["sm90"]] == ["torch cudnn_attention fwd",
                                                                         "torch cudnn_attention bwd"]
    assert [label for label, _, _ in targets.TORCH_TARGETS["flash"]] == ["torch flash_attention fwd",
                                                                          "torch flash_attention bwd"]
    cudnn = targets.torch_targets(targets.parse_args(["flash", "--cudnn"]))
    assert cudnn == targets.TORCH_TARGETS["flash"] + targets.TORCH_TARGETS["sm90"]
    assert targets.torch_targets(targets.parse_args(["sm90", "--cudnn"])) == targets.TORCH_TARGETS["sm90"]
    fastgpt = pytest.importorskip("fastgpt")
    if not fastgpt._C.built_with_cuda:
        pytest.skip("fastgpt built without CUDA: no tile options")
    from fastgpt import ops
    options = ops.flash_attention_tile_options()
    want = {what: [label for label, _, _ in targets.fastgpt_targets(options, what == "sm90") +
                   targets.TORCH_TARGETS[what]] for what in ("flash", "sm90")}
    for what in ("flash", "sm90"):
        out = subprocess.run([sys.executable, str(REPO / "scripts" / "ncu_targets.py"), what, "--list"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.split("\n")[:-1] == want[what]


def test_grouped_rows_sum_times_and_weight_percentages(tmp_path):
    """--group --top: the training step's table, one row per kernel name, the longest first."""
    rng = random.Random()
    metrics = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "launch__registers_per_thread"]
    names = [KERNEL, "void ln_kernel<float>(int)", "void tiny(int)"]
    rows, want = [], {}
    for n, name in enumerate(names):
        for _ in range(rng.randint(2, 5)):
            t, pct, regs = rng.uniform(1e3, 1e5) * (10 if n == 1 else 1), rng.uniform(1, 99), rng.randint(16, 255)
            rows.append((name, {metrics[0]: f"{t:.1f}", metrics[1]: f"{pct:.2f}", metrics[2]: str(regs)}))
            w = want.setdefault(summary.short_name(name), [0.0, 0.0, 0, 0])
            t, pct = float(f"{t:.1f}") / 1e3, float(f"{pct:.2f}")
            w[0] += t
            w[1] += t * pct
            w[2] = max(w[2], regs)
            w[3] += 1
    rng.shuffle(rows)
    write_csv(tmp_path / "raw.csv", metrics, {metrics[0]: "nsecond"}, rows)
    out = summary.grouped(summary.summarize(*summary.read(tmp_path / "raw.csv")))
    assert len(out) == 3
    for g in out:
        t, tp, regs, count = want[summary.short_name(g["kernel"])]
        assert g["time_us"] == pytest.approx(t) and g["sm_pct"] == pytest.approx(tp / t)
        assert g["regs"] == regs and g["label"] == f"{count} launches"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "ncu_summary.py"), str(tmp_path / "raw.csv"),
                          "--group", "--top", "2"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    longest = sorted(want, key=lambda k: -want[k][0])[:2]
    assert [line.split()[2] for line in lines[1:3]] == longest  # "N launches" takes two words
    assert f"{len(rows)} kernels" in lines[3]


FAKE_NCU = r'''#!PYTHON
"""A stand-in for ncu: records its arguments; with -o writes a report file; with -i prints a page."""
import csv, io, json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_NCU_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
if "-o" in args:
    open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("report")
    sys.exit(0)
rep = args[args.index("-i") + 1]
page = args[args.index("--page") + 1]
if page != "raw":
    print(f"{page} page of {rep}")
    sys.exit(0)
named = "--print-nvtx-rename" in args
rows = [("0", "fwd 16x64" if named else "void fwd_kernel<__nv_bfloat16, 64>(Params)", "52,000"),
        ("1", "bwd det 16x64/16x64" if named else "void dq_kernel<__nv_bfloat16, 64>(Params)", "91,000")]
buf = io.StringIO()
w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
w.writerow(["ID", "Kernel Name", "gpu__time_duration.sum"])
w.writerow(["", "", "nsecond"])
for r in rows:
    w.writerow(r)
print("==PROF== fake\n" + buf.getvalue(), end="")
'''


def fake_ncu(tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.replace("PYTHON", sys.executable))
    fake.chmod(0o755)
    return fake


def run_ncu_part(tmp_path, diagnose=None, reports=None):
    fake = fake_ncu(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    if diagnose is not None:
        (out / "diagnose.log").write_text(diagnose)
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, NCU=str(fake), FAKE_NCU_LOG=str(log))
    env.pop("NCU_REPORTS", None)
    if reports is not None:
        env["NCU_REPORTS"] = reports
    res = subprocess.run(["bash", str(REPO / "scripts" / "ncu_profile.sh"), str(out)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    return out, res.stdout.strip(), [json.loads(line) for line in log.read_text().splitlines()]


def test_gpu_checks_ncu_part_runs_and_packs_its_files(tmp_path):
    """scripts/ncu_profile.sh (gpu_check.sh ncu) with a stand-in ncu: the reports in the order that loses the least
    to a call's time running out (the Hopper kernels and their SASS pages first, then the step, the step's memory-bound
    ops, then the other flash kernels), the options each ncu call gets, the CSV it imports, the tables it writes and
    the archives it leaves (no reports in them)."""
    out, status, calls = run_ncu_part(tmp_path, "== fwd sm90 128x128: OK\n== dkdv sm90 fused: WRONG\n")
    assert status == "ok"
    profiles = [c for c in calls if "-o" in c]
    assert "--cudnn" not in profiles[3]  # cuDNN is in the sm90 report
    assert [c[-1] for c in profiles] == ["sm90", "step", "ops", "flash"]
    sm90_sass = next(i for i, c in enumerate(calls) if "-i" in c and c[c.index("-i") + 1].endswith("sm90.ncu-rep")
                     and "sass" in c)
    assert calls.index(profiles[0]) < sm90_sass < calls.index(profiles[1])  # its SASS page before the step
    for c in profiles:
        for opt in (["--profile-from-start", "off"], ["--clock-control", "none"]):
            i = c.index(opt[0])
            assert c[i:i + 2] == opt
        assert "--nvtx" in c and c[-3:-1] == ["python3", "scripts/ncu_targets.py"]
    assert all(c[c.index("--set") + 1] == "full" and "--replay-mode" not in c for c in profiles[:1] + profiles[2:])
    step = profiles[1]
    assert step[step.index("--replay-mode") + 1] == "application" and "--set" not in step
    assert step[step.index("--app-replay-mode") + 1] == "relaxed"
    imports = [c for c in calls if "-i" in c]
    # raw, labelled raw and details of each report; SASS and .cu source pages of all but the step's
    assert sum("--print-nvtx-rename" in c for c in imports) == 4 and len(imports) == 18
    text = (out / "ncu.log").read_text()
    assert "fwd 16x64" in text and "bwd det 16x64/16x64" in text and "dq_kernel<bf16,64>" in text
    assert text.count("2 kernels, 143.0 us in all") == 4
    assert sorted(p.name for p in out.iterdir()) == ["diagnose.log", "ncu.log", "ncu.tgz", "ncu_sass.tgz"]
    with tarfile.open(out / "ncu.tgz") as t:
        names = set(t.getnames())
    assert {"ncu/flash-raw.csv", "ncu/flash-labels.csv", "ncu/sm90-raw.csv", "ncu/step-details.csv",
            "ncu/flash-summary.json", "ncu/sm90-summary.json", "ncu/ops-raw.csv", "ncu/ops-summary.json"} <= names
    assert not any(n.endswith(".ncu-rep") or "sass" in n or "cuda" in n for n in names)
    with tarfile.open(out / "ncu_sass.tgz") as t:
        assert sorted(t.getnames()) == ["flash-cuda.csv", "flash-sass.csv", "ops-cuda.csv", "ops-sass.csv",
                                        "sm90-cuda.csv", "sm90-sass.csv"]
        assert t.extractfile("flash-sass.csv").read().decode().startswith("source page of")


def test_the_hopper_kernels_are_not_profiled_after_a_crash_in_diagnose(tmp_path):
    """A Hopper choice that crashed or timed out in flash_diagnose (the same call, before) would hang or trap under
    ncu too: its report is left out, and the status says so; the others are made as before."""
    out, status, calls = run_ncu_part(tmp_path, "== fwd 16x64: OK\n== dkdv sm90 ws fused: TIMEOUT (30 s)\n")
    profiles = [c for c in calls if "-o" in c]
    assert [c[c.index("scripts/ncu_targets.py") + 1] for c in profiles] == ["step", "ops", "flash"]
    assert profiles[2][-1] == "--cudnn"  # cuDNN's kernels join the flash report instead
    assert status == "sm90 not profiled (diagnose: a crash or timeout)"
    assert (out / "ncu.log").read_text().count("2 kernels, 143.0 us in all") == 3


def test_ncu_reports_picks_the_reports_and_their_order(tmp_path):
    """NCU_REPORTS="flash ops" (a short call after one that ran out of time): only those reports, in that order, each
    imported with its pages; with no sm90 report, cuDNN's kernels go with the flash one."""
    out, status, calls = run_ncu_part(tmp_path, reports=" flash  ops")
    assert status == "ok"
    profiles = [c for c in calls if "-o" in c]
    assert [c[c.index("scripts/ncu_targets.py") + 1] for c in profiles] == ["flash", "ops"]
    assert profiles[0][-1] == "--cudnn"
    reps = [c[c.index("-i") + 1].rsplit("/", 1)[1] for c in calls if "-i" in c]
    assert reps == ["flash.ncu-rep"] * 5 + ["ops.ncu-rep"] * 5  # raw, labels, details, SASS, .cu lines
    assert (out / "ncu.log").read_text().count("2 kernels, 143.0 us in all") == 2
    with tarfile.open(out / "ncu.tgz") as t:
        assert not any("sm90" in n or "step" in n for n in t.getnames())


@pytest.mark.parametrize("value, said", [("ops steps", "NCU_REPORTS names steps"), (" ", "NCU_REPORTS is blank")])
def test_ncu_reports_refuses_a_name_it_has_no_report_for(tmp_path, value, said):
    fake = fake_ncu(tmp_path)
    for args in ([str(tmp_path / "out")], ["--check"]):
        res = subprocess.run(["bash", str(REPO / "scripts" / "ncu_profile.sh"), *args], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, NCU=str(fake), NCU_REPORTS=value,
                                                             FAKE_NCU_LOG=str(tmp_path / "calls.jsonl")))
        assert res.returncode == 2 and said in res.stderr, res.stderr
    assert not (tmp_path / "calls.jsonl").exists() and not (tmp_path / "out").exists()  # nothing ran


def test_targets_run_on_the_cpu(capsys):
    """ncu_targets.py's calls on the CPU (the same lambdas, no profiler): every mma.sync choice runs, in order, and
    one training step; the Hopper choices say why they are skipped."""
    fastgpt = pytest.importorskip("fastgpt")
    torch = pytest.importorskip("torch")
    if not fastgpt._C.built_with_cuda:
        pytest.skip("fastgpt built without CUDA: no tile options")
    run = targets.Plain()
    targets.flash(targets.parse_args(["flash", "--device", "cpu", "--B", "1", "--T", "80", "--n-head", "2"]), torch,
                  run)
    skipped = [line[9:].split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("skipped: ")]
    from fastgpt import ops
    options = ops.flash_attention_tile_options()
    assert [x for x in run.labels if not x.startswith("torch")] == [
        label for label, _, _ in targets.fastgpt_targets(options, False)]
    assert "fwd 16x64" in run.labels and all(x.startswith("torch") for x in skipped)
    if not fastgpt.cuda_available():  # the Hopper choices say why they cannot run here
        run = targets.Plain()
        targets.flash(targets.parse_args(["sm90", "--device", "cpu", "--B", "1", "--T", "80", "--n-head", "2"]),
                      torch, run)
        skipped = [line[9:].split(":")[0] for line in capsys.readouterr().out.splitlines()
                   if line.startswith("skipped: ")]
        assert run.labels == [] and skipped == [label for label, _, _ in targets.fastgpt_targets(options, True) +
                                                targets.TORCH_TARGETS["sm90"]]
    run = targets.Plain()
    targets.step(targets.parse_args(["step", "--device", "cpu", "--B", "2", "--T", "16", "--n-head", "2", "--n-embd",
                                     "32", "--n-layer", "2", "--vocab", "96"]), torch, run)
    assert run.labels == ["step fastgpt bf16"]
    run = targets.Plain()
    targets.memory_ops(targets.parse_args(["ops", "--device", "cpu", "--B", "2", "--T", "16", "--n-head", "2",
                                           "--n-embd", "32", "--vocab", "96"]), torch, run)
    assert run.labels == targets.OPS_LABELS


def test_profiled_calls_bracket_only_the_second_call():
    """The GPU runner's order of calls, with a recording stand-in for torch: the warm-up call outside the profiler's
    window, the measured one inside it and inside its NVTX range, the range and the window closed even if the call
    raises."""
    events = []

    class Rec:
        def __getattr__(self, name):
            return Rec.Node(name)

        class Node:
            def __init__(self, name):
                self.name = name

            def __getattr__(self, name):
                return Rec.Node(f"{self.name}.{name}")

            def __call__(self, *args):
                events.append((self.name,) + args)

    fake = Rec()
    run = targets.Profiled(fake)
    run("fwd x", lambda: events.append(("fn",)))
    assert events == [("fn",), ("cuda.synchronize",), ("cuda.profiler.start",), ("cuda.nvtx.range_push", "fwd x"),
                      ("fn",), ("cuda.synchronize",), ("cuda.nvtx.range_pop",), ("cuda.profiler.stop",)]
    assert run.labels == ["fwd x"]
    events.clear()
    calls = []

    def fails():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel fault")

    with pytest.raises(RuntimeError):
        run("bwd y", fails)
    assert events[-2:] == [("cuda.nvtx.range_pop",), ("cuda.profiler.stop",)] and run.labels == ["fwd x"]
