"""generate: deterministic for a seed, greedy decoding agrees with the model's own logits and with the PyTorch
reference, top_k=1 is greedy, the prompt is kept, and the context is cropped to block_size. The KV cache: greedy
decoding with it equals full recomputation token for token (past block_size too, in every precision), each decode
step's logits equal the full forward's last row (1e-5), the prefill's equal a last-row forward's bitwise;
generators taking turns with each other and with optimizer steps get their own tokens; top-k/top-p restrict the
support as specified; stop tokens; streaming."""
import numpy as np
import pytest
import torch

import fastgpt
from reference_gpt import ref_from_fastgpt, rel_err

CONFIG = fastgpt.GPTConfig(block_size=16, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


def test_same_seed_same_tokens(rng):
    model = fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, CONFIG.vocab_size, (2, 5))
    a = model.generate(prompt, 12, temperature=1.0, seed=123)
    b = model.generate(prompt, 12, temperature=1.0, seed=123)
    c = model.generate(prompt, 12, temperature=1.0, seed=124)
    assert a.shape == (2, 17) and a.dtype == np.int64
    assert np.array_equal(a[:, :5], prompt)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert ((a >= 0) & (a < CONFIG.vocab_size)).all()


def test_greedy_matches_logits_and_torch(rng):
    model = fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31)))
    ref = ref_from_fastgpt(model, torch.float64)
    prompt = rng.integers(0, CONFIG.vocab_size, (1, 4))
    out = model.generate(prompt, 8, temperature=0.0)
    for t in range(4, 12):
        logits, _ = model.forward(out[:, :t])
        assert out[0, t] == logits[0, -1].argmax()
        ref_logits, _ = ref(torch.tensor(out[:, :t]))
        assert out[0, t] == ref_logits[0, -1].argmax().item()
    assert np.array_equal(model.generate(prompt, 8, top_k=1, seed=5), out)


def test_generate_past_block_size_crops_context(rng):
    model = fastgpt.GPT(CONFIG, seed=1)
    prompt = rng.integers(0, CONFIG.vocab_size, (1, CONFIG.block_size))
    out = model.generate(prompt, 3, temperature=0.0)
    assert out.shape == (1, CONFIG.block_size + 3)
    # The last token was chosen from the last block_size tokens only.
    logits, _ = model.forward(out[:, -CONFIG.block_size - 1:-1])
    assert out[0, -1] == logits[0, -1].argmax()


def test_top_k_restricts_choices(rng):
    model = fastgpt.GPT(CONFIG, seed=2)
    prompt = rng.integers(0, CONFIG.vocab_size, (1, 3))
    logits, _ = model.forward(prompt)
    top3 = set(np.argsort(logits[0, -1])[-3:].tolist())
    picks = {int(model.generate(prompt, 1, temperature=5.0, top_k=3, seed=s)[0, -1]) for s in range(40)}
    assert picks <= top3 and len(picks) >= 2


# ---- the KV cache, top-p, stop tokens, streaming

SMALL = fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)


def _devices():
    from devices import needs_cuda
    return ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", _devices())
def test_cached_greedy_equals_full_recomputation(rng, prec, device):
    # 3 prompts of 5 tokens, 30 new ones: past block_size (16) the window slides and the cache is rebuilt.
    model = fastgpt.GPT(CONFIG, device=device, precision=prec, seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, CONFIG.vocab_size, (3, 5))
    cached = model.generate(prompt, 30, temperature=0.0)
    full = model.generate(prompt, 30, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 35)
    np.testing.assert_array_equal(cached, full)
    assert model.memory()["kv_cache"] == 0  # freed when generation ends


