"""The build's choice of GPU architectures (csrc/cuda/architectures.cmake, run on its own with `cmake -P` and a
stand-in nvidia-smi), the architectures the installed extension really holds (its fatbins), and the messages a GPU too
old for a precision gives (a Colab T4 is sm_75). What only a real T4 can show (the kernels running there) is not
claimed here; see BENCHMARKS.md."""
import os
import pathlib
import re
import shutil
import struct
import subprocess

import pytest

from fastgpt import _C

REPO = pathlib.Path(__file__).resolve().parent.parent
MODULE = REPO / "csrc" / "cuda" / "architectures.cmake"
CMAKE = shutil.which("cmake")
NVCC = shutil.which("nvcc")
needs_cmake = pytest.mark.skipif(CMAKE is None, reason="needs cmake on PATH")


def choose(tmp_path, gpus=None, smi_rc=0, cudaarchs=None, define=None, nvcc=None):
    """Runs the architecture choice as a fresh configure would. gpus: the lines the stand-in nvidia-smi prints (None:
    no nvidia-smi on PATH). Returns (list, reason)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    if gpus is not None:
        smi.write_text("#!/bin/sh\n" + "".join(f"echo '{g}'\n" for g in gpus) + f"exit {smi_rc}\n")
        smi.chmod(0o755)
    elif smi.exists():
        smi.unlink()
    script = tmp_path / "choose.cmake"
    script.write_text(f'include("{MODULE}")\nfastgpt_cuda_architectures(a how)\nmessage("ARCHS=${{a}}|${{how}}")\n')
    env = {k: v for k, v in os.environ.items() if k != "CUDAARCHS"}
    env["PATH"] = str(bin_dir)  # no real nvidia-smi can answer
    if cudaarchs is not None:
        env["CUDAARCHS"] = cudaarchs
    args = [CMAKE]
    if define is not None:
        args.append(f"-DCMAKE_CUDA_ARCHITECTURES={define}")
    if nvcc is not None:
        args.append(f"-DFASTGPT_NVCC={nvcc}")
    r = subprocess.run(args + ["-P", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    archs, how = re.search(r"ARCHS=(.*)\|(.*)", r.stderr).groups()
    return archs.split(";"), how


@needs_cmake
def test_no_gpu_builds_the_default_list_with_ptx_of_the_newest(tmp_path):
    archs, how = choose(tmp_path)
    assert archs == ["75-real", "80-real", "90"], archs  # "90" is sm_90 code plus compute_90 PTX
    assert "no GPU" in how
    # an nvidia-smi that finds no device (a driver without a GPU) is no GPU either
    assert choose(tmp_path, gpus=["No devices were found"], smi_rc=6)[0] == archs
    assert choose(tmp_path, gpus=["No devices were found"], smi_rc=0)[0] == archs


@needs_cmake
@pytest.mark.parametrize("gpus,expected", [(["7.5"], ["75"]), (["8.6", "9.0", "8.6"], ["86", "90"]),
                                           (["8.9"], ["89"])], ids=["t4", "two-kinds", "l4"])
def test_visible_gpus_are_built_for_exactly(tmp_path, gpus, expected):
    archs, how = choose(tmp_path, gpus=gpus)
    assert archs == expected
    assert how == "the GPUs visible at build time"


@needs_cmake
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_a_gpu_newer_than_nvcc_gets_ptx_of_the_newest_it_knows(tmp_path):
    listed = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True).stdout
    newest = max(int(x) for x in re.findall(r"compute_(\d+)", listed))
    archs, _ = choose(tmp_path, gpus=["99.0", "9.0"], nvcc=NVCC)
    assert archs == [f"{newest}-virtual", "90"]


@needs_cmake
def test_the_user_overrides_the_choice(tmp_path):
    assert choose(tmp_path, gpus=["7.5"], cudaarchs="86")[0] == ["86"]
    assert choose(tmp_path, cudaarchs="80;90")[0] == ["80", "90"]
    archs, how = choose(tmp_path, gpus=["7.5"], cudaarchs="86", define="89-real")
    assert archs == ["89-real"] and how == "CMAKE_CUDA_ARCHITECTURES"


def fatbin_entries(path):
    """{("sm" | "ptx", arch)} of every fatbin in a shared library: nvcc's container (magic 0xBA55ED50, u16 version,
    u16 header size, u64 payload size) holds entries of u16 kind (1 PTX, 2 machine code), u16, u32 header size,
    u64 payload size, ..., u32 architecture at byte 28, which is what cuobjdump --list-elf/--list-ptx print (read by
    hand here because the toolkit on a CI machine may lack cuobjdump)."""
    data, found, i = pathlib.Path(path).read_bytes(), set(), 0
    while (i := data.find(struct.pack("<I", 0xBA55ED50), i)) >= 0:
        header, size = struct.unpack_from("<H", data, i + 6)[0], struct.unpack_from("<Q", data, i + 8)[0]
        j, end = i + header, i + header + size
        while j < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, j)
            assert kind in (1, 2), f"unknown fatbin entry kind {kind} at byte {j} of {path}"
            found.add(("ptx" if kind == 1 else "sm", struct.unpack_from("<I", data, j + 28)[0]))
            j += entry_header + payload
        i = end
    return found


@pytest.mark.skipif(not _C.built_with_cuda, reason="built without CUDA")
def test_the_extension_holds_the_architectures_it_reports():
    """Machine code for "NN" and "NN-real", PTX for "NN" and "NN-virtual", and nothing else (with the default list:
    sm_75, sm_80, sm_90 code and compute_90 PTX)."""
    listed = _C.cuda_architectures.split()
    assert listed, "a CUDA build must report its architectures"
    expected = set()
    for a in listed:
        num, _, kind = a.partition("-")
        expected |= {("sm", int(num))} if kind == "real" else {("ptx", int(num))} if kind == "virtual" else \
            {("sm", int(num)), ("ptx", int(num))}
    assert fatbin_entries(_C.__file__) == expected


@pytest.mark.parametrize("major,minor,precision,needs", [
    (7, 5, "bf16", ["compute capability 8.0", "'fp16'", "'fp32'", "sm_75"]),
    (7, 5, "tf32", ["compute capability 8.0", "'fp32'", "sm_75"]),
    (6, 1, "fp32", ["older than", "sm_75"]),
])
def test_a_gpu_too_old_for_a_precision_says_what_it_can_do(major, minor, precision, needs):
    why = _C.cuda_precision_unsupported(major, minor, precision)
    for word in needs:
        assert word in why, why


@pytest.mark.parametrize("major,minor,precision", [(7, 5, "fp32"), (7, 5, "fp16"), (8, 0, "bf16"), (8, 6, "tf32"),
                                                   (8, 9, "bf16"), (9, 0, "fp16"), (10, 0, "bf16")])
def test_supported_precisions_pass(major, minor, precision):
    assert _C.cuda_precision_unsupported(major, minor, precision) == ""
