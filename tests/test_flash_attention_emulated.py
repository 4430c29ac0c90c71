"""flash_attention on the CPU through the warp emulator: the CUDA kernels' own sources (tensor-core bf16/fp16, the fp32
path on CUDA cores and on TF32 tensor cores, three products per product within 5e-6 of float64 and one within 4e-3; in
"mix" mode also the KV-cache decode kernels of attention_decode.cu and GPUs with less shared memory per block (99 KB:
sm_86/sm_89, where float32 takes the simt kernels and d 128's dq pass 32-key blocks; mode "smem" also 163 KB), in
"quick" mode fp32 on TF32 x3 at T 256 with mma.sync adding as tensor cores do (each sum cut toward zero: the long sums
into O, dK, dV, dQ must not drift, which put an H200's dK 1.1e-5 from float64), the cross-entropy kernels of
cross_entropy.cu, the LayerNorm ones of layernorm.cu (their weight gradients the CPU reference's bits) and
residual_layernorm.cu, the fused one giving the unfused pair's bits, the optimizer step's of adamw.cu and the
embedding's of encoder.cu, which must give the CPU reference's bits, the linear layers' bias-gradient column sums of
matmul_bias.cu and the flash backward's delta pass, the bits of their fixed orders) run in tests/warp_emu (one fiber
per CUDA thread; ldmatrix, mma.sync (bf16/fp16 m16n8k16, tf32 m16n8k8, whose operands must be rounded to TF32),
cvt.rna.tf32, shuffles, ballots, static shared memory and cp.async emulated from the PTX ISA's definitions; also
Hopper's wgmma for the sm90 forward, with its descriptors, 128-byte swizzle, fences and a vector-clock race check
against cp.async and stores, the fused Hopper backward with its turn-taking between CTAs, and the warp-specialised
forward's and backward's mbarriers, named barriers and setmaxnreg, and the forward's TMA copies and their mbarrier
transaction bytes, one CTA taking several tiles in turn in the persistent forward, giving the other sm90 kernels' bits)
and must match a float64 reference. This checks their indexing, fragment layouts, masking and barriers where no GPU is
lent; it is not a GPU run (see BENCHMARKS.md for what only a GPU can verify). "quick" also runs the emulator's own
checks (emu_test.cpp's run_selftest): a wait no thread can end, and lanes at different warp collectives, must stop the
run with their messages. Needs g++ with C++20 and the CUDA headers (cuda_bf16.h); skipped without them."""
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

RUN = Path(__file__).parent / "warp_emu" / "run.sh"


def _cuda_include():
    home = os.environ.get("CUDA_HOME") or (str(Path(shutil.which("nvcc")).parent.parent) if shutil.which("nvcc")
                                           else None)
    return home and (Path(home) / "include" / "cuda_bf16.h").exists()


needs_toolchain = pytest.mark.skipif(not (shutil.which("g++") and shutil.which("bash") and _cuda_include()),
                                     reason="needs g++ and the CUDA toolkit headers")


@needs_toolchain
@pytest.mark.parametrize("mode,lazy,shuffled", [("mix", "1", False), ("mix", "0", False), ("quick", "1", True)],
                         ids=["mix-copy-at-wait", "mix-copy-at-issue", "quick-random-schedule"])
def test_cuda_kernels_in_warp_emulator(tmp_path_factory, mode, lazy, shuffled):
    """The quick case runs each block's threads in a random order (a fresh EMU_SEED each run, in the report): a kernel
    whose barriers hold only in the default first-come order fails under some seed."""
    build = tmp_path_factory.getbasetemp() / "warp_emu"  # one build shared by the cases (make-style timestamps)
    env = {k: v for k, v in os.environ.items() if k != "EMU_SEED"}
    if shuffled:
        env["EMU_SEED"] = str(random.SystemRandom().randrange(1, 2**63))
    r = subprocess.run(["bash", str(RUN), str(build), mode, lazy], capture_output=True, text=True, timeout=900,
                       env=env)
    report = f"EMU_SEED={env.get('EMU_SEED', '(first come, first run)')}\n" + r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, report
    assert "failures 0" in r.stdout and "ok " in r.stdout, report
    assert "FAIL" not in r.stdout, report
    if shuffled:  # the seed reached the emulator
        assert f"in random order, EMU_SEED={env['EMU_SEED']}" in r.stdout, report