@pytest.mark.parametrize("device", _devices())
def test_decode_step_logits_equal_full_forward(rng, device):
    model = fastgpt.GPT(CONFIG, device=device, seed=int(rng.integers(1 << 31)))
    engine = model._engine
    x = rng.integers(0, CONFIG.vocab_size, (2, CONFIG.block_size)).astype(np.int32)
    engine.decode(np.ascontiguousarray(x[:, :6]), 0)  # the prefill: forward()'s own attention, the same bits
    prefill = np.array(engine.logits()[:, 0])
    engine.forward(np.ascontiguousarray(x[:, :6]), None, True)  # last_only: the lm_head on the same rows
    np.testing.assert_array_equal(prefill, engine.logits()[:, 0])
    full, _ = model.forward(x[:, :6])  # the lm_head on every row: another matmul shape, other roundings
    assert rel_err(prefill, full[:, -1]) < 1e-5
    engine.decode(np.ascontiguousarray(x[:, :6]), 0)
    for t in range(6, CONFIG.block_size):
        engine.decode(np.ascontiguousarray(x[:, t:t + 1]), t)
        step = np.array(engine.logits()[:, 0])
        full, _ = model.forward(x[:, :t + 1])
        assert rel_err(step, full[:, -1]) < 1e-5, t
    # two positions at once continue the cache as well as two single steps
    engine.decode(np.ascontiguousarray(x[:, :6]), 0)
    engine.decode(np.ascontiguousarray(x[:, 6:8]), 6)
    two = np.array(engine.logits()[:, 0])
    assert engine.cache_length == 8 and rel_err(two, model.forward(x[:, :8])[0][:, -1]) < 1e-5


def test_decode_refuses_a_position_that_does_not_continue_the_cache(rng):
    model = fastgpt.GPT(SMALL, seed=0)
    engine = model._engine
    x = rng.integers(0, SMALL.vocab_size, (2, 4)).astype(np.int32)
    engine.decode(x, 0)
    with pytest.raises(ValueError, match="does not continue the cache, which holds 4 positions of 2 rows"):
        engine.decode(x[:, :1].copy(), 5)
    with pytest.raises(ValueError, match="does not continue the cache"):
        engine.decode(x[:1, :1].copy(), 4)
    with pytest.raises(ValueError, match="within block_size=16"):
        engine.decode(np.zeros((2, 13), np.int32), 4)
    with pytest.raises(ValueError, match=r"must hold token ids in \[0, vocab_size=64\)"):
        engine.decode(np.full((2, 1), 64, np.int32), 4)
    engine.decode(x[:, :1].copy(), 4)  # still usable after the refusals
    assert engine.cache_length == 5


def test_generation_leaves_training_as_it_was(rng):
    model = fastgpt.GPT(SMALL, seed=4)
    x, y = rng.integers(0, SMALL.vocab_size, (2, 16)), rng.integers(0, SMALL.vocab_size, (2, 16))
    _, before = model.forward(x, y)
    model.generate(x[:, :3], 20, seed=1)
    _, after = model.forward(x, y)
    assert before == after
    model.backward()  # the forward after generate is the one backward sees
    assert np.abs(model.grads()["transformer.wte.weight"]).sum() > 0


def _nucleus(probs, top_p):
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    return set(order[before < top_p].tolist())


def test_top_p_keeps_the_smallest_set_reaching_p(rng):
    # The support of each draw is the nucleus computed from the model's own logits, and every member shows up.
    model = fastgpt.GPT(SMALL, seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, SMALL.vocab_size, (1, 4))
    logits, _ = model.forward(prompt)
    temperature = 0.02  # sharpens the random model's logits so that the nucleus is small
    z = logits[0, -1].astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    for top_p in (0.5, 0.9):
        nucleus = _nucleus(probs, top_p)
        picks = [int(model.generate(prompt, 1, temperature=temperature, top_p=top_p, seed=s)[0, -1])
                 for s in range(300)]
        assert set(picks) <= nucleus
        expect = {t for t in nucleus if probs[t] / sum(probs[list(nucleus)]) > 0.03}  # likely enough to appear
        assert expect <= set(picks)
    tiny = {int(model.generate(prompt, 1, temperature=temperature, top_p=1e-9, seed=s)[0, -1]) for s in range(20)}
    assert tiny == {int(probs.argmax())}  # the most likely token is always kept


def test_top_p_draws_with_renormalised_probabilities():
    # Four tokens with probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1} (0.5 + 0.3 reaches it), 0.85
    # keeps {0, 1, 2}; the kept ones are drawn in proportion.
    from fastgpt.model import _Sampler
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 20000))
    for top_p, kept in ((0.75, [0.5, 0.3, 0, 0]), (0.85, [0.5, 0.3, 0.15, 0]), (1.0, [0.5, 0.3, 0.15, 0.05])):
        counts = np.bincount(_Sampler(4, 1.0, None, top_p, 0)(logits), minlength=4) / len(logits)
        expect = np.array(kept) / sum(kept)
        np.testing.assert_allclose(counts, expect, atol=0.015)
        assert (counts[expect == 0] == 0).all()
    # top_k then top_p: top_k 3 leaves 0.5, 0.3, 0.15 (renormalised 0.526, 0.316, 0.158); top_p 0.82 then keeps
    # {0, 1} (0.842 is past it), where without top_k it would keep {0, 1, 2} (0.8 is not)
    counts = np.bincount(_Sampler(4, 1.0, 3, 0.82, 0)(logits), minlength=4) / len(logits)
    np.testing.assert_allclose(counts, [0.625, 0.375, 0, 0], atol=0.015)


