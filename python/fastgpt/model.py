"""fastgpt.GPT: the GPT-2 model of build-nanogpt, run by the compiled engine.

All parameters live in one float32 buffer inside the engine (llm.c's layout); `state_dict()` and `grads()` hand out
zero-copy NumPy views of it under build-nanogpt's names and nn.Linear (out, in) shapes, so the weights load into a
PyTorch GPT-2 as they are. The training step is one call into C++ (`AdamW.train_step`: every micro-step's forward
and backward, the clip and the update), or build-nanogpt's few (forward_backward, clip_grad_norm, step, zero_grad);
Python never loops over layers.

precision (llm.c's mixed-precision recipe, chosen at run time; one engine for all):
  "fp32"  float32 everywhere (on a GPU of sm_80 or newer, attention at head size 64/128 runs on TF32 tensor cores
          with three products per product, fp32-accurate, as PyTorch's own float32 attention does).
  "tf32"  float32 storage, matmuls and attention on TF32 tensor cores (a GPU only).
  "bf16"  activations and the weights the kernels read in bfloat16; matmuls accumulate in fp32; LayerNorm
          statistics, softmax, log-sum-exp and the loss in fp32; fp32 master weights, gradients and AdamW moments.
          After each optimizer step the bf16 weights are written from the masters with stochastic rounding.
  "fp16"  as bf16 with float16 storage (weights rounded to nearest), plus dynamic loss scaling with
          torch.amp.GradScaler's rules; AdamW.step() returns False for a skipped (inf/NaN) step.
"""
import contextlib
import re
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import _C, distributed
from ._convert import INT32_MAX, INT64_MAX, as_ids, check_float, check_int, to_numpy

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length
    vocab_size: int = 50257  # GPT-2's; 50304 is the "nice number" padding the speed-up progression uses
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def validate(self):
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            check_int(getattr(self, field), f"config.{field}", low=1, high=INT32_MAX)
        if self.n_embd % self.n_head:
            raise ValueError(f"config.n_embd ({self.n_embd}) must be a multiple of config.n_head ({self.n_head})")
        return self


def _check_device(device, precision):
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if device.startswith("cuda"):
        if not _C.built_with_cuda:
            raise RuntimeError("device='cuda': this fastgpt was built without CUDA; reinstall where nvcc is on "
                               "PATH (or with FASTGPT_CUDA=ON)")
        if _C.cuda_device_count() == 0:
            raise RuntimeError("device='cuda': no CUDA GPU is visible (no driver or no device)")
        # 'cuda' in a data-parallel run is this rank's GPU, cuda:LOCAL_RANK (GPT() and train.py map it so)
        index = int(device.partition(":")[2] or (distributed.local_rank() if distributed.is_initialized() else 0))
        if index < _C.cuda_device_count():  # else the engine says which devices there are
            # A precision the GPU lacks (bf16 on a T4), said here: the CLIs name --precision, not the checkpoint.
            name = _C.cuda_device_name(index)
            cc = re.search(r"\(sm_([0-9]+)([0-9])\)$", name)
            why = _C.cuda_precision_unsupported(int(cc[1]), int(cc[2]), precision) if cc else ""
            if why:
                raise ValueError(f"{name}: {why}")
    elif precision == "tf32":
        raise ValueError("precision='tf32' needs device='cuda' (TF32 is a tensor-core format; the CPU has none): "
                         "use 'fp32', 'bf16' or 'fp16' on the CPU")


