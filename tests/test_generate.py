"""generate: deterministic for a seed, greedy decoding agrees with the model's own logits and with the PyTorch
reference, top_k=1 is greedy, the prompt is kept, and the context is cropped to block_size."""
import numpy as np
import torch

import fastgpt
from reference_gpt import ref_from_fastgpt

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
