"""bench/_profile.py, behind bench_gpu_train.py --profile (where a training step's GPU time goes, fastgpt beside torch
compiled): kernel names sort into the op groups the table shows, a Chrome trace's GPU events are summed per kernel
and per step, and the profiler's own trace is read back (here with CPU activity: no GPU kernels to find)."""
import pathlib
import sys

import numpy as np
import pytest

from fastgpt import ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _profile  # noqa: E402

# Demangled names as CUPTI reports them: fastgpt's own (from the built module), cuBLAS/cuBLASLt, torch eager and
# torch.compile's Triton kernels, torch's flash and cuDNN attention.
NAMES = {
    "void fastgpt::cuda::flash::(anonymous namespace)::forward_kernel<__nv_bfloat16, 64, 2, 64>(fastgpt::cuda::"
    "flash::Params)": "attention",
    "void fastgpt::cuda::flash::(anonymous namespace)::dkdv_kernel<__half, 64, 1, 64, false>(fastgpt::cuda::flash::"
    "Params)": "attention",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x"
    "_cublas": "matmul",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": "matmul",
    "void fastgpt::cuda::(anonymous namespace)::epilogue_kernel<fastgpt::bf16, float>(...)": "matmul",
    "void fastgpt::cuda::(anonymous namespace)::residual_layernorm_forward_kernel<fastgpt::bf16>(...)": "layernorm",
    "triton_per_fused_add_native_layer_norm_native_layer_norm_backward_3": "layernorm",
    "void fastgpt::cuda::(anonymous namespace)::cross_entropy_forward_backward_kernel<fastgpt::bf16>(...)":
        "cross-entropy",
    "triton_red_fused__log_softmax_backward_data_nll_loss_backward_nll_loss_forward_5": "cross-entropy",
    "void fastgpt::cuda::detail::map_kernel<fastgpt::bf16, fastgpt::cuda::Gelu>(...)": "gelu",
    "triton_poi_fused_gelu_gelu_backward_4": "gelu",
    "void fastgpt::cuda::detail::map_kernel<float, fastgpt::cuda::Add>(...)": "residual",
    "void fastgpt::cuda::(anonymous namespace)::adamw_step_kernel<fastgpt::bf16>(...)": "optimizer",
    "void fastgpt::cuda::sum_in_order_kernel(...)": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<float, 4>>(...)": "optimizer",
    "void fastgpt::cuda::(anonymous namespace)::encoder_backward_wte_kernel<fastgpt::bf16>(...)": "embedding",
    "void at::native::embedding_backward_feature_kernel<c10::BFloat16, float, long>(...)": "embedding",
    "void fastgpt::cuda::(anonymous namespace)::narrow_kernel<fastgpt::bf16>(...)": "copy/fill",
    "Memcpy HtoD (Pinned -> Device)": "copy/fill",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, void*, unsigned int)":
        "attention",
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int)": "attention",
    "void cub::DeviceRadixSortOnesweepKernel<...>": "other",
}


def test_kernel_names_fall_into_their_op_groups():
    wrong = {n: (_profile.group_of(n), g) for n, g in NAMES.items() if _profile.group_of(n) != g}
    assert not wrong, wrong
    assert _profile.short(next(iter(NAMES))).startswith("flash::forward_kernel<")


