"""Bad input gets a Python exception that names the problem; never a crash. One test per case."""
import subprocess
import sys

import numpy as np
import pytest

import fastgpt
from fastgpt import ops

CONFIG = fastgpt.GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def model():
    return fastgpt.GPT(CONFIG, seed=0)


def ids(*shape, high=100):
    return np.random.default_rng().integers(0, high, shape)


def test_idx_wrong_ndim(model):
    with pytest.raises(ValueError, match="idx must be 2-D"):
        model.forward(ids(16))


def test_idx_float_dtype(model):
    with pytest.raises(TypeError, match="idx must be an integer array"):
        model.forward(np.zeros((2, 4), np.float32))


def test_targets_shape_mismatch(model):
    with pytest.raises(ValueError, match="targets shape"):
        model.forward(ids(2, 8), ids(2, 7))


def test_negative_token_id(model):
    x = ids(2, 8)
    x[1, 3] = -1
    with pytest.raises(ValueError, match=r"idx must hold token ids in \[0, vocab_size=100\), found -1"):
        model.forward(x)


def test_token_id_too_large(model):
    x = ids(2, 8)
    x[0, 0] = 100
    with pytest.raises(ValueError, match="found 100"):
        model.forward(x)


def test_target_id_too_large(model):
    y = ids(2, 8)
    y[0, 5] = 1000
    with pytest.raises(ValueError, match="targets must hold token ids"):
        model.forward(ids(2, 8), y)


def test_id_beyond_int32(model):
    x = ids(1, 4).astype(np.int64)
    x[0, 0] = 2**40
    with pytest.raises(ValueError, match="int32 range"):
        model.forward(x)


def test_sequence_longer_than_block_size(model):
    with pytest.raises(ValueError, match="T=17 > block_size=16"):
        model.forward(ids(1, 17))


def test_empty_batch(model):
    with pytest.raises(ValueError, match="B >= 1 and T >= 1"):
        model.forward(np.zeros((0, 4), np.int64))


def test_backward_without_targets():
    m = fastgpt.GPT(CONFIG, seed=0)
    m.forward(ids(1, 4))
    with pytest.raises(RuntimeError, match="forward\\(\\) with targets"):
        m.backward()


def test_backward_twice_after_one_forward():
    m = fastgpt.GPT(CONFIG, seed=0)
    m.forward(ids(1, 4), ids(1, 4))
    m.backward()
    with pytest.raises(RuntimeError, match="one backward per forward"):
        m.backward()


def test_backward_after_the_weights_changed():
    # The forward's activations are of the old weights: the gradients would be neither weights' (PyTorch refuses
    # a backward after an in-place change of a weight it saved, too).
    m = fastgpt.GPT(CONFIG, seed=0)
    opt = fastgpt.AdamW(m)
    x, y = ids(2, 8), ids(2, 8)
    for change in (lambda: m.load_state_dict(m.state_dict()), lambda: opt.step()):
        m.forward(x, y)
        change()
        with pytest.raises(RuntimeError, match="weights changed since its forward"):
            m.backward()
    m.forward(x, y)  # a new forward is fine
    m.backward()


