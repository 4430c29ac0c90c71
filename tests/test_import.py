"""Importing fastgpt before torch: torch loads the NCCL of its pip package (nvidia-nccl-cu1x) by path; a fastgpt
built against another libnccl.so.2 (the CUDA toolkit's) must not make its copy the process's first, or `import torch`
afterwards fails on a symbol the other lacks (fastgpt/__init__.py preloads the pip package's library). Fresh
interpreters, since this process has both imported already."""
import subprocess
import sys

import pytest


@pytest.mark.uses_gpu  # a CUDA build's libraries (NCCL) are what it checks
def test_torch_imports_after_fastgpt():
    r = subprocess.run([sys.executable, "-c", "import fastgpt, torch; x = torch.ones(2); print(float(x.sum()))"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr[-2000:]


@pytest.mark.uses_gpu
def test_transformers_loads_after_fastgpt(tmp_path):
    code = ("import fastgpt, transformers\n"
            "fastgpt.GPT(fastgpt.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8))"
            f".save_pretrained({str(tmp_path)!r})\n"
            f"print(transformers.GPT2LMHeadModel.from_pretrained({str(tmp_path)!r}).num_parameters())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == str(16 * 8 + 8 * 8 + 12 * 8 * 8 + 13 * 8 + 2 * 8), \
        r.stderr[-2000:]
