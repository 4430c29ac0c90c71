"""Data-parallel training on CPUs: ranks started by mpiexec (the MPI of the test dependencies) against one process
on the same global batch, ZeRO-1 against plain data parallel, one reduction per optimizer step, failures that must
not hang, bad launches, and the TCP rendezvous NCCL's id travels over under torchrun/srun."""
import json
import os
import pathlib
import shutil
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import fastgpt
from fastgpt import distributed
from fastgpt.data import write_shard

REPO = pathlib.Path(__file__).resolve().parent.parent
WORKER = str(REPO / "tests" / "dist_worker.py")


def _mpiexec():
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        exe = None
    if exe is None:
        msg = "mpi4py and mpiexec are test dependencies (pip install '.[test]')"
        if os.environ.get("FASTGPT_REQUIRE_DATA") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def _env(timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1", FASTGPT_DIST_TIMEOUT=str(timeout))
    for k in list(env):  # whatever launched pytest must not leak into the jobs it starts
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID") or \
                k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL")):
            env.pop(k)
    # Open MPI (the system MPI of some machines, e.g. the GPU one, where tests run as root without ssh) refuses root
    # without the first two and wants an rsh agent even for a job on this node without the third; MPICH ignores them.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_plm_rsh_agent="sh")
    return env


def _run(cmd, timeout=120, check=True, env=None):
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    r.seconds = time.monotonic() - t0
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "tokens.bin"
    # Learnable (each token is the last plus 1 or 2), so the loss must fall; fresh on every run.
    write_shard(path, np.cumsum(np.random.default_rng().integers(1, 3, size=20_000)) % 96)
    return str(path)


def _train(tmp_path, shard, ranks, accum, tag, *extra, timeout=120):
    out = tmp_path / f"{tag}.npz"
    cmd = [sys.executable, WORKER, "--data", shard, "--out", str(out), "--accum", str(accum), *extra]
    _run(([_mpiexec(), "-n", str(ranks)] if ranks else []) + cmd, timeout=timeout)
    return dict(np.load(out))


