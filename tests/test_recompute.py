"""GPT(recompute=0|1|2): activations that backward makes again instead of forward keeping them (issue 10's memory
goal). 1 recomputes each layer's GELU from fc's kept pre-activation, 2 also ln_1 and ln_2 from their kept inputs and
statistics; both into one-layer buffers. Checked: every level gives level 0's loss, gradients and trained weights bit
for bit on the CPU (every precision, fused and unfused, accumulation, the recorded step), frees exactly the memory
it says, still matches build-nanogpt's model, generates the same tokens, and refuses bad settings clearly. On a GPU:
the same bits where the forward's own kernel recomputes, else the same error against float64."""
import numpy as np
import pytest
import torch

import fastgpt
from devices import needs_cuda
from reference_gpt import random_layernorms, ref_from_fastgpt, rel_err

# Three layers: a recomputed buffer that still held another layer's values would show in the layers below the top.
CONFIG = fastgpt.GPTConfig(block_size=32, vocab_size=97, n_layer=3, n_head=4, n_embd=32)


def batch(rng, B, T, V=CONFIG.vocab_size):
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def models(rng, levels, **kw):
    """One model per recompute level from the same weights, LayerNorms random (a LayerNorm recomputed with another
    layer's parameters would show)."""
    out = [fastgpt.GPT(CONFIG, recompute=r, **kw) for r in levels]
    random_layernorms(out, rng)
    return out