def test_trace_events_are_summed_per_kernel_and_per_step():
    rng = np.random.default_rng()
    durs = rng.uniform(1, 100, size=6)  # microseconds
    gemm, ln = "nvjet_tst_128x256", "void fastgpt::cuda::(anonymous namespace)::layernorm_forward_kernel<float>()"
    events = [{"cat": "kernel", "name": gemm, "dur": durs[0]}, {"cat": "kernel", "name": gemm, "dur": durs[1]},
              {"cat": "kernel", "name": ln, "dur": durs[2]}, {"cat": "gpu_memset", "name": "Memset (Device)",
                                                              "dur": durs[3]},
              {"cat": "cpu_op", "name": "aten::mm", "dur": durs[4]},  # host side: not GPU time
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": durs[5]}, {"cat": "kernel", "name": ln}]
    b = _profile.breakdown(events, steps=2, top=2)
    assert np.isclose(b["groups"]["matmul"], (durs[0] + durs[1]) / 2e3)
    assert np.isclose(b["groups"]["layernorm"], durs[2] / 2e3)
    assert np.isclose(b["groups"]["copy/fill"], durs[3] / 2e3)
    assert np.isclose(b["kernel_ms"], durs[:4].sum() / 2e3)
    assert b["kernels"] == 3 and len(b["top"]) == 2
    assert [r["ms"] for r in b["top"]] == sorted((r["ms"] for r in b["top"]), reverse=True)
    assert b["top"][0]["calls"] in (0.5, 1.0)


def test_gaps_are_the_gpus_idle_time_between_events_by_the_ops_around_them():
    rng = np.random.default_rng()
    d = rng.uniform(1, 50, size=6)  # durations, us
    g = rng.uniform(1, 20, size=3)  # the idle gaps, us
    a, b, c, m = "nvjet_a", "void fastgpt::cuda::k<float>()", "nvjet_c", "Memset (Unknown)"
    t_b = d[0] + g[0]
    t_c = t_b + d[1] / 2  # starts while b runs (another stream): no gap before it
    end_c = max(t_b + d[1], t_c + d[2])
    t_a2 = end_c + g[1]
    t_m = t_a2 + d[3] + g[2]
    events = [{"cat": "kernel", "name": c, "ts": t_c, "dur": d[2]},  # out of order: sorted by start
              {"cat": "kernel", "name": a, "ts": 0.0, "dur": d[0]},
              {"cat": "kernel", "name": b, "ts": t_b, "dur": d[1]},
              {"cat": "kernel", "name": a, "ts": t_a2, "dur": d[3]},
              {"cat": "gpu_memset", "name": m, "ts": t_m, "dur": d[4]},
              {"cat": "cpu_op", "name": "aten::mm", "ts": t_m + 100.0, "dur": d[5]},  # host side: not the GPU's
              {"cat": "kernel", "name": a, "dur": 1.0}]  # no start time: left out
    out = _profile.gaps(events, steps=2)
    assert np.isclose(out["idle_ms"], g.sum() / 2e3)
    assert out["events"] == 2.5
    got = {(r["before"], r["after"]): (r["ms"], r["count"]) for r in out["top"]}
    last = c if t_c + d[2] > t_b + d[1] else b  # of the two that overlap, the one whose end opened the gap
    assert set(got) == {(a, b), (last, a), (a, m)}, got
    assert np.allclose(got[(a, b)], (g[0] / 2e3, 0.5)) and np.allclose(got[(last, a)], (g[1] / 2e3, 0.5))
    assert np.allclose(got[(a, m)], (g[2] / 2e3, 0.5))
    assert [r["ms"] for r in out["top"]] == sorted((r["ms"] for r in out["top"]), reverse=True)
    assert _profile.breakdown(events, steps=2)["gaps"] == out


def test_profile_steps_reads_the_profilers_trace(monkeypatch):
    x = np.random.default_rng().standard_normal((32, 48)).astype(np.float32)
    calls = []

    def step(i):
        calls.append(i)
        ops.layernorm_forward(x, np.ones(48, np.float32), np.zeros(48, np.float32))

    b = _profile.profile_steps(step, range(3), lambda: None, activity="CPU")
    assert calls == [0, 1, 2]
    seen = []  # the steps the sums are divided by: one a call, or as many as the caller says the calls make
    monkeypatch.setattr(_profile, "breakdown", lambda events, steps: seen.append(steps) or {})
    _profile.profile_steps(step, range(2), lambda: None, activity="CPU")
    _profile.profile_steps(step, range(1), lambda: None, activity="CPU", steps=7)
    assert seen == [2, 7]
    monkeypatch.undo()
    assert b["kernel_ms"] == 0 and b["kernels"] == 0  # CPU activity: no GPU kernel events
    assert set(b["groups"]) == set(_profile.GROUP_NAMES)


def test_the_table_puts_variants_side_by_side(capsys):
    events = [{"cat": "kernel", "name": n, "dur": 10.0 * (i + 1)} for i, n in enumerate(NAMES)]
    res = {"fastgpt bf16 fused": {"profile": _profile.breakdown(events, 1)},
           "torch compiled bf16": {"profile": _profile.breakdown(events[:3], 1)},
           "fastgpt bf16 graph": {"profile_error": "RuntimeError: no CUPTI"}}
    step_ms = {"fastgpt bf16 fused": 50.0, "torch compiled bf16": 40.0}
    _profile.print_breakdown(res, ("fastgpt bf16 fused", "fastgpt bf16 graph", "torch compiled bf16"), step_ms)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("group"))
    assert header.split()[1:] == ["fastgpt", "bf16", "fused", "torch", "compiled", "bf16"]  # no profile, no column
    idle = next(line for line in out.splitlines() if line.startswith("idle"))
    fused_ms = sum(10.0 * (i + 1) for i in range(len(NAMES))) / 1e3
    assert np.isclose(float(idle.split()[1]), 50.0 - fused_ms, atol=0.006)
    assert "forward_kernel" in out and f"fastgpt bf16 fused: {len(NAMES)} distinct kernels" in out


