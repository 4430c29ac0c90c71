"""train_step: AdamW.train_step, the whole optimizer step in one engine call (micro-batches, the gradients' norm on
the device, the clip folded into one AdamW pass, a non-finite step skipped on the device). It must give the loop's
bits (forward_backward per micro-batch, clip_grad_norm, step) in every precision, fused and unfused, follow PyTorch
(AdamW + clip_grad_norm_) over several steps, skip what the loop would refuse, and name bad arguments. With
graph=True the step is recorded and replayed (on the CPU a recording of the calls, with their arguments as recorded,
as a CUDA graph has them): the replays must give the eager steps' bits, and shapes that change, memory that moves
and recordings that fail must fall back to eager steps."""
import math

import numpy as np
import pytest
import torch

import fastgpt
from devices import DEVICES, needs_cuda
from reference_gpt import ref_from_fastgpt, rel_err

CONFIG = fastgpt.GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=32)


def batches(rng, A, B=2, T=16):
    return rng.integers(0, CONFIG.vocab_size, (A, B, T)), rng.integers(0, CONFIG.vocab_size, (A, B, T))


def params(model):
    return np.array(model._engine.params)


def loop_step(model, opt, x, y, lr, max_norm):
    """The loop train_step replaces, as build-nanogpt writes it."""
    model.zero_grad()
    loss = 0.0
    for a in range(len(x)):
        model.require_backward_grad_sync = a == len(x) - 1
        loss += model.forward_backward(x[a], y[a], grad_scale=1.0 / len(x)) / len(x)
    norm = opt.clip_grad_norm(max_norm) if max_norm is not None else None
    applied = opt.step(lr)
    return loss, norm, applied


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("A,max_norm", [(1, None), (3, 0.3), (2, 100.0)])
def test_train_step_is_the_loop_bit_for_bit(rng, precision, fused, A, max_norm):
    seed = int(rng.integers(1 << 31))
    models = [fastgpt.GPT(CONFIG, precision=precision, seed=seed, fused=fused) for _ in range(2)]
    opts = [fastgpt.AdamW(m, lr=2e-3, weight_decay=0.1) for m in models]
    for step in range(3):
        x, y = batches(rng, A)
        lr = 2e-3 * (step + 1) / 3
        stats = opts[0].train_step(x, y, lr=lr, max_norm=max_norm)
        loss, norm, applied = loop_step(models[1], opts[1], x, y, lr, max_norm)
        assert stats.loss == loss, step
        if norm is not None:
            assert stats.norm == norm, step
        assert stats.applied and applied
        assert stats.step_count == opts[1].step_count == step + 1
        np.testing.assert_array_equal(params(models[0]), params(models[1]))
        if precision != "fp32":  # the 16-bit compute weights too (bf16: stochastic rounding keyed by the step)
            np.testing.assert_array_equal(models[0]._engine.compute_params(), models[1]._engine.compute_params())
        for m0, m1 in zip(opts[0].moments(), opts[1].moments()):
            np.testing.assert_array_equal(m0, m1)
    if max_norm == 0.3:
        assert stats.norm > 0.3, "the case meant to clip did not"


