"""The whole model vs the PyTorch reference (build-nanogpt's GPT loaded with fastgpt's weights): logits, loss and
every gradient within 1e-5 relative; parameter layout, names, tying, init statistics and state_dict round trips."""
import numpy as np
import pytest
import torch

import fastgpt
from devices import needs_cuda
from reference_gpt import RefConfig, RefGPT, ref_from_fastgpt, rel_err

TOL = 1e-5
SMALL = fastgpt.GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=64)


def batch(rng, B, T, V):
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


@pytest.mark.parametrize("config,B,T", [(SMALL, 4, 32), (SMALL, 3, 17),
                                        (fastgpt.GPTConfig(block_size=16, vocab_size=101, n_layer=3, n_head=3,
                                                           n_embd=48), 2, 16)])
def test_forward_backward_matches_torch(rng, config, B, T):
    model = fastgpt.GPT(config, seed=int(rng.integers(1 << 31)))
    ref = ref_from_fastgpt(model, torch.float64)
    x, y = batch(rng, B, T, config.vocab_size)

    logits, loss = model.forward(x, y)
    model.backward()
    ref_logits, ref_loss = ref(torch.tensor(x), torch.tensor(y))
    ref_loss.backward()

    assert logits.shape == (B, T, config.vocab_size)
    assert abs(loss - ref_loss.item()) / ref_loss.item() < TOL
    assert rel_err(logits, ref_logits.detach()) < TOL
    grads = model.grads()
    for name, p in ref.named_parameters():
        assert rel_err(grads[name], p.grad) < TOL, name


def test_inference_forward_has_no_loss(rng):
    model = fastgpt.GPT(SMALL, seed=3)
    x, _ = batch(rng, 2, 8, SMALL.vocab_size)
    logits, loss = model.forward(x)
    ref_logits, _ = ref_from_fastgpt(model)(torch.tensor(x))
    assert loss is None
    assert rel_err(logits, ref_logits.detach()) < TOL


def test_backward_accumulates_with_grad_scale(rng):
    model = fastgpt.GPT(SMALL, seed=4)
    x, y = batch(rng, 2, 16, SMALL.vocab_size)
    model.forward(x, y, return_logits=False)
    model.backward()
    once = {k: v.copy() for k, v in model.grads().items()}
    model.forward(x, y, return_logits=False)
    model.backward(grad_scale=0.5)
    for name, g in model.grads().items():
        assert np.allclose(g, 1.5 * once[name], rtol=1e-5, atol=1e-9), name
    model.zero_grad()
    assert all(not g.any() for g in model.grads().values())


def test_same_seed_same_weights_and_bitwise_same_step(rng):
    a, b = fastgpt.GPT(SMALL, seed=7), fastgpt.GPT(SMALL, seed=7)
    c = fastgpt.GPT(SMALL, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert not np.array_equal(sa["transformer.wte.weight"], sc["transformer.wte.weight"])
    x, y = batch(rng, 2, 16, SMALL.vocab_size)
    _, la = a.forward(x, y)
    _, lb = b.forward(x, y)
    a.backward()
    b.backward()
    assert la == lb
    assert all(np.array_equal(a.grads()[k], b.grads()[k]) for k in sa)


def test_layout_names_shapes_and_tying():
    model = fastgpt.GPT(SMALL, seed=0)
    ref = RefGPT(RefConfig(**vars(SMALL)))
    sd = model.state_dict()
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd)  # same names, same order as build-nanogpt's state_dict
    for k in sd:
        assert sd[k].shape == tuple(ref_sd[k].shape), k
        assert sd[k].dtype == np.float32
    assert np.shares_memory(sd["lm_head.weight"], sd["transformer.wte.weight"])
    unique = sum(v.size for k, v in sd.items() if k != "lm_head.weight")
    assert model.num_parameters() == unique == sum(p.numel() for p in ref.parameters())
    # Views are zero-copy: a write through the state_dict changes the model.
    sd["transformer.ln_f.bias"][:] = 1.0
    assert (model.state_dict()["transformer.ln_f.bias"] == 1.0).all()