def grads_equal(a, b):
    gb = b.grads()
    for name, g in a.grads().items():
        assert np.array_equal(g, gb[name]), name


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_level_gives_the_same_bits(rng, precision, fused):
    m0, m1, m2 = models(rng, (0, 1, 2), precision=precision, fused=fused, seed=int(rng.integers(1 << 31)))
    assert (m0.recompute, m1.recompute, m2.recompute) == (0, 1, 2)
    for m in (m0, m1, m2):
        m.classifier_rows = 29
    # Two micro-batches of different shapes: the second runs in buffers sized by the first.
    for B, T in ((3, 32), (2, 17)):
        x, y = batch(rng, B, T)
        losses = [m.forward_backward(x, y, grad_scale=0.5) for m in (m0, m1, m2)]
        assert losses[0] == losses[1] == losses[2], (B, T)
    grads_equal(m0, m1)
    grads_equal(m0, m2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recorded_training_steps_give_the_same_weights(rng, precision):
    # The recorded step (graph=True: recorded on the second step, replayed after) replays the recomputations too.
    ms = models(rng, (0, 2), precision=precision, seed=int(rng.integers(1 << 31)))
    opts = [fastgpt.AdamW(m, lr=3e-3, weight_decay=0.1) for m in ms]
    x, y = rng.integers(0, CONFIG.vocab_size, (2, 2, 2, 24)).astype(np.int32)  # (A, B, T) ids and targets
    for step in range(4):
        stats = [opt.train_step(x, y, max_norm=1.0, graph=True) for opt in opts]
        assert stats[0].loss == stats[1].loss and stats[0].norm == stats[1].norm, step
    assert opts[1].graph_counts[1] >= 1  # the last steps were replays
    for (name, a), b in zip(ms[0].state_dict().items(), ms[1].state_dict().values()):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_level_frees_the_layers_buffers_it_recomputes(rng, precision):
    B, T = 4, 32
    L, C = CONFIG.n_layer, CONFIG.n_embd
    es = 4 if precision == "fp32" else 2
    x, y = batch(rng, B, T)
    act = {}
    for r in (0, 1, 2):
        m = fastgpt.GPT(CONFIG, precision=precision, recompute=r)
        m.forward_backward(x, y)
        act[r] = m.memory()["activations"]
    # All layers' GELU (B, T, 4C) kept, or one layer's; then ln_1 and ln_2 (B, T, C) each, the same.
    assert act[0] - act[1] == (L - 1) * B * T * 4 * C * es
    assert act[1] - act[2] == 2 * (L - 1) * B * T * C * es


def test_least_memory_still_matches_torch(rng):
    # Level 2, fp32, against build-nanogpt's model in float64: loss and every gradient within 1e-5.
    (model,) = models(rng, (2,), seed=int(rng.integers(1 << 31)))
    model.classifier_rows = 40
    x, y = batch(rng, 3, 32)
    ref = ref_from_fastgpt(model, torch.float64)
    _, ref_loss = ref(torch.tensor(x), torch.tensor(y))
    ref_loss.backward()
    loss = model.forward_backward(x, y)
    assert abs(loss - ref_loss.item()) / ref_loss.item() < 1e-5
    grads = model.grads()
    for name, p in ref.named_parameters():
        assert rel_err(grads[name], p.grad) < 1e-5, name


def test_generation_and_last_rows_are_unchanged(rng):
    m0, m2 = models(rng, (0, 2), seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, CONFIG.vocab_size, (2, 5))
    a = m0.generate(prompt, max_new_tokens=8, temperature=0.0)
    b = m2.generate(prompt, max_new_tokens=8, temperature=0.0)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    # A last_only forward gathers the last rows into backward's scratch: the full forward's logits (to rounding:
    # lm_head over 3 rows sums in another order than over 33).
    x, _ = batch(rng, 3, 11)
    full, _ = m2(x)
    last = m2._engine.forward(np.ascontiguousarray(x, np.int32), None, last_only=True)
    assert np.isnan(last)
    assert rel_err(np.asarray(m2._engine.logits()).reshape(3, -1), np.asarray(full)[:, -1]) < 1e-6


def test_bad_settings_are_clear_errors(rng):
    for bad, err in ((3, ValueError), (-1, ValueError), (1.0, TypeError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(err, match="recompute"):
            fastgpt.GPT(CONFIG, recompute=bad)
    c = CONFIG
    with pytest.raises(ValueError, match="recompute must be 0, 1 or 2"):  # the engine checks too
        fastgpt._C.GPT(c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, 0, recompute=7)
    # 0 by default, fused or not; the engine's own default (None from train.py) too
    assert fastgpt.GPT(CONFIG).recompute == 0 and fastgpt.GPT(CONFIG, fused=False).recompute == 0
    assert fastgpt.GPT(CONFIG, recompute=None).recompute == 0
    assert "recompute=2" in repr(fastgpt.GPT(CONFIG, recompute=2))


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_levels(rng, precision):
    # The LayerNorms are recomputed by their forward kernel: levels 1 and 2 agree bit for bit everywhere. GELU is
    # too, except in the 16-bit fused model, whose forward GELU is cuBLASLt's epilogue (gelu of the fp32
    # accumulator; the recomputation's is of the rounded pre-activation, as PyTorch's): there each level is judged
    # by its error against float64, as test_fused_step judges fused against unfused.
    m0, m1, m2 = models(rng, (0, 1, 2), precision=precision, device="cuda", seed=int(rng.integers(1 << 31)))
    x, y = batch(rng, 4, 32)
    ref = ref_from_fastgpt(m0, torch.float64)
    _, ref_loss = ref(torch.tensor(x), torch.tensor(y))
    ref_loss.backward()
    losses = [m.forward_backward(x, y) for m in (m0, m1, m2)]
    assert losses[1] == losses[2] == losses[0]  # forward is the same for every level
    grads_equal(m1, m2)
    if precision == "fp32":
        grads_equal(m0, m1)
        return
    g0, g1 = m0.grads(), m1.grads()
    for name, p in ref.named_parameters():
        e0, e1 = rel_err(g0[name], p.grad), rel_err(g1[name], p.grad)
        assert e1 <= 2 * e0 + 1e-2, f"{name}: recompute 1 {e1:.2e}, 0 {e0:.2e}"
    L, C, BT = CONFIG.n_layer, CONFIG.n_embd, 4 * 32
    assert m0.memory()["activations"] - m2.memory()["activations"] == (L - 1) * BT * 6 * C * 2
