"""fastgpt.AdamW: torch.optim.AdamW's update over the model's flat parameter buffer, in C++.

Weight decay applies to the 2-D weights only (embeddings and matmul weights), never to biases or LayerNorm
parameters: build-nanogpt's two parameter groups. Moments live in buffers of the parameter layout. In bf16/fp16
the update also rewrites the model's 16-bit compute weights from the fp32 masters (one pass); in fp16 it first
unscales the gradients and skips the step if they hold an inf/NaN, as GradScaler.step does.

train_step is the whole optimizer step in one call (micro-batches, the norm, the clipped update), queued on the
device without waiting for it; its StepStats reads the loss and the norm only when asked.
"""
import math

import numpy as np

from . import _C
from ._convert import INT64_MAX, as_ids, check_float, check_int


class StepStats:
    """What one AdamW.train_step did: loss (the mean over its micro-batches, this rank's), norm (of the gradients
    before clipping, over all ranks), applied (False: skipped for a non-finite loss or norm, or an fp16 overflow),
    step_count and skipped_steps after it. Read from the device on first access (that waits for the step to
    finish), which must come before the optimizer's next step overwrites them."""

    def __init__(self, opt, serial):
        self._opt, self._serial, self._values = opt, serial, None

    def _read(self):
        if self._values is None:
            if self._opt._serial != self._serial:
                raise RuntimeError("this train_step's statistics were overwritten by a later step of the optimizer: "
                                   "read loss/norm/applied before the next step (or keep the values)")
            loss, norm, applied, steps, skipped = self._opt._step.stats()
            self._values = (float(loss), float(norm), bool(applied), int(steps), int(skipped))
        return self._values

    loss = property(lambda self: self._read()[0])
    norm = property(lambda self: self._read()[1])
    applied = property(lambda self: self._read()[2])
    step_count = property(lambda self: self._read()[3])
    skipped_steps = property(lambda self: self._read()[4])

    def __repr__(self):
        if self._values is None and self._opt._serial != self._serial:
            return "StepStats(<overwritten by a later step>)"
        loss, norm, applied, steps, skipped = self._read()
        return f"StepStats(loss={loss:.6g}, norm={norm:.6g}, applied={applied}, step_count={steps})"


def _fixed(name):
    """A read-only attribute whose write says why it is refused."""
    def refuse(self, value):
        raise AttributeError(f"AdamW.{name} is fixed when the optimizer is made (the engine holds it): make a new "
                             f"AdamW with {name}={value!r}")
    return property(lambda self: getattr(self, "_" + name), refuse, doc=f"{name}, as given to the constructor")


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
        self.lr = lr
        self._betas = (check_float(betas[0], "betas[0]", 0.0, 0.999999),
                       check_float(betas[1], "betas[1]", 0.0, 0.999999))
        self._eps = check_float(eps, "eps", low=0.0, low_open=True)
        self._weight_decay = check_float(weight_decay, "weight_decay", low=0.0)
        if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage must be 0 (plain data parallel) or 1 (sharded moments), got {zero_stage!r}")
        if zero_stage == 1 and not model.data_parallel:
            raise ValueError("zero_stage=1 shards the optimizer over data-parallel ranks, but the model is not data "
                             "parallel: build it after fastgpt.distributed.init() (or with data_parallel=True)")
        self._zero_stage = zero_stage
        self._opt = _C.AdamW(model._engine, self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay,
                             zero_stage)
        self._step = _C.TrainStep(model._engine, self._opt)
        self._serial = 0  # counts what rewrites the step's scalars on the device (StepStats checks it)

    @property
    def lr(self):
        """The learning rate of step() and train_step() when they are given none; may be set between steps."""
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = check_float(value, "lr", low=0.0)

    # The other hyper-parameters are the engine's from construction on: read-only, so that a write cannot look as
    # if it took effect.
    betas = _fixed("betas")
    eps = _fixed("eps")
    weight_decay = _fixed("weight_decay")  # of the 2-D weights only, as build-nanogpt's parameter groups
    zero_stage = _fixed("zero_stage")

    def step(self, lr=None):
        """One update of every parameter from the gradient buffer; lr overrides the default for this step.
        Returns True if applied, False if skipped (fp16 only: inf/NaN gradients; weights, moments and step_count
        unchanged, the loss scale backed off)."""
        lr = self.lr if lr is None else check_float(lr, "lr", low=0.0)
        self._serial += 1
        return bool(self._opt.step(lr))

    def train_step(self, idx, targets, lr=None, max_norm=None, graph=False):
        """The whole optimizer step in one call: zero_grad, then for each of the A micro-batches of idx, targets
        ((A, B, T) int arrays; (B, T) is one) forward_backward with grad_scale 1/A (data parallel: the gradients are
        averaged over ranks with the last), the global gradient norm, and the update with the clip to max_norm
        (None: no clipping) folded in. The same weights as that loop with clip_grad_norm and step() (bit for bit on
        the CPU), but nothing waits for the device: the loss and the norm stay there until the returned StepStats
        is read. A step whose loss or norm is not finite is skipped (weights, moments, step_count unchanged). The
        gradient buffer keeps this step's unclipped gradients (fp16: still scaled; the loss scale is updated on the
        device, read model.loss_scale when needed); lr overrides the default for this step.

        graph=True records the step the second time its shape (A, B, T, max_norm) comes in a row and replays the
        recording while the shape holds: one launch for the whole step on a GPU (a CUDA graph), the same bits.
        Other shapes, or memory freed since (a larger eval batch), run eagerly and are recorded anew; data parallel
        models always run eagerly; so does a shape whose recording failed (graph_error says why).
        graph_counts says how many steps were recorded and replayed."""
        lr = self.lr if lr is None else check_float(lr, "lr", low=0.0)
        max_norm = math.inf if max_norm is None else check_float(max_norm, "max_norm", low=0.0, low_open=True)
        ids, tgt = as_ids(idx, "idx"), as_ids(targets, "targets")
        if ids.ndim == 2:
            ids = ids[None]
        if tgt.ndim == 2:
            tgt = tgt[None]
        if ids.ndim != 3:
            raise ValueError(f"idx must be (A, B, T) micro-batches or one (B, T) batch, got shape {ids.shape}")
        if tgt.shape != ids.shape:
            raise ValueError(f"targets shape {tgt.shape} must equal idx shape {ids.shape}")
        if min(ids.shape) < 1:
            raise ValueError(f"idx must have A >= 1, B >= 1 and T >= 1, got shape {ids.shape}")
        block = self.model.config.block_size
        if ids.shape[2] > block:
            raise ValueError(f"idx has sequence length T={ids.shape[2]} > block_size={block}")
        if not isinstance(graph, bool):
            raise ValueError(f"graph must be True or False, got {graph!r}")
        self._serial += 1
        self._step.run(ids, tgt, lr, max_norm, graph)
        return StepStats(self, self._serial)

    @property
    def graph_counts(self):
        """(recorded, replayed): train_step(graph=True) steps recorded as a graph, and launched from one."""
        return int(self._step.captures), int(self._step.replays)

    @property
    def graph_error(self):
        """Why the last recording of a step failed (that shape then runs eagerly), or None."""
        return self._step.capture_error or None

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
        self._serial += 1
        self._opt.load_state(arrays[0], arrays[1], check_int(state["step_count"], "step_count", 0, INT64_MAX),
                             check_int(state["skipped_steps"], "skipped_steps", 0, INT64_MAX))