def test_a_reused_config_object_changes_no_model():
    config = fastgpt.GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
    small = fastgpt.GPT(config)
    config.n_layer, config.block_size = 1, 8  # the caller's object, reused for another model
    other = fastgpt.GPT(config)
    assert small.config.n_layer == 2 and small.config.block_size == 16 and other.config.n_layer == 1
    assert small.num_parameters() > other.num_parameters()
    with pytest.raises(TypeError, match="config must be a fastgpt.GPTConfig, got dict"):
        fastgpt.GPT({"n_layer": 2})


def test_a_diverged_models_state_dict_loads_back():
    # NaN in the tied embedding: lm_head still equals wte (NaN where it is NaN), so its own state_dict loads back.
    model = fastgpt.GPT(fastgpt.GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8))
    sd = {k: np.array(v) for k, v in model.state_dict().items()}
    sd["transformer.wte.weight"][3, 1] = sd["lm_head.weight"][3, 1] = np.nan
    model.load_state_dict(sd)
    assert np.isnan(model.state_dict()["transformer.wte.weight"][3, 1])
    sd["lm_head.weight"] = sd["lm_head.weight"].copy()
    sd["lm_head.weight"][0, 0] += 1
    with pytest.raises(ValueError, match="must equal 'transformer.wte.weight'"):
        model.load_state_dict(sd)


def test_init_distribution():
    config = fastgpt.GPTConfig(block_size=64, vocab_size=2000, n_layer=4, n_head=4, n_embd=128)
    sd = fastgpt.GPT(config, seed=11).state_dict()
    proj_std = 0.02 / np.sqrt(2 * config.n_layer)
    for name, a in sd.items():
        if name.endswith("c_proj.weight"):
            assert abs(a.std() - proj_std) < 0.05 * proj_std, name
            assert abs(a.mean()) < 0.05 * proj_std, name
        elif name.endswith(".weight") and a.ndim == 2:
            assert abs(a.std() - 0.02) < 0.05 * 0.02, name
            assert abs(a.mean()) < 0.05 * 0.02, name
        elif "ln_" in name and name.endswith(".weight"):
            assert (a == 1).all(), name
        else:
            assert (a == 0).all(), name


def test_load_state_dict_from_torch_and_back(rng):
    ref = RefGPT(RefConfig(**vars(SMALL)))
    model = fastgpt.GPT(SMALL, seed=0)
    model.load_state_dict(ref.state_dict())
    for name, t in ref.state_dict().items():
        assert np.array_equal(model.state_dict()[name], t.numpy()), name
    # A torch.compile'd model's names carry a prefix; they load too.
    other = fastgpt.GPT(SMALL, seed=1)
    other.load_state_dict({"_orig_mod." + k: v for k, v in model.state_dict().items()})
    assert np.array_equal(other.state_dict()["transformer.wpe.weight"], model.state_dict()["transformer.wpe.weight"])


@needs_cuda
def test_cuda_model_matches_torch(rng):
    # The same model on the GPU: same initial weights as on the CPU, and logits, loss and every gradient within
    # 1e-5 of the float64 PyTorch reference.
    seed = int(rng.integers(1 << 31))
    cpu, gpu = fastgpt.GPT(SMALL, seed=seed), fastgpt.GPT(SMALL, device="cuda", seed=seed)
    assert all(np.array_equal(a, gpu.state_dict()[k]) for k, a in cpu.state_dict().items())
    ref = ref_from_fastgpt(cpu, torch.float64)
    x, y = batch(rng, 4, 32, SMALL.vocab_size)
    logits, loss = gpu.forward(x, y)
    gpu.backward()
    ref_logits, ref_loss = ref(torch.tensor(x), torch.tensor(y))
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) / ref_loss.item() < TOL
    assert rel_err(logits, ref_logits.detach()) < TOL
    grads = gpu.grads()
    for name, p in ref.named_parameters():
        assert rel_err(grads[name], p.grad) < TOL, name
