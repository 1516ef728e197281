"""Expert parallel on CPU: each rank of an ep group holds E / ep of every MoE layer's experts.

The ranks of an ep group (ep consecutive data-parallel ranks) each bring their own tokens. A MoE
layer's dispatcher (AllGatherDispatch, swapped in at the seam) gathers the group's tokens and
routing weights, runs this rank's experts on all of them, and sums the partial outputs over the
group, each rank keeping its own tokens' rows: Megatron-Core's "allgather" token dispatcher, built
from the one collective MindSpore's CPU backend has on sub-groups, AllReduce (a gather is an
AllReduce of buffers that are zero outside each rank's rows). The gradient of an AllReduce is an
AllReduce, so backward needs nothing more.

Expert weights and their AdamW moments are this rank's only: their gradients are summed over the
ranks holding the same experts (the expert-data-parallel group: ranks with the same index in their
ep group), the others over all ranks, and the gradient norm adds the experts' squares over the ep
group. Under ZeRO-1 (msllm.parallel.zero) the experts' moments are split over that edp group and
the updated chunks come back by GroupAllGather. Checkpoints hold every expert (`whole` gathers them;
`mine` cuts a checkpoint's), so a run resumes at any ep and any worker count.
"""
from __future__ import annotations

import functools

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from msllm.config import Config, ConfigError
from msllm.grad_norm import sum_squares
from msllm.models.moe import Dispatch, EveryExpert, capacity, choices, gather_rows, rank_at_expert, sum_choices
from msllm.parallel.dp import BUCKET_BYTES, GradAllReduce, all_gather

EXPERT_LEAVES = (".experts.w1", ".experts.w2", ".experts.w3")
GATHER_PIECE = 4 << 20  # floats per rank in one checkpoint gather (16 MiB; mccl fails on ~64 MiB collectives)


def is_expert(name: str) -> bool:
    """Whether a parameter (or its AdamW moment) holds stacked experts [E, ...]."""
    return name.endswith(EXPERT_LEAVES)


@functools.lru_cache(maxsize=None)
def groups(ep: int, rank: int, world: int) -> tuple[str | None, str | None]:
    """(this rank's ep group, its expert-data-parallel group): None for the world group, "" for a group
    of one (nothing to reduce); the others are created here, once (every member creates them)."""
    from mindspore.communication import create_group

    def made(name: str, members: list[int]) -> str | None:
        if len(members) == world:
            return None
        if len(members) == 1:
            return ""
        create_group(name, members)
        return name

    first = rank // ep * ep
    return (made(f"msllm_ep_{first // ep}", list(range(first, first + ep))),
            made(f"msllm_edp_{rank % ep}", list(range(rank % ep, world, ep))))


def all_reduce(group: str | None):
    return ops.AllReduce() if group is None else ops.AllReduce(group=group)


def placed(x, index: int, count: int):
    """x [N, c] -> [count N, c], x at rows index N .. (index + 1) N, zeros elsewhere: summed over a group
    by AllReduce, every member's x at its rows, an all-gather."""
    n, c = x.shape
    pieces = (x,)
    if index > 0:
        pieces = (ops.zeros((index * n, c), x.dtype),) + pieces
    if index < count - 1:
        pieces = pieces + (ops.zeros(((count - 1 - index) * n, c), x.dtype),)
    return ops.concat(pieces, 0)


class GroupAllGather(nn.Cell):
    """x [c] -> [size, c], row j the x of the group's j-th rank: an all-gather over a sub-group (mccl
    has AllGather on the world only), as an AllReduce of `placed` buffers. group "": a group of one."""

    def __init__(self, size: int, index: int, group: str | None):
        super().__init__()
        self.size, self.index, self.alone = size, index, group == ""
        self.all_reduce = None if self.alone else all_reduce(group)

    def construct(self, x):
        if self.alone:
            return x.reshape(1, -1)
        return self.all_reduce(placed(x.reshape(1, -1), self.index, self.size))