def _not_key_bias(n_params):
    # The key bias's true gradient is 0 (softmax is shift-invariant per query), so AdamW amplifies rounding noise
    # there into O(lr) steps of either sign: those entries are compared by the others' standard only via losses.
    model = fastgpt.GPT(fastgpt.GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=32))
    keep = np.ones(n_params, bool)
    for name, shape, offset in model._layout:
        if name.endswith("attn.c_attn.bias"):
            keep[offset + shape[0] // 3: offset + 2 * shape[0] // 3] = False
    return keep


@pytest.mark.parametrize("ranks", [2, 3])
def test_matches_one_process_on_the_same_global_batch(ranks, tmp_path, shard):
    dp = _train(tmp_path, shard, ranks, 2, "dp")
    one = _train(tmp_path, shard, 0, 2 * ranks, "one")
    assert int(dp["world"]) == ranks and int(one["world"]) == 1
    assert bool(dp["identical"]), "ranks' weights differ bitwise after some step"
    assert int(dp["syncs"]) == 10, "one gradient reduction per optimizer step"
    np.testing.assert_allclose(dp["losses"], one["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(dp["norms"], one["norms"], rtol=1e-4)
    keep = _not_key_bias(dp["params"].size)
    a, b = dp["params"][keep].astype(np.float64), one["params"][keep].astype(np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5
    assert dp["losses"][-1] < dp["losses"][0] - 0.1, "it trains"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_zero1_gives_the_same_weights_as_plain_data_parallel(precision, tmp_path, shard):
    plain = _train(tmp_path, shard, 2, 2, "plain", "--precision", precision, "--steps", "4")
    zero = _train(tmp_path, shard, 2, 2, "zero", "--precision", precision, "--steps", "4", "--zero", "1")
    assert bool(zero["identical"]) and int(zero["syncs"]) == 4
    np.testing.assert_array_equal(zero["params"], plain["params"])
    np.testing.assert_array_equal(zero["losses"], plain["losses"])
    assert int(zero["moments"]) * 2 == int(zero["padded"]), "each rank keeps half the moments"
    assert int(plain["moments"]) == plain["params"].size


@pytest.mark.parametrize("zero,precision", [(0, "fp32"), (1, "bf16"), (0, "fp16")])
def test_train_step_gives_the_loop_s_weights(zero, precision, tmp_path, shard):
    # AdamW.train_step (the norm's per-rank slots reduced on the device, the clip folded into the update; fp16: the
    # loss scale divided out and updated there, alike on every rank) against the loop of forward/backward,
    # clip_grad_norm and step (fp16: unscaled on the host): the same bits, and every rank the same weights.
    extra = ("--steps", "3", "--zero", str(zero), "--precision", precision)
    loop = _train(tmp_path, shard, 2, 2, "loop", *extra)
    fused = _train(tmp_path, shard, 2, 2, "step", *extra, "--train-step")
    assert bool(fused["identical"]) and int(fused["syncs"]) == 3
    assert list(fused["graph_counts"]) == [0, 0], "a data-parallel step asked for graph=True must run eagerly"
    np.testing.assert_array_equal(fused["params"], loop["params"])
    np.testing.assert_array_equal(fused["losses"], loop["losses"])
    np.testing.assert_array_equal(fused["norms"], loop["norms"])
    assert float(fused["loss_scale"]) == float(loop["loss_scale"]) == (2.0**16 if precision == "fp16" else 1.0)


def test_layer_by_layer_reduction_reduces_every_gradient_once(tmp_path, shard):
    # The overlapped path (NCCL's) hands the gradients over per layer slice, then wte/wpe/ln_f: a slice reduced twice
    # or never would leave the ranks apart or off plain data parallel. At 2 ranks a sum is a + b either way: same bits.
    plain = _train(tmp_path, shard, 2, 2, "plain", "--steps", "3")
    overlap = _train(tmp_path, shard, 2, 2, "overlap", "--steps", "3", "--overlap")
    assert bool(overlap["identical"]) and int(overlap["syncs"]) == 3
    np.testing.assert_array_equal(overlap["params"], plain["params"])


@pytest.mark.parametrize("how", ["raise", "kill", "exit"])
def test_a_failing_rank_ends_the_job(how, tmp_path, shard):
    cmd = [_mpiexec(), "-n", "2", sys.executable, WORKER, "--data", shard, "--out", str(tmp_path / "x.npz"),
           "--fail", how, "--steps", "50"]
    r = _run(cmd, timeout=90, check=False, env=_env(timeout=5))
    assert r.returncode != 0
    assert r.seconds < 30
    if how == "raise":
        assert "fails on purpose" in r.stderr + r.stdout
    if how == "exit":  # the rank that left waited FASTGPT_DIST_TIMEOUT for the others, then ended the job
        assert "not every rank reached the end" in r.stderr + r.stdout


def _python(code, env_extra, timeout=60):
    env = dict(_env(), **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_launches_say_what_is_wrong(tmp_path, shard):
    init = "from fastgpt import distributed; print(distributed.init())"
    r = _python(init, {"RANK": "0", "WORLD_SIZE": "2"})
    assert r.returncode != 0 and "MASTER_ADDR is not set" in r.stderr
    r = _python(init, {"WORLD_SIZE": "2"})
    assert r.returncode != 0 and "no launcher" in r.stderr
    r = _python(init, {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert r.returncode != 0 and "RANK=2 must be in [0, WORLD_SIZE=2)" in r.stderr
    # A CPU model under torchrun has no MPI to reduce with.
    r = _python("import fastgpt; fastgpt.distributed.init(); fastgpt.GPT(fastgpt.GPTConfig(block_size=8, "
                "vocab_size=16, n_layer=1, n_head=1, n_embd=8))",
                {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert r.returncode != 0 and "mpiexec -n 2" in r.stderr
    r = _python(f"import sys; sys.argv = ['train.py', '--input', {shard!r}]; from fastgpt.train import main; main()",
                {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert r.returncode == 2 and "launch with mpiexec -n 2" in r.stderr
    # WORLD_SIZE that disagrees with mpiexec.
    env = dict(_env(), WORLD_SIZE="3")
    r = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", init], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "WORLD_SIZE=3 disagrees with the MPI launcher" in r.stdout + r.stderr
    # A total batch that 2 ranks cannot split: every rank says so and the job ends (no rank left waiting).
    r = _run([_mpiexec(), "-n", "2", sys.executable, str(REPO / "train.py"), "--input", shard, "-B", "2", "-T", "8",
              "--total-batch-size", "48", "--out-dir", str(tmp_path / "run")], timeout=60, check=False)
    assert r.returncode == 2 and "must be a multiple of B*T*world_size = 2*8*2" in r.stderr and r.seconds < 30


def test_slurm_environment():
    show = ("from fastgpt import distributed as d; print(d.init(), d.launcher(), d._group.addr, d._group.port)")
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
             "SLURM_JOB_NODELIST": "gpu[007-008]"}
    r = _python(show, slurm)
    assert r.returncode == 0 and r.stdout.split() == ["(1,", "4,", "1)", "slurm", "gpu007", str(29500 + 456)], r.stderr
    r = _python(show, dict(slurm, MASTER_ADDR="head", MASTER_PORT="4000"))
    assert r.stdout.split()[-2:] == ["head", "4000"], r.stderr
    r = _python(show, dict(slurm, WORLD_SIZE="8"))
    assert r.returncode != 0 and "WORLD_SIZE=8 disagrees with SLURM_NTASKS=4" in r.stderr
    r = _python(show, {k: v for k, v in slurm.items() if k != "SLURM_JOB_NODELIST"})
    assert r.returncode != 0 and "cannot find rank 0's host" in r.stderr


def test_broadcast_object_without_mpi(monkeypatch):
    # Under torchrun/srun the host channel is NCCL's sum of doubles: rank 1's view of a 2-rank job, rank 0's
    # contributions (the size, then the bytes) played back by a stand-in communicator.
    obj = {"out_dir": "runs/x", "n": [1, 2.5]}
    import pickle
    data = np.frombuffer(pickle.dumps(obj), np.uint8).astype(np.float64)
    from_root = [np.array([float(data.size)]), data]

    class Sum:
        def all_reduce_host(self, x):
            x += from_root.pop(0)

    monkeypatch.setattr(distributed, "_group", distributed._Group(1, 2, 1, "torchrun", "h", 1))
    monkeypatch.setattr(distributed, "_host_comm", lambda: Sum())
    assert distributed.broadcast_object("ignored on rank 1") == obj and not from_root
    with pytest.raises(ValueError, match="op must be"):
        distributed.all_reduce(1.0, op="max")


def test_first_slurm_host():
    assert distributed._first_slurm_host("gpu[003-005,9],cpu1") == "gpu003"
    assert distributed._first_slurm_host("node7,node8") == "node7"
    assert distributed._first_slurm_host("a[10,2]") == "a10"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RDZV = ("import sys, pickle; from fastgpt import distributed as d; r = int(sys.argv[1]); w = int(sys.argv[2]); "
        "info = pickle.dumps(('host', int(sys.argv[4]))); "
        "out = d._rendezvous('127.0.0.1', int(sys.argv[3]), r, w, bytes(range(128)) if r == 0 else b'', info, "
        "float(sys.argv[5])); assert out == bytes(range(128)), out; print('ok', r)")


def _rdzv(ranks, worlds, devices, timeout):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RDZV, str(r), str(w), str(port), str(d), str(timeout)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, w, d in zip(ranks, worlds, devices)]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=timeout + 30) for p in procs]
    return [(p.returncode, o + e) for p, (o, e) in zip(procs, outs)], time.monotonic() - t0


def test_rendezvous_hands_rank0s_id_to_everyone():
    res, _ = _rdzv([1, 0, 2], [3, 3, 3], [1, 0, 2], 30)
    assert all(code == 0 for code, _ in res), res


def test_rendezvous_drops_connections_that_are_not_ranks():
    # A port scan or health check at MASTER_PORT used to end rank 0 with "peer closed the connection" (or a
    # MemoryError for a huge announced length); it must be dropped and the real ranks still meet.
    port = _free_port()
    rank0 = subprocess.Popen([sys.executable, "-c", RDZV, "0", "2", str(port), "0", "60"], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # connects, says nothing
            break
        except OSError:
            assert time.monotonic() < deadline and rank0.poll() is None, rank0.communicate()
            time.sleep(0.05)
    for junk in (b"\xff" * 8 + b"x", b"\x00\x00", struct.pack("!Q", 3) + b"abc", struct.pack("!Q", 5) + b"FGPT1"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
    rank1 = subprocess.run([sys.executable, "-c", RDZV, "1", "2", str(port), "1", "60"], env=_env(),
                           capture_output=True, text=True, timeout=90)
    out, err = rank0.communicate(timeout=30)
    assert rank0.returncode == 0 and "ok 0" in out, out + err
    assert rank1.returncode == 0 and "ok 1" in rank1.stdout, rank1.stdout + rank1.stderr


def test_rendezvous_errors_instead_of_hanging():
    res, seconds = _rdzv([0], [2], [0], 2)  # rank 1 never comes
    assert res[0][0] != 0 and "ranks [1] of 2 never connected" in res[0][1] and seconds < 20
    res, _ = _rdzv([0, 1], [2, 3], [0, 1], 20)  # disagreeing world sizes
    assert all(code != 0 and "every rank must agree" in out for code, out in res), res
    res, _ = _rdzv([0, 1], [2, 2], [0, 0], 20)  # two ranks on GPU 0 of one host
    assert all(code != 0 and "both use GPU 0" in out for code, out in res), res


# ---- the data-parallel code path in one process (a world of one: no MPI needed) --------------------------------

def _tiny(dp, seed=3, precision="fp32"):
    cfg = fastgpt.GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
    return fastgpt.GPT(cfg, precision=precision, seed=seed, data_parallel=dp)


def _steps(model, opt, rng_seed, steps=3, accum=2, sync_last=True):
    """Training steps on random tokens (2 rows of block_size), syncing the last micro-step (or none)."""
    rng = np.random.default_rng(rng_seed)
    c = model.config
    for _ in range(steps):
        model.zero_grad()
        for micro in range(accum):
            x = rng.integers(0, c.vocab_size, size=(2, c.block_size))
            model.forward(x, np.roll(x, -1, axis=1), return_logits=False)
            model.require_backward_grad_sync = sync_last and micro == accum - 1
            model.backward(1.0 / accum)
        opt.clip_grad_norm(1.0)
        opt.step()


@pytest.mark.parametrize("zero", [0, 1])
def test_world_of_one_matches_a_plain_model(zero):
    seed = int.from_bytes(os.urandom(4), "little")
    plain, dp = _tiny(False), _tiny(True)
    assert dp.data_parallel and dp.world_size == 1 and not plain.data_parallel
    _steps(plain, fastgpt.AdamW(plain), seed)
    _steps(dp, fastgpt.AdamW(dp, zero_stage=zero), seed)
    for name, w in plain.state_dict().items():
        np.testing.assert_array_equal(dp.state_dict()[name], w, err_msg=name)
    assert dp.grad_sync_count == 3 and plain.grad_sync_count == 0


def test_unsynced_gradients_are_reduced_once_before_the_step():
    dp = _tiny(True)
    with dp.no_sync():
        _steps(dp, fastgpt.AdamW(dp), 0, steps=2, sync_last=False)
    assert dp.require_backward_grad_sync is True  # restored
    assert dp.grad_sync_count == 2  # clip_grad_norm reduced what the backwards left


def test_zero1_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="not data parallel"):
        fastgpt.AdamW(_tiny(False), zero_stage=1)
    with pytest.raises(ValueError, match="zero_stage must be 0"):
        fastgpt.AdamW(_tiny(True), zero_stage=2)
    dp = _tiny(True)
    fastgpt.AdamW(dp, zero_stage=1)
    x = np.random.default_rng().integers(0, 96, size=(2, 16))
    dp.forward(x, x)
    dp.backward()  # synced: this rank's shard now holds the reduced gradients
    dp.forward(x, x)
    with pytest.raises(RuntimeError, match="zero_grad"):
        dp.backward()


def test_train_py_under_mpiexec_matches_one_process(tmp_path, shakespeare_txt, encoder_json):
    common = [str(REPO / "train.py"), "--input", str(shakespeare_txt), "--encoder", str(encoder_json),
              "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "-B", "2", "-T", "32", "--total-batch-size", "256",
              "--max-steps", "5", "--eval-interval", "5", "--eval-steps", "4", "--sample-tokens", "0",
              "--no-progress"]
    _run([_mpiexec(), "-n", "2", sys.executable, *common, "--out-dir", str(tmp_path / "dp")], timeout=180)
    _run([sys.executable, *common, "--out-dir", str(tmp_path / "one")], timeout=180)

    def log(name):
        return [json.loads(line) for line in open(tmp_path / name / "log.jsonl")]

    dp, one = log("dp"), log("one")
    assert dp[0]["header"]["world_size"] == 2 and dp[0]["header"]["grad_accum"] == 2
    assert one[0]["header"]["grad_accum"] == 4
    for key in ("loss", "val_loss"):
        a = [e[key] for e in dp if key in e]
        b = [e[key] for e in one if key in e]
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=key)
    assert dp[-1]["summary"]["grad_syncs"] == 5
    assert (tmp_path / "dp" / "model.safetensors").is_file()


def test_train_py_zero1_resumes_bitwise_under_mpiexec(tmp_path, shakespeare_txt, encoder_json):
    # ZeRO-1 checkpoints hold one moment shard per rank; a job resumed from an earlier checkpoint repeats the
    # uninterrupted job's losses bit for bit. HellaSwag is scored with the examples split over the ranks.
    mini = str(REPO / "tests" / "data" / "hellaswag_mini.jsonl")
    run = tmp_path / "run"
    common = [str(REPO / "train.py"), "--input", str(shakespeare_txt), "--encoder", str(encoder_json),
              "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "-B", "2", "-T", "32", "--zero-stage", "1",
              "--max-steps", "6", "--eval-interval", "3", "--eval-steps", "2", "--sample-tokens", "0",
              "--no-progress", "--save-every", "3", "--hellaswag", mini, "--out-dir", str(run)]
    _run([_mpiexec(), "-n", "2", sys.executable, *common], timeout=180)

    def trace():
        log = [json.loads(line) for line in open(run / "log.jsonl")]
        return [(e["step"], e.get("loss"), e.get("norm"), e.get("val_loss"), e.get("hellaswag"))
                for e in log if "step" in e]

    full = trace()
    assert {n for n in os.listdir(run / "step_000003") if n.startswith("optimizer")} == \
        {"optimizer_rank0.safetensors", "optimizer_rank1.safetensors"}
    swag = [e for e in (json.loads(line) for line in open(run / "log.jsonl")) if "hellaswag" in e]
    assert [e["hellaswag_total"] for e in swag] == [6, 6, 6]
    _run([_mpiexec(), "-n", "2", sys.executable, str(REPO / "train.py"), "--resume", str(run / "step_000003")],
         timeout=180)
    assert trace() == full
    r = _run([_mpiexec(), "-n", "3", sys.executable, str(REPO / "train.py"), "--resume", str(run)], timeout=180,
             check=False)
    assert r.returncode != 0 and "written by 2 ranks" in r.stdout + r.stderr