class GPT:
    """data_parallel: None (the default) makes the model a replica of a data-parallel job when
    fastgpt.distributed.init() found one with more than one rank; True forces it (a world of one without a
    launcher), False never. A replica starts from rank 0's weights and averages gradients over ranks once per
    optimizer step: on the backward with `require_backward_grad_sync` True (DDP's attribute; build-nanogpt sets it
    on the last micro-step), or at the latest in clip_grad_norm/step. device='cuda' means cuda:LOCAL_RANK then.

    fused (the default): the hand-fused model. In forward_backward (the training step's call) lm_head, softmax,
    cross-entropy and their gradients run over chunks of rows, so the (B, T, V) logits never exist
    (forward(..., return_logits=False) keeps none either); each residual add runs with the LayerNorm after it; on a
    GPU in 16-bit, GELU and its gradient run in the epilogues of the matmuls around them. fused=False is the model
    before torch.compile: one kernel per op, the full logits kept (the progression notebook's early rungs).

    recompute: what backward makes again instead of forward keeping it (llm.c's setting of that name; what
    torch.compile's partitioner does to pointwise ops). 0 keeps every activation; 1 recomputes each layer's GELU
    from fc's kept pre-activation (a quarter of the per-layer activations); 2 also each LayerNorm's output from its
    kept input and statistics (another eighth). The gradients are the same bits on the CPU. 0 is the default, as
    in eager PyTorch: on a GPU each recomputation is a kernel of its own (torch.compile's partitioner fuses its
    recomputed pointwise ops into kernels that run anyway). At GPT-2 124M, B 64, on an H200 (BENCHMARKS.md,
    2026-11-26) GELU's took 3.8 ms of a 115.4 ms step, level 0 stepped in 131.8 ms where 1 took 136.1 (eager
    steps, second run), and 1 saves 4.1 GiB, which 0 can spare: its peak was 23.2 GB there, PyTorch compiled's
    43.8 (0.53x)."""

    def __init__(self, config=None, device="cpu", precision="fp32", seed=0, data_parallel=None, fused=True,
                 recompute=0):
        config = GPTConfig() if config is None else config
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a fastgpt.GPTConfig, got {type(config).__name__}")
        self.config = replace(config).validate()  # a copy: the caller may reuse theirs for another model
        if data_parallel not in (None, True, False):
            raise ValueError(f"data_parallel must be None, True or False, got {data_parallel!r}")
        if data_parallel is None:
            data_parallel = distributed.is_initialized() and distributed.world_size() > 1
        if data_parallel:
            distributed.init()
        _check_device(device, precision)  # after init: 'cuda' of a data-parallel rank is its cuda:LOCAL_RANK
        if device == "cuda" and distributed.is_initialized():
            device = f"cuda:{distributed.local_rank()}"
        comm = distributed._comm_for(device if device != "cuda" else "cuda:0") if data_parallel else None
        self.device, self.precision = device, precision
        seed = check_int(seed, "seed", low=0, high=2**64 - 1)
        c = self.config
        if fused not in (True, False):
            raise ValueError(f"fused must be True or False, got {fused!r}")
        if recompute is not None:
            recompute = check_int(recompute, "recompute", low=0, high=2)
        self._engine = _C.GPT(c.block_size, c.vocab_size, c.n_layer, c.n_head, c.n_embd, seed, device, precision,
                              comm, fused=fused, recompute=recompute)
        self.fused = fused
        self.recompute = int(self._engine.recompute)
        self.data_parallel = bool(data_parallel)
        self.require_backward_grad_sync = True
        self._layout = [(name, tuple(shape), offset) for name, shape, offset in self._engine.named_views()]
        self._cache_owner = None  # the generator whose keys and values the engine's KV cache holds
        self._on_cpu = device == "cpu"
        if self._on_cpu:  # zero-copy views of the engine's buffers, made once
            self._params = self._views(self._engine.params)
            self._grads = self._views(self._engine.grads)

    def _views(self, flat):
        return {name: flat[off:off + int(np.prod(shape))].reshape(shape) for name, shape, off in self._layout}

    # ---- running the model
    def _ids(self, idx, name):
        ids = as_ids(idx, name, ndim=2)
        if ids.shape[1] > self.config.block_size:
            raise ValueError(f"{name} has sequence length T={ids.shape[1]} > block_size={self.config.block_size}")
        if ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"{name} must have B >= 1 and T >= 1, got shape {ids.shape}")
        return ids

    def _batch(self, idx, targets):
        ids = self._ids(idx, "idx")
        if targets is None:
            return ids, None
        tgt = self._ids(targets, "targets")
        if tgt.shape != ids.shape:
            raise ValueError(f"targets shape {tgt.shape} must equal idx shape {ids.shape}")
        return ids, tgt

    def forward(self, idx, targets=None, *, return_logits=True):
        """idx, targets: int arrays (B, T). Returns (logits (B, T, vocab_size) float32 copy, mean loss or None).
        return_logits=False returns (None, loss) and, in a fused model, keeps no logits (backward() then recomputes
        them chunk by chunk: forward_backward is the training step's faster call)."""
        ids, tgt = self._batch(idx, targets)
        loss = self._engine.forward(ids, tgt, False, keep_logits=bool(return_logits))
        logits = None
        if return_logits:  # an fp32 CPU view is copied (backward overwrites it); others arrive as copies already
            logits = self._engine.logits()
            logits = np.array(logits) if self._on_cpu and self.precision == "fp32" else logits
        return logits, (float(loss) if tgt is not None else None)

    __call__ = forward

    def backward(self, grad_scale=1.0, sync=None):
        """Adds the gradients of grad_scale * (last forward's mean loss) to the gradient buffer. Data parallel:
        sync (default: require_backward_grad_sync) averages them over ranks at the end of this backward, overlapped
        with it where the communicator can; otherwise they only accumulate, as under DDP's no_sync()."""
        sync = self.require_backward_grad_sync if sync is None else sync
        self._engine.backward(check_float(grad_scale, "grad_scale"), bool(sync))

    def forward_backward(self, idx, targets, grad_scale=1.0, sync=None):
        """The training step's forward and backward in one call: returns the mean loss (a float) and adds the
        gradients of grad_scale * loss to the gradient buffer, as forward(idx, targets) then backward(grad_scale,
        sync) would (sync as there). In a fused model the (B, T, V) logits never exist: lm_head, the loss and its
        gradient run over chunks of rows. Leaves no logits and no pending backward."""
        ids, tgt = self._batch(idx, targets)
        if tgt is None:
            raise ValueError("forward_backward needs targets (B, T)")
        sync = self.require_backward_grad_sync if sync is None else sync
        return float(self._engine.forward_backward(ids, tgt, check_float(grad_scale, "grad_scale"), bool(sync)))

    @property
    def classifier_rows(self):
        """Rows of logits per chunk of the fused classifier (default 4096 on a GPU, 256 on the CPU): fewer hold
        less memory ((rows, vocab_size) logits at a time) but read and write wte's gradient once per chunk."""
        return int(self._engine.classifier_rows)

    @classifier_rows.setter
    def classifier_rows(self, rows):
        self._engine.classifier_rows = check_int(rows, "classifier_rows", low=1)

    def zero_grad(self):
        self._engine.zero_grad()

    # ---- data parallel
    @contextlib.contextmanager
    def no_sync(self):
        """DDP's no_sync(): backwards inside only accumulate locally."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def sync_grads(self):
        """Averages the gradients accumulated since the last reduction over ranks (no-op if none, or not data
        parallel). AdamW.clip_grad_norm and AdamW.step call it."""
        self._engine.sync_grads()

    @property
    def rank(self):
        return int(self._engine.rank)

    @property
    def world_size(self):
        return int(self._engine.world_size)

    @property
    def grad_sync_count(self):
        """Gradient reductions over ranks so far: one per optimizer step when accumulation syncs only its last
        micro-step."""
        return int(self._engine.grad_sync_count)

    # ---- parameters
    def num_parameters(self):
        return int(self._engine.num_parameters())

    def state_dict(self):
        """name -> float32 array with build-nanogpt's names: the fp32 master weights in every precision;
        lm_head.weight is the same storage as transformer.wte.weight. On the CPU these are zero-copy views of the
        model (in bf16/fp16 a write reaches the 16-bit compute weights only through load_state_dict, which recasts);
        on a GPU, host copies."""
        return dict(self._params) if self._on_cpu else self._views(self._engine.params)

    def grads(self):
        """Like state_dict(), for the gradient buffer (float32 in every precision; in fp16 multiplied by
        loss_scale until AdamW.clip_grad_norm or AdamW.step unscales them; AdamW.train_step leaves them scaled by
        the scale it stepped with)."""
        return dict(self._grads) if self._on_cpu else self._views(self._engine.grads)

    def compute_weights(self):
        """name -> float32 copy of the weights the kernels read: the bf16/fp16 rounding of the masters (exactly
        widened), or the masters themselves in fp32/tf32. Read-only: write through load_state_dict."""
        views = self._views(self._engine.compute_params())
        for v in views.values():
            v.flags.writeable = False
        return views

    def memory(self):
        """Bytes of engine memory: 'parameters' (fp32 masters + 16-bit compute weights), 'gradients',
        'activations' (sized by the largest batch run so far), 'kv_cache' (generation's keys and values, held only
        while generate runs) and 'total' (also the optimizer moments); besides them 'scratch': on a GPU the kernels'
        workspace, sized by the first training step and reused by every later one (no allocation in a step)."""
        return dict(self._engine.memory())

    # ---- fp16 loss scaling (torch.amp.GradScaler's rules)
    @property
    def loss_scale(self):
        """The factor the loss gradient is multiplied by: 1.0 except in fp16 (initially 2**16). It lives in device
        memory, where train_step updates it: reading it waits for the device."""
        return float(self._engine.loss_scale)

    def set_loss_scaler(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                        growth_tracker=0):
        """GradScaler's settings (and state, to resume): fp16 only."""
        if self.precision != "fp16":
            raise ValueError(f"loss scaling is used by precision='fp16' only, this model is {self.precision!r}")
        self._engine.set_loss_scaler(check_float(init_scale, "init_scale", 0.0, low_open=True),
                                     check_float(growth_factor, "growth_factor", 1.0, low_open=True),
                                     check_float(backoff_factor, "backoff_factor", 0.0, 1.0, low_open=True),
                                     check_int(growth_interval, "growth_interval", 1, INT64_MAX),
                                     check_int(growth_tracker, "growth_tracker", 0, INT64_MAX))

    # ---- Hugging Face GPT-2 files (fastgpt.hf; local files only)
    @classmethod
    def from_pretrained(cls, path, device="cpu", precision="fp32", n_head=None, **kwargs):
        """A model with the weights of a transformers GPT-2: a folder (config.json + model.safetensors, a sharded
        index, or pytorch_model.bin with torch installed) or a bare .safetensors file (n_head= when no config.json
        sits beside it). Conv1D weights are transposed, the attention mask buffers ignored, lm_head tied to wte.
        kwargs go to GPT() (seed, data_parallel)."""
        from . import hf
        fields, tensors = hf.read_pretrained(path, n_head)
        model = cls(GPTConfig(**fields), device=device, precision=precision, **kwargs)
        model.load_state_dict(tensors)
        return model

    def save_pretrained(self, folder):
        """Writes config.json + model.safetensors into folder (made if missing), in the layout that
        transformers.GPT2LMHeadModel.from_pretrained(folder) loads as it is: the same function, fp32 weights."""
        from . import hf
        return hf.save_pretrained(self, folder)

    def load_state_dict(self, state_dict):
        """Copies weights in from NumPy arrays or torch tensors with build-nanogpt names (a torch.compile or DDP
        prefix is accepted). Every name and shape is checked before anything is written."""
        if not hasattr(state_dict, "items"):
            raise TypeError(f"state_dict must be a mapping of name -> array, got {type(state_dict).__name__}")
        given = {}
        for key, value in state_dict.items():
            name = str(key)
            for prefix in ("_orig_mod.", "module."):
                name = name[len(prefix):] if name.startswith(prefix) else name
            given[name] = value
        expected = {name: shape for name, shape, _ in self._layout}
        missing = [n for n in expected if n not in given and n != "lm_head.weight"]
        unexpected = [n for n in given if n not in expected]
        if missing or unexpected:
            raise KeyError(f"state_dict does not match the model: missing {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                           f"{' ...' if len(unexpected) > 8 else ''}")
        arrays = {}
        for name, value in given.items():
            a = to_numpy(value, f"state_dict[{name!r}]")
            if not np.issubdtype(a.dtype, np.floating):
                raise TypeError(f"state_dict[{name!r}] must be floating point, got dtype {a.dtype}")
            if a.shape != expected[name]:
                raise ValueError(f"state_dict[{name!r}] has shape {a.shape}, expected {expected[name]}")
            arrays[name] = a
        if "lm_head.weight" in arrays and not np.array_equal(arrays["lm_head.weight"], arrays["transformer.wte.weight"],
                                                             equal_nan=True):
            raise ValueError("state_dict['lm_head.weight'] must equal 'transformer.wte.weight' (the weights are tied)")
        if self._on_cpu:
            for name, a in arrays.items():
                self._params[name][...] = a
            self._engine.refresh_compute_params()
        else:  # assemble the whole buffer on the host, then one upload
            flat = self._engine.params
            views = self._views(flat)
            for name, a in arrays.items():
                views[name][...] = a
            self._engine.load_params(flat)

    # ---- sampling
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, seed=None, stop_token=None,
                 use_cache=True):
        """Appends up to max_new_tokens sampled tokens to each row of idx (B, T) (or one prompt (T,)) and returns
        them with the prompt, int64 (B, T + n). temperature 0 picks the most likely token; otherwise logits / temperature,
        then the top_k most likely tokens, then the smallest set of most likely tokens whose probability reaches top_p
        (nucleus sampling), then a draw from what is left. The same seed gives the same tokens. stop_token: a row that
        produced it is finished and is padded with it; generation ends early when every row is finished (n <
        max_new_tokens). The keys and values of the tokens seen are cached (use_cache), so each new token costs one
        position, not a forward over the whole sequence; the tokens are those of full recomputation. Past
        block_size the context is the last block_size tokens (a sliding window, recomputed for each token there)."""
        ids, squeeze = self._prompt(idx)
        steps = self.generate_iter(ids, max_new_tokens, temperature, top_k, top_p, seed, stop_token, use_cache)
        out = np.concatenate([ids] + [s[:, None] for s in steps], axis=1)
        return out[0] if squeeze else out

    def generate_iter(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, seed=None, stop_token=None,
                      use_cache=True):
        """generate(), one step at a time: yields the next token of every row, int64 (B,) ((), for a 1-D prompt),
        as soon as it is sampled (for streaming text out). Arguments as generate(). Generators may take turns with
        each other and with training: one whose KV cache another took or freed, or that a change of the weights (an
        optimizer step, a load) made stale, starts over from its tokens, so each gets generate()'s tokens for the
        weights of the moment. An in-place write into state_dict()'s CPU views is not seen: call
        load_state_dict."""
        ids, squeeze = self._prompt(idx)
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", low=0)
        pick = _Sampler(self.config.vocab_size, temperature, top_k, top_p, seed)
        if stop_token is not None:
            stop_token = check_int(stop_token, "stop_token", low=0, high=self.config.vocab_size - 1)
        return self._generate_steps(ids, max_new_tokens, pick, stop_token, bool(use_cache), squeeze)

    def _prompt(self, idx):
        ids = as_ids(idx, "idx")
        squeeze = ids.ndim == 1
        ids = ids[None] if squeeze else ids
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"idx must be (B, T) or (T,) with B, T >= 1, got shape {ids.shape}")
        return ids.astype(np.int64), squeeze

    def _generate_steps(self, ids, max_new_tokens, pick, stop_token, use_cache, squeeze):
        # The engine has one KV cache. This generator continues it only while it holds it (_cache_owner: another
        # generator may have taken or freed it between two tokens) and the cache goes on (a change of the weights
        # ends it: cache_length 0). Otherwise it starts over from its own tokens.
        engine, window = self._engine, self.config.block_size
        # The engine's id type, filled as we go. Only the last block_size tokens condition the next one, so the
        # buffer holds the prompt and at most max(window, 1024) more; when full, the older tokens are dropped (a
        # huge max_new_tokens, e.g. streaming until a stop token, must not allocate them all up front).
        tokens = np.empty((len(ids), ids.shape[1] + min(max_new_tokens, max(window, 1024))), np.int32)
        end = ids.shape[1]
        tokens[:, :end] = ids
        done = np.zeros(len(ids), bool)
        me = object()  # this generator, as the cache's owner
        try:
            for step in range(max_new_tokens):
                if use_cache and self._cache_owner is me and 0 < engine.cache_length < window:  # one new position
                    engine.decode(np.ascontiguousarray(tokens[:, end - 1:end]), engine.cache_length)
                else:  # the prompt, a window that slid (every position moved), or a cache lost: the last block_size
                    cond = np.ascontiguousarray(tokens[:, max(0, end - window):end])
                    if use_cache:
                        self._cache_owner = me
                        engine.decode(cond, 0)
                    else:
                        engine.forward(cond, None, True)
                nxt = pick(engine.logits()[:, 0, :])
                if stop_token is not None:
                    nxt[done] = stop_token
                    done |= nxt == stop_token
                if end == tokens.shape[1]:  # full (its size exceeds window): keep the last window tokens
                    tokens[:, :window] = tokens[:, end - window:end]  # NumPy buffers the overlap
                    end = window
                tokens[:, end] = nxt
                end += 1
                yield nxt[0] if squeeze else nxt
                if done.all():
                    break
        finally:
            if self._cache_owner is me:
                self._cache_owner = None
                engine.free_cache()

    def __repr__(self):
        dp = f", rank {self.rank} of {self.world_size}" if self.data_parallel else ""
        return (f"fastgpt.GPT({asdict(self.config)}, device={self.device!r}, precision={self.precision!r}, "
                f"fused={self.fused}, recompute={self.recompute}, "
                f"{self.num_parameters():,} parameters{dp})")