class AllGatherDispatch(Dispatch):
    """EveryExpert's interface (msllm.models.moe) over an ep group: dispatch(x [N, h], weights, chosen)
    -> (the group's ep x N tokens for this rank's E / ep experts [E / ep, ep N, h], their routing
    weights); combine -> (this rank's N rows of the summed outputs, zero drops)."""

    def __init__(self, num_experts: int, ep: int, index: int, group: str | None):
        super().__init__()
        self.num_experts, self.ep, self.index = num_experts, ep, index
        self.local = num_experts // ep
        self.all_reduce = all_reduce(group)

    def place(self, x):
        """x [N, c] -> [ep N, c], x at this rank's rows, zeros elsewhere."""
        return placed(x, self.index, self.ep)

    def dispatch(self, x, weights, chosen):
        combine = ops.sum(choices(chosen, self.num_experts) * weights.reshape(weights.shape + (1,)), 1)  # [N, E]
        tokens = self.all_reduce(self.place(x))                                                  # [ep N, h]
        mine = self.all_reduce(self.place(combine))[:, self.index * self.local:(self.index + 1) * self.local]
        rows = ops.broadcast_to(tokens.reshape((1,) + tokens.shape), (self.local,) + tokens.shape)
        return rows, (mine, x.shape[0])

    def combine(self, ys, route):
        mine, n = route
        partial = ops.sum(ys * mine.astype(ys.dtype).transpose(1, 0).reshape(self.local, -1, 1), 0)
        out = self.all_reduce(partial)[self.index * n:(self.index + 1) * n]
        return out, ops.zeros((self.num_experts,), ms.float32)


class AllGatherCapacityDispatch(AllGatherDispatch):
    """AllGatherDispatch under train.moe_capacity_factor: CapacityDispatch's choice of rows
    (msllm.models.moe) made over the ep group's gathered tokens, each rank keeping the rows of its own
    experts. Each expert takes at most C = ceil(factor x ep N x k / E) of the group's choices in token
    order, rank 0's tokens first: what one process with the group's whole batch and CapacityDispatch
    computes, the same choices dropped. A rank computes factor x its share of the routed choices
    instead of every gathered token on every one of its experts."""

    def __init__(self, num_experts: int, ep: int, index: int, group: str | None, factor: float):
        super().__init__(num_experts, ep, index, group)
        self.factor = factor

    def dispatch(self, x, weights, chosen):
        (n, h), k = x.shape, chosen.shape[1]
        total, local = self.ep * n, self.local
        c = capacity(self.factor, total, k, self.num_experts)
        tokens = self.all_reduce(self.place(x))                                                   # [ep N, h]
        routed = self.all_reduce(self.place(ops.concat((ops.stop_gradient(chosen.astype(ms.float32)), weights), 1)))
        expert = routed[:, :k].astype(ms.int32).reshape(-1) - self.index * local              # this rank's numbering
        mine = ops.logical_and(expert >= 0, expert < local)
        expert = ops.select(mine, expert, ops.full(expert.shape, local, dtype=ms.int32))      # others: a spare column
        picked = ops.one_hot(expert, local + 1, ops.ones((), ms.float32), ops.zeros((), ms.float32))[:, :local]
        place = rank_at_expert(picked).astype(ms.int32)
        kept = ops.logical_and(mine, place < c)
        slot = ops.select(kept, expert * c + place, ops.full(kept.shape, local * c, dtype=ms.int32))
        rows = gather_rows(tokens, slot, k, local * c).reshape(local, c, h)
        dropped = ops.sum(picked * (1.0 - kept.astype(ms.float32)).reshape(-1, 1), 0) / total     # [E / ep]
        dropped = self.all_reduce(self.place(dropped.reshape(-1, 1))).reshape(-1)                 # [E]
        weight = routed[:, k:].reshape(-1) * kept.astype(ms.float32)
        return rows, (slot, weight, dropped, k, n)

    def combine(self, ys, route):
        slot, weight, dropped, k, n = route
        partial = sum_choices(ys, slot, weight, k)                                                  # [ep N, h]
        return self.all_reduce(partial)[self.index * n:(self.index + 1) * n], dropped


class ExpertGradReduce(nn.Cell):
    """(grads, loss) -> summed as msllm.parallel.dp.GradAllReduce does: the experts' over their
    expert-data-parallel group, the rest (and the loss) over all ranks. `norm(grads, sum_of_squares)`:
    the global gradient norm, the experts' squares summed over the ep group."""

    def __init__(self, params, ep_group: str | None, edp_group: str | None, bucket_bytes: int = BUCKET_BYTES):
        super().__init__(auto_prefix=False)
        self.expert = tuple(i for i, p in enumerate(params) if is_expert(p.name))
        self.shared = tuple(i for i, p in enumerate(params) if not is_expert(p.name))
        self.world_reduce = GradAllReduce([params[i] for i in self.shared], bucket_bytes)
        self.edp_reduce = None if edp_group == "" else GradAllReduce([params[i] for i in self.expert], bucket_bytes,
                                                                      group=edp_group)
        self.ep_reduce = all_reduce(ep_group)
        self.count = len(params)

    def construct(self, grads, loss):
        shared, loss = self.world_reduce(tuple(grads[i] for i in self.shared), loss)
        expert = tuple(grads[i] for i in self.expert)
        if self.edp_reduce is not None:
            expert, _ = self.edp_reduce(expert, ops.zeros((), loss.dtype))
        out = [None] * self.count
        for j, i in enumerate(self.shared):
            out[i] = shared[j]
        for j, i in enumerate(self.expert):
            out[i] = expert[j]
        return tuple(out), loss

    def norm(self, grads, sum_of_squares_op=None):
        """The global gradient norm (msllm.train.step.global_norm), this rank's experts' squares summed
        over the ep group."""
        mine = sum_squares(tuple(grads[i] for i in self.expert), sum_of_squares_op)
        shared = sum_squares(tuple(grads[i] for i in self.shared), sum_of_squares_op)
        return ops.sqrt(shared + self.ep_reduce(mine.reshape(1)).reshape(()))


