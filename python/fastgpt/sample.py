"""Sample text from a saved model: `python -m fastgpt.sample CHECKPOINT --prompt "..." -n 100` (or `fastgpt-sample`).

CHECKPOINT is what train.py wrote (runs/<timestamp>/model.safetensors, or the run folder itself) or a Hugging Face
GPT-2 (a transformers folder, or a bare .safetensors file with --n-head). Tokens are printed as they are sampled
(the KV cache makes each one cost a single position), one sample after another; generation stops at --stop
(<|endoftext|> by default) or after -n tokens. The GPT-2 tokenizer comes from --encoder, $FASTGPT_GPT2_ENCODER, the
vocab.json of a transformers folder (GPT-2's encoder.json under another name), else tiktoken.
"""
import argparse
import codecs
import os
import sys

from . import resume
from ._io import stdout_to_devnull
from .checkpoint import load_checkpoint, read_metadata
from .model import GPT, _check_device
from .tokenizer import EOT, N_VOCAB, get_gpt2_encoding


def _is_fastgpt_checkpoint(path):
    try:
        read_metadata(path)
    except ValueError:  # another safetensors file, or a damaged one: the Hugging Face reader says which
        return False
    return True


def load_model(path, device="cpu", precision="fp32", n_head=None):
    """A fastgpt.GPT from a train.py checkpoint (file, run folder, or, for a run stopped before its end, the run's
    latest step_NNNNNN checkpoint) or a Hugging Face GPT-2 (folder or file)."""
    path = os.fspath(path)
    ours = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
    steps = resume.list_checkpoints(path) if os.path.isdir(path) and not os.path.exists(ours) else []
    if steps and not os.path.isfile(os.path.join(path, "config.json")):  # a train.py run that did not finish
        ours = os.path.join(steps[-1][1], "model.safetensors")
        print(f"note: {path} has no final model.safetensors (the run stopped early): loading its latest "
              f"checkpoint, {steps[-1][1]}", file=sys.stderr)
    if os.path.isfile(ours) and _is_fastgpt_checkpoint(ours):
        return load_checkpoint(ours, device=device, precision=precision)
    return GPT.from_pretrained(path, device=device, precision=precision, n_head=n_head)


def _encoding(args):
    encoder = args.encoder
    vocab = os.path.join(args.checkpoint, "vocab.json")
    if encoder is None and not os.environ.get("FASTGPT_GPT2_ENCODER") and os.path.isfile(vocab):
        encoder = vocab
    return get_gpt2_encoding(encoder)


def build_parser():
    p = argparse.ArgumentParser(prog="fastgpt-sample", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", help="train.py's model.safetensors or run folder, or a Hugging Face GPT-2")
    p.add_argument("--prompt", default="", help="text to continue (empty: a new document, <|endoftext|>)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=100)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0, help="0: always the most likely token")
    p.add_argument("--top-k", type=int, default=50, help="0: no top-k")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off")
    p.add_argument("--seed", type=int, help="sample i uses seed + i (default: fresh randomness)")
    p.add_argument("--stop", default="<|endoftext|>", help="stop a sample at this token ('' never stops)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"))
    p.add_argument("--encoder", help="GPT-2 encoder.json")
    p.add_argument("--n-head", type=int, help="heads, for a bare .safetensors file without a config.json")
    return p


def main(argv=None, out=None):
    """Prints the samples to out (default stdout) as they come; returns them as lists of token ids."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error(f"--num-samples must be >= 1, got {args.num_samples}")
    try:
        _check_device(args.device, args.precision)
    except (ValueError, RuntimeError) as e:
        parser.error(f"--device/--precision: {e}")
    try:
        model = load_model(args.checkpoint, args.device, args.precision, args.n_head)
    except (OSError, ValueError, KeyError, ImportError) as e:
        parser.error(f"checkpoint: {e}")
    except (RuntimeError, MemoryError) as e:  # the device: a GPU that cannot take this precision, out of memory
        parser.error(f"--device/--precision: {e}")
    try:
        enc = _encoding(args)
    except (OSError, ValueError, RuntimeError) as e:
        parser.error(f"--encoder: {e}")
    prompt = enc.encode(args.prompt, allowed_special={"<|endoftext|>"}) if args.prompt else [EOT]
    stop = None
    if args.stop:
        ids = enc.encode(args.stop, allowed_special={"<|endoftext|>"})
        if len(ids) != 1:
            parser.error(f"--stop must be one token, {args.stop!r} is {len(ids)}")
        stop = ids[0] if ids[0] < model.config.vocab_size else None
    if max(prompt) >= model.config.vocab_size:
        parser.error(f"the prompt has token ids the model's vocabulary ({model.config.vocab_size}) lacks")
    samples = []
    try:
        for i in range(args.num_samples):
            if args.num_samples > 1:
                out.write(f"---- sample {i + 1} of {args.num_samples} ----\n")
            out.write(args.prompt)
            text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
            tokens = []
            steps = model.generate_iter(prompt, args.max_new_tokens, temperature=args.temperature,
                                        top_k=args.top_k or None, top_p=None if args.top_p == 1 else args.top_p,
                                        seed=None if args.seed is None else args.seed + i, stop_token=stop)
            for token in steps:
                token = int(token)
                tokens.append(token)
                if token == stop or token >= N_VOCAB:  # padded ids (50257..) have no text
                    continue
                piece = text.decode(enc.decode_single_token_bytes(token))
                if piece:
                    out.write(piece)
                    out.flush()
            out.write(text.decode(b"", final=True) + "\n")
            out.flush()
            samples.append(tokens)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return samples


def cli():
    try:
        main()
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a shell tool does on SIGPIPE
        stdout_to_devnull()
        return 128 + 13  # SIGPIPE's number: what `yes | head` reports for yes
    return 0


if __name__ == "__main__":
    sys.exit(cli())
