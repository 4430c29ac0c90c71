"""HellaSwag (fastgpt.hellaswag, train.py --hellaswag): the scores and predictions of build-nanogpt's method,
recomputed here in PyTorch on the same weights; the mean (not the sum) of the ending's losses decides; batching and
padding change nothing; examples are split over ranks without overlap; bad files name file and line; train.py
reports the accuracy at every eval. tests/data/hellaswag_mini.jsonl holds six examples written for these tests in
the official file's format."""
import json
import os

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import fastgpt
from fastgpt import hellaswag
from fastgpt.tokenizer import get_gpt2_encoding
from fastgpt.train import main
from reference_gpt import ref_from_fastgpt

MINI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hellaswag_mini.jsonl")


def _model(seed, block_size=64):
    cfg = fastgpt.GPTConfig(block_size=block_size, vocab_size=50304, n_layer=2, n_head=2, n_embd=64)
    return fastgpt.GPT(cfg, seed=seed)


def _build_nanogpt_losses(ref, example, enc):
    # build-nanogpt's hellaswag.py: render_example, then the masked mean of the shifted cross-entropy per row
    ctx = enc.encode(example["ctx"])
    rows = [(ctx + enc.encode(" " + e), [0] * len(ctx) + [1] * len(enc.encode(" " + e))) for e in example["endings"]]
    width = max(len(t) for t, _ in rows)
    tokens = torch.zeros((4, width), dtype=torch.long)
    mask = torch.zeros((4, width), dtype=torch.long)
    for i, (t, m) in enumerate(rows):
        tokens[i, :len(t)] = torch.tensor(t)
        mask[i, :len(m)] = torch.tensor(m)
    with torch.no_grad():
        logits = ref(tokens)[0].double()
    shift_logits, shift_tokens = logits[..., :-1, :].contiguous(), tokens[..., 1:].contiguous()
    losses = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_tokens.view(-1), reduction="none")
    shift_mask = mask[..., 1:].contiguous().double()
    masked = losses.view(4, -1) * shift_mask
    return (masked.sum(dim=1) / shift_mask.sum(dim=1)).numpy()


def test_matches_build_nanogpt_in_torch(encoder_json, rng):
    enc = get_gpt2_encoding(encoder_json)
    model = _model(int(rng.integers(1 << 30)))
    ref = ref_from_fastgpt(model)
    examples = hellaswag.load(MINI)
    raw = [json.loads(line) for line in open(MINI)]
    ours = hellaswag.score(model, examples, enc)
    theirs = np.stack([_build_nanogpt_losses(ref, r, enc) for r in raw])
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-5
    assert (ours.argmin(axis=1) == theirs.argmin(axis=1)).all()
    result = hellaswag.evaluate(model, examples, enc)
    expected = sum(int(theirs[i].argmin()) == int(r["label"]) for i, r in enumerate(raw))
    assert result == {"accuracy": expected / 6, "correct": expected, "total": 6}


def test_batching_and_padding_change_nothing(encoder_json, rng):
    enc = get_gpt2_encoding(encoder_json)
    model = _model(int(rng.integers(1 << 30)))
    examples = hellaswag.load(MINI)
    one_by_one = hellaswag.score(model, examples, enc, tokens_per_batch=1)
    together = hellaswag.score(model, examples, enc, tokens_per_batch=10**6)  # one forward, rows padded
    np.testing.assert_allclose(together, one_by_one, rtol=1e-5)
    # ranks take disjoint shares that cover every example once
    parts = [hellaswag.evaluate(model, examples, enc, rank=r, world_size=3) for r in range(3)]
    assert sum(p["correct"] for p in parts) == hellaswag.evaluate(model, examples, enc)["correct"]


def test_the_mean_loss_decides_not_the_sum(rng):
    V = 7
    logits = rng.normal(size=(2, 6, V)) * 3
    tokens = rng.integers(0, V, size=(2, 6))
    mask = np.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0]])
    got = hellaswag.ending_losses(logits, tokens, mask)
    per_token = F.cross_entropy(torch.tensor(logits[:, :-1]).reshape(-1, V), torch.tensor(tokens[:, 1:]).reshape(-1),
                                reduction="none").view(2, 5).numpy()
    want = [(per_token[r] * mask[r, 1:]).sum() / mask[r, 1:].sum() for r in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_long_rows_keep_their_last_block_size_tokens(encoder_json):
    enc = get_gpt2_encoding(encoder_json)
    ex = hellaswag.load(MINI)[0]
    full = hellaswag.render(ex, enc, 1000)
    short = hellaswag.render(ex, enc, 12)
    for (t, m), (ft, fm) in zip(short, full):
        assert len(t) == 12 and t == ft[-12:] and m == fm[-12:] and sum(m) == min(12, sum(fm))
    model = _model(0, block_size=12)
    assert np.isfinite(hellaswag.score(model, [ex], enc)).all()


@pytest.mark.parametrize("line, named", [
    ("not json", "not a JSON object"),
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', "'endings' must be a list of 4 strings"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 7}', "'label' must be 0, 1, 2 or 3"),
    ('{"endings": ["b", "c", "d", "e"], "label": 1}', "'ctx' must be a string"),
    ('{"ctx": "", "endings": ["b", "c", "d", "e"], "label": 1}', "'ctx' is empty"),
])
def test_bad_files_name_file_and_line(tmp_path, line, named):
    path = tmp_path / "h.jsonl"
    path.write_text(open(MINI).readline() + line + "\n")
    with pytest.raises(ValueError, match=named) as e:
        hellaswag.load(path)
    assert f"{path}:2" in str(e.value)
    assert len(hellaswag.load(path, limit=1)) == 1  # the first line alone is fine
    with pytest.raises(FileNotFoundError):
        hellaswag.load(tmp_path / "missing.jsonl")


