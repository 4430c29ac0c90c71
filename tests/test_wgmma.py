"""The Hopper flash attention kernels' use of wgmma (csrc/cuda/wgmma.cuh, flash_attention_sm90.cuh), held to CUTLASS.

The sm90 kernels have not run on a GPU; the warp emulator checks them against one reading of the PTX ISA, the same
reading they were written from. These tests put CUTLASS's code, which runs on Hopper in CUTLASS's own kernels, in
place of that reading (CUTLASS's headers come with the `nvidia-cutlass` test dependency):
- tests/warp_emu/cute_check.cpp: the tile loader's placement of every element against CuTe's 128-byte swizzled
  K-major and MN-major layouts, every descriptor the kernels pass against the one CuTe's TiledMMA partition makes for
  the same slice, the element the emulator reads through each descriptor against CuTe's address of it, and the
  emulator's accumulator and register-A maps against CuTe's CLayout_64xN and ALayout_64x16;
- tests/warp_emu/cute_ptx.cu: the PTX wgmma instruction of each wgmma.cuh call against CUTLASS's for the same
  operation (m64n64k16 and m64n128k16, bf16 and f16, both operands from shared memory or A from registers with an
  MN-major B; the fused backward's m64n32k16 with an MN-major A and a K-major B, and the 128-query warp-specialised
  one's m64n64k16 with both MN-major), compiled by nvcc for sm_90a;
  and the warp-specialised forward's mbarrier, named-barrier and setmaxnreg instructions against barrier.h's and
  reg_reconfig.h's, its TMA instructions (the copies, and the tensor store of O) and the backward's bulk copies
  (tma.cuh) against copy_sm90_tma.hpp's; and in cute_check.cpp, the TMA loader's placement of every element (the
  emulator's copies) against the same CuTe layouts, whose TMA swizzle mode CuTe takes to be the 128-byte one tma.cu
  encodes.
They say nothing of speed, and nothing of what the emulator cannot model; a GPU run is still the verification."""
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ptx import compile_ptx, entries

HERE = Path(__file__).parent / "warp_emu"


def _cutlass_include():
    spec = importlib.util.find_spec("cutlass_library")  # not imported: only its files are needed
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return path if (path / "cute" / "tensor.hpp").exists() else None


def _cuda_home():
    home = os.environ.get("CUDA_HOME")
    if not home and shutil.which("nvcc"):
        home = str(Path(shutil.which("nvcc")).resolve().parent.parent)
    return Path(home) if home and (Path(home) / "include" / "cuda_bf16.h").exists() else None


needs_cutlass = pytest.mark.skipif(_cutlass_include() is None,
                                   reason="needs CUTLASS's headers (pip install nvidia-cutlass)")


@needs_cutlass
@pytest.mark.skipif(not (shutil.which("g++") and shutil.which("bash") and _cuda_home()),
                    reason="needs g++ and the CUDA toolkit headers")
def test_sm90_tiles_descriptors_and_emulator_match_cute(tmp_path):
    env = dict(os.environ, CUTLASS_INCLUDE=str(_cutlass_include()))
    r = subprocess.run(["bash", str(HERE / "run.sh"), str(tmp_path), "cute"], capture_output=True, text=True,
                       timeout=600, env=env)
    report = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, report
    m = re.search(r"cute checks (\d+) failures (\d+)", r.stdout)
    assert m, report
    assert int(m.group(2)) == 0, report
    # every (row, column) of five tile shapes, every descriptor slice and register: far more than a stub would make
    assert int(m.group(1)) > 300_000, report


def _wgmma_lines(ptx):
    """The PTX wgmma instruction (and its scale-d predicate) of each kernel, register numbers and spacing dropped."""
    return {name: [" ".join(re.sub(r"%(f|rd|r|p)\d+", r"%\1", line).replace(",", " , ").split()) for line in lines
                   if re.match(r"\s*(wgmma\.|setp\.ne\.b32 p,)", line)]
            for name, lines in entries(ptx, r"((?:ours|cute)_(?:ss|rs|amn|mn)_\w+?)P").items()}


@pytest.fixture(scope="module")
def cute_ptx(tmp_path_factory):
    """tests/warp_emu/cute_ptx.cu compiled by nvcc to PTX for sm_90a (once for the tests that read it)."""
    if _cutlass_include() is None or shutil.which("nvcc") is None:
        pytest.skip("needs CUTLASS's headers (pip install nvidia-cutlass) and nvcc")
    return compile_ptx(HERE / "cute_ptx.cu", tmp_path_factory.mktemp("cute_ptx") / "cute_ptx.ptx", "sm_90a",
                       [_cutlass_include()])


