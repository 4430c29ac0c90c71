"""Hugging Face GPT-2 weights in and out, from and to local files only (nothing is downloaded).

transformers' GPT-2 is the same function as fastgpt's (pre-LN blocks, fused QKV, tanh GELU "gelu_new", LayerNorm eps
1e-5, lm_head tied to wte); only the file layout differs:
- its four projections are Conv1D modules, weights stored (in, out): c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj are
  transposed on the way in and out (nn.Linear's (out, in) here);
- names carry a "transformer." prefix in files written by GPT2LMHeadModel, none in older files (the hub's gpt2);
- attn.bias / attn.masked_bias are the causal mask buffers of older versions, not weights: ignored;
- lm_head.weight is wte (tied): ignored if present and equal, never written.
from_pretrained reads a transformers folder (config.json plus model.safetensors, a sharded
model.safetensors.index.json, or pytorch_model.bin when torch is installed) or a bare .safetensors file (its
config.json beside it, or n_head given). save_pretrained writes config.json + model.safetensors that
transformers.GPT2LMHeadModel.from_pretrained loads as it is, atomically file by file.
"""
import json
import os
import pickle

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ._io import atomic_path, atomic_write_bytes

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BUFFERS = ("attn.bias", "attn.masked_bias")
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation fastgpt computes
EOT = 50256


def _conv1d(name):
    return name.startswith("transformer.h.") and name.split(".", 3)[3] in CONV1D