def check(cfg: Config, replicas: int, source: str = "config") -> None:
    """ConfigError (one line) when parallel.ep cannot lay this run's experts over its `replicas`."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.ep == 1:
        return
    if "moe" not in m.mlp_kinds():
        raise ConfigError(source, "parallel.ep", f"is {p.ep} but the model has no MoE layer (model.num_experts)")
    if m.num_experts % p.ep:
        raise ConfigError(source, "parallel.ep", f"must divide model.num_experts ({m.num_experts} % {p.ep} != 0)")
    if replicas % p.ep:
        raise ConfigError(source, "parallel.ep", f"is {p.ep} but the run has {replicas} data-parallel "
                          f"worker{'s' if replicas > 1 else ''}; ep must divide them (msllm launch --nproc N)")
    for key, on, why in (("parallel.cp", p.cp > 1, "context parallel"),
                         ("train.debug_nonfinite", t.debug_nonfinite, "the one-process re-run of a bad step")):
        if on:
            raise ConfigError(source, key, f"does not combine with parallel.ep {p.ep} yet ({why}); "
                              f"set it off or use parallel.ep 1")


def specialise(model, cfg: Config, training: bool) -> int:
    """The seam's expert-parallel step (msllm.backends): with parallel.ep > 1 in training, keep this
    rank's experts of every MoE layer and swap in the all-gather dispatcher (at a capacity with
    train.moe_capacity_factor). Returns ep."""
    ep = cfg.parallel.ep if training else 1
    if ep == 1:
        return 1
    from msllm.parallel.cp import rank_and_world

    rank, world = rank_and_world()
    check(cfg, world // cfg.parallel.cp)
    index = rank % ep
    ep_group, _ = groups(ep, rank, world)
    for block in model.layers:
        if block.routed:
            moe = block.feed_forward
            for p in moe.experts.get_parameters():
                p.set_data(p[index * (moe.num_experts // ep):(index + 1) * (moe.num_experts // ep)], True)
            factor = cfg.train.moe_capacity_factor
            moe.dispatch = (AllGatherCapacityDispatch(moe.num_experts, ep, index, ep_group, factor) if factor > 0
                            else AllGatherDispatch(moe.num_experts, ep, index, ep_group))
    return ep


def whole_experts(model) -> None:
    """Every MoE layer dispatching dropless again (inference on whole experts)."""
    for block in model.layers:
        if block.routed:
            block.feed_forward.dispatch = EveryExpert(block.feed_forward.num_experts)


def whole(arrays: dict[str, np.ndarray], ep: int) -> dict[str, np.ndarray]:
    """A rank's arrays (weights or AdamW moments) with every expert tensor gathered whole from its ep
    group: a collective, every rank calls it. The expert tensors travel as one flat buffer, so a
    checkpoint compiles one gather; ranks 0 .. ep-1 form the first ep group."""
    if ep == 1:
        return arrays
    names = [name for name in arrays if is_expert(name)]
    flat = np.concatenate([np.ascontiguousarray(arrays[n], np.float32).reshape(-1) for n in names])
    # in pieces of one size (the last one padded): each gather stays small, and one compile serves all
    piece = min(GATHER_PIECE, flat.size)
    padded = np.zeros(-(-flat.size // piece) * piece, np.float32)
    padded[:flat.size] = flat
    ranks = np.concatenate([all_gather(padded[i:i + piece])[:ep] for i in range(0, padded.size, piece)], 1)
    out, at = dict(arrays), 0
    for name in names:
        a = arrays[name]
        out[name] = ranks[:, at:at + a.size].reshape((ep * a.shape[0],) + a.shape[1:]).astype(a.dtype)
        at += a.size
    return out


def mine(arrays, ep: int, index: int) -> dict[str, np.ndarray]:
    """Whole arrays (a checkpoint's) -> this rank's: each expert tensor cut to its E / ep experts."""
    if ep == 1:
        return arrays
    out = {}
    for name in arrays.keys():
        a = arrays[name]
        if is_expert(name):
            per = a.shape[0] // ep
            a = a[index * per:(index + 1) * per]
        out[name] = a
    return out
