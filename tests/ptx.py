"""PTX and SASS for tests that read what nvcc makes of the kernels and their building blocks (test_wgmma.py,
test_flash_attention.py, test_layernorm.py): a source compiled to PTX, and its kernels' lines by entry name; or to a
cubin, and its kernels' machine instructions (nvdisasm). No GPU needed; nvcc on PATH."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def compile_ptx(src, out, arch, includes=(), timeout=600):
    """nvcc -ptx of the file `src` for `arch` (e.g. "sm_90a") with csrc/ and `includes` on the include path; -> the
    PTX text (written to `out`). A failed compile fails the test with nvcc's message."""
    args = ["nvcc", "-std=c++17", f"-arch={arch}", "-ptx", "-DFASTGPT_WITH_CUDA", f"-I{CSRC}"]
    r = subprocess.run(args + [f"-I{i}" for i in includes] + [str(src), "-o", str(out)], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(out).read_text()


def entries(ptx, name_pattern):
    """{name: its lines} for each kernel of the PTX whose mangled entry name matches name_pattern (group 1 the name
    kept), the lines up to the next entry."""
    out, name = {}, None
    for line in ptx.splitlines():
        if line.startswith(".visible .entry"):
            entry = re.match(r"\.visible \.entry _Z\d+" + name_pattern, line)
            name = entry.group(1) if entry else None
            if name:
                out[name] = []
        elif name:
            out[name].append(line)
    return out


def kernel_lines(ptx, name):
    """The lines of the one kernel of the PTX whose mangled entry name contains `name`, up to the next entry. Also
    kernels in an anonymous namespace (layernorm.cu's), whose entries are .entry, not .visible .entry."""
    found, lines = [], None
    for line in ptx.splitlines():
        entry = re.match(r"(?:\.visible )?\.entry (\S+?)\(", line)
        if entry:
            lines = [] if name in entry.group(1) else None
            if lines is not None:
                found.append(lines)
        elif lines is not None:
            lines.append(line.strip())
    assert len(found) == 1, f"{len(found)} kernels named like {name}"
    return found[0]


# ---- SASS: what ptxas made of the PTX (instruction order is ptxas's, not the source's)

def nvdisasm():
    """The path of nvdisasm: on PATH, or from the `nvidia-cuda-nvdisasm` wheel (a test dependency, as the toolkit
    on the CI machine has nvcc and ptxas but no disassembler); None without either."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    for base in map(Path, sys.path):
        for path in sorted(base.glob("nvidia/*/bin/nvdisasm")):
            if os.access(path, os.X_OK):
                return str(path)
    return None


def compile_sass(src, out, gencode, timeout=600):
    """nvcc -cubin of the file `src` with csrc/ on the include path, as CMakeLists.txt builds it (C++17,
    FASTGPT_WITH_CUDA, -lineinfo; `gencode` e.g. "arch=compute_90a,code=sm_90a"), disassembled by nvdisasm
    -> {mangled kernel name: its instructions in address order, predicates and operands kept, ';' dropped}."""
    args = ["nvcc", "-std=c++17", f"--generate-code={gencode}", "-cubin", "-lineinfo", "-DFASTGPT_WITH_CUDA=1",
            f"-I{CSRC}", str(src), "-o", str(out)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([nvdisasm(), "-c", str(out)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    kernels, name = {}, None
    for line in r.stdout.splitlines():
        head = re.match(r"\.text\.(\S+):$", line.strip())
        if head:
            name = head.group(1)
            kernels[name] = []
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if ins and name:
            kernels[name].append(ins.group(1))
    return kernels


def unpredicated(ins):
    """A SASS instruction (compile_sass's form) without its guard predicate (@P0, @!UP1, ...): its opcode first."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins)