def test_state_dict_missing_key(model):
    sd = dict(model.state_dict())
    del sd["transformer.h.0.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match="missing.*mlp.c_fc.bias"):
        model.load_state_dict(sd)


def test_state_dict_unexpected_key(model):
    sd = dict(model.state_dict(), extra=np.zeros(3, np.float32))
    with pytest.raises(KeyError, match="unexpected.*extra"):
        model.load_state_dict(sd)


def test_state_dict_wrong_shape_changes_nothing(model):
    before = model.state_dict()["transformer.wpe.weight"].copy()
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    sd["transformer.h.0.attn.c_attn.weight"] = np.zeros((16, 48), np.float32)  # transposed
    with pytest.raises(ValueError, match=r"c_attn.weight'\] has shape \(16, 48\), expected \(48, 16\)"):
        model.load_state_dict(sd)
    assert np.array_equal(model.state_dict()["transformer.wpe.weight"], before)  # nothing was written


def test_state_dict_untied_lm_head(model):
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = sd["transformer.wte.weight"] + 1
    with pytest.raises(ValueError, match="tied"):
        model.load_state_dict(sd)


def test_state_dict_integer_values(model):
    sd = dict(model.state_dict())
    sd["transformer.ln_f.bias"] = np.zeros(16, np.int64)
    with pytest.raises(TypeError, match="ln_f.bias.*floating point"):
        model.load_state_dict(sd)


def test_config_head_mismatch():
    with pytest.raises(ValueError, match="multiple of config.n_head"):
        fastgpt.GPT(fastgpt.GPTConfig(n_embd=30, n_head=4))


def test_config_non_positive():
    with pytest.raises(ValueError, match="config.n_layer must be >= 1"):
        fastgpt.GPT(fastgpt.GPTConfig(n_layer=0))


@pytest.mark.parametrize("device", ["tpu", "cuda:1x", "cuda:", "cuda:-1", "cpu:0", "cuda:+1", " cuda"])
def test_unknown_device(device):
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        fastgpt.GPT(CONFIG, device=device)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):  # the engine's own parse
        fastgpt._C.GPT(8, 16, 1, 1, 8, 0, device)


def test_tf32_on_cpu():
    with pytest.raises(ValueError, match="precision='tf32' needs device='cuda'"):
        fastgpt.GPT(CONFIG, precision="tf32")


def test_unknown_precision():
    with pytest.raises(ValueError, match="precision must be one of"):
        fastgpt.GPT(CONFIG, precision="fp8")


def test_cuda_device_is_a_clear_error():
    if fastgpt.cuda_available():  # a GPU is usable here: a device index past the visible ones is the error (the
        # CUDA backend's check, a ValueError through pybind11's std::invalid_argument)
        with pytest.raises(ValueError, match="device='cuda:"):
            fastgpt.GPT(CONFIG, device=f"cuda:{fastgpt._C.cuda_device_count()}")
        return
    with pytest.raises((RuntimeError, NotImplementedError), match="device='cuda'"):
        fastgpt.GPT(CONFIG, device="cuda")


def test_adamw_negative_lr(model):
    with pytest.raises(ValueError, match="lr must be >= 0"):
        fastgpt.AdamW(model, lr=-1.0)


def test_adamw_bad_betas(model):
    with pytest.raises(ValueError, match="betas"):
        fastgpt.AdamW(model, betas=(0.9,))


def test_adamw_hyper_parameters_are_fixed_but_lr(model):
    opt = fastgpt.AdamW(model, weight_decay=0.1)
    for name, value in (("weight_decay", 0.0), ("betas", (0.5, 0.5)), ("eps", 1e-6), ("zero_stage", 1)):
        with pytest.raises(AttributeError, match=f"AdamW.{name} is fixed when the optimizer is made"):
            setattr(opt, name, value)
    assert opt.weight_decay == 0.1 and opt.state_dict()["weight_decay"] == 0.1
    opt.lr = 1e-3
    assert opt.lr == 1e-3
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="lr must be"):
            opt.lr = bad
    assert opt.lr == 1e-3


def test_adamw_wrong_model():
    with pytest.raises(TypeError, match="fastgpt.GPT"):
        fastgpt.AdamW(object())


def test_clip_non_positive(model):
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        fastgpt.AdamW(model).clip_grad_norm(0.0)


def test_generate_negative_temperature(model):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(ids(1, 3), 2, temperature=-1.0)


def test_generate_bad_top_k(model):
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        model.generate(ids(1, 3), 2, top_k=0)


def test_op_matmul_inner_dim():
    with pytest.raises(ValueError, match="x must have last dimension 8"):
        ops.matmul_forward(np.ones((4, 7), np.float32), np.ones((3, 8), np.float32))


def test_op_matmul_bias_length():
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        ops.matmul_forward(np.ones((4, 8), np.float32), np.ones((3, 8), np.float32), np.ones(4, np.float32))


def test_op_layernorm_weight_length():
    with pytest.raises(ValueError, match="last dimension 5"):
        ops.layernorm_forward(np.ones((2, 4), np.float32), np.ones(5, np.float32), np.ones(5, np.float32))