def test_train_step_follows_torch(rng):
    # Four steps of build-nanogpt's recipe (clip 1.0, decay groups, a changing LR, two micro-batches) against torch
    # in float64: losses and norms within 1e-5, the weights within 1e-5 over the whole buffer. With the recipe's eps
    # 1e-8 that last rule failed 28 seeds in 2000 (2026-11-24: median 8e-7, worst 1.4e-4; one failed CI): a parameter
    # whose first gradient is below eps (a wpe entry at -1.2e-9) takes the update lr g / (|g| + eps), which float32's
    # rounding of g (a few 1e-9 after two layers) moves by a third of lr. eps 1e-5 keeps every update's sensitivity to
    # that rounding small (2000 seeds: median 1e-7, worst 1.0e-6) and still tests where eps enters the update.
    eps = 1e-5
    model = fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31)))
    opt = fastgpt.AdamW(model, lr=3e-3, weight_decay=0.1, eps=eps)
    ref = ref_from_fastgpt(model, torch.float64)
    ref_opt = ref.configure_optimizers(weight_decay=0.1, learning_rate=3e-3)
    for group in ref_opt.param_groups:
        group["eps"] = eps
    for step in range(4):
        x, y = batches(rng, 2)
        lr = 3e-3 * (0.5 + 0.5 * math.cos(step))
        stats = opt.train_step(x, y, lr=lr, max_norm=1.0)
        ref_opt.zero_grad()
        ref_loss = 0.0
        for a in range(2):
            _, loss = ref(torch.tensor(x[a]), torch.tensor(y[a]))
            (loss / 2).backward()
            ref_loss += loss.item() / 2
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        assert abs(stats.loss - ref_loss) <= 1e-5 * ref_loss, step
        assert abs(stats.norm - ref_norm) <= 1e-5 * ref_norm, step
    ours = model.state_dict()
    flat = lambda sd: np.concatenate([np.asarray(sd[k], np.float64).ravel() for k in ours if k != "lm_head.weight"])
    theirs = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    assert rel_err(flat(ours), flat(theirs)) < 1e-5


def test_a_non_finite_step_is_skipped_on_the_device(rng):
    model = fastgpt.GPT(CONFIG, seed=3)
    opt = fastgpt.AdamW(model, lr=1e-3)
    x, y = batches(rng, 2)
    w = model.state_dict()["transformer.ln_f.weight"]  # a zero-copy view on the CPU
    saved = w[0]
    w[0] = np.nan  # every row's loss becomes NaN
    before = params(model)
    stats = opt.train_step(x, y, max_norm=1.0)
    assert not stats.applied and math.isnan(stats.loss)
    assert stats.step_count == 0 and stats.skipped_steps == 1
    np.testing.assert_array_equal(params(model), before)  # NaN compares equal to itself here
    assert not any(np.any(m) for m in opt.moments()), "the moments must not move on a skipped step"
    w[0] = saved
    stats = opt.train_step(x, y, max_norm=1.0)
    assert stats.applied and stats.step_count == 1 and stats.skipped_steps == 1
    # ... and that step is the first step of a fresh optimizer (the skipped one left no trace but the count).
    twin = fastgpt.GPT(CONFIG, seed=3)
    twin_opt = fastgpt.AdamW(twin, lr=1e-3)
    twin_opt.train_step(x, y, max_norm=1.0)
    np.testing.assert_array_equal(params(model), params(twin))


def test_step_stats_are_read_once_and_go_stale(rng):
    model = fastgpt.GPT(CONFIG, seed=1)
    opt = fastgpt.AdamW(model)
    x, y = batches(rng, 1)
    first = opt.train_step(x, y)
    loss = first.loss  # read now: kept
    second = opt.train_step(x[0], y[0])  # (B, T) is one micro-batch
    assert first.loss == loss and first.step_count == 1
    assert second.step_count == 2 and second.loss < loss
    third = opt.train_step(x, y)
    fourth = opt.train_step(x, y)
    with pytest.raises(RuntimeError, match="overwritten"):
        third.norm  # never read, and the optimizer stepped since  # noqa: B018
    assert "overwritten" in repr(third)
    opt.step()  # the plain step rewrites the step's scalars too
    with pytest.raises(RuntimeError, match="overwritten"):
        fourth.loss  # noqa: B018


def twins(precision="fp32", fused=True, seed=11, device="cpu"):
    models = [fastgpt.GPT(CONFIG, device=device, precision=precision, seed=seed, fused=fused) for _ in range(2)]
    return models, [fastgpt.AdamW(m, lr=2e-3, weight_decay=0.1) for m in models]


