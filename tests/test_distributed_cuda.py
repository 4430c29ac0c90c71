"""Data parallel on GPUs through NCCL (skipped without a GPU and an NCCL build): the NCCL communicator at world
size 1 in this process (every collective, the layer-by-layer overlap, ZeRO-1), and with two GPUs two ranks
launched the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the TCP rendezvous carries NCCL's id)
against one process on the same global batch."""
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import fastgpt
from fastgpt import _C, distributed
from fastgpt.data import write_shard
from test_distributed import _steps

REPO = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (fastgpt.cuda_available() and _C.built_with_nccl),
                                reason="needs a CUDA GPU and a fastgpt built with NCCL")


def _cfg():
    return fastgpt.GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=64)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1])
def test_nccl_world_of_one_matches_a_plain_model(precision, zero):
    seed = int.from_bytes(os.urandom(4), "little")
    plain = fastgpt.GPT(_cfg(), device="cuda", precision=precision, seed=5)
    dp = fastgpt.GPT(_cfg(), device="cuda", precision=precision, seed=5, data_parallel=True)
    assert dp.data_parallel and dp._engine.world_size == 1
    _steps(plain, fastgpt.AdamW(plain), seed)
    _steps(dp, fastgpt.AdamW(dp, zero_stage=zero), seed)
    assert dp.grad_sync_count == 3
    a = np.concatenate([w.ravel() for w in dp.state_dict().values()]).astype(np.float64)
    b = np.concatenate([w.ravel() for w in plain.state_dict().values()]).astype(np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-6


def test_nccl_host_collectives():
    comm = distributed._comm_for("cuda:0")
    assert comm.name == "nccl" and comm.world_size == 1
    x = np.random.default_rng().standard_normal(5)
    y = x.copy()
    comm.all_reduce_host(y)
    np.testing.assert_array_equal(x, y)
    comm.barrier()


@pytest.mark.skipif(_C.cuda_device_count() < 2, reason="needs two GPUs")
def test_two_gpus_torchrun_style_match_one_process(tmp_path):
    data = tmp_path / "tokens.bin"
    write_shard(data, np.cumsum(np.random.default_rng().integers(1, 3, size=20_000)) % 96)
    worker = str(REPO / "tests" / "dist_worker.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, FASTGPT_DIST_TIMEOUT="120")
    procs = [subprocess.Popen([sys.executable, worker, "--data", str(data), "--out", str(tmp_path / "dp.npz"),
                               "--device", "cuda"],
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    subprocess.run([sys.executable, worker, "--data", str(data), "--out", str(tmp_path / "one.npz"), "--device",
                    "cuda", "--accum", "4"], env=base, check=True, timeout=300)
    dp, one = np.load(tmp_path / "dp.npz"), np.load(tmp_path / "one.npz")
    assert bool(dp["identical"]) and int(dp["syncs"]) == 10
    np.testing.assert_allclose(dp["losses"], one["losses"], rtol=0, atol=1e-4)
