"""Hugging Face GPT-2 files in and out (transformers is a test dependency; nothing is downloaded): a fastgpt model
saved with save_pretrained loads into transformers.GPT2LMHeadModel.from_pretrained as it is, and a transformers model
saved by transformers loads into fastgpt.GPT.from_pretrained, with the same logits (1e-5) both ways and the same
greedy tokens as transformers' generate. Also the hub's older layout (no "transformer." prefix, mask buffers,
lm_head stored), pytorch_model.bin, sharded and bf16 safetensors, a bare .safetensors file, and what is refused."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

import fastgpt
from reference_gpt import rel_err

CONFIG = fastgpt.GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _hf_model(seed):
    torch.manual_seed(seed)
    cfg = GPT2Config(n_positions=CONFIG.block_size, vocab_size=CONFIG.vocab_size, n_layer=CONFIG.n_layer,
                     n_head=CONFIG.n_head, n_embd=CONFIG.n_embd, activation_function="gelu_new",
                     layer_norm_epsilon=1e-5)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # every tensor random (biases and LayerNorm included), so a missed transpose shows
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _hf_logits(model, x):
    with torch.no_grad():
        return model(torch.tensor(x)).logits.double().numpy()


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(prompt.shape, dtype=torch.long))
    return out.numpy()


def test_save_pretrained_loads_into_transformers(rng, tmp_path):
    model = fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31)))
    model.save_pretrained(tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = rng.integers(0, CONFIG.vocab_size, (3, CONFIG.block_size))
    assert rel_err(model.forward(x)[0], _hf_logits(hf, x)) < 1e-5
    prompt = rng.integers(0, CONFIG.vocab_size, (2, 4))
    np.testing.assert_array_equal(model.generate(prompt, 20, temperature=0.0), _hf_greedy(hf, prompt, 20))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_from_pretrained_reads_what_transformers_writes(rng, tmp_path, precision):
    hf = _hf_model(int(rng.integers(1 << 31)))
    hf.save_pretrained(tmp_path / "hf")
    model = fastgpt.GPT.from_pretrained(tmp_path / "hf", precision=precision)
    assert model.config == CONFIG and model.precision == precision
    for name, p in hf.state_dict().items():  # the weights themselves, Conv1D transposed
        if name in model.state_dict():
            want = p.numpy().T if name.endswith(CONV1D) else p.numpy()
            np.testing.assert_array_equal(model.state_dict()[name], want)
    x = rng.integers(0, CONFIG.vocab_size, (2, 16))
    if precision == "fp32":
        assert rel_err(model.forward(x)[0], _hf_logits(hf, x)) < 1e-5
        prompt = rng.integers(0, CONFIG.vocab_size, (2, 5))
        np.testing.assert_array_equal(model.generate(prompt, 25, temperature=0.0), _hf_greedy(hf, prompt, 25))
    else:  # bf16 compute weights and activations: close, not exact
        assert rel_err(model.forward(x)[0], _hf_logits(hf, x)) < 3e-2


def _hub_layout(hf):
    """The hub's gpt2 file: no "transformer." prefix, the mask buffers stored, lm_head.weight beside wte."""
    sd = {k.removeprefix("transformer."): v.clone().contiguous() for k, v in hf.state_dict().items()}
    T = CONFIG.block_size
    for l in range(CONFIG.n_layer):
        sd[f"h.{l}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        sd[f"h.{l}.attn.masked_bias"] = torch.tensor(-1e4)
    sd["lm_head.weight"] = sd["wte.weight"].clone()
    return sd


def test_hub_layout_pytorch_bin_and_sharded(rng, tmp_path):
    hf = _hf_model(int(rng.integers(1 << 31)))
    x = rng.integers(0, CONFIG.vocab_size, (2, 12))
    ref = _hf_logits(hf, x)
    hf.config.to_json_file(tmp_path / "config.json")
    sd = _hub_layout(hf)
    for kind in ("safetensors", "bin", "sharded"):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "config.json").read_text())
        if kind == "safetensors":
            save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
        elif kind == "bin":
            torch.save(sd, folder / "pytorch_model.bin")
        else:
            names = sorted(sd)
            half = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
            for file, keys in half.items():
                save_file({k: sd[k] for k in keys}, folder / file, metadata={"format": "pt"})
            index = {"metadata": {}, "weight_map": {k: f for f, keys in half.items() for k in keys}}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        model = fastgpt.GPT.from_pretrained(folder)
        assert rel_err(model.forward(x)[0], ref) < 1e-5, kind