def test_the_json_keeps_more_kernels_than_the_table_lists(capsys):
    # The table lists the PRINTED largest; the JSON keeps up to 60, so that a group's small kernels (a LayerNorm's
    # combine, a bias sum's second pass) can be read from a run's evidence.
    n = _profile.PRINTED + 5
    events = [{"cat": "kernel", "name": f"kernel_{i:02d}", "dur": 10.0 * (i + 1)} for i in range(n)]
    res = {"fastgpt bf16 fused": {"profile": _profile.breakdown(events, 1)}}
    assert [r["name"] for r in res["fastgpt bf16 fused"]["profile"]["top"]] == [f"kernel_{i:02d}" for i in
                                                                                 reversed(range(n))]
    _profile.print_breakdown(res, ("fastgpt bf16 fused",), {"fastgpt bf16 fused": 1.0})
    listed = [line for line in capsys.readouterr().out.splitlines() if "kernel_" in line]
    assert len(listed) == _profile.PRINTED and "kernel_05" in listed[-1]


def test_generate_profile_is_per_new_token(tmp_path, monkeypatch):
    # bench_generate.py --profile: one generation's kernels per new token (the table's "step"), recorded with each
    # fastgpt variant; on the CPU no GPU kernels, but the wiring and the JSON are the GPU's.
    import json

    import bench_generate
    steps = []
    real = bench_generate.profile_steps
    monkeypatch.setattr(bench_generate, "profile_steps", lambda *a, **k: steps.append(k.get("steps")) or real(*a, **k))
    out = tmp_path / "gen.json"
    bench_generate.main(["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--vocab", "97", "--block-size", "32",
                         "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1", "--no-torch", "--profile",
                         "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["fastgpt, KV cache", "fastgpt, full recompute"]
    assert all(set(r["profile"]["groups"]) == set(_profile.GROUP_NAMES) for r in rows)
    assert steps == [3, 3]  # one generation each, shared out among its 3 new tokens


def _profile_of(rows, groups=None):
    """A breakdown as bench_gpu_train's JSON keeps it: rows of (name, ms, calls)."""
    top = [{"name": n, "group": _profile.group_of(n), "ms": ms, "calls": c} for n, ms, c in rows]
    g = dict.fromkeys(_profile.GROUP_NAMES, 0.0)
    for r in top:
        g[r["group"]] += r["ms"]
    return {"kernel_ms": sum(g.values()), "groups": groups or g, "top": top, "kernels": len(top)}


def test_kernel_keys_drop_parameters_and_keep_template_arguments():
    ws = ("void fastgpt::cuda::flash::(anonymous namespace)::forward_ws_kernel<__nv_bfloat16, 64, 2, 128>(fastgpt::"
          "cuda::flash::Params, fastgpt::cuda::flash::(anonymous namespace)::Maps)")
    assert _profile.kernel_key(ws) == "flash::forward_ws_kernel<__nv_bfloat16, 64, 2, 128>"
    assert _profile.kernel_key(ws.replace("Maps)", "Maps, fastgpt::cuda::flash::Tiles)")) == _profile.kernel_key(ws)
    assert _profile.kernel_key(ws.replace("2, 128", "3, 128")) != _profile.kernel_key(ws)
    for whole in ("Memset (Unknown)", "Memcpy HtoD (Pinned -> Device)", "memset32", "nvjet_sm90_tst_256x128_NNT"):
        assert _profile.kernel_key(whole) == whole
    # a parenthesis inside the template arguments (a cast) is not the parameter list
    cub = "void cub::Onesweep<Policy,(cub::SortOrder)0, unsigned int>(int*, int const*)"
    assert _profile.kernel_key(cub) == "cub::Onesweep<Policy,(cub::SortOrder)0, unsigned int>"


def test_compare_lists_the_kernels_by_how_much_they_changed():
    rng = np.random.default_rng()
    ms = rng.uniform(0.5, 5.0, size=5)
    d = rng.uniform(0.01, 0.4, size=3) * rng.choice([-1, 1], size=3)
    e = rng.uniform(0.01, 0.1)
    ln, ln_args = "void fastgpt::cuda::(anonymous namespace)::layernorm_backward_kernel<fastgpt::bf16, 3>", "(float*)"
    old = _profile_of([("nvjet_a_NNT", ms[0], 36.0), (ln + ln_args, ms[1], 24.0), ("gone_kernel", ms[2], 1.0),
                       ("Memset (Unknown)", ms[3], 130.0)])
    new = _profile_of([("nvjet_a_NNT", ms[0] + d[0], 36.0), (ln + "(float*, int)", ms[1] + d[1], 24.0),
                       ("fresh_kernel", ms[4], 12.0), ("Memset (Unknown)", ms[3] + d[2], 130.0),
                       (ln + "(double*)", e, 2.0)])  # an overload: the same key, its time and calls added
    c = _profile.compare(old, new)
    got = {r["name"]: r for r in c["kernels"]}
    key = "layernorm_backward_kernel<fastgpt::bf16, 3>"
    assert set(got) == {"nvjet_a_NNT", key, "gone_kernel", "fresh_kernel", "Memset (Unknown)"}
    assert np.isclose(got[key]["new_ms"] - got[key]["old_ms"], d[1] + e) and got[key]["new_calls"] == 26.0
    assert got["gone_kernel"]["new_ms"] is None and got["fresh_kernel"]["old_ms"] is None
    # those in both lists by their change, largest first; then those in one list only, largest first
    both = [r for r in c["kernels"] if r["old_ms"] is not None and r["new_ms"] is not None]
    assert c["kernels"][:len(both)] == both and len(both) == 3
    for part in (both, c["kernels"][len(both):]):
        change = [abs((r["new_ms"] or 0.0) - (r["old_ms"] or 0.0)) for r in part]
        assert change == sorted(change, reverse=True)
    assert c["cut"] == [False, False]
    assert _profile.compare({**old, "kernels": 61}, new)["cut"] == [True, False]  # its list kept 4 of 61
    assert np.allclose(c["kernel_ms"], [old["kernel_ms"], new["kernel_ms"]])
    assert set(c["groups"]) == {g for g in _profile.GROUP_NAMES if max(old["groups"][g], new["groups"][g]) >= 0.005}
    assert np.allclose(c["groups"]["matmul"], [ms[0], ms[0] + d[0]])


def test_compare_files_an_earlier_runs_kernels_into_todays_groups():
    """A kernel that an earlier run's JSON filed under another group (GROUPS has changed since: cuDNN's dot(dO, O)
    under other, its dQ conversion under copy/fill, until the ninth run) moves to its group now, on the earlier
    side, so that the table shows no change of speed where there was none."""
    rng = np.random.default_rng()
    ms = rng.uniform(0.5, 5.0, size=4)
    dot, conv = "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(...)", "convert_dq_to_16bits<true>(...)"
    rows = [("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", ms[0], 12.0), (dot, ms[1], 12.0),
            (conv, ms[2], 12.0), ("nvjet_a_NNT", ms[3], 36.0)]
    old, new = _profile_of(rows), _profile_of(rows)
    for r, then in zip(old["top"][1:3], ("other", "copy/fill")):
        r["group"] = then
        old["groups"]["attention"] -= r["ms"]
        old["groups"][then] += r["ms"]
    c = _profile.compare(old, new)
    assert np.allclose(c["groups"]["attention"], [ms[:3].sum()] * 2)
    assert np.allclose(c["groups"]["matmul"], [ms[3]] * 2)
    assert max(abs(v) for g in ("other", "copy/fill") for v in c["groups"].get(g, [0.0])) < 1e-12
    assert np.allclose(c["kernel_ms"], [old["kernel_ms"], new["kernel_ms"]])


def _run_json(path, gpu, date, names=("fastgpt bf16 graph",), partial=False, n_layer=12, B=64, profile=None):
    import json
    res = {n: {"B": B, "step_ms_median": 100.0, **({"profile": profile} if profile else {})} for n in names}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "bench_gpu_train", "partial": partial, "env": {"gpu": gpu, "date": date},
                                "config": {"n_layer": n_layer, "n_head": 12, "n_embd": 768, "T": 1024,
                                           "vocab": 50304}, "results": res}))
    return path


