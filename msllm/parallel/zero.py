"""ZeRO-1: AdamW with its moments split over the data-parallel ranks.

Each parameter, flattened and padded to a multiple of the world size, is cut into `world` equal
chunks; rank r keeps the moments of chunk r only (2/world of plain AdamW's state). A step takes
the all-reduced gradients (msllm.parallel.dp), updates this rank's chunk of every weight with
torch's AdamW arithmetic, then gathers every rank's updated chunks back into the full weights with
a world AllGather, bucketed like the gradient all-reduce. On CPU this is the whole mechanism; on
Ascend the same config maps to MindSpore's parallel optimizer (backends/ascend.py).

Checkpoints hold the state in its full, layout-free form (`full_state` gathers it, `load_full_state`
slices it), so a run resumes at any world size, with or without sharding.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from msllm.config import OptimConfig
from msllm.parallel.dp import plan_buckets
from msllm.train.optim import LRSchedule, decays

MOMENTS = ("exp_avg", "exp_avg_sq")
# Gathered buckets are smaller than the all-reduce's: each one's update temporaries are alive at once.
GATHER_BUCKET_BYTES = 8 << 20


class ShardedAdamW(nn.Cell):
    """The AdamW interface (`optimizer(grads, grad_coef) -> lr`, `params`, `fused`) over sharded moments."""

    fused = False  # the fused CPU kernel updates whole parameters in place; chunks use MindSpore ops

    def __init__(self, params, cfg: OptimConfig, total_steps: int, *, rank: int, world: int,
                 bucket_bytes: int = GATHER_BUCKET_BYTES):
        super().__init__()
        self.params = ParameterTuple(params)
        self.rank, self.world = rank, world
        self.sizes = tuple(int(np.prod(p.shape)) for p in self.params)
        self.shapes = tuple(tuple(p.shape) for p in self.params)
        self.chunks = tuple(math.ceil(n / world) for n in self.sizes)
        # this rank's [start, end) of each flattened parameter; the last rank's chunk may run short
        self.bounds = tuple((min(n, rank * c), min(n, (rank + 1) * c)) for n, c in zip(self.sizes, self.chunks))
        self.exp_avg = ParameterTuple([Parameter(Tensor(np.zeros(c, np.float32)), name=f"exp_avg.{p.name}")
                                       for p, c in zip(self.params, self.chunks)])
        self.exp_avg_sq = ParameterTuple([Parameter(Tensor(np.zeros(c, np.float32)), name=f"exp_avg_sq.{p.name}")
                                          for p, c in zip(self.params, self.chunks)])
        self.step = Parameter(Tensor(np.array(0, np.int32)), name="optimizer.step")
        self.schedule = LRSchedule(cfg, total_steps)
        self.beta1, self.beta2, self.eps = cfg.beta1, cfg.beta2, cfg.eps
        self.weight_decay = tuple(cfg.weight_decay if decays(p.name, p) else 0.0 for p in self.params)
        self.buckets = tuple(tuple(b) for b in plan_buckets([c * world for c in self.chunks], 4, bucket_bytes))
        self.all_gather = ops.AllGather()
        self.gather_moments = _GatherMoments(self.sizes, self.shapes)  # for checkpoints; compiled once

    def _chunk(self, x, i):
        """This rank's chunk of tensor x shaped like parameter i, flattened and zero-padded."""
        start, end = self.bounds[i]
        flat = x.reshape(-1)[start:end]
        pad = self.chunks[i] - (end - start)
        if pad > 0:
            flat = ops.concat((flat, ops.zeros(pad, flat.dtype)))
        return flat

    def construct(self, grads, grad_coef=None):
        step = self.step + 1
        ops.assign(self.step, step)
        t = step.astype(ms.float32)
        lr = self.schedule(t)
        bias1, bias2 = 1.0 - ops.pow(self.beta1, t), 1.0 - ops.pow(self.beta2, t)
        step_size = lr * ops.sqrt(bias2) / bias1
        eps = self.eps * ops.sqrt(bias2)  # torch's eps, moved inside the bias correction
        # Bucket by bucket: update this rank's chunks, gather them, write the weights back, and only
        # then start the next bucket, so one bucket's temporaries are alive at a time.
        done = lr
        for bucket in self.buckets:
            updated = ()
            for i in bucket:
                g = self._chunk(ops.depend(grads[i], done), i)
                if grad_coef is not None:
                    g = g * grad_coef
                m = self.beta1 * self.exp_avg[i] + (1.0 - self.beta1) * g
                v = self.beta2 * self.exp_avg_sq[i] + (1.0 - self.beta2) * g * g
                ops.assign(self.exp_avg[i], m)
                ops.assign(self.exp_avg_sq[i], v)
                w = self._chunk(self.params[i], i) * (1.0 - lr * self.weight_decay[i])  # torch AdamW: decay first
                updated = updated + (w - step_size * m / (ops.sqrt(v) + eps),)
            gathered = self.all_gather(ops.concat(updated).reshape(1, -1))  # [world, sum of the bucket's chunks]
            offset = 0
            for j in range(len(bucket)):
                i = bucket[j]
                whole = gathered[:, offset:offset + self.chunks[i]].reshape(-1)[:self.sizes[i]]
                done = ops.assign(self.params[i], whole.reshape(self.shapes[i]))
                offset += self.chunks[i]
        return lr

    def state_parameters(self):
        return [self.step, *self.exp_avg, *self.exp_avg_sq]

    def full_state(self) -> dict[str, np.ndarray]:
        """The optimizer state as plain AdamW holds it (gathered from every rank; all ranks must call)."""
        state = {self.step.name: self.step.asnumpy()}
        for moment in MOMENTS:
            chunks = tuple(Tensor(c.asnumpy()) for c in getattr(self, moment))  # graph inputs, not Parameters
            for p, whole in zip(self.params, self.gather_moments(chunks)):
                state[f"{moment}.{p.name}"] = whole.asnumpy()
        return state

    def load_full_state(self, arrays: dict[str, np.ndarray], source: str) -> None:
        from msllm.checkpoint import check_shapes
        shapes = {self.step.name: ()}
        for moment in MOMENTS:
            shapes.update({f"{moment}.{p.name}": tuple(p.shape) for p in self.params})
        check_shapes(shapes, {name: tuple(a.shape) for name, a in arrays.items()}, source)
        self.step.set_data(Tensor(np.asarray(arrays[self.step.name], np.int32)))
        for moment in MOMENTS:
            for i, (p, chunk) in enumerate(zip(self.params, getattr(self, moment))):
                start, end = self.bounds[i]
                flat = np.zeros(self.chunks[i], np.float32)
                flat[:end - start] = np.asarray(arrays[f"{moment}.{p.name}"], np.float32).reshape(-1)[start:end]
                chunk.set_data(Tensor(flat))


class _GatherMoments(nn.Cell):
    """Chunks of one moment from every rank -> full tensors shaped like the parameters."""

    def __init__(self, sizes, shapes):
        super().__init__()
        self.sizes, self.shapes = sizes, shapes
        self.all_gather = ops.AllGather()

    def construct(self, chunks):
        out = ()
        for i in range(len(chunks)):
            whole = self.all_gather(chunks[i].reshape(1, -1)).reshape(-1)[:self.sizes[i]]
            out = out + (whole.reshape(self.shapes[i]),)
        return out
