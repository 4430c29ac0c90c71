"""The offline GPT-2 tokenizer: known GPT-2 token ids, lossless round trips, special-token handling, and the
errors a missing or damaged encoder.json must raise."""
import json

import pytest
import tiktoken

from fastgpt import tokenizer
from fastgpt.tokenizer import EOT, get_gpt2_encoding


@pytest.fixture
def enc(encoder_json):
    return get_gpt2_encoding(encoder_json)


def test_known_gpt2_facts(enc):
    assert EOT == 50256
    assert enc.n_vocab == 50257
    assert enc.eot_token == EOT
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("hello world") == [31373, 995]
    assert enc.decode([15496, 995]) == "Hello world"
    assert enc.decode([31373, 995]) == "hello world"
    assert [enc.encode(s) for s in ("!", "\n", " ", " the")] == [[0], [198], [220], [262]]


def test_round_trip_shakespeare(enc, shakespeare_txt, rng):
    text = shakespeare_txt.read_text(encoding="utf-8")
    n = int(rng.integers(2000, 5000))
    start = int(rng.integers(0, len(text) - n))
    piece = text[start:start + n]
    tokens = enc.encode_ordinary(piece)
    assert 0 < len(tokens) < len(piece)  # BPE must actually merge English text
    assert all(0 <= t < EOT for t in tokens)
    assert enc.decode(tokens) == piece


def test_round_trip_random_unicode(enc, rng):
    # Mix ASCII, Latin-1 (GPT-2's remapped bytes), CJK, emoji and whitespace so multi-byte tokens get exercised.
    ranges = [(0x20, 0x7F), (0x00, 0x20), (0xA0, 0x100), (0x400, 0x500), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]
    chars = []
    for _ in range(int(rng.integers(500, 2000))):
        lo, hi = ranges[int(rng.integers(len(ranges)))]
        chars.append(chr(int(rng.integers(lo, hi))))
    text = "".join(chars)
    tokens = enc.encode_ordinary(text)
    assert enc.decode(tokens) == text
    assert enc.decode_bytes(tokens) == text.encode("utf-8")


def test_special_token_only_when_allowed(enc, rng):
    words = ["".join(chr(int(c)) for c in rng.integers(ord("a"), ord("z") + 1, size=5)) for _ in range(2)]
    text = f"{words[0]}<|endoftext|>{words[1]}"
    special = enc.encode(text, allowed_special={"<|endoftext|>"})
    ordinary = enc.encode_ordinary(text)
    assert special.count(EOT) == 1
    assert EOT not in ordinary
    assert special == enc.encode_ordinary(words[0]) + [EOT] + enc.encode_ordinary(words[1])
    assert enc.decode(special) == enc.decode(ordinary) == text
    assert enc.encode_ordinary("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    with pytest.raises(ValueError):  # tiktoken refuses special text unless told how to treat it
        enc.encode(text)


def test_cached_per_path(encoder_json):
    assert get_gpt2_encoding(encoder_json) is get_gpt2_encoding(str(encoder_json))


def test_env_var(encoder_json, monkeypatch, enc):
    monkeypatch.setenv("FASTGPT_GPT2_ENCODER", str(encoder_json))
    from_env = get_gpt2_encoding()
    assert from_env.encode("Hello world") == [15496, 995]
    assert from_env is enc


def test_argument_beats_env_var(encoder_json, monkeypatch, tmp_path):
    monkeypatch.setenv("FASTGPT_GPT2_ENCODER", str(tmp_path / "absent.json"))
    assert get_gpt2_encoding(encoder_json).encode("hello world") == [31373, 995]
    with pytest.raises(FileNotFoundError, match="absent.json"):
        get_gpt2_encoding()


def test_no_source_offline_raises_runtime_error(monkeypatch):
    monkeypatch.delenv("FASTGPT_GPT2_ENCODER", raising=False)

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="FASTGPT_GPT2_ENCODER"):
        get_gpt2_encoding()


def test_missing_file(tmp_path):
    path = tmp_path / "nope" / "encoder.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        get_gpt2_encoding(path)


def test_invalid_json(tmp_path, encoder_json, rng):
    raw = encoder_json.read_bytes()
    path = tmp_path / "garbled.json"
    path.write_bytes(raw[: int(rng.integers(10, len(raw) - 10))])  # cut mid-file: no longer valid JSON
    with pytest.raises(ValueError, match="garbled.json"):
        get_gpt2_encoding(path)


def test_wrong_table(tmp_path, encoder_json, rng):
    table = json.loads(encoder_json.read_text(encoding="utf-8"))
    victim = list(table)[int(rng.integers(0, EOT))]
    table[victim] = table[list(table)[0]] if victim != list(table)[0] else 1  # a duplicate id
    path = tmp_path / "dup_ids.json"
    path.write_text(json.dumps(table), encoding="utf-8")
    with pytest.raises(ValueError, match="dup_ids.json"):
        get_gpt2_encoding(path)


def test_not_a_table(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]", encoding="utf-8")
    with pytest.raises(ValueError, match="list.json"):
        get_gpt2_encoding(path)


def test_pattern_is_tiktoken_gpt2(enc):
    pytest.importorskip("tiktoken_ext.openai_public")
    from tiktoken_ext.openai_public import r50k_pat_str

    assert tokenizer.GPT2_PATTERN == r50k_pat_str == enc._pat_str
