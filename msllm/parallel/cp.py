"""Context parallel on MindSpore's CPU collectives: the sequence of each sample split over a cp group.

Ranks. world = dp x cp. Ranks g*cp .. g*cp + cp - 1 form cp group g; the group reads data-parallel
replica g's samples (the loader sees dp replicas, not world ranks), and rank i of the group
computes its chunks of every sequence.

Chunks: zig-zag. The s tokens are cut into 2 cp chunks of c = s / (2 cp); rank i takes chunks i and
2cp-1-i. Under causal attention the queries of chunk j see j + 1 chunks of keys, so every rank
does (i + 1) + (2cp - i) = 2cp + 1 chunk pairs of attention work: balanced, where contiguous
halves would leave the last rank with most of it.

Keys and values: every rank needs those of the whole sequence. MindSpore 2.10's CPU backend has no
AllGather on sub-groups and no Send / Receive, ReduceScatter or AlltoAll (AllGather's backward is a
ReduceScatter, so even the world group's AllGather could not train). So each rank places its K and
V at their global positions in a zero buffer [2, b, kv_heads, s, d] and the cp group sums the
buffers with AllReduce, in pieces of at most 32 MiB (one larger AllReduce has failed on CPU). The
backward of an AllReduce sum is again an AllReduce sum: every rank then holds dK, dV of the whole
sequence summed over the group's queries, and the slice at its own positions (the backward of the
placing) is exactly its tokens' gradient. Traffic: 2 (cp - 1) / cp of the buffer per rank and
direction, twice the AllGather a ring would need, per layer forward and again backward.

Queries attend by index (msllm.models.llama.visibility): a rank's query slots are its tokens'
global positions and the keys are all s slots, so causal attention, sliding windows and packed
documents (segments of the whole sequence) hold without any [s, s] tensor, and RoPE reads the
rank's positions.

Loss: each rank averages its own tokens' losses (an equal count per rank), the step sums gradients
and losses over the world and divides by it, as data parallel does: the mean over all tokens. A
masked mean (SFT) divides by the group's mean count instead, so the ranks' losses still average to
the sequence's loss.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from msllm.config import Config
from msllm.models import decoder, layers
from msllm.models.mixers import attention
from msllm.layout.check import data_replicas
from msllm.layout.plan import BUCKET_BYTES


def chunks_of(cp: int, index: int) -> tuple[int, int]:
    """The two zig-zag chunks (of 2 cp) rank `index` of a cp group holds."""
    return index, 2 * cp - 1 - index


def local_positions(seq: int, cp: int, index: int) -> np.ndarray:
    """Global positions [s / cp] of the tokens rank `index` of a cp group computes (int32, ascending)."""
    c = seq // (2 * cp)
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks_of(cp, index)]).astype(np.int32)


def rank_and_world() -> tuple[int, int]:
    """This process's (rank, world) once msllm.parallel.dp has formed the group; (0, 1) without msrun."""
    from msllm.parallel.dp import launched

    if not launched():
        return 0, 1
    from mindspore.communication import get_group_size, get_rank

    return get_rank(), get_group_size()


def cp_group(cp: int, rank: int, world: int) -> str | None:
    """The communication group of rank's cp group: None (the world group) when it is the whole world,
    else a sub-group created here (every member creates it)."""
    if cp == world:
        return None
    from mindspore.communication import create_group

    first = rank // cp * cp
    name = f"msllm_cp_{first // cp}"
    create_group(name, list(range(first, first + cp)))
    return name


def all_reduce(group: str | None):
    return ops.AllReduce() if group is None else ops.AllReduce(group=group)


class ZigZagTokens(nn.Cell):
    """Token-aligned inputs [.., s] -> this rank's tokens [.., s / cp] (layers.WholeSequence's place)."""

    def __init__(self, seq: int, cp: int, index: int):
        super().__init__()
        self.index = Tensor(local_positions(seq, cp, index))

    def construct(self, x):
        return ops.gather(x, self.index, x.ndim - 1)