def test_sampler_refuses_non_finite_logits_and_takes_any_temperature(rng):
    from fastgpt.model import _Sampler
    logits = rng.standard_normal((3, 10))
    for temperature in (1.0, 0.0):
        bad = logits.copy()
        bad[1, 4] = np.nan
        with pytest.raises(ValueError, match=r"logits hold inf or NaN \(row 1\)"):
            _Sampler(10, temperature, None, None, 0)(bad)
    # a temperature so small that logits / temperature overflows: the argmax, not token 0
    for temperature in (1e-6, 1e-310):
        np.testing.assert_array_equal(_Sampler(10, temperature, None, None, 0)(logits), logits.argmax(axis=1))


def test_same_seed_same_tokens_with_top_p_and_cache(rng):
    model = fastgpt.GPT(SMALL, seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, SMALL.vocab_size, (2, 3))
    a = model.generate(prompt, 25, top_k=20, top_p=0.9, seed=7)
    b = model.generate(prompt, 25, top_k=20, top_p=0.9, seed=7)
    c = model.generate(prompt, 25, top_k=20, top_p=0.9, seed=7, use_cache=False)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)  # the cache changes the cost, not the tokens
    assert not np.array_equal(a, model.generate(prompt, 25, top_k=20, top_p=0.9, seed=8))


def test_stop_token_finishes_rows_and_ends_early(rng):
    model = fastgpt.GPT(SMALL, seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, SMALL.vocab_size, (2, 3))
    free = model.generate(prompt, 12, temperature=0.0)
    stop = int(free[0, 3 + 4])  # row 0's fifth new token
    out = model.generate(prompt, 12, temperature=0.0, stop_token=stop)
    for row in range(2):
        new = free[row, 3:].tolist()
        first = new.index(stop) if stop in new else None
        got = out[row, 3:].tolist()
        if first is None:
            assert got == new[:len(got)]
        else:  # identical up to the stop token, then padded with it
            assert got[:first + 1] == new[:first + 1] and set(got[first:]) == {stop}
    finished = [row.index(stop) for row in free[:, 3:].tolist() if stop in row]
    expect_len = max(finished) + 1 if len(finished) == 2 else 12
    assert out.shape == (2, 3 + expect_len)


def test_generate_iter_streams_the_tokens_of_generate(rng):
    model = fastgpt.GPT(SMALL, seed=int(rng.integers(1 << 31)))
    prompt = rng.integers(0, SMALL.vocab_size, 4)  # one prompt, 1-D: yields scalars
    steps = list(model.generate_iter(prompt, 10, top_k=10, seed=3))
    assert len(steps) == 10 and all(np.ndim(s) == 0 for s in steps)
    np.testing.assert_array_equal(model.generate(prompt, 10, top_k=10, seed=3), np.concatenate([prompt, steps]))


def test_long_generation_keeps_only_the_window(rng):
    # The token buffer holds the prompt and at most max(block_size, 1024) more, then drops the older tokens: a huge
    # max_new_tokens allocates nothing up front, and past the buffer's end each token is still the argmax of a
    # forward over the last block_size tokens (the cached and the sliding paths).
    import itertools
    model = _context_model(int(rng.integers(1 << 31)))
    prompt = rng.integers(0, SMALL.vocab_size, (2, 3))
    steps = itertools.islice(model.generate_iter(prompt, 10**15, temperature=0.0), 1100)
    out = np.concatenate([prompt] + [s[:, None] for s in steps], axis=1)
    window = SMALL.block_size
    for t in list(range(3, 40)) + list(range(1000, out.shape[1])):
        logits, _ = model.forward(out[:, max(0, t - window):t])
        assert np.array_equal(out[:, t], logits[:, -1].argmax(-1)), t