def test_wgmma_instructions_are_cutlass_instructions(cute_ptx):
    lines = _wgmma_lines(cute_ptx)
    pairs = sorted(n[len("ours_"):] for n in lines if n.startswith("ours_"))
    want = [f"{k}_{n}_{t}" for k in ("ss", "rs") for n in (64, 128) for t in ("BF16", "F16")]
    assert pairs == sorted(want + [f"{k}_{t}" for k in ("amn_32", "mn_64") for t in ("BF16", "F16")]), lines
    for p in pairs:
        ours, cutlass = lines["ours_" + p], lines["cute_" + p]
        assert len(ours) == 2 and any(x.startswith("wgmma.mma_async") for x in ours), (p, ours)
        assert ours == cutlass, (p, ours, cutlass)


def _sync_instructions(ptx):
    """The synchronisation instructions (opcode and qualifiers; setmaxnreg with its count) of each sync_ kernel."""
    pattern = re.compile(r"\s*(?:@%?\w+\s+)?((?:mbarrier|bar|barrier|setmaxnreg|cp|prefetch|fence)\.[\w.:]+)"
                         r"(\s+\d+)?")
    return {name: {m.group(1) + (m.group(2) or "") for m in map(pattern.match, lines) if m}
            for name, lines in entries(ptx, r"(\w+?_(?:sync_(?:mbar|named|regs|tma|tstore|bulk|g2s)|bulk_add))")
            .items()}


def test_barrier_instructions_are_cutlass_instructions(cute_ptx):
    """mbar_init / mbar_arrive / mbar_wait, bar_sync / bar_arrive and regs_dec / regs_inc (wgmma.cuh), and prefetch
    / expect / arrive_expect / load, store_box, store / commit / wait_read and load_bulk (tma.cuh), for the
    warp-specialised kernels, emit the instructions CUTLASS's ClusterBarrier, NamedBarrier, warpgroup_reg_(de)alloc,
    ClusterTransactionBarrier (expect_transaction, arrive_and_expect_tx), prefetch_tma_descriptor, SM90_TMA_LOAD_4D,
    SM90_TMA_STORE_4D (behind tma_store_fence), SM90_BULK_COPY_S2G, tma_store_arrive, tma_store_wait and
    SM90_BULK_COPY_G2S emit, with the same qualifiers (state space, scope, parity, register counts, the copy's
    completion on the mbarrier's transaction bytes and its L2 hint, whose value both load from the same constant; the
    bulk copies' completion by bulk group)."""
    found = _sync_instructions(cute_ptx)
    assert sorted(n for n in found if n.startswith("ours_")) == ["ours_bulk_add", "ours_sync_bulk", "ours_sync_g2s",
                                                                 "ours_sync_mbar", "ours_sync_named", "ours_sync_regs",
                                                                 "ours_sync_tma", "ours_sync_tstore"], found
    want = {"mbar": {"mbarrier.init.shared::cta.b64", "mbarrier.arrive.shared::cta.b64",
                     "mbarrier.try_wait.parity.shared::cta.b64"},
            "named": {"bar.sync", "bar.arrive"},
            "regs": {"setmaxnreg.dec.sync.aligned.u32 24", "setmaxnreg.inc.sync.aligned.u32 240"},
            "tma": {"prefetch.tensormap", "mbarrier.expect_tx.shared::cta.b64",
                    "mbarrier.arrive.expect_tx.shared::cta.b64",
                    "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"},
            "bulk": {"cp.async.bulk.global.shared::cta.bulk_group", "cp.async.bulk.commit_group",
                     "cp.async.bulk.wait_group.read 0"},
            "g2s": {"mbarrier.arrive.expect_tx.shared::cta.b64",
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"},
            "tstore": {"fence.proxy.async.shared::cta", "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group",
                       "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read 0"}}
    for what, instructions in want.items():
        assert found["ours_sync_" + what] == found["cute_sync_" + what] == instructions, (what, found)
    # No CUTLASS counterpart (its bulk reduce takes a tensor map): the PTX ISA's spelling of the f32 bulk add to
    # global memory from shared, completed by bulk group, the full wait (writes done, not only the source read) and
    # the proxy fence between an acquire of global memory and the copy engine's access.
    assert found["ours_bulk_add"] == {"fence.proxy.async.global",
                                      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
                                      "cp.async.bulk.commit_group", "cp.async.bulk.wait_group 0"}, found
    hint = str(0x1000000000000000)  # CacheHintSm90::EVICT_NORMAL
    tma = entries(cute_ptx, r"(\w+?_sync_tma)")
    assert all(any(hint in line for line in tma[k]) for k in ("ours_sync_tma", "cute_sync_tma")), tma