def _config_from_hf(cfg, where):
    """GPTConfig fields from a transformers GPT2Config dict; anything fastgpt would compute differently is refused."""
    def bad(why):
        return ValueError(f"{where}: {why}; fastgpt runs GPT-2 exactly as build-nanogpt does and cannot load it")

    if cfg.get("model_type", "gpt2") != "gpt2":
        raise bad(f"model_type is {cfg['model_type']!r}, not 'gpt2'")
    act = cfg.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        raise bad(f"activation_function is {act!r}, fastgpt's GELU is the tanh approximation ({TANH_GELU})")
    if abs(float(cfg.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        raise bad(f"layer_norm_epsilon is {cfg['layer_norm_epsilon']}, fastgpt's LayerNorm uses 1e-5")
    n_embd = cfg.get("n_embd", 768)
    if cfg.get("n_inner") not in (None, 4 * n_embd):
        raise bad(f"n_inner is {cfg['n_inner']}, fastgpt's MLP is 4 * n_embd = {4 * n_embd} wide")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if cfg.get(key, want) != want:
            raise bad(f"{key} is {cfg[key]}, fastgpt needs {want}")
    return dict(block_size=cfg.get("n_positions", cfg.get("n_ctx", 1024)), vocab_size=cfg.get("vocab_size", 50257),
                n_layer=cfg.get("n_layer", 12), n_head=cfg.get("n_head", 12), n_embd=n_embd)


def _read_safetensors(path):
    """name -> NumPy array. bfloat16 tensors (which safetensors' NumPy side cannot type) are read from the file's
    header and bytes as ml_dtypes.bfloat16."""
    try:
        with safe_open(path, framework="np") as f:
            out, bf16 = {}, []
            for name in f.keys():
                try:
                    out[name] = f.get_tensor(name)
                except TypeError:
                    bf16.append(name)
    except SafetensorError as e:  # a cut-short or damaged file; safetensors' own message names no file
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if bf16:
        with open(path, "rb") as f:  # safe_open has checked the header and the file's length against it
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            for name in bf16:
                info = header[name]
                if info["dtype"] != "BF16":
                    raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which fastgpt cannot read")
                begin, end = info["data_offsets"]
                f.seek(8 + n + begin)
                data = f.read(end - begin)
                if len(data) != end - begin:  # the file changed after safe_open checked it
                    raise ValueError(f"{path}: not a readable safetensors file (tensor {name!r} is cut short)")
                out[name] = np.frombuffer(data, ml_dtypes.bfloat16).reshape(info["shape"])
    return out


def _read_torch_bin(path):
    try:
        import torch
    except ImportError:
        raise ImportError(f"{path} is a PyTorch pickle: reading it needs torch (pip install torch), or convert the "
                          "folder to model.safetensors") from None
    with open(path, "rb") as f:  # open()'s own errors name the file; what fails past it is the file's content
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:  # damaged, cut short, not tensors
            detail = str(e)
            # torch wraps the unpickler's reason in advice to pass weights_only=False, which would run code from a
            # file that is most likely just damaged: only the reason is kept.
            if "WeightsUnpickler error:" in detail:
                detail = detail.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
            detail = " ".join(detail.split()) or type(e).__name__
            raise ValueError(f"{path}: not a readable PyTorch file ({detail})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a PyTorch state dict (names to tensors), got {type(state).__name__}")
    return {k: v.detach().float().numpy() for k, v in state.items()}


def _weights_file(folder):
    # transformers' order (model.safetensors, its sharded index, then pytorch_model.bin), so a folder holding more
    # than one of them gives fastgpt the weights transformers would load.
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return lambda: _read_safetensors(single)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError):  # not JSON (or not UTF-8), or JSON but not an object
            weight_map = None
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{index}: expected a JSON object whose 'weight_map' maps tensor names to shard files")
        files = sorted(set(weight_map.values()))
        return lambda: {k: v for shard in files for k, v in _read_safetensors(os.path.join(folder, shard)).items()}
    pickled = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(pickled):
        return lambda: _read_torch_bin(pickled)
    raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_pretrained(path, n_head=None):
    """(GPTConfig fields, {fastgpt name: array}) from a transformers GPT-2 folder or a bare .safetensors file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        folder, read = path, _weights_file(path)
    elif os.path.isfile(path):
        folder, read = os.path.dirname(os.path.abspath(path)), lambda: _read_safetensors(path)
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: expected a transformers GPT-2 folder or a .safetensors file")
    else:
        raise FileNotFoundError(f"no such folder or file: {path}")
    cfg_path = os.path.join(folder, "config.json")
    config = None
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                raw = json.load(f)
        except ValueError as e:  # json's message gives line and column, not the file
            raise ValueError(f"{cfg_path}: not a JSON file ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object (a transformers GPT2Config), got "
                             f"{type(raw).__name__}")
        config = _config_from_hf(raw, cfg_path)
        if n_head is not None and n_head != config["n_head"]:
            raise ValueError(f"n_head={n_head} disagrees with {cfg_path} (n_head {config['n_head']})")
    elif n_head is None:
        # A damaged file is the thing to report (a cut-short train.py checkpoint, its header unreadable, lands
        # here too): asking for n_head would send the user the wrong way.
        read()
        raise ValueError(f"{path}: no config.json beside the weights, and n_head cannot be read from tensor shapes: "
                         "pass n_head=")
    tensors = {}
    for key, value in read().items():
        name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if ".".join(name.split(".")[-2:]) in BUFFERS:
            continue
        value = np.asarray(value, np.float32)  # fp16 / bf16 files widen exactly
        tensors[name] = value.T if _conv1d(name) else value
    if "lm_head.weight" in tensors:
        wte = tensors.get("transformer.wte.weight")
        if wte is None or not np.array_equal(tensors["lm_head.weight"], wte):
            raise ValueError(f"{path}: lm_head.weight differs from transformer.wte.weight; fastgpt ties them")
        del tensors["lm_head.weight"]
    shapes = _shapes_config(tensors, path)
    if config is None:
        config = dict(shapes, n_head=n_head)
    else:
        for key, value in shapes.items():
            if config[key] != value:
                raise ValueError(f"{path}: config says {key}={config[key]}, the weights have {value}")
    return config, tensors


def _shapes_config(tensors, path):
    try:
        V, C = tensors["transformer.wte.weight"].shape
        block = tensors["transformer.wpe.weight"].shape[0]
    except KeyError as e:
        raise KeyError(f"{path}: no {e.args[0]} among the weights: not a GPT-2 checkpoint") from None
    layers = {int(k.split(".")[2]) for k in tensors if k.startswith("transformer.h.")}
    return dict(block_size=block, vocab_size=V, n_layer=len(layers), n_embd=C)


def hf_config(config):
    """A transformers GPT2Config (as a dict) for a fastgpt GPTConfig: the same function, no dropout."""
    cfg = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "torch_dtype": "float32",
    }
    # GPT-2's <|endoftext|>, where the vocabulary has it. Otherwise None, written out: a missing key would get
    # GPT2Config's default 50256, an id outside the vocabulary, which transformers warns about on every load.
    eot = EOT if config.vocab_size > EOT else None
    cfg.update(bos_token_id=eot, eos_token_id=eot)
    return cfg


def save_pretrained(model, folder):
    """config.json + model.safetensors (the fp32 master weights) in folder, as transformers writes GPT-2."""
    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"{folder} exists and is not a folder")
    tensors = {name: np.ascontiguousarray(value.T if _conv1d(name) else value)
               for name, value in model.state_dict().items() if name != "lm_head.weight"}
    with atomic_path(os.path.join(folder, "model.safetensors")) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    text = json.dumps(hf_config(model.config), indent=2) + "\n"
    atomic_write_bytes(os.path.join(folder, "config.json"), [text.encode()])
    return folder