def _context_model(seed, device="cpu"):
    # Weights of std 0.5 instead of GPT-2's 0.02: sharp attention, so that the next token depends on the whole
    # context (at the initial scale it is nearly a function of the last token alone, and a wrong cache goes unseen).
    model, wrng = fastgpt.GPT(SMALL, device=device, seed=seed), np.random.default_rng(seed)
    model.load_state_dict({k: (wrng.standard_normal(v.shape) * 0.5).astype(np.float32) if v.ndim == 2 else v
                           for k, v in model.state_dict().items() if k != "lm_head.weight"})
    return model


def test_interleaved_generators_each_get_their_own_tokens(rng):
    # The engine has one KV cache: a generator whose cache another one took (or freed when it ended) starts over
    # from its tokens instead of continuing someone else's keys and values.
    model = _context_model(int(rng.integers(1 << 31)))
    pa, pb = rng.integers(0, SMALL.vocab_size, (2, 5)), rng.integers(0, SMALL.vocab_size, (2, 5))
    alone_a = model.generate(pa, 9, temperature=0.0)[:, 5:]
    alone_b = model.generate(pb, 9, temperature=0.0)[:, 5:]
    for b_cached in (True, False):
        ga = model.generate_iter(pa, 9, temperature=0.0)
        gb = model.generate_iter(pb, 4, temperature=0.0, use_cache=b_cached)  # ends (and frees) first
        got_a, got_b = [], []
        for step in range(9):
            got_a.append(next(ga))
            if step < 4:
                got_b.append(next(gb))
        assert next(gb, None) is None and next(ga, None) is None
        np.testing.assert_array_equal(np.stack(got_a, 1), alone_a)
        np.testing.assert_array_equal(np.stack(got_b, 1), alone_b[:, :4])
        assert model.memory()["kv_cache"] == 0  # the last one to hold it freed it


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("device", _devices())
def test_a_generator_sees_each_optimizer_step(rng, graph, device):
    # Steps between a generator's tokens change the weights: the cached keys and values are then stale, and the
    # tokens after a step are those of full recomputation with the new weights.
    seed, prompt = int(rng.integers(1 << 31)), rng.integers(0, SMALL.vocab_size, (2, 4))
    x, y = rng.integers(0, SMALL.vocab_size, (2, 2, 16)), rng.integers(0, SMALL.vocab_size, (2, 2, 16))
    runs = []
    for use_cache in (True, False):
        model = _context_model(seed, device)
        opt = fastgpt.AdamW(model, lr=3e-2, weight_decay=0.0)
        model.forward(x[0])  # sizes the buffers for what generation will need, so that steps can be recorded
        tokens = []
        for t in model.generate_iter(prompt, 6, temperature=0.0, use_cache=use_cache):
            tokens.append(t)
            opt.train_step(x, y, graph=graph)
        runs.append(np.stack(tokens, 1))
        assert opt.graph_counts[1] >= (3 if graph else 0)  # the replayed steps end the cache too
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_weight_change_ends_the_cache(rng):
    model = fastgpt.GPT(SMALL, seed=0)
    engine = model._engine
    x = rng.integers(0, SMALL.vocab_size, (2, 4)).astype(np.int32)
    opt = fastgpt.AdamW(model)
    for change in (lambda: model.load_state_dict(model.state_dict()),
                   lambda: (model.forward_backward(x, x), opt.step())):
        engine.decode(x, 0)
        assert engine.cache_length == 4
        change()
        assert engine.cache_length == 0
        with pytest.raises(ValueError, match="does not continue the cache, which holds 0 positions"):
            engine.decode(x[:, :1].copy(), 4)


def test_bad_sampling_arguments():
    model = fastgpt.GPT(SMALL, seed=0)
    prompt = np.zeros((1, 2), np.int64)
    with pytest.raises(ValueError, match="top_p must be > 0"):
        model.generate(prompt, 1, top_p=0.0)
    with pytest.raises(ValueError, match="top_p must be <= 1"):
        model.generate(prompt, 1, top_p=1.5)
    with pytest.raises(ValueError, match="stop_token must be <= 63"):
        model.generate(prompt, 1, stop_token=64)
    with pytest.raises(ValueError, match="top_k must be <= 64"):
        model.generate_iter(prompt, 1, top_k=65)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        model.generate(prompt, -1)