def test_op_attention_heads_do_not_divide():
    with pytest.raises(ValueError, match="n_head must divide C=8"):
        ops.attention_forward(np.ones((1, 4, 24), np.float32), 3)


def test_op_cross_entropy_target_out_of_range():
    with pytest.raises(ValueError, match="targets must hold ids in"):
        ops.cross_entropy_forward(np.ones((2, 5), np.float32), np.array([1, 5]))


def test_op_cross_entropy_targets_of_another_layout():
    # (T, B) targets for (B, T, V) logits hold the right number of ids in the wrong order: refused; (B, T) and the
    # flat (B*T,) are taken.
    logits = np.random.default_rng().standard_normal((2, 3, 5)).astype(np.float32)
    for call in (lambda t: ops.cross_entropy_forward(logits, t),
                 lambda t: ops.cross_entropy_forward_backward(logits, t),
                 lambda t: ops.cross_entropy_backward(logits, t, np.zeros(6, np.float32) + 1.0)):
        with pytest.raises(ValueError, match=r"targets must have shape \(2, 3\) \(logits' without V\) or \(6,\), "
                                             r"got \(3, 2\)"):
            call(ids(3, 2, high=5))
        call(ids(2, 3, high=5))
        call(ids(6, high=5))


def test_op_matmul_backward_dout_of_another_layout():
    rng = np.random.default_rng()
    x, w = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 3, 6\), got \(3, 2, 6\)"):
        ops.matmul_backward(rng.standard_normal((3, 2, 6)).astype(np.float32), x, w)


def test_op_layernorm_backward_stats_of_another_layout():
    # mean/rstd laid out (T, B) for x (B, T, C) hold the right count in the wrong order: refused; x.shape[:-1],
    # torch's (B, T, 1) and the flat (B*T,) that layernorm_forward returns are taken.
    rng = np.random.default_rng()
    x, dout = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(2))
    w, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    _, mean, rstd = ops.layernorm_forward(x, w, b)
    with pytest.raises(ValueError, match=r"mean must be x.shape\[:-1\] \(2, 3\).*got shape \(3, 2\)"):
        ops.layernorm_backward(dout, x, w, mean.reshape(3, 2), rstd)
    with pytest.raises(ValueError, match=r"rstd must be .*got shape \(6, 1, 1\)"):
        ops.layernorm_backward(dout, x, w, mean, rstd.reshape(6, 1, 1))
    want = ops.layernorm_backward(dout, x, w, mean, rstd)
    for shape in ((2, 3), (2, 3, 1), (6, 1)):
        got = ops.layernorm_backward(dout, x, w, mean.reshape(shape), rstd.reshape(shape))
        assert all(np.array_equal(g, r) for g, r in zip(got, want)), shape


def test_op_embedding_backward_longer_than_block_size():
    dout = np.random.default_rng().standard_normal((2, 8, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"T must be <= dwpe rows \(block_size 4\), got 8"):
        ops.embedding_backward(dout, ids(2, 8, high=10), 10, 4)


def test_op_zero_sized_features():
    # A zero-width dimension is refused with its name (it was a division by zero that killed the process).
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="weight must be 2-D \\(out_features, in_features\\), both >= 1"):
        ops.matmul_forward(np.ones((2, 0), np.float32), np.ones((3, 0), np.float32))
    with pytest.raises(ValueError, match="both >= 1"):
        ops.matmul_forward(x, np.ones((0, 4), np.float32))
    with pytest.raises(ValueError, match="x must have a last dimension >= 1"):
        ops.layernorm_forward(np.ones((2, 0), np.float32), np.ones(0, np.float32), np.ones(0, np.float32))