def test_the_baseline_is_the_newest_earlier_run_of_the_same_gpu_and_model(tmp_path):
    p = _profile_of([("nvjet_a_NNT", 1.0, 1.0)])
    cfg = {"n_layer": 12, "n_head": 12, "n_embd": 768, "T": 1024, "vocab": 50304}
    want = _run_json(tmp_path / "a" / "x.json", "NVIDIA H200", "2026-11-26T10:00:00", profile=p)
    others = [_run_json(tmp_path / "b" / "x.json", "NVIDIA H200", "2026-11-25T10:00:00", profile=p),  # older
              _run_json(tmp_path / "c" / "x.json", "NVIDIA H100 80GB HBM3", "2026-11-27T10:00:00", profile=p),
              _run_json(tmp_path / "d" / "x.json", "NVIDIA H200", "2026-11-27T10:00:00", profile=p, partial=True),
              _run_json(tmp_path / "e" / "x.json", "NVIDIA H200", "2026-11-27T10:00:00", profile=p, n_layer=2),
              _run_json(tmp_path / "f" / "x.json", "NVIDIA H200", "2026-11-27T10:00:00"),  # no profile
              _run_json(tmp_path / "g" / "x.json", "NVIDIA H200", "2026-11-27T10:00:00", names=("torch eager fp32",),
                        profile=p)]
    bad = tmp_path / "h" / "x.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    older = _run_json(tmp_path / "k" / "x.json", "NVIDIA H200", "2026-11-24T10:00:00", profile=p)
    paths = [older, want, *others, bad]  # older matches before and after it: neither the first nor the last seen
    found = _profile.find_baseline(paths, "NVIDIA H200", cfg, ("fastgpt bf16 graph", "torch compiled bf16"))
    assert found["path"] == str(want) and found["json"]["env"]["date"] == "2026-11-26T10:00:00"
    assert _profile.find_baseline(paths, "NVIDIA A100", cfg, ("fastgpt bf16 graph",)) is None
    # only runs with a profile of a variant asked for: "torch eager fp32" is in g alone
    assert _profile.find_baseline(paths, "NVIDIA H200", cfg, ("torch eager fp32",))["path"] == str(others[-1])
    odd = _run_json(tmp_path / "i" / "x.json", "NVIDIA H200", "2026-11-28T10:00:00", profile=p)
    odd.write_text(odd.read_text().replace('"results": {', '"results": {"junk": null, '))
    assert _profile.find_baseline([odd], "NVIDIA H200", cfg, ("junk", "fastgpt bf16 graph"))["path"] == str(odd)
    listy = tmp_path / "j.json"
    listy.write_text('{"benchmark": "bench_gpu_train", "env": [], "results": []}')
    assert _profile.find_baseline([listy], "NVIDIA H200", cfg, ("fastgpt bf16 graph",)) is None