def assert_same_state(models, opts):
    np.testing.assert_array_equal(params(models[0]), params(models[1]))
    if models[0].precision != "fp32":
        np.testing.assert_array_equal(models[0]._engine.compute_params(), models[1]._engine.compute_params())
    for m0, m1 in zip(opts[0].moments(), opts[1].moments()):
        np.testing.assert_array_equal(m0, m1)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_replayed_graph_is_the_eager_step_bit_for_bit(rng, precision, fused):
    # The CPU's graphs replay the recorded calls with their recorded arguments, as a CUDA graph does: a learning
    # rate, token ids or step counter baked into the recording would give other weights than the eager twin's.
    models, opts = twins(precision, fused)
    for step in range(5):
        x, y = batches(rng, 2)
        lr = 2e-3 * (step + 1) / 5
        got = opts[0].train_step(x, y, lr=lr, max_norm=0.4, graph=True)
        want = opts[1].train_step(x, y, lr=lr, max_norm=0.4)
        assert (got.loss, got.norm, got.applied, got.step_count) == (want.loss, want.norm, want.applied,
                                                                    want.step_count), step
        assert_same_state(models, opts)
    assert opts[0].graph_counts == (1, 4), "recorded on the second step, replayed from then on"
    assert opts[1].graph_counts == (0, 0)
    # After a replay the model is as after an eager step: a forward, and then the loop's own calls, work as usual.
    x, y = batches(rng, 1)
    assert models[0].forward(x[0], y[0])[1] == models[1].forward(x[0], y[0])[1]


def test_new_shapes_and_moved_memory_run_eagerly_then_are_recorded_again(rng):
    models, opts = twins("bf16")
    plan = [(2, 2), (2, 2), (2, 2), (1, 2), (1, 2), (1, 2), "eval", (1, 2), (1, 2), (2, 2), (2, 2)]
    want_counts = [(0, 0), (1, 1), (1, 2), (1, 2), (2, 3), (2, 4), None, (2, 4), (3, 5), (3, 5), (4, 6)]
    for step, (what, counts) in enumerate(zip(plan, want_counts)):
        if what == "eval":  # a larger batch than any step's: the activations are taken anew (the graph's are freed)
            big = rng.integers(0, CONFIG.vocab_size, (6, 16))
            assert models[0].forward(big, big)[1] == models[1].forward(big, big)[1]
            continue
        A, B = what
        x, y = batches(rng, A, B)
        got = opts[0].train_step(x, y, max_norm=1.0, graph=True)
        want = opts[1].train_step(x, y, max_norm=1.0)
        assert (got.loss, got.norm) == (want.loss, want.norm), step
        assert_same_state(models, opts)
        assert opts[0].graph_counts == counts, step


@pytest.mark.parametrize("device", DEVICES)
def test_a_recording_that_fails_runs_eagerly_and_says_why(rng, device):
    # More classifier rows than the eager step before it used: recording the step would free the logits buffer and
    # take a larger one, which a recording may not (both backends refuse: a CUDA capture would break on cudaMalloc
    # and on the synchronize before cudaFree). That step runs eagerly, the reason is kept, and the next step of the
    # shape is recorded; the weights stay the eager twin's throughout. On the GPU the failed capture must leave
    # nothing behind: the old buffer freed after it, no CUDA error left for the eager step's first launch check.
    models, opts = twins(device=device)
    for m in models:
        m.classifier_rows = 8
    for step in range(4):
        if step == 1:
            for m in models:
                m.classifier_rows = 16
        x, y = batches(rng, 1)
        got = opts[0].train_step(x, y, max_norm=1.0, graph=True)
        want = opts[1].train_step(x, y, max_norm=1.0)
        assert (got.loss, got.norm) == (want.loss, want.norm), step
        assert_same_state(models, opts)
    assert "memory inside a graph capture" in opts[0].graph_error
    assert opts[0].graph_counts == (1, 2) and opts[1].graph_error is None