def test_non_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "h.jsonl"
    first = open(MINI, "rb").readline()
    path.write_bytes(first + first.replace(b'"ctx": "', b'"ctx": "caf\xe9 '))  # line 2 in Latin-1
    with pytest.raises(ValueError, match="not UTF-8") as e:
        hellaswag.load(path)
    assert f"{path}:2" in str(e.value)


def test_evaluate_refuses_what_it_cannot_score(encoder_json, tmp_path, capsys):
    enc = get_gpt2_encoding(encoder_json)
    with pytest.raises(ValueError, match="examples is empty"):
        hellaswag.evaluate(_model(0), [], enc)
    # GPT-2's token ids past a small model's vocabulary: refused by name, by the API and the command line
    small = fastgpt.GPT(fastgpt.GPTConfig(block_size=64, vocab_size=96, n_layer=1, n_head=2, n_embd=16), seed=0)
    with pytest.raises(ValueError, match="vocab_size is 96"):
        hellaswag.evaluate(small, hellaswag.load(MINI, 1), enc)
    fastgpt.checkpoint.save_checkpoint(small, tmp_path / "m.safetensors")
    with pytest.raises(SystemExit) as e:
        hellaswag.main([str(tmp_path / "m.safetensors"), "--data", MINI, "--encoder", str(encoder_json)])
    assert e.value.code == 2 and "vocab_size is 96" in capsys.readouterr().err


def test_train_py_refuses_an_empty_ctx_before_training(shakespeare_txt, encoder_json, tmp_path, capsys):
    # The example would pass until the first eval and end the run there; it is refused before any step.
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps({"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n")
    with pytest.raises(SystemExit):
        main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), "--n-layer", "1", "--n-head", "2",
              "--n-embd", "32", "-B", "2", "-T", "16", "--no-progress", "--max-steps", "2", "--eval-interval", "1",
              "--eval-steps", "1", "--sample-tokens", "0", "--hellaswag", str(path), "--out-dir", str(tmp_path / "r")])
    assert f"--hellaswag: {path}:1: 'ctx' is empty" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r" / "log.jsonl")


def test_train_py_reports_hellaswag_at_every_eval(shakespeare_txt, encoder_json, tmp_path, capsys):
    out = tmp_path / "run"
    result = main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), "--n-layer", "2", "--n-head",
                   "2", "--n-embd", "64", "-B", "4", "-T", "32", "--no-progress", "--max-steps", "4",
                   "--eval-interval", "2", "--eval-steps", "2", "--sample-tokens", "0", "--hellaswag", MINI,
                   "--out-dir", str(out)])
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    swag = [e for e in log if "hellaswag" in e]
    assert [e["step"] for e in swag] == [0, 2, 4] and all(e["hellaswag_total"] == 6 for e in swag)
    final = hellaswag.evaluate(result["model"], MINI, get_gpt2_encoding(encoder_json))
    assert swag[-1]["hellaswag"] == final["accuracy"] == result["hellaswag"]
    assert f"hellaswag {final['correct']}/6" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--input", str(shakespeare_txt), "--encoder", str(encoder_json), "--hellaswag",
              str(tmp_path / "nope.jsonl"), "--out-dir", str(tmp_path / "x")])
    assert "--hellaswag" in capsys.readouterr().err


def test_command_line(encoder_json, tmp_path, capsys, rng):
    model = _model(int(rng.integers(1 << 30)))
    fastgpt.checkpoint.save_checkpoint(model, tmp_path / "m.safetensors")
    result = hellaswag.main([str(tmp_path / "m.safetensors"), "--data", MINI, "--limit", "4", "--encoder",
                             str(encoder_json)])
    want = hellaswag.evaluate(model, hellaswag.load(MINI, 4), get_gpt2_encoding(encoder_json))
    assert result == want and f"hellaswag: {want['correct']}/4" in capsys.readouterr().out
