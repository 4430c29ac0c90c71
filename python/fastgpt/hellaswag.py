"""HellaSwag accuracy as build-nanogpt scores it: `python -m fastgpt.hellaswag CHECKPOINT --data hellaswag_val.jsonl`
(or `fastgpt-hellaswag`).

Each example is a context and four endings. Every ending is appended to the context (" " + ending, GPT-2 tokens),
the model reads the four rows, and the ending whose tokens have the lowest mean cross-entropy wins (build-nanogpt's
acc_norm: the mean, not the sum, so long endings are not penalised for their length). The data is the official
jsonl (one example a line with "ctx", "endings" and "label"), read from a local file: nothing is downloaded.

A row longer than the model's block_size keeps its last block_size tokens (the start of the context goes), which
build-nanogpt's T = 1024 never needed. Data parallel: rank r scores examples r, r + world_size, ... and the counts
are summed, so every rank returns the accuracy over all examples.
"""
import argparse
import json
import os
import sys
from dataclasses import dataclass

import numpy as np

from . import distributed
from .tokenizer import EOT


@dataclass
class Example:
    ctx: str
    endings: list  # four strings
    label: int     # index of the right ending


def load(path, limit=None):
    """The examples of a HellaSwag jsonl file (the first `limit`), each line checked; errors name file and line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"HellaSwag file not found: {path}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    examples = []
    with open(path, "rb") as f:  # bytes, decoded line by line below, so that a bad byte's error names its line
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(examples) == limit:
                break
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start} of the line); "
                                 "the official files are UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            ctx, endings, label = row.get("ctx"), row.get("endings"), row.get("label")
            if not isinstance(ctx, str):
                raise ValueError(f"{where}: 'ctx' must be a string, got {ctx!r:.60}")
            if not ctx:  # each ending token is scored from the tokens before it: the first would have none
                raise ValueError(f"{where}: 'ctx' is empty; an ending's first token needs a context to be scored")
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise ValueError(f"{where}: 'endings' must be a list of 4 strings, got {endings!r:.80}")
            if isinstance(label, str) and label.isdigit():  # some copies of the data store it as text
                label = int(label)
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < 4:
                raise ValueError(f"{where}: 'label' must be 0, 1, 2 or 3, got {label!r}")
            examples.append(Example(ctx, endings, label))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def render(example, enc, block_size):
    """The four rows of an example: (tokens, mask) pairs of int lists, mask 1 on the ending's tokens; at most
    block_size tokens each (the context's start is dropped if need be)."""
    ctx = enc.encode(example.ctx)
    rows = []
    for ending in example.endings:
        end = enc.encode(" " + ending)  # GPT-2 tokens carry their leading space
        tokens, mask = ctx + end, [0] * len(ctx) + [1] * len(end)
        rows.append((tokens[-block_size:], mask[-block_size:]))
    return rows


def ending_losses(logits, tokens, mask):
    """Mean cross-entropy of each row's ending tokens, float64 (rows,): logits (rows, L, V) predict tokens[:, 1:];
    only targets with mask 1 count."""
    losses = np.empty(len(tokens))
    for r in range(len(tokens)):
        pos = np.flatnonzero(mask[r, 1:])  # predictions whose target is an ending token
        if pos.size == 0:
            raise ValueError(f"row {r} has no ending token after its first position")
        rows = np.asarray(logits[r, pos], dtype=np.float64)  # (n, V)
        top = rows.max(axis=1)
        lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        losses[r] = np.mean(lse - rows[np.arange(pos.size), tokens[r, pos + 1]])
    return losses


def score(model, examples, enc, tokens_per_batch=4096):
    """The mean ending losses of each example, float64 (len(examples), 4). Examples are scored a few at a time, their
    rows padded to the longest (causal attention: the padding cannot change the positions before it), about
    tokens_per_batch tokens per forward."""
    block = model.config.block_size
    out = np.empty((len(examples), 4))
    i = 0
    while i < len(examples):
        first, rendered, longest = i, [], 0
        while i < len(examples) and (not rendered or 4 * (len(rendered) + 1) * longest <= tokens_per_batch):
            rows = render(examples[i], enc, block)
            rendered.append(rows)
            longest = max(longest, *(len(t) for t, _ in rows))
            i += 1
        tokens = np.zeros((4 * len(rendered), longest), np.int64)
        mask = np.zeros_like(tokens)
        for e, rows in enumerate(rendered):
            for j, (t, m) in enumerate(rows):
                tokens[4 * e + j, :len(t)] = t
                mask[4 * e + j, :len(m)] = m
        logits, _ = model.forward(tokens)
        out[first:i] = ending_losses(logits, tokens, mask).reshape(-1, 4)
    return out


def evaluate(model, examples, enc, rank=None, world_size=None, tokens_per_batch=4096):
    """Accuracy of a fastgpt.GPT on examples (a list from load(), or a path): {"accuracy", "correct", "total"}; the
    prediction is the ending with the lowest mean loss. Data parallel: each rank scores its share, counts summed."""
    if not isinstance(examples, list):
        examples = load(examples)
    if not examples:
        raise ValueError("examples is empty")
    if model.config.vocab_size <= EOT:  # GPT-2's tokens would index past the model's embedding table
        raise ValueError(f"the model's vocab_size is {model.config.vocab_size}: HellaSwag is scored in GPT-2's "
                         f"tokens, which need a vocabulary of at least {EOT + 1}")
    rank = distributed.rank() if rank is None else rank
    world_size = distributed.world_size() if world_size is None else world_size
    mine = examples[rank::world_size]
    losses = score(model, mine, enc, tokens_per_batch)
    correct = int(sum(int(np.argmin(l)) == e.label for l, e in zip(losses, mine)))
    if distributed.world_size() > 1:
        correct = int(round(distributed.all_reduce(float(correct))))
    return {"accuracy": correct / len(examples), "correct": correct, "total": len(examples)}


def main(argv=None):
    from .sample import load_model
    from .tokenizer import get_gpt2_encoding

    p = argparse.ArgumentParser(prog="python -m fastgpt.hellaswag", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="train.py's model.safetensors or run folder, or a Hugging Face GPT-2 folder")
    p.add_argument("--data", required=True, help="HellaSwag jsonl (e.g. hellaswag_val.jsonl)")
    p.add_argument("--limit", type=int, help="score the first N examples only")
    p.add_argument("--encoder", help="GPT-2 encoder.json (default: $FASTGPT_GPT2_ENCODER, else tiktoken)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"))
    args = p.parse_args(argv)
    try:
        examples = load(args.data, args.limit)
        enc = get_gpt2_encoding(args.encoder)
        model = load_model(args.checkpoint, device=args.device, precision=args.precision)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        p.error(str(e))
    try:
        result = evaluate(model, examples, enc)
    except ValueError as e:  # the model cannot score these examples (its vocabulary, say)
        p.error(f"{args.checkpoint}: {e}")
    print(f"hellaswag: {result['correct']}/{result['total']} = {result['accuracy']:.4f}")
    return result


def cli():
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