def test_a_run_unlike_this_one_says_how(tmp_path):
    import json
    cfg = {"n_layer": 12, "n_head": 12, "n_embd": 768, "T": 1024, "vocab": 50304}
    run = json.loads(_run_json(tmp_path / "x.json", "NVIDIA H200", "2026-11-26T10:00:00").read_text())
    assert _profile.unlike(run, "NVIDIA H200", cfg) == []
    assert _profile.unlike(run, "NVIDIA H100", cfg) == ["ran on NVIDIA H200, this run on NVIDIA H100"]
    assert _profile.unlike(run, "NVIDIA H200", {**cfg, "T": 2048}) == ["T 1024 there, 2048 here"]
    assert _profile.unlike({**run, "partial": True}, "NVIDIA H200", cfg) == ["a partial run"]
    for odd in ([], {**run, "benchmark": "bench_ops"}, {**run, "results": None}):
        assert _profile.unlike(odd, "NVIDIA H200", cfg) == ["not a bench_gpu_train run"]


def test_the_comparison_prints_each_variant_then_and_now(capsys):
    import json
    rng = np.random.default_rng()
    a, b = rng.uniform(1, 5, size=2)
    old = {"fastgpt bf16 graph": {"B": 64, "step_ms_median": 110.0, "profile": _profile_of([("nvjet_a_NNT", a, 36)])},
           "torch compiled bf16": {"B": 32, "step_ms_median": 120.0, "profile": _profile_of([("triton_x", 1.0, 1)])}}
    new = {"fastgpt bf16 graph": {"B": 64, "step_ms_median": 105.0, "profile": _profile_of([("nvjet_a_NNT", b, 36)])},
           "torch compiled bf16": {"B": 64, "step_ms_median": 119.0, "profile": _profile_of([("triton_x", 1.0, 1)])},
           "fastgpt bf16 fused": {"B": 64, "step_ms_median": 107.0, "profile": _profile_of([("k", 1.0, 1)])}}
    base = {"path": "old.json", "json": json.loads(json.dumps({"env": {"fastgpt_commit": "abc1234"},
                                                               "results": old}))}
    out = _profile.print_comparison(base, new, ("fastgpt bf16 fused", "fastgpt bf16 graph", "torch compiled bf16"))
    text = capsys.readouterr().out
    assert set(out) == {"fastgpt bf16 graph"}  # fused: not in the old run; torch: another B
    assert out["fastgpt bf16 graph"]["step_ms"] == [110.0, 105.0]
    assert "fastgpt bf16 graph against old.json (abc1234" in text and "B 32 there, 64 here" in text
    step = next(line for line in text.splitlines() if "step (wall)" in line)
    assert "(-5.00)" in step
    row = next(line for line in text.splitlines() if line.endswith("nvjet_a_NNT"))
    assert f"({b - a:+.3f})" in row
    assert _profile.print_comparison(base, {"fastgpt bf16 graph": None}, ("fastgpt bf16 graph",)) == {}
    assert "nothing compared with old.json" in capsys.readouterr().out


