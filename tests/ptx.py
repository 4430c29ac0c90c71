"""PTX for tests that read what nvcc makes of the kernels and their building blocks (test_wgmma.py,
test_flash_attention.py, test_layernorm.py): a source compiled to PTX, and its kernels' lines by entry name. No GPU
needed; nvcc on PATH."""
import re
import subprocess
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
