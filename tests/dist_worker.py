"""One rank of a data-parallel test run (tests/test_distributed.py starts it under mpiexec, or alone as the
single-process reference): a tiny GPT trained for --steps optimizer steps with gradient accumulation, every rank
reading its own slice of the same shard. After every step the ranks compare a hash of their weights; rank 0 writes
the losses, norms, final weights and what it saw to --out (.npz). --fail makes one rank raise, exit or die at a
step, to check that the others do not hang."""
import argparse
import hashlib
import os
import signal
import sys

import numpy as np

import fastgpt
from fastgpt import distributed
from fastgpt.data import DataLoader

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--zero", type=int, default=0)
p.add_argument("--precision", default="fp32")
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--device", default="cpu")
p.add_argument("--overlap", action="store_true", help="CPU: reduce layer by layer as the backward goes (NCCL's way)")
p.add_argument("--train-step", action="store_true", help="each step as one AdamW.train_step call, not the loop")
p.add_argument("--fail", choices=("none", "raise", "kill", "exit"), default="none")
p.add_argument("--fail-rank", type=int, default=1)
p.add_argument("--fail-step", type=int, default=2)
args = p.parse_args()

rank, world, _ = distributed.init()
distributed._MpiComm.overlaps = args.overlap
config = fastgpt.GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=32)
# A different seed on every rank: the replicas must still start from rank 0's weights.
model = fastgpt.GPT(config, device=args.device, precision=args.precision, seed=7 + rank)
opt = fastgpt.AdamW(model, lr=args.lr, weight_decay=0.1, zero_stage=args.zero)
loader = DataLoader([args.data], B=2, T=16, rank=rank, world_size=world)


def weights_hash():
    h = hashlib.sha256(np.ascontiguousarray(model._engine.params).tobytes())
    if args.precision != "fp32":
        h.update(np.ascontiguousarray(model._engine.compute_params()).tobytes())
    return h.hexdigest()


def same_everywhere():
    mine = weights_hash()
    return distributed.all_reduce(float(mine != distributed.broadcast_object(mine))) == 0


identical = same_everywhere()  # after the broadcast at construction
losses, norms = [], []
for step in range(args.steps):
    if args.fail != "none" and rank == args.fail_rank and step == args.fail_step:
        if args.fail == "raise":
            raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
        if args.fail == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.train_step:
        batches = [loader.next_batch() for _ in range(args.accum)]
        # graph=True: a data-parallel step is never recorded (the host takes part in its reductions); it must run
        # eagerly, and graph_counts stays (0, 0).
        stats = opt.train_step(np.stack([b[0] for b in batches]), np.stack([b[1] for b in batches]), max_norm=1.0,
                               graph=True)
        losses.append(distributed.all_reduce(stats.loss, "avg"))
        norms.append(stats.norm)
        identical = same_everywhere() and identical
        continue
    model.zero_grad()
    loss = 0.0
    for micro in range(args.accum):
        x, y = loader.next_batch()
        loss += model.forward(x, y, return_logits=False)[1] / args.accum
        model.require_backward_grad_sync = micro == args.accum - 1
        model.backward(1.0 / args.accum)
    losses.append(distributed.all_reduce(loss, "avg"))
    norms.append(opt.clip_grad_norm(1.0))
    opt.step()
    identical = same_everywhere() and identical

if rank == 0:
    m, v = opt.moments()
    np.savez(args.out, losses=np.array(losses), norms=np.array(norms), params=np.array(model._engine.params),
             identical=identical, syncs=model.grad_sync_count, world=world, moments=m.size,
             padded=model._engine.shard[1] * world, graph_counts=np.array(opt.graph_counts),
             loss_scale=model.loss_scale)
