"""fastgpt.AdamW: torch.optim.AdamW's update over the model's flat parameter buffer, in C++.

Weight decay applies to the 2-D weights only (embeddings and matmul weights), never to biases or LayerNorm
parameters: build-nanogpt's two parameter groups. Moments live in buffers of the parameter layout. In bf16/fp16
the update also rewrites the model's 16-bit compute weights from the fp32 masters (one pass); in fp16 it first
unscales the gradients and skips the step if they hold an inf/NaN, as GradScaler.step does.
"""
import numpy as np

from . import _C
from ._convert import check_float, check_int


class AdamW:
    """zero_stage=1 (a data-parallel model): each rank keeps the moments of its shard of the parameters only,
    updates that shard from reduce-scattered gradients and all-gathers the weights (ZeRO-1); the same weights as
    plain data parallel, with 8/world_size bytes of moments per parameter instead of 8. The fp32 masters stay whole
    on every rank; grads() is then valid on this rank's shard only (model._engine.shard)."""

    def __init__(self, model, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, zero_stage=0):
        if not hasattr(model, "_engine"):
            raise TypeError(f"model must be a fastgpt.GPT, got {type(model).__name__}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.model = model
        self.lr = check_float(lr, "lr", low=0.0)
        self.betas = (check_float(betas[0], "betas[0]", 0.0, 0.999999), check_float(betas[1], "betas[1]", 0.0, 0.999999))
        self.eps = check_float(eps, "eps", low=0.0, low_open=True)
        self.weight_decay = check_float(weight_decay, "weight_decay", low=0.0)
        if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage must be 0 (plain data parallel) or 1 (sharded moments), got {zero_stage!r}")
        if zero_stage == 1 and not model.data_parallel:
            raise ValueError("zero_stage=1 shards the optimizer over data-parallel ranks, but the model is not data "
                             "parallel: build it after fastgpt.distributed.init() (or with data_parallel=True)")
        self.zero_stage = zero_stage
        self._opt = _C.AdamW(model._engine, self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay,
                             zero_stage)

    def step(self, lr=None):
        """One update of every parameter from the gradient buffer; lr overrides the default for this step.
        Returns True if applied, False if skipped (fp16 only: inf/NaN gradients; weights, moments and step_count
        unchanged, the loss scale backed off)."""
        return bool(self._opt.step(self.lr if lr is None else check_float(lr, "lr", low=0.0)))

    @property
    def skipped_steps(self):
        """Steps skipped for inf/NaN gradients (fp16 loss scaling)."""
        return int(self._opt.skipped_steps)

    def clip_grad_norm(self, max_norm):
        """Scales the gradients so their global L2 norm is at most max_norm; returns the norm before clipping
        (what torch.nn.utils.clip_grad_norm_ returns). fp16: unscales first; inf when the gradients overflowed."""
        return float(self.model._engine.clip_grad_norm(check_float(max_norm, "max_norm", low=0.0, low_open=True)))

    def zero_grad(self):
        self.model.zero_grad()

    @property
    def step_count(self):
        return int(self._opt.step_count)

    def moments(self):
        """(exp_avg, exp_avg_sq) as flat zero-copy views in the parameter layout; with zero_stage=1, of this
        rank's shard only, which starts at flat index moments_begin."""
        return self._opt.m, self._opt.v

    @property
    def moments_begin(self):
        return int(self._opt.moments_begin)

    def state_dict(self):
        """What resuming needs: copies of the moments (this rank's shard with zero_stage=1), the step counter
        (AdamW's bias correction and bf16's stochastic rounding are keyed by it), skipped steps, hyper-parameters."""
        m, v = self.moments()
        return {"exp_avg": np.array(m), "exp_avg_sq": np.array(v), "step_count": self.step_count,
                "skipped_steps": self.skipped_steps, "moments_begin": self.moments_begin,
                "zero_stage": self.zero_stage, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def load_state_dict(self, state):
        """Restores state_dict()'s moments and counters; the layout (size, shard, zero_stage) must be this
        optimizer's. The hyper-parameters stay those given to the constructor."""
        m, v = self.moments()
        for key, want in (("zero_stage", self.zero_stage), ("moments_begin", self.moments_begin)):
            if int(state.get(key, -1)) != want:
                raise ValueError(f"optimizer state has {key}={state.get(key)!r}, this optimizer {want} (resume with "
                                 f"the same zero stage and world size)")
        arrays = []
        for key in ("exp_avg", "exp_avg_sq"):
            a = np.asarray(state[key], dtype=np.float32).reshape(-1)
            if a.size != m.size:
                raise ValueError(f"optimizer state {key!r} holds {a.size} values, this optimizer {m.size}")
            arrays.append(np.ascontiguousarray(a))
        self._opt.load_state(arrays[0], arrays[1], check_int(state["step_count"], "step_count", low=0),
                             check_int(state["skipped_steps"], "skipped_steps", low=0))
