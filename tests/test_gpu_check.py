"""scripts/gpu_check.sh's tests part (run on a lent GPU; `--list-tests` prints its files in order without running
anything): every test file with a GPU case runs once, the bring-up's first, the never-run Hopper cases last."""
import os
import pathlib
import re
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU_ONLY = {"flash_attention_emulated", "wgmma", "ncu_summary", "flash_diagnose", "tokenizer", "data", "hellaswag",
            "hf", "sample", "bench_common", "gpu_check"}


def test_the_tests_part_runs_every_gpu_file_once_in_priority_order():
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--list-tests"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    order = out.stdout.split()
    names = [p.split("/")[-1][len("test_"):].replace(".py", "") for p in order]
    # Every test file is there once (the flash file twice: its Hopper cases apart), or is a CPU-only one left to CI.
    files = sorted(p.stem[len("test_"):] for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted([n for n in names if "@" not in n] + ["flash_attention"]) == \
        [n for n in files if n not in CPU_ONLY], (names, files)
    assert names.count("flash_attention@not_sm90") == 1 and names[-1] == "flash_attention@sm90"
    assert all((ROOT / p.split("@")[0]).is_file() for p in order)
    # test_cuda proves the build runs at all; then the model and the training step, before anything peripheral.
    assert names[0] == "cuda"
    first_peripheral = min(names.index(n) for n in ("notebooks", "ladder", "distributed", "bench_ops"))
    for core in ("model", "train_step", "train_steps", "precision", "flash_attention@not_sm90", "layernorm",
                 "cross_entropy", "matmul", "adamw"):
        assert names.index(core) < first_peripheral, (core, names)


def test_a_tests_entry_is_split_only_at_its_selection():
    # FILE@SEL is pytest -k SEL on FILE; a node id or a folder given by hand in TESTS= goes to pytest as it is.
    def args(entry):
        out = subprocess.run(["bash", "scripts/gpu_check.sh", "--pytest-args", entry], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()
    assert args("tests/test_flash_attention.py@not_sm90") == ["tests/test_flash_attention.py", "-k", "not sm90"]
    assert args("tests/test_cuda.py") == ["tests/test_cuda.py"]
    assert args("tests/test_model.py::test_forward_shapes") == ["tests/test_model.py::test_forward_shapes"]
    assert args("tests") == ["tests"]


def test_first_moves_named_entries_ahead_and_refuses_unknown_ones():
    # FIRST (what the last GPU run failed or never reached) runs first, the rest keeps its order, nothing twice.
    def listing(first):
        return subprocess.run(["bash", "scripts/gpu_check.sh", "--list-tests"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "FIRST": first})
    base = listing("").stdout.split()
    out = listing("resume flash_attention@sm90 cross_entropy")
    assert out.returncode == 0, out.stderr
    moved = out.stdout.split()
    head = ["tests/test_resume.py", "tests/test_flash_attention.py@sm90", "tests/test_cross_entropy.py"]
    assert moved[:3] == head
    assert moved[3:] == [e for e in base if e not in head]
    bad = listing("cross_entropy no_such_file")
    assert bad.returncode == 2 and "no_such_file" in bad.stderr


def test_bench_parts_names_only_parts_that_exist(tmp_path):
    # BENCH_PARTS narrows a short second call's bench; a name with no part behind it would run nothing, silently.
    text = (ROOT / "scripts/gpu_check.sh").read_text()
    listed = text.split('bench_parts=" ', 1)[1].split('"', 1)[0].split()
    gated = re.findall(r"^  if part (\w+); then$", text, re.M)
    assert sorted(listed) == sorted(gated) and len(gated) == len(set(gated)) >= 9, (listed, gated)
    for value, said in (("adamw ce", "BENCH_PARTS names ce"), (" \t", "BENCH_PARTS is blank")):
        bad = subprocess.run(["bash", "scripts/gpu_check.sh", "bench"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "BENCH_PARTS": value, "OUT": str(tmp_path)})
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert not (tmp_path / "build.log").exists()  # refused before the build


def test_ncu_reports_is_checked_before_the_build(tmp_path):
    # NCU_REPORTS narrows the ncu part (scripts/ncu_profile.sh); a misspelt name would cost the call its build.
    bad = subprocess.run(["bash", "scripts/gpu_check.sh", "ncu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "NCU_REPORTS": "ops sm80", "OUT": str(tmp_path)})
    assert bad.returncode == 2 and "NCU_REPORTS names sm80" in bad.stderr, bad.stderr
    assert not (tmp_path / "build.log").exists()


def test_the_initcheck_probe_refuses_a_bad_argument_and_says_when_it_cannot_run():
    # scripts/initcheck_tma.py (gpu_check's initcheck-tma-probe line): without an H100/H200 it runs
    # nothing and says why; a wrong argument is a usage error.
    import sys
    bad = subprocess.run([sys.executable, "scripts/initcheck_tma.py", "both"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "usage: initcheck_tma.py tma|plain" in bad.stderr
    import torch
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return  # on an H100/H200 it runs (gpu_check's sanitize part, under initcheck)
    out = subprocess.run([sys.executable, "scripts/initcheck_tma.py", "tma"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("initcheck_tma: skipped ("), (out.stdout, out.stderr)


def test_train_sanitize_parts_cover_every_model_once():
    # gpu_check.sh runs racecheck's train_sanitize as --part 1/2 and 2/2 side by side: together they must run every
    # model of the whole list, each once; a part outside 1..N is a usage error.
    def names(*args):
        out = subprocess.run([sys.executable, "scripts/train_sanitize.py", "--list", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("\n")[:-1]

    whole = names()
    assert len(whole) == 9 and len(set(whole)) == 9 and "bf16 unfused hs 32" in whole
    for n in (2, 3):
        parts = [names("--part", f"{k}/{n}") for k in range(1, n + 1)]
        assert sorted(sum(parts, [])) == sorted(whole)
        assert all(parts)  # none empty
    for bad in ("0/2", "3/2", "1", "a/b"):
        out = subprocess.run([sys.executable, "scripts/train_sanitize.py", "--list", "--part", bad], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "--part" in out.stderr, (bad, out.stderr)


def test_device_prep_copies_the_data_and_names_the_commit(tmp_path, shakespeare_txt):
    # scripts/device_prep.sh fills the folder a device call carries (DEVICE_DIR here, not the checkout's .device):
    # the shared data, which gpu_check.sh points FASTGPT_SHARED at, and the commit; a missing data folder is refused
    # before anything is removed.
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "keep").write_text("x")
    env = {**os.environ, "DEVICE_DIR": str(dev), "FASTGPT_SHARED": str(tmp_path / "nowhere")}
    prep = lambda *args, **more: subprocess.run(["bash", "scripts/device_prep.sh", *args], cwd=ROOT,
                                                capture_output=True, text=True, timeout=60, env={**env, **more})
    bad = prep("--no-wheels", "--no-prebuild")
    assert bad.returncode == 2 and "tinyshakespeare.txt" in bad.stderr and (dev / "keep").exists()
    shared = str(pathlib.Path(shakespeare_txt).parent.parent)
    bad = prep("--no-wheel", FASTGPT_SHARED=shared)  # a misspelt flag is refused before anything is removed
    assert bad.returncode == 2 and "usage: device_prep.sh" in bad.stderr and (dev / "keep").exists()
    out = prep("--no-wheels", "--no-prebuild", FASTGPT_SHARED=shared)
    assert out.returncode == 0, out.stderr
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert (dev / "COMMIT").read_text() == head and not (dev / "keep").exists()
    assert not (dev / "wheels").exists() and not (dev / "prebuilt").exists()
    assert "MiB (the limit is 64)" in out.stdout
    copied = dev / "shared" / "data" / "tinyshakespeare.txt"
    assert copied.read_bytes() == pathlib.Path(shakespeare_txt).read_bytes()


def without_archs(**more):
    """The environment without the caller's CUDAARCHS (the scripts' default, 90, applies), plus more."""
    return {**{k: v for k, v in os.environ.items() if k != "CUDAARCHS"}, **more}


def stamp(root, archs=None):
    out = subprocess.run(["bash", str(ROOT / "scripts" / "source_stamp.sh"), str(root)], capture_output=True,
                         text=True, timeout=60, env=without_archs(**({"CUDAARCHS": archs} if archs else {})))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_source_stamp_follows_what_the_wheel_is_built_from(tmp_path):
    # scripts/source_stamp.sh: the line that ties device_prep.sh's prebuilt wheel to the sources. It must change with
    # any file the wheel is made from and with the architectures, and with nothing else: not the files' times (the
    # device tool's copy renews them), not caches or compiled leftovers, not the tests.
    files = {"csrc/cuda/a.cu": "kernel", "csrc/cpu/b.cpp": "ref", "python/fastgpt/m.py": "x = 1",
             "CMakeLists.txt": "cmake", "pyproject.toml": "[project]", "tests/test_a.py": "t"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    first = stamp(tmp_path)
    assert first.startswith("archs=90 src=") and stamp(tmp_path, "80").startswith("archs=80 src=")
    assert stamp(tmp_path, "80").split()[1] == first.split()[1]
    os.utime(tmp_path / "csrc/cuda/a.cu", (1e9, 1e9))
    (tmp_path / "python/fastgpt/__pycache__").mkdir()
    (tmp_path / "python/fastgpt/__pycache__/m.cpython-312.pyc").write_text("cache")
    (tmp_path / "python/fastgpt/_C.cpython-312-x86_64-linux-gnu.so").write_text("leftover")
    (tmp_path / "tests/test_a.py").write_text("another test")
    assert stamp(tmp_path) == first
    for name in ("csrc/cuda/a.cu", "python/fastgpt/m.py", "CMakeLists.txt", "pyproject.toml"):
        (tmp_path / name).write_text(files[name] + " changed")
        assert stamp(tmp_path) != first, name
        (tmp_path / name).write_text(files[name])
        assert stamp(tmp_path) == first
    (tmp_path / "csrc/cuda/new.cuh").write_text("")
    assert stamp(tmp_path) != first
    (tmp_path / "pyproject.toml").unlink()
    gone = subprocess.run(["bash", str(ROOT / "scripts" / "source_stamp.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert gone.returncode == 2 and "no pyproject.toml" in gone.stderr


def test_gpu_check_takes_the_prebuilt_wheel_only_for_these_sources(tmp_path):
    # gpu_check.sh installs device_prep.sh's wheel instead of building only when its stamp is this tree's line for
    # the architectures it builds (CUDAARCHS, default 90); else it builds from source (--prebuilt-status says which).
    def status(**env):
        out = subprocess.run(["bash", "scripts/gpu_check.sh", "--prebuilt-status"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=without_archs(PREBUILT=str(tmp_path), **env))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()
    assert status() == "none"
    (tmp_path / "STAMP").write_text(stamp(ROOT, "90") + "\n")
    assert status() == "none"  # a stamp without a wheel
    (tmp_path / "fastgpt-0.1.0-cp312-cp312-linux_x86_64.whl").write_bytes(b"PK")
    assert status() == "match" and status(CUDAARCHS="90") == "match"
    assert status(CUDAARCHS="80").startswith("stale (built from archs=90 src=")
    (tmp_path / "STAMP").write_text("archs=90 src=0123456789abcdef0123\n")
    assert status().startswith("stale (")


def gpu_check(out, *args):
    """gpu_check.sh ARGS with OUT=out (its --out-listing and --pack-evidence, which need no GPU) -> stdout."""
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *map(str, args)], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, OUT=str(out)))
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_the_evidence_archive_holds_only_this_calls_files(tmp_path):
    """gpu_check.sh's archive of small files (benchmark JSON, build and NCCL logs, sanitizer logs) takes only the
    files that are not in the listing of the output folder made at the call's start (--out-listing), as they were
    then: what an earlier run left there stays as it was whatever its time (here as new as the call's own files: a
    start stamp let files of the day before into both archives of the 2026-11-27 H200 run), and so does what is not
    evidence; a file of that listing that the call wrote again goes in."""
    out = tmp_path / "out"
    (out / "san").mkdir(parents=True)
    stale = {"bench_adamw.json": "old", "pytest_nccl.log": "old nccl", "san/memcheck-x.log": "old san"}
    for name, text in {**stale, "bench_gpu_train.json": "earlier run"}.items():
        (out / name).write_text(text)
    listing = tmp_path / "listing"
    listing.write_text(gpu_check(out, "--out-listing"))
    assert sorted(line.split("\t")[0] for line in listing.read_text().splitlines()) == \
        sorted([*stale, "bench_gpu_train.json"])
    fresh = {"bench_gpu_train.json": "this call's, longer", "build.log": "built", "san/racecheck-y.log": "new san"}
    for name, text in {**fresh, "bench.log": "kept", "sub/deep.json": "not top level"}.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    gpu_check(out, "--pack-evidence", listing)
    with tarfile.open(out / "evidence.tgz") as t:
        assert sorted(t.getnames()) == sorted(fresh)
        assert t.extractfile("san/racecheck-y.log").read() == b"new san"
        assert t.extractfile("bench_gpu_train.json").read() == b"this call's, longer"
    for name, text in {**stale, "bench.log": "kept", "sub/deep.json": "not top level"}.items():
        assert (out / name).read_text() == text
    assert not any((out / name).exists() for name in fresh)
    # a call with nothing new writes an empty archive: the one above cannot pass for its evidence
    listing.write_text(gpu_check(out, "--out-listing"))
    gpu_check(out, "--pack-evidence", listing)
    with tarfile.open(out / "evidence.tgz") as t:
        assert t.getnames() == []
