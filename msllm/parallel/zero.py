"""ZeRO-1: AdamW with its moments split over the data-parallel ranks.

Each parameter, flattened and padded to a multiple of the world size, is cut into `world` equal
chunks; rank r keeps the moments of chunk r only (2/world of plain AdamW's state). A step takes
the all-reduced gradients (msllm.parallel.dp), updates this rank's chunk of every weight with
torch's AdamW arithmetic, then gathers every rank's updated chunks back into the full weights with
a world AllGather, bucketed like the gradient all-reduce. On CPU this is the whole mechanism; on
Ascend the same config maps to MindSpore's parallel optimizer (backends/ascend.py).

Under expert parallel (parallel.ep, msllm.parallel.ep) a rank's experts are shared only by its
expert-data-parallel (edp) group, world / ep ranks, so their moments are cut into world / ep chunks
and the updated chunks come back by ep.GroupAllGather, an AllReduce over the edp group of buffers
that are zero outside each rank's chunk: mccl has AllGather on the world only. That moves twice an
all-gather's bytes, but only the experts this group holds; a world AllGather of every rank's expert
chunks would move and buffer ep times more. At ep = world the edp group is one rank: nothing moves.

Checkpoints hold the state in its full, layout-free form (`full_state` gathers it, `load_full_state`
slices it; experts as plain AdamW holds this rank's, whole), so a run resumes at any world size and
ep, with or without sharding.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from msllm.config import OptimConfig
from msllm.parallel.dp import plan_buckets
from msllm.parallel.ep import GroupAllGather, is_expert
from msllm.train.optim import LRSchedule, decays

MOMENTS = ("exp_avg", "exp_avg_sq")
# Gathered buckets are smaller than the all-reduce's: each one's update temporaries are alive at once.
GATHER_BUCKET_BYTES = 8 << 20


class ShardedAdamW(nn.Cell):
    """The AdamW interface (`optimizer(grads, grad_coef) -> lr`, `params`, `fused`) over sharded moments."""

    fused = False  # the fused CPU kernel updates whole parameters in place; chunks use MindSpore ops

    def __init__(self, params, cfg: OptimConfig, total_steps: int, *, rank: int, world: int, ep: int = 1,
                 edp_group: str | None = None, bucket_bytes: int = GATHER_BUCKET_BYTES):
        """ep > 1: the experts' moments split over edp_group (msllm.parallel.ep.groups), not the world."""
        super().__init__()
        self.params = ParameterTuple(params)
        self.sizes = tuple(int(np.prod(p.shape)) for p in self.params)
        self.shapes = tuple(tuple(p.shape) for p in self.params)
        self.expert = tuple(ep > 1 and is_expert(p.name) for p in self.params)
        # (ranks sharing the parameter, this rank's place among them): an edp group is every ep-th rank
        shards = tuple((world // ep, rank // ep) if expert else (world, rank) for expert in self.expert)
        self.shards = tuple(count for count, _ in shards)
        self.chunks = tuple(math.ceil(n / count) for n, count in zip(self.sizes, self.shards))
        # this rank's [start, end) of each flattened parameter; the last rank's chunk may run short
        self.bounds = tuple((min(n, at * c), min(n, (at + 1) * c))
                            for n, c, (_, at) in zip(self.sizes, self.chunks, shards))
        self.exp_avg = ParameterTuple([Parameter(Tensor(np.zeros(c, np.float32)), name=f"exp_avg.{p.name}")
                                       for p, c in zip(self.params, self.chunks)])
        self.exp_avg_sq = ParameterTuple([Parameter(Tensor(np.zeros(c, np.float32)), name=f"exp_avg_sq.{p.name}")
                                          for p, c in zip(self.params, self.chunks)])
        self.step = Parameter(Tensor(np.array(0, np.int32)), name="optimizer.step")
        self.schedule = LRSchedule(cfg, total_steps)
        self.beta1, self.beta2, self.eps = cfg.beta1, cfg.beta2, cfg.eps
        self.weight_decay = tuple(cfg.weight_decay if decays(p.name, p) else 0.0 for p in self.params)
        self.buckets = _buckets([c * count for c, count in zip(self.chunks, self.shards)], self.expert, bucket_bytes)
        self.world_gather = _GatherChunks()
        self.edp_gather = _GatherChunks(GroupAllGather(world // ep, rank // ep, edp_group if ep > 1 else None))
        self.gather_moments = _GatherMoments(self.sizes, self.shapes, self.expert, self.world_gather,
                                             self.edp_gather)  # for checkpoints

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
            if self.expert[bucket[0]]:  # [shards, the bucket's chunks]
                gathered = self.edp_gather(ops.concat(updated))
            else:
                gathered = self.world_gather(ops.concat(updated))
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


def _buckets(sizes: list[int], expert: tuple[bool, ...], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """plan_buckets over the dense parameters, then over the experts: a bucket comes back by one collective."""
    buckets = []
    for kind in (False, True):
        members = [i for i, e in enumerate(expert) if e == kind]
        buckets += [tuple(members[j] for j in b) for b in plan_buckets([sizes[i] for i in members], 4, bucket_bytes)]
    return tuple(buckets)


class _GatherChunks(nn.Cell):
    """This rank's chunk [c] -> [shards, c], every sharing rank's chunk in rank order: a dense
    parameter's from the world (AllGather), or with `edp_gather` an expert's from its edp group."""

    def __init__(self, edp_gather: GroupAllGather | None = None):
        super().__init__()
        self.all_gather = ops.AllGather()
        self.edp_gather = edp_gather

    def construct(self, chunk):
        if self.edp_gather is not None:
            return self.edp_gather(chunk)
        return self.all_gather(chunk.reshape(1, -1))


class _GatherMoments(nn.Cell):
    """Chunks of one moment from every rank -> full tensors shaped like the parameters."""

    def __init__(self, sizes, shapes, expert, world_gather: _GatherChunks, edp_gather: _GatherChunks):
        super().__init__()
        self.sizes, self.shapes, self.expert = sizes, shapes, expert
        self.world_gather, self.edp_gather = world_gather, edp_gather

    def construct(self, chunks):
        out = ()
        for i in range(len(chunks)):
            if self.expert[i]:
                whole = self.edp_gather(chunks[i])
            else:
                whole = self.world_gather(chunks[i])
            out = out + (whole.reshape(-1)[:self.sizes[i]].reshape(self.shapes[i]),)
        return out
