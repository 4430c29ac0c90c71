"""The PyTorch reference: GPT-2 written the build-nanogpt way (train_gpt2.py's GPT), and its AdamW set-up.
fastgpt's weights load into it by name; every parity test compares against it. Attention goes through
F.scaled_dot_product_attention(is_causal=True), exactly as in build-nanogpt; `flash=False` is build-nanogpt before its
flash-attention step (the (T, T) scores written out), the speed-up ladder's earlier rungs.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class RefConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    flash: bool = True  # attention through SDPA (False: scores, mask and softmax as separate ops)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        self.n_head, self.n_embd, self.flash = config.n_head, config.n_embd, config.flash

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight sharing
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "NANOGPT_SCALE_INIT"):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=None):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused)


def ref_from_fastgpt(model, dtype=torch.float32, flash=True):
    """A RefGPT with the same config and weights as a fastgpt.GPT."""
    c = model.config
    ref = RefGPT(RefConfig(c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, flash)).to(dtype)
    sd = {k: torch.from_numpy(v.copy()).to(dtype) for k, v in model.state_dict().items()}
    ref.load_state_dict(sd)
    return ref


def random_layernorms(models, rng):
    """Loads models (fastgpt.GPTs of one config) with the first one's weights, its LayerNorms made random: they start
    as weight 1, bias 0 in every layer, which would let an op that reached another layer's LayerNorm pass."""
    state = {k: np.array(v) for k, v in models[0].state_dict().items()}
    for name, v in state.items():
        if ".ln_" in name:
            state[name] = (v + rng.standard_normal(v.shape) * 0.5).astype(np.float32)
    for m in models:
        m.load_state_dict(state)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64."""
    out = torch.as_tensor(out).double()
    ref = torch.as_tensor(ref).double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def lse_err(out, ref):
    """rel_err for log-sum-exp values, with entries of magnitude below 1 judged absolutely: a log-sum-exp can sit at
    ~0 by chance (at T = 1 it is a single score q.k / sqrt(d), e.g. -0.0015), where float32 rounding of the dot
    product alone is a large relative error. ||out - ref|| / max(||ref||, sqrt(n))."""
    out = torch.as_tensor(out).double()
    ref = torch.as_tensor(ref).double()
    return ((out - ref).norm() / max(ref.norm().item(), ref.numel() ** 0.5)).item()
