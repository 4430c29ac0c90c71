"""How far fastgpt's half-precision flash attention is from float64, next to every SDPA backend of PyTorch and to a
float64 emulation of the flash algorithm's own roundings (P and dS rounded to the input dtype before the tensor-core
products, as flash-attention 2 does). Prints, per case and seed, max|x - ref| of out/dq/dk/dv for each, so a test
failure of the "within 2x torch's error" rule can be told apart: a kernel bug (fastgpt far from the emulation) or a
yardstick backend that rounds less than the flash algorithm does (fastgpt near the emulation).
Usage: python3 scripts/flash_accuracy.py [--seeds 3]"""
import argparse
import itertools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastgpt import ops

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def exact(q, k, v, dout, causal):
    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def emulated(q, k, v, dout, causal, dtype):
    """The flash backward's arithmetic in float64, with P, dS and O rounded to dtype where the kernels round them."""
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    T, d = q.shape[2], q.shape[3]
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    rd = lambda x: x.to(dtype).double()  # noqa: E731
    out = rd(rd(p) @ v)
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ v.transpose(-1, -2) - delta)
    return out, rd(ds) @ k / math.sqrt(d), rd(ds).transpose(-1, -2) @ q / math.sqrt(d), rd(p).transpose(-1, -2) @ dout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    B, H, T = 1, 16, 1000
    print(f"B {B} H {H} T {T}: max|x - float64| of out dq dk dv")
    for dtype, d, causal in itertools.product((torch.bfloat16, torch.float16), (64, 128), (False, True)):
        for seed in range(args.seeds):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v, dout = (torch.randn(B, H, T, d, device="cuda", generator=g).to(dtype) for _ in range(4))
            ref = exact(q, k, v, dout, causal)
            rows = {}
            out, lse = ops.flash_attention_forward(q, k, v, causal=causal)
            rows["fastgpt"] = (out,) + tuple(ops.flash_attention_backward(dout, q, k, v, out, lse, causal=causal))
            rows["emulated"] = emulated(q, k, v, dout, causal, dtype)
            for name, be in BACKENDS.items():
                qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))
                try:
                    with sdpa_kernel([be]):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        o.backward(dout)
                except RuntimeError as e:
                    print(f"  {name}: unavailable ({str(e).splitlines()[0][:60]})")
                    continue
                rows[name] = (o.detach(), qt.grad, kt.grad, vt.grad)
            tag = f"{str(dtype)[6:]:8} d{d:<3} {'causal' if causal else 'full':6} seed {seed}"
            for name, xs in rows.items():
                errs = [(x.double() - r).abs().max().item() for x, r in zip(xs, ref)]
                print(f"{tag} {name:9} " + " ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