def test_bench_gpu_train_compares_with_the_newest_run_it_finds_or_the_one_named(tmp_path, monkeypatch, capsys):
    import argparse

    import bench_gpu_train
    p_old = _profile_of([("nvjet_a_NNT", 2.0, 36.0)])
    results = tmp_path / "bench" / "results"
    _run_json(results / "2026-11-26-h200" / "bench_gpu_train.json", "NVIDIA H200", "2026-11-26T10:00:00", profile=p_old)
    mine = _run_json(results / "2026-11-28-h200" / "bench_gpu_train.json", "NVIDIA H200", "2026-11-28T10:00:00",
                     profile=p_old)  # the file this run writes (--json): never its own baseline
    monkeypatch.setattr(bench_gpu_train, "REPO", tmp_path)
    res = {"fastgpt bf16 graph": {"B": 64, "step_ms_median": 99.0, "profile": _profile_of([("nvjet_a_NNT", 1.5, 36)])}}
    args = argparse.Namespace(baseline="auto", json=str(mine), n_layer=12, n_head=12, n_embd=768, T=1024, vocab=50304)
    got = bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H200"}, res)
    assert got["baseline"]["path"] == "bench/results/2026-11-26-h200/bench_gpu_train.json"  # as the ledger names it
    assert got["baseline"]["variants"]["fastgpt bf16 graph"]["step_ms"] == [100.0, 99.0]
    assert "(-0.500)" in capsys.readouterr().out
    assert bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H100 80GB HBM3"}, res) == {}
    assert "no earlier run of this model on NVIDIA H100" in capsys.readouterr().out
    args.baseline = str(mine)  # named: taken as it is, saying when it ran on another GPU
    got = bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H100 80GB HBM3"}, res)
    said = capsys.readouterr().out
    assert got["baseline"]["path"] == str(mine) and "not like for like: ran on NVIDIA H200" in said
    listy = tmp_path / "list.json"
    listy.write_text("[1, 2]")
    args.baseline = str(listy)
    assert bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H200"}, res) == {}
    assert "is not a bench_gpu_train run" in capsys.readouterr().out
    args.baseline = str(tmp_path / "missing.json")
    assert bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H200"}, res) == {}
    assert "cannot read" in capsys.readouterr().out
    assert bench_gpu_train.parse_args(["--baseline", "auto", "--profile"]).baseline == "auto"
    with pytest.raises(SystemExit):
        bench_gpu_train.parse_args(["--baseline", "auto"])  # without --profile there is nothing to compare
    capsys.readouterr()
    # only the variants this run profiled choose the run: one that profiled only another variant is passed over
    _run_json(results / "2026-11-27-h200" / "bench_gpu_train.json", "NVIDIA H200", "2026-11-27T10:00:00",
              names=("torch compiled bf16",), profile=p_old)
    args.baseline = "auto"
    got = bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H200"}, res)
    assert got["baseline"]["path"] == "bench/results/2026-11-26-h200/bench_gpu_train.json"
    res["torch compiled bf16"] = {"B": 64, "step_ms_median": 1.0, "profile": _profile_of([("triton_x", 1.0, 1)])}
    got = bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H200"}, res)
    assert got["baseline"]["path"] == "bench/results/2026-11-27-h200/bench_gpu_train.json"
    assert set(got["baseline"]["variants"]) == {"torch compiled bf16"}
    monkeypatch.setattr(bench_gpu_train, "print_comparison", lambda *a: 1 / 0)
    assert bench_gpu_train.against_baseline(args, {"gpu": "NVIDIA H200"}, res) == {}  # printed, not raised
    assert "the comparison failed: ZeroDivisionError" in capsys.readouterr().out