def test_fp16_loss_scale_moves_on_the_device_inside_replays(rng):
    # fp16's loss scale lives in device memory: the cross-entropy kernels read it and the step divides it out and
    # updates it there. Started far too high (2^24: the scaled logit gradients overflow fp16), it backs off step by
    # step, skipping those steps, and then grows every second step: the recorded step (recorded once, its scale read
    # from memory at each replay) must follow the eager twin bit for bit, and both the loop (unscale on the host,
    # GradScaler's update there) in what they decide.
    models = [fastgpt.GPT(CONFIG, precision="fp16", seed=5) for _ in range(3)]
    opts = [fastgpt.AdamW(m, lr=2e-3, weight_decay=0.1) for m in models]
    for m in models:
        m.set_loss_scaler(init_scale=2.0**24, growth_interval=2)
    x, y = batches(rng, 2)
    scales, applied = [], []
    for step in range(10):
        got = opts[0].train_step(x, y, max_norm=1.0, graph=True)
        want = opts[1].train_step(x, y, max_norm=1.0)
        loss, norm, loop_applied = loop_step(models[2], opts[2], x, y, opts[2].lr, 1.0)
        assert (got.loss, got.applied, got.step_count, got.skipped_steps) == (
            want.loss, want.applied, want.step_count, want.skipped_steps), step
        assert got.norm == want.norm or (math.isnan(got.norm) and math.isnan(want.norm)), step
        assert models[0].loss_scale == models[1].loss_scale == models[2].loss_scale, step
        assert got.applied == loop_applied and got.loss == loss, step
        if got.applied:
            assert got.norm == norm, step
        assert_same_state(models[:2], opts[:2])
        np.testing.assert_array_equal(params(models[0]), params(models[2]))
        scales.append(models[0].loss_scale)
        applied.append(got.applied)
    first = applied.index(True)  # it overflowed first (backing off each time), and then trained, growing the scale
    assert first > 0 and sum(applied) >= 3 and scales[0] == 2.0**23, (applied, scales)
    assert max(scales[first:]) > scales[first], scales
    assert opts[0]._step.graph_eligible and opts[0].graph_counts[1] >= 7, opts[0].graph_counts
    # The device step leaves the gradients scaled by the scale it stepped with, which has moved on since: unscaling
    # them now would be wrong, so it is refused (as is a second step on them).
    with pytest.raises(RuntimeError, match="zero_grad"):
        opts[0].clip_grad_norm(1.0)
    with pytest.raises(RuntimeError, match="zero_grad|new backward"):
        opts[0].step()
    with pytest.raises(RuntimeError, match="zero_grad"):
        models[0].forward_backward(x[0], y[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr"), (dict(max_norm=0.0), "max_norm"), (dict(max_norm=float("nan")), "max_norm"),
    (dict(idx=np.zeros((1, 1, 2, 16), np.int64)), "idx"), (dict(targets=np.zeros((1, 2, 15), np.int64)), "targets"),
    (dict(targets=np.full((1, 2, 16), 96)), "targets"),
    (dict(idx=np.zeros((1, 2, 17), np.int64), targets=np.zeros((1, 2, 17), np.int64)), "block_size"),
    (dict(idx=np.zeros((0, 2, 16), np.int64), targets=np.zeros((0, 2, 16), np.int64)), "A >= 1"),
    (dict(targets=np.zeros((1, 2, 16), np.float32)), "integer"), (dict(graph=1), "graph"),
])
def test_bad_arguments_are_named_and_change_nothing(rng, kwargs, match):
    model = fastgpt.GPT(CONFIG, seed=2)
    opt = fastgpt.AdamW(model)
    x, y = batches(rng, 1)
    args = dict(idx=x, targets=y) | kwargs
    before = params(model)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.train_step(args.pop("idx"), args.pop("targets"), **args)
    np.testing.assert_array_equal(params(model), before)
    assert opt.step_count == 0


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("graph", [False, True])
def test_train_step_on_the_gpu_is_the_loop(rng, precision, graph):
    # On the GPU the bias corrections come from the device's pow (one double rounding apart from the host's at
    # worst) and the loss from a tree sum: the loop's values within float rounding, the weights within 1e-6. With
    # graph=True the step is recorded as a CUDA graph on the second step and launched from it after.
    gpu_step_is_the_loop(rng, precision, graph)