class PlaceChunks(nn.Cell):
    """x [.., q, d] of this rank's tokens -> [.., s, d] with them at their global positions, zeros elsewhere."""

    def __init__(self, seq: int, cp: int, index: int):
        super().__init__()
        c = seq // (2 * cp)
        first, second = chunks_of(cp, index)
        # zero rows before the first chunk, between the two, after the second (fixed at compile time)
        self.gaps = (first * c, (second - first - 1) * c, (2 * cp - 1 - second) * c)
        self.chunk = c

    def zeros(self, x, n: int):
        return ops.zeros(x.shape[:-2] + (n, x.shape[-1]), x.dtype)

    def construct(self, x):
        c = self.chunk
        pieces = (x[..., :c, :],)
        if self.gaps[0] > 0:
            pieces = (self.zeros(x, self.gaps[0]),) + pieces
        if self.gaps[1] > 0:
            pieces = pieces + (self.zeros(x, self.gaps[1]),)
        pieces = pieces + (x[..., c:, :],)
        if self.gaps[2] > 0:
            pieces = pieces + (self.zeros(x, self.gaps[2]),)
        return ops.concat(pieces, -2)


class BucketedAllReduce(nn.Cell):
    """Sum of x over a group, flattened and sent in pieces of at most `bucket_bytes` (sizes fixed at compile time)."""

    def __init__(self, group: str | None, bucket_bytes: int = BUCKET_BYTES):
        super().__init__()
        self.all_reduce = all_reduce(group)
        self.bucket_bytes = bucket_bytes

    def construct(self, x):
        flat = x.reshape(-1)
        n = flat.shape[0]
        step = max(1, self.bucket_bytes // (4 if x.dtype == ms.float32 else 2))
        if n <= step:
            return self.all_reduce(flat).reshape(x.shape)
        parts = ()
        for start in range(0, n, step):
            parts = parts + (self.all_reduce(flat[start:min(start + step, n)]),)
        return ops.concat(parts, 0).reshape(x.shape)


class ExchangeKV(nn.Cell):
    """k, v [b, kv_heads, q, d] of this rank's tokens -> those of the whole sequence [b, kv_heads, s, d]
    on every rank of the cp group (layers.OwnKeys's place): placed in zeros and summed by `reduce`."""

    def __init__(self, seq: int, cp: int, index: int, reduce: nn.Cell):
        super().__init__()
        self.place = PlaceChunks(seq, cp, index)
        self.reduce = reduce

    def construct(self, k, v):
        both = self.reduce(self.place(ops.stack((k, v))))
        return both[0], both[1]


class GroupMean(nn.Cell):
    """A scalar -> its mean over the cp group (layers.OneRankMean's place)."""

    def __init__(self, cp: int, group: str | None):
        super().__init__()
        self.all_reduce = all_reduce(group)
        self.inv = 1.0 / cp

    def construct(self, x):
        return self.all_reduce(x.reshape(1)).reshape(()) * self.inv


def split_sequence(model: decoder.Decoder, seq: int, cp: int, index: int, group: str | None) -> None:
    """Make `model` compute rank `index`'s zig-zag chunks of `seq`-token sequences, exchanging keys and
    values and averaging losses over `group` (its cp group)."""
    model.local_tokens = ZigZagTokens(seq, cp, index)
    model.sequence_mean = GroupMean(cp, group)
    reduce = BucketedAllReduce(group)
    for cell in [cell for _, cell in model.cells_and_names()]:
        if isinstance(cell, attention.Attention):
            cell.whole_kv = ExchangeKV(seq, cp, index, reduce)


def whole_sequence(model: decoder.Decoder) -> None:
    """Undo split_sequence: the process computes whole sequences (generation after training)."""
    model.local_tokens = layers.WholeSequence()
    model.sequence_mean = layers.OneRankMean()
    for cell in [cell for _, cell in model.cells_and_names()]:
        if isinstance(cell, attention.Attention):
            cell.whole_kv = layers.OwnKeys()


def specialise(model: decoder.Decoder, cfg: Config, training: bool) -> int:
    """The seam's context-parallel step (msllm.backends): split sequences over the cp group this
    process belongs to when training with parallel.cp > 1, whole sequences otherwise. Returns cp."""
    cp = cfg.parallel.cp if training else 1
    if cp == 1:
        whole_sequence(model)
        return 1
    rank, world = rank_and_world()
    data_replicas(cfg, world)  # cp divides the workers
    split_sequence(model, cfg.data.seq_len, cp, rank % cp, cp_group(cp, rank, world))
    return cp
