"""Data parallel on MindSpore's own collectives: process group, gradient all-reduce, weight checks.

Every rank runs the same compiled step on its slice of the global batch. The gradients (and the
loss, for logging) are summed across ranks inside that step, before the gradient norm, the
finiteness check and clipping, so every rank applies the same update and an overflow on one
rank skips the step on all of them. The 1/world of the mean is folded into the step's clip
coefficient rather than spent as one more pass over the gradients.

Collectives on CPU (mccl) in GRAPH mode: AllReduce (sum) and world-group AllGather only, and one
AllReduce of ~64 MiB has failed there, so gradients travel in buckets of at most 32 MiB.
"""
from __future__ import annotations

import hashlib
import os

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from msllm.layout.plan import BUCKET_BYTES  # the planner counts the buckets too


def launched() -> bool:
    """Whether msrun started this process (it exports the scheduler's address to every worker)."""
    return "MS_SCHED_HOST" in os.environ and "MS_WORKER_NUM" in os.environ


_JOINED: list = []  # the process joined msrun's cluster (once: it may then train more than once)


def init_process_group() -> tuple[int, int]:
    """(rank, world) from MindSpore's communication layer; (0, 1) when not launched by msrun.
    The device context must be set first."""
    if not launched():
        return 0, 1
    from mindspore.communication import get_group_size, get_rank, init

    if not _JOINED:
        init()
        _JOINED.append(True)
    return get_rank(), get_group_size()


def local_workers() -> int:
    """Worker processes sharing this machine (set by msllm launch), for the default thread count."""
    return max(1, int(os.environ.get("MSLLM_LOCAL_WORKERS", "1")))


def pin_local_cores() -> list[int] | None:
    """Give this worker its own slice of the machine's cores (msrun exports the local index as
    DEVICE_ID): MindSpore's runtime threads otherwise roam over every core and workers sharing a
    node slow each other down. Applies to every thread of the process. None when not applicable."""
    local, here = int(os.environ.get("DEVICE_ID", "0")), local_workers()
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // here
    if not launched() or here < 2 or per < 1 or local >= here:
        return None
    mine = cores[local * per:(local + 1) * per]
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), mine)
        except OSError:  # a thread that ended meanwhile
            pass
    return mine


def plan_buckets(sizes: list[int], itemsize: int = 4, bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive parameter indices grouped so each group holds at most bucket_bytes (a larger single
    parameter gets a bucket of its own)."""
    buckets, current, used = [], [], 0
    for i, size in enumerate(sizes):
        if current and used + size * itemsize > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += size * itemsize
    if current:
        buckets.append(current)
    return buckets


class GradAllReduce(nn.Cell):
    """(grads, loss) -> (grads, loss) summed over all ranks (or the ranks of `group`), one AllReduce
    per bucket; the loss rides in the last bucket."""

    def __init__(self, params, bucket_bytes: int = BUCKET_BYTES, group: str | None = None):
        super().__init__(auto_prefix=False)
        self.shapes = tuple(tuple(p.shape) for p in params)
        self.sizes = tuple(int(np.prod(s)) for s in self.shapes)
        self.buckets = tuple(tuple(b) for b in plan_buckets(list(self.sizes), 4, bucket_bytes))
        self.all_reduce = ops.AllReduce() if group is None else ops.AllReduce(group=group)

    def construct(self, grads, loss):
        reduced = ()
        last = len(self.buckets) - 1
        done = loss
        for b in range(len(self.buckets)):  # one bucket after the other: one bucket's buffers alive at a time
            bucket = self.buckets[b]
            flat = ()
            for i in bucket:
                flat = flat + (ops.depend(grads[i], done).reshape(-1),)
            sizes = ()
            for i in bucket:
                sizes = sizes + (self.sizes[i],)
            if b == last:
                flat = flat + (loss.reshape(1),)
                sizes = sizes + (1,)
            parts = ops.split(self.all_reduce(ops.concat(flat)), sizes)
            for j in range(len(bucket)):
                reduced = reduced + (parts[j].reshape(self.shapes[bucket[j]]),)
            done = parts[0]
            if b == last:
                loss = parts[len(bucket)].reshape(())
        return reduced, loss


class RankMean(nn.Cell):
    """x -> its mean over all ranks: a loss cell's metrics that are means over each rank's samples (DPO's
    rewards, GRPO's clip ratios), so that every rank logs the global batch's. `after`: a value the
    all-reduce waits for (the gradients' reduction), so every rank issues the collectives in one order."""

    def __init__(self, world: int):
        super().__init__(auto_prefix=False)
        self.all_reduce, self.world = ops.AllReduce(), world

    def construct(self, x, after):
        return self.all_reduce(ops.depend(x, after)) / self.world


class _Collective(nn.Cell):
    """One collective op as a graph of its own (collectives run in GRAPH mode on CPU)."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, x):
        return self.op(x)


def barrier() -> None:
    """Wait until every rank gets here (a one-element all-reduce)."""
    _Collective(ops.AllReduce())(ms.Tensor(np.ones(1, np.float32))).asnumpy()


_GATHER: list = []  # one AllGather Cell per process: its compiled graph is reused for every same-sized call


def all_gather(x: np.ndarray) -> np.ndarray:
    """Stack of every rank's x along a new first axis (x fp32, same shape on every rank)."""
    if not _GATHER:
        _GATHER.append(_Collective(ops.AllGather()))
    out = _GATHER[0](ms.Tensor(np.ascontiguousarray(x, np.float32).reshape(1, -1))).asnumpy()
    return out.reshape((-1, *x.shape))


def all_gather_exact(x: np.ndarray) -> np.ndarray:
    """all_gather of an array of any 2-, 4- or 8-byte dtype, bit for bit (float64 rewards, int token ids):
    its bytes travel as 16-bit pieces, each exactly a float32."""
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize % 2:
        raise ValueError(f"all_gather_exact: {x.dtype} is not a whole number of 16-bit pieces")
    pieces = all_gather(np.frombuffer(x.tobytes(), np.uint16).astype(np.float32))
    return np.frombuffer(pieces.astype(np.uint16).tobytes(), x.dtype).reshape((-1, *x.shape))


def weights_digest(params) -> np.ndarray:
    """sha256 of every parameter's bytes as 8 exactly representable floats (16-bit pieces)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.name.encode())
        h.update(np.ascontiguousarray(p.asnumpy()).tobytes())
    return np.frombuffer(h.digest()[:16], np.uint16).astype(np.float32)


def ranks_differing(params) -> list[int]:
    """Ranks whose weights differ from rank 0's (bitwise), by comparing digests."""
    digests = all_gather(weights_digest(params))
    return [r for r in range(1, len(digests)) if not np.array_equal(digests[r], digests[0])]