@needs_cuda
def test_autotuned_gpu_step_is_the_loop_and_its_graph_runs_the_timed_choices(rng):
    # fastgpt.ops.matmul_autotune(True): every product of the model is a new problem (the setting is part of the plan
    # cache's key), timed at its first run. That is the first step, which runs eagerly: no problem may first be met
    # while the second step is being recorded (it would keep the heuristic's choice, "skipped"). The train step and
    # the loop then share each problem's one choice, so they agree as they do untuned.
    before = fastgpt.ops.matmul_autotune(True)
    try:
        n0 = len(fastgpt.ops.matmul_autotune_report())
        gpu_step_is_the_loop(rng, "bf16", True)
        new = fastgpt.ops.matmul_autotune_report()[n0:]
    finally:
        fastgpt.ops.matmul_autotune(before)
    assert new, "no product was timed"
    assert [r for r in new if r["skipped"]] == []
    # The model's forward products (qkv, attention projection, fc, fc_proj, lm_head) and their backward ones: at
    # least a dozen problems (which epilogues cuBLASLt accepts at this size is test_precision_ops.py's to check).
    assert len(new) >= 12 and "none" in {r["epilogue"] for r in new}, [(r["M"], r["N"], r["K"]) for r in new]
    for r in new:
        assert 0 <= r["chosen"] < r["candidates"] and r["reps"] >= 1, r
        assert 0 < r["ms"][r["chosen"]] <= r["ms"][0] or r["ms"][0] < 0, r  # never slower than the heuristic's


def gpu_step_is_the_loop(rng, precision, graph):
    seed = int(rng.integers(1 << 31))
    models = [fastgpt.GPT(CONFIG, device="cuda", precision=precision, seed=seed) for _ in range(2)]
    opts = [fastgpt.AdamW(m, lr=2e-3) for m in models]
    for step in range(5):
        x, y = batches(rng, 2)
        lr = 2e-3 * (step + 1) / 5
        stats = opts[0].train_step(x, y, lr=lr, max_norm=0.5, graph=graph)
        loss, norm, _ = loop_step(models[1], opts[1], x, y, lr, 0.5)
        assert abs(stats.loss - loss) <= 1e-6 * loss and abs(stats.norm - norm) <= 1e-5 * norm, step
        assert stats.applied and stats.step_count == step + 1
    assert opts[0].graph_counts == ((1, 4) if graph else (0, 0)), opts[0].graph_error
    a, b = params(models[0]).astype(np.float64), params(models[1]).astype(np.float64)
    assert rel_err(a, b) < 1e-6


@needs_cuda
def test_the_gpu_step_allocates_no_scratch_after_the_first():
    # The kernels' scratch (GEMM workspace, LayerNorm and bias partial sums, flash backward) comes from the stream's
    # workspace, sized by the first step: later steps of the same shape neither grow it nor go to the pool.
    model = fastgpt.GPT(CONFIG, device="cuda", precision="bf16", seed=5)
    opt = fastgpt.AdamW(model)
    x, y = batches(np.random.default_rng(5), 2)
    opt.train_step(x, y, max_norm=1.0).loss  # noqa: B018
    opt.train_step(x, y, max_norm=1.0).loss  # noqa: B018  (the first step's last windows grow it at their rewind)
    sized = model.memory()["scratch"]
    for _ in range(3):
        assert opt.train_step(x, y, max_norm=1.0).applied
        assert model.memory()["scratch"] == sized
    assert sized > 0
    assert fastgpt.GPT(CONFIG).memory()["scratch"] == 0  # the CPU's scratch is per thread, not the engine's