def test_bare_safetensors_and_bf16_file(rng, tmp_path):
    hf = _hf_model(int(rng.integers(1 << 31)))
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, tmp_path / "w.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="pass n_head="):
        fastgpt.GPT.from_pretrained(tmp_path / "w.safetensors")
    model = fastgpt.GPT.from_pretrained(tmp_path / "w.safetensors", n_head=CONFIG.n_head)
    assert model.config == CONFIG
    x = rng.integers(0, CONFIG.vocab_size, (2, 12))
    assert rel_err(model.forward(x)[0], _hf_logits(hf, x)) < 1e-5
    # bfloat16 on disk: widened exactly to the fp32 masters
    save_file({k: v.bfloat16() for k, v in sd.items()}, tmp_path / "b.safetensors", metadata={"format": "pt"})
    model = fastgpt.GPT.from_pretrained(tmp_path / "b.safetensors", n_head=CONFIG.n_head)
    want = sd["transformer.h.1.mlp.c_fc.weight"].bfloat16().float().numpy().T
    np.testing.assert_array_equal(model.state_dict()["transformer.h.1.mlp.c_fc.weight"], want)


def test_round_trip_is_bitwise(rng, tmp_path):
    model = fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31)))
    model.save_pretrained(tmp_path)
    again = fastgpt.GPT.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[name], value)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["activation_function"] == "gelu_new" and config["n_positions"] == CONFIG.block_size


@pytest.mark.parametrize("key,value,match", [("activation_function", "gelu", "tanh approximation"),
                                             ("layer_norm_epsilon", 1e-6, "eps"),
                                             ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse"),
                                             ("n_inner", 100, "n_inner"), ("model_type", "llama", "model_type")])
def test_what_fastgpt_would_compute_differently_is_refused(rng, tmp_path, key, value, match):
    fastgpt.GPT(CONFIG, seed=0).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        fastgpt.GPT.from_pretrained(tmp_path)


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        fastgpt.GPT.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        fastgpt.GPT.from_pretrained(tmp_path)
    fastgpt.GPT(CONFIG, seed=0).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_layer=3)))
    with pytest.raises(ValueError, match="config says n_layer=3, the weights have 2"):
        fastgpt.GPT.from_pretrained(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        fastgpt.GPT(CONFIG, seed=0).save_pretrained(tmp_path / "file")


def _cut(path):
    # A copy cut short (disk full, an interrupted scp): its first half.
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_damaged_safetensors_is_a_clear_error(rng, tmp_path):
    # ValueErrors naming the file, which the CLIs turn into "error: ..." (safetensors' own error names no file and
    # is neither a ValueError nor an OSError).
    fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31))).save_pretrained(tmp_path)
    _cut(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        fastgpt.GPT.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        fastgpt.GPT.from_pretrained(tmp_path / "model.safetensors", n_head=2)
    # no config.json: the damage is reported, not a request for n_head (a cut-short train.py checkpoint)
    os.remove(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        fastgpt.GPT.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_damaged_pytorch_bin_is_a_clear_error(tmp_path, damage):
    # torch's own errors name no file, and one advises weights_only=False: running code from a damaged file.
    hf = _hf_model(0)
    hf.config.to_json_file(tmp_path / "config.json")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    if damage == "cut":
        _cut(tmp_path / "pytorch_model.bin")
    else:
        (tmp_path / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: not a readable PyTorch file") as e:
        fastgpt.GPT.from_pretrained(tmp_path)
    assert "weights_only" not in str(e.value)


def test_damaged_config_and_index_are_clear_errors(rng, tmp_path):
    fastgpt.GPT(CONFIG, seed=int(rng.integers(1 << 31))).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"n_layer": 2,')
    with pytest.raises(ValueError, match=r"config\.json: not a JSON file"):
        fastgpt.GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object"):
        fastgpt.GPT.from_pretrained(tmp_path)
    _hf_model(0).config.to_json_file(tmp_path / "config.json")
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(ValueError, match=r"index\.json: expected a JSON object whose 'weight_map'"):
        fastgpt.GPT.from_pretrained(tmp_path)


def test_folder_with_bin_and_shards_loads_what_transformers_loads(rng, tmp_path):
    # An old pytorch_model.bin left beside a newer sharded save: transformers reads the shards, so must fastgpt.
    old, new = _hf_model(1), _hf_model(2)
    torch.save(old.state_dict(), tmp_path / "pytorch_model.bin")
    new.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert not os.path.isfile(tmp_path / "model.safetensors")
    x = rng.integers(0, CONFIG.vocab_size, (2, 12))
    ours = fastgpt.GPT.from_pretrained(tmp_path).forward(x)[0]
    assert rel_err(ours, _hf_logits(GPT2LMHeadModel.from_pretrained(tmp_path).eval(), x)) < 1e-5
    assert rel_err(ours, _hf_logits(new, x)) < 1e-5


@pytest.mark.parametrize("vocab_size,eot", [(96, None), (50304, 50256)])
def test_bos_eos_ids_only_inside_the_vocabulary(tmp_path, vocab_size, eot):
    # Left out, transformers would fill in GPT-2's 50256 for a smaller vocabulary (and warn on every load).
    cfg = fastgpt.GPTConfig(block_size=8, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16)
    fastgpt.GPT(cfg, seed=0).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["bos_token_id"] == saved["eos_token_id"] == eot
    loaded = GPT2Config.from_pretrained(tmp_path)
    assert loaded.bos_token_id == loaded.eos_token_id == eot