class _Sampler:
    """The next token from a batch of logits (B, V): temperature, then top-k, then top-p (nucleus), then a draw, in
    float64 on the host with one NumPy generator (the same seed, the same tokens)."""

    def __init__(self, vocab_size, temperature, top_k, top_p, seed):
        self.V = vocab_size
        self.temperature = check_float(temperature, "temperature", low=0.0)
        self.top_k = None if top_k is None else check_int(top_k, "top_k", low=1, high=vocab_size)
        self.top_p = None if top_p is None else check_float(top_p, "top_p", 0.0, 1.0, low_open=True)
        self.rng = np.random.default_rng(None if seed is None else check_int(seed, "seed", low=0))

    def __call__(self, logits):
        logits = np.array(logits, dtype=np.float64)  # a copy: the engine's buffer is reused by the next step
        bad = ~np.isfinite(logits).all(axis=1)
        if bad.any():  # NaN would make every draw token 0 (and argmax the first NaN's): no token is right
            raise ValueError(f"the model's logits hold inf or NaN (row {int(np.argmax(bad))}): nothing to sample "
                             "from (have the weights diverged?)")
        if self.temperature == 0.0:
            return logits.argmax(axis=1).astype(np.int64)
        # The row's maximum first, then the temperature: no overflow however small it is (the most likely tokens
        # stay at 0, the others go to -inf: the argmax's, drawn among ties).
        logits -= logits.max(axis=1, keepdims=True)
        with np.errstate(over="ignore"):  # -inf: a token that can no longer be drawn
            logits /= self.temperature
        V = self.V
        if self.top_k is not None and self.top_k < V:
            kth = np.partition(logits, V - self.top_k, axis=1)[:, V - self.top_k][:, None]
            logits[logits < kth] = -np.inf
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        if self.top_p is not None and self.top_p < 1.0:
            probs /= probs.sum(axis=1, keepdims=True)
            order = np.argsort(-probs, axis=1, kind="stable")
            ranked = np.take_along_axis(probs, order, axis=1)
            # Keep a token while the tokens more likely than it hold less than top_p: the smallest prefix reaching
            # top_p, never empty (the most likely token has nothing ahead of it).
            keep = (np.cumsum(ranked, axis=1) - ranked) < self.top_p
            np.put_along_axis(probs, order, np.where(keep, ranked, 0.0), axis=1)
        cdf = np.cumsum(probs, axis=1)
        u = self.rng.random((len(cdf), 1)) * cdf[:, -1:]
        return np.minimum((cdf <= u).sum(axis=1), V - 1).astype(np.int64)
