"""GPT-2 tokenizer: a tiktoken Encoding identical to tiktoken's "gpt2", built offline from encoder.json.

tiktoken.get_encoding("gpt2") downloads vocab.bpe and encoder.json, which fails without internet. For GPT-2 every
merge's rank equals the id of the token it produces, so encoder.json alone defines the BPE: the ids are the ranks.
"""
import functools
import json
import os

import tiktoken

EOT = 50256  # <|endoftext|>: separates documents, and the last id in GPT-2's table
N_VOCAB = 50257
ENV_VAR = "FASTGPT_GPT2_ENCODER"

try:  # the exact split regex tiktoken's own "gpt2" uses, so both encodings agree token for token
    from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN
except ImportError:  # older tiktoken: the same regex without possessive quantifiers
    GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode():
    # GPT-2 stores tokens as text: printable bytes stand for themselves, the other bytes (control characters,
    # space, ...) are shifted to code points 256+ so that every byte has a visible, non-whitespace character.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _bad(path, why):
    return ValueError(f"{path}: not a GPT-2 encoder.json ({why})")


@functools.lru_cache(maxsize=None)
def _load(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GPT-2 encoder.json not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(path, f"invalid JSON: {e}") from None
    if not isinstance(table, dict):
        raise _bad(path, f"expected a JSON object, found {type(table).__name__}")
    if len(table) != N_VOCAB or table.get("<|endoftext|>") != EOT:
        raise _bad(path, f"expected {N_VOCAB} entries with <|endoftext|> = {EOT}, found {len(table)} entries")
    ranks = {}
    for key, rank in table.items():
        if key == "<|endoftext|>":
            continue
        if type(rank) is not int or not 0 <= rank < EOT:
            raise _bad(path, f"id of {key!r} is {rank!r}, expected an integer in [0, {EOT})")
        try:
            token = bytes(_UNICODE_TO_BYTE[c] for c in key)
        except KeyError as e:
            raise _bad(path, f"key {key!r} has character {e.args[0]!r} outside GPT-2's byte alphabet") from None
        if token in ranks:
            raise _bad(path, f"token {token!r} appears twice")
        ranks[token] = rank
    if len(set(ranks.values())) != EOT:
        raise _bad(path, f"ids are not the distinct integers 0..{EOT - 1}")
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=N_VOCAB,
    )


def get_gpt2_encoding(encoder_json=None):
    """GPT-2's tiktoken Encoding, from encoder_json, else $FASTGPT_GPT2_ENCODER, else tiktoken's download."""
    path = encoder_json if encoder_json is not None else os.environ.get(ENV_VAR) or None
    if path is not None:
        # Resolve so that the same file reached by different spellings is loaded once.
        return _load(os.path.realpath(os.fspath(path)))
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise RuntimeError(
            "cannot load the GPT-2 tokenizer: tiktoken could not fetch it "
            f"({type(e).__name__}: {e}). Offline, pass encoder_json=/path/to/gpt2/encoder.json "
            f"or set {ENV_VAR} to that path."
        ) from e
