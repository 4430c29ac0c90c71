"""attention_decode: generation's KV cache op. append writes the k/v thirds of new positions into the caches
(B, n_head, Tmax, hs) and nothing else; forward attends each new row to the cached positions up to its own, against
torch's scaled_dot_product_attention in float64 on the cache torch would hold (fp32 1e-5; bf16/fp16 by the
half-precision rule: at most 2x the error of torch's own SDPA in that dtype, plus the one rounding of out).
Positions past the last new one hold NaN: reading one would show."""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastgpt import ops
from devices import DEVICES, host, on
from reference_gpt import rel_err

DTYPES = {"fp32": (np.float32, torch.float32), "bf16": (ml_dtypes.bfloat16, torch.bfloat16),
          "fp16": (np.float16, torch.float16)}
ROUNDING = {"fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11}


def _to(device, a):
    if device == "cpu":
        return a
    if a.dtype == ml_dtypes.bfloat16:  # torch cannot take NumPy's bfloat16: move the bits
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to("cuda")
    return on(device, a)


def _np(a):
    a = host(a) if not isinstance(a, torch.Tensor) or a.dtype != torch.bfloat16 else \
        a.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return np.asarray(a).astype(np.float64)


def _heads(x, n_head):  # (B, T, C) -> (B, n_head, T, hs)
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _reference(qkv, k_old, v_old, pos, n_head, dtype=torch.float64):
    """torch SDPA on the cache after the append: new row t (position pos + t) sees positions [0, pos + t]."""
    C = qkv.shape[2] // 3
    q, k_new, v_new = (_heads(qkv[:, :, i * C:(i + 1) * C], n_head) for i in range(3))
    k = np.concatenate([k_old[:, :, :pos], k_new], axis=2)
    v = np.concatenate([v_old[:, :, :pos], v_new], axis=2)
    T, S = q.shape[2], k.shape[2]
    allowed = torch.arange(S)[None, :] <= pos + torch.arange(T)[:, None]
    t = [torch.tensor(np.asarray(a, np.float64), dtype=dtype) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*t, attn_mask=allowed)
    B = qkv.shape[0]
    return y.transpose(1, 2).reshape(B, T, C).double().numpy(), k, v


@pytest.mark.parametrize("B,T,pos,Tmax,n_head,hs", [(2, 1, 5, 16, 4, 16), (1, 1, 0, 8, 1, 8), (3, 4, 9, 20, 3, 12),
                                                    (2, 1, 63, 64, 2, 64), (1, 3, 0, 3, 2, 32),
                                                    (1, 1, 200, 256, 12, 64)])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_append_then_forward_matches_sdpa(rng, B, T, pos, Tmax, n_head, hs, prec, device):
    np_dtype, torch_dtype = DTYPES[prec]
    C = n_head * hs
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np_dtype)
    k_cache = np.full((B, n_head, Tmax, hs), np.nan, np.float32)
    v_cache = np.full((B, n_head, Tmax, hs), np.nan, np.float32)
    k_cache[:, :, :pos] = rng.standard_normal((B, n_head, pos, hs))
    v_cache[:, :, :pos] = rng.standard_normal((B, n_head, pos, hs))
    k_cache, v_cache = k_cache.astype(np_dtype), v_cache.astype(np_dtype)
    k_old, v_old = k_cache.astype(np.float64), v_cache.astype(np.float64)

    kc, vc, dq = _to(device, k_cache), _to(device, v_cache), _to(device, qkv)
    ops.attention_decode_append(kc, vc, dq, pos)
    out = _np(ops.attention_decode_forward(dq, kc, vc, pos))
    kc, vc = _np(kc), _np(vc)

    qkv64 = qkv.astype(np.float64)
    ref, k_ref, v_ref = _reference(qkv64, k_old, v_old, pos, n_head)
    # append: exactly the new keys and values at [pos, pos + T), everything else as it was (NaN stays NaN)
    np.testing.assert_array_equal(kc[:, :, :pos + T], k_ref)
    np.testing.assert_array_equal(vc[:, :, :pos + T], v_ref)
    assert np.isnan(kc[:, :, pos + T:]).all() and np.isnan(vc[:, :, pos + T:]).all()
    assert out.shape == (B, T, C) and np.isfinite(out).all()
    e = rel_err(out, ref)
    if prec == "fp32":
        assert e < 1e-5, e
    else:  # torch's SDPA in the same dtype, on the same rounded inputs
        own, _, _ = _reference(qkv64, k_old, v_old, pos, n_head, torch_dtype)
        e_torch = rel_err(own, ref)
        assert e <= 2 * e_torch + ROUNDING[prec], (e, e_torch)


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_one_position_at_a_time_equals_causal_attention(rng, device):
    # Appending positions one by one and attending each equals the engine's causal attention on the whole sequence.
    B, T, n_head, hs = 2, 24, 3, 16
    C = n_head * hs
    qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    full, _ = ops.attention_forward(on(device, qkv), n_head, causal=True)
    kc = on(device, np.zeros((B, n_head, T, hs), np.float32))
    vc = on(device, np.zeros((B, n_head, T, hs), np.float32))
    rows = []
    for t in range(T):
        x = on(device, np.ascontiguousarray(qkv[:, t:t + 1]))
        ops.attention_decode_append(kc, vc, x, t)
        rows.append(host(ops.attention_decode_forward(x, kc, vc, t)))
    assert rel_err(np.concatenate(rows, axis=1), host(full)) < 1e-6


def test_bad_arguments_are_clear_errors(rng):
    qkv = rng.standard_normal((2, 1, 3 * 32)).astype(np.float32)
    kc, vc = np.zeros((2, 4, 8, 8), np.float32), np.zeros((2, 4, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"positions \[pos, pos \+ T\) = \[8, 9\)"):
        ops.attention_decode_append(kc, vc, qkv, 8)
    with pytest.raises(ValueError, match="qkv must be"):
        ops.attention_decode_forward(qkv[:1], kc, vc, 0)
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        ops.attention_decode_forward(qkv, kc[0], vc, 0)
    with pytest.raises(TypeError, match="written in place"):
        ops.attention_decode_append(kc.astype(np.float64), vc, qkv, 0)
    with pytest.raises(TypeError, match="written in place"):
        ops.attention_decode_append(kc[:, :, ::2], vc[:, :, ::2], qkv, 0)
    with pytest.raises(ValueError, match="pos must be >= 0"):
        ops.attention_decode_forward(qkv, kc, vc, -1)
    # at position 0 there is one key: the output is its value, exactly
    ops.attention_decode_append(kc, vc, qkv, 0)
    np.testing.assert_array_equal(ops.attention_decode_forward(qkv, kc, vc, 0), qkv[:, :, 64:])