def test_op_attention_decode_position_past_int_range():
    kc = np.zeros((1, 2, 8, 4), np.float32)
    qkv = np.ones((1, 1, 24), np.float32)
    for pos in (2**31 - 1, 2**31 - 8):
        with pytest.raises(ValueError, match="must lie in the cache's \\[0, 8\\)"):
            ops.attention_decode_append(kc, kc.copy(), qkv, pos)
        with pytest.raises(ValueError, match="must lie in the cache's"):
            ops.attention_decode_forward(qkv, kc, kc.copy(), pos)
    with pytest.raises(ValueError, match="k_cache must be non-empty"):
        ops.attention_decode_forward(qkv, np.zeros((1, 0, 8, 4), np.float32), np.zeros((1, 0, 8, 4), np.float32), 0)


def test_config_whose_parameter_count_wraps_int64():
    # L (12 C^2 + 13 C) wraps past 2**64 to a small count: the buffer was allocated that small, then written past.
    with pytest.raises(ValueError, match="more than 2\\*\\*40"):
        fastgpt.GPT(fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=2095228334, n_head=1, n_embd=27086))
    with pytest.raises(ValueError, match="config.n_layer must be <= 2147483647"):
        fastgpt.GPT(fastgpt.GPTConfig(block_size=16, vocab_size=64, n_layer=2**31, n_head=1, n_embd=8))


def test_op_cpu_attention_head_too_large():
    # One head's (T, d) copies would need int indices past 2**31: refused before any thread takes scratch (an
    # allocation failing inside the parallel region ended the process).
    q = np.zeros((1, 1, 1, 2**25), np.float32)  # zero pages: nothing is touched
    with pytest.raises(ValueError, match="too large for one head's copies"):
        ops.flash_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="too large for one head's copies"):
        ops.attention_forward(np.zeros((1, 1, 3 * 2**25), np.float32), 1)
    with pytest.raises(ValueError, match=r"qkv must be \(B, T, 3C\) with C >= 1"):
        ops.attention_forward(np.ones((1, 2, 0), np.float32), 1)


def test_op_scalars_that_overflow_float32_or_int32():
    p = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="lr must be finite as a float32"):
        ops.adamw_update(p, p.copy(), p.copy(), p.copy(), 1, lr=1e300)
    with pytest.raises(ValueError, match="pos must be <= 2147483647"):
        ops.attention_decode_forward(np.ones((1, 1, 24), np.float32), np.zeros((1, 2, 8, 4), np.float32),
                                     np.zeros((1, 2, 8, 4), np.float32), 2**31)


def test_op_zero_dimensional_input_stays_zero_dimensional():
    out = ops.gelu_forward(np.array(0.5, np.float32))
    ref = 0.5 * 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (0.5 + 0.044715 * 0.5**3)))  # GELU (tanh) at 0.5
    assert out.shape == () and abs(float(out) - ref) < 1e-6


def test_op_string_input():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        ops.gelu_forward(np.array(["a", "b"]))


_OOM_THEN_SMALLER = r"""
import resource, sys
import numpy as np
import fastgpt
cfg = fastgpt.GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=1, n_embd=64)
fastgpt.GPT(cfg, seed=0).forward(np.ones((2, 8), np.int32))  # the worker threads exist before the limit
m = fastgpt.GPT(cfg, seed=0)  # no activation buffers yet
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), resource.RLIM_INFINITY))
try:
    m.forward(np.ones((1 << 16, 64), np.int32))  # 4M tokens: the first activation buffer alone is 1 GiB
    sys.exit("the large batch did not run out of memory")
except MemoryError:
    pass
x = np.ones((4, 64), np.int32)  # far smaller than the refused batch
print(m.forward(x, x)[1])  # (logits, loss)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm: Linux")
def test_out_of_memory_then_a_smaller_batch():
    # A batch whose activations cannot be allocated raises MemoryError; the model then runs a smaller batch in
    # buffers of that size. It used to take the refused size for its buffers' size, so that the smaller batch ran in
    # buffers never allocated: a crash (on a GPU an illegal address, which ends the process's CUDA context). In a
    # subprocess, under an address-space limit, so that the allocation fails whatever the machine's memory and
    # overcommit setting.
    r = subprocess.run([sys.executable, "-c", _OOM_THEN_SMALLER], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert np.isfinite(float(r.stdout.strip().splitlines()[-1]))
