"""Helpers shared by the benchmarks: the thread count both libraries get, the machine description recorded with
every result, a measure of how much CPU other processes took during a run (timings on a shared machine are
only trustworthy when that is near zero), the summary of matmul autotune's decisions in a run, and the batches of a
text the training benchmarks learn from.
"""
import datetime
import json
import os
import platform
import statistics
import tempfile
import time


def default_threads():
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(env) if env.isdigit() and int(env) > 0 else os.cpu_count() or 1


class OtherLoad:
    """How much of the machine's CPU time other processes took while we ran (Linux /proc/stat minus our own)."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait, in seconds
        except (OSError, ValueError, IndexError):
            return None
        t = os.times()
        return time.monotonic(), busy, t.user + t.system

    def other_share(self):
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        wall = end[0] - self.start[0]
        other = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / (wall * (os.cpu_count() or 1)))


def report_other_load(share):
    if share is None:
        return
    print(f"other processes used {100 * share:.0f}% of the machine's CPU time during the run", end="")
    print(": timings are inflated, rerun on a quiet machine for absolute numbers" if share > 0.1 else "")


def environment(threads):
    import numpy as np
    import torch

    import fastgpt
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host_cpu": cpu,
            "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "threads": threads,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
            "fastgpt": fastgpt.__version__, "platform": platform.platform()}




def cuda_median_ms(fn, warmup, repeats):
    """Median milliseconds of fn() by CUDA events on the current stream (the one fastgpt.ops launches on too), after
    `warmup` untimed calls."""
    import torch
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def write_json(path, payload, quiet=False):
    """The benchmark's raw numbers, for bench/results/ and BENCHMARKS.md. Written to a temporary file beside path and
    renamed over it: a run cut short (a device call's time limit) leaves the last complete file, never half of one."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if not quiet:
        print(f"wrote {path}")


def autotune_summary(records):
    """fastgpt.ops.matmul_autotune_report()'s records of one run in a few numbers: how many problems were met, how
    many timed (not skipped), how many left the heuristic's choice, and, over the timed ones, the sum of one run of
    the heuristic's algorithm against one of the chosen (ms): what the tuning saves per call of every product once,
    an upper bound on a step's saving only where each product runs once per step. The records go along whole."""
    timed = [r for r in records if not r["skipped"] and r["ms"] and r["ms"][0] > 0 and r["ms"][r["chosen"]] > 0]
    heuristic = sum(r["ms"][0] for r in timed)
    chosen = sum(r["ms"][r["chosen"]] for r in timed)
    return {"problems": len(records), "timed": len(timed), "changed": sum(r["chosen"] != 0 for r in timed),
            "heuristic_ms": heuristic, "chosen_ms": chosen,
            "saved": (1 - chosen / heuristic) if heuristic > 0 else 0.0, "records": list(records)}


def text_batches(data, encoder, B, T, n):
    """n (x, y) batches of int64 (B, T) GPT-2 tokens of the text file `data` (through `encoder`, GPT-2's
    encoder.json), y = x one token on: its train split (fastgpt.data) in consecutive B*T windows, in order and
    wrapping around, as build-nanogpt's DataLoaderLite. Held in memory: the token shards are removed again.
    -> (batches, the train split's token count)."""
    import fastgpt
    with tempfile.TemporaryDirectory(prefix="fastgpt-bench-") as shards:
        info = fastgpt.data.tokenize_file(data, shards, encoder_json=encoder)
        loader = fastgpt.data.DataLoader(info["train"], B, T, split="train")
        return [tuple(a.copy() for a in loader.next_batch()) for _ in range(n)], info["train_tokens"]
