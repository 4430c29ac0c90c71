"""bench/bench_ops.py's embedding, LayerNorm, matmul and cross-entropy cases: the options it refuses, and on each
device a short run whose rows compare the same computation on both sides (its max|diff| column; the timings are not
judged: benchmarks are not tests). On a GPU the embedding's backward also gets a row with one id at 12% of the
positions ("bwd hot"), the LayerNorm forward and backward the rows of the older kernels ("fwd2", "bwd2") that the
one-pass ones are measured against, matmul the rows with autotune ("fwd tuned", "bwd tuned") and its decisions, and
cross-entropy the training step's kernel ("fb")."""
import pathlib
import sys

import pytest

from devices import needs_cuda

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import bench_ops  # noqa: E402


@pytest.mark.parametrize("argv,message", [
    (["--device", "cuda", "--case", "attention"],
     "--device cuda runs --case embedding or layernorm or residual_layernorm or matmul or cross_entropy"),
    (["--device", "cuda"], "--device cuda runs --case"),
    (["--dtype", "bf16"], "--dtype bf16/fp16 needs --device cuda"),
])
def test_refused_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_ops.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("device,dtype,tol", [("cpu", "fp32", 1e-3),
                                              pytest.param("cuda", "bf16", 0.5, marks=needs_cuda)])
@pytest.mark.parametrize("case", ["layernorm", "residual_layernorm"])
def test_layernorm_rows(device, dtype, tol, case, capsys):
    args = bench_ops.parse_args(["--device", device, "--dtype", dtype, "--case", case, "--B", "2", "--T", "33",
                                 "--C", "256", "--warmup", "1", "--repeats", "2", "--seed", "7"])
    rows = bench_ops.run_cases(args)
    want = ["fwd", "bwd"] + (["fwd2", "bwd2"] if device == "cuda" else [])
    assert [r["pass"] for r in rows] == want and all(r["op"] == case for r in rows)
    for r in rows:
        assert r["fastgpt_ms"] > 0 and r["torch_ms"] > 0
        # bf16: torch rounds its dweight/dbias (sums over 66 rows) to bf16, fastgpt keeps them in fp32
        assert r["max_abs_diff"] < tol, r


# bf16: torch's dwte/dwpe are bf16 (sums of up to about 12 rows here), fastgpt's fp32
@pytest.mark.parametrize("device,dtype,tol", [("cpu", "fp32", 1e-5),
                                              pytest.param("cuda", "bf16", 0.1, marks=needs_cuda)])
def test_embedding_rows(device, dtype, tol, capsys):
    args = bench_ops.parse_args(["--device", device, "--dtype", dtype, "--case", "embedding", "--B", "3", "--T", "33",
                                 "--C", "72", "--vocab", "500", "--warmup", "1", "--repeats", "2", "--seed", "7"])
    rows = bench_ops.run_cases(args)
    assert [r["pass"] for r in rows] == ["fwd", "bwd"] + (["bwd hot"] if device == "cuda" else [])
    for r in rows:
        assert r["op"] == "embedding" and r["fastgpt_ms"] > 0 and r["torch_ms"] > 0
        assert r["max_abs_diff"] < tol, r


# bf16: torch's mean loss is a bf16 number (near 7, in steps of 1/32); the gradients (~1/(66 * 1000)) differ by
# their bf16 rounding, ~1e-7
@pytest.mark.parametrize("device,dtype,tol", [("cpu", "fp32", 1e-6),
                                              pytest.param("cuda", "bf16", 0.05, marks=needs_cuda)])
def test_cross_entropy_rows(device, dtype, tol, capsys):
    args = bench_ops.parse_args(["--device", device, "--dtype", dtype, "--case", "cross_entropy", "--B", "2", "--T",
                                 "33", "--vocab", "1000", "--warmup", "1", "--repeats", "2", "--seed", "7"])
    rows = bench_ops.run_cases(args)
    assert [r["pass"] for r in rows] == ["fwd", "bwd"] + (["fb"] if device == "cuda" else [])
    for r in rows:
        assert r["op"] == "cross_entropy" and r["fastgpt_ms"] > 0 and r["torch_ms"] > 0
        assert r["max_abs_diff"] < tol, r


@pytest.mark.parametrize("device,dtype,tol", [("cpu", "fp32", 1e-3),
                                              pytest.param("cuda", "bf16", 0.5, marks=needs_cuda)])
def test_matmul_rows(device, dtype, tol, capsys):
    # attn_proj at C 96 over 2 x 33 rows; on a GPU the tuned rows come after, then the backward with the bias
    # gradient's epilogue, and the case's last row carries the autotune decisions: its three products (forward with
    # the bias epilogue, dx, dW), each timed.
    args = bench_ops.parse_args(["--device", device, "--dtype", dtype, "--case", "matmul", "--linears", "attn_proj",
                                 "--B", "2", "--T", "33", "--C", "96", "--n-head", "2", "--warmup", "1",
                                 "--repeats", "2", "--seed", "7"])
    rows = bench_ops.run_cases(args)
    want = ["fwd", "bwd"] + (["fwd tuned", "bwd tuned", "bwd epilogue"] if device == "cuda" else [])
    assert [r["pass"] for r in rows] == want
    for r in rows:
        assert r["op"] == "matmul" and r["fastgpt_ms"] > 0 and r["torch_ms"] > 0
        assert r["max_abs_diff"] < tol, r
    if device == "cuda":
        t = rows[-1]["matmul_autotune"]
        assert t["problems"] == t["timed"] == 3 and 0 < t["chosen_ms"] <= t["heuristic_ms"], t
        assert "matmul autotune: 3 problems, 3 timed" in capsys.readouterr().out
    else:
        assert all("matmul_autotune" not in r for r in rows)
