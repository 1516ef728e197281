"""Fixed-length windows over a token stream, split across data-parallel ranks, fed by mindspore.dataset.

Sample i is tokens[i*L : i*L + L + 1] (inputs plus the shifted labels). The *global* stream is
an endless sequence of seeded epoch permutations of all samples; position p is sample
perm_{p // n}[p % n]. Each optimizer step consumes the next `global_batch` positions, and rank
r of `world` takes the r-th contiguous slice of them. So the samples a step sees do not depend
on the world size: 2 ranks at micro-batch b see exactly what 1 rank at 2b sees, and a run can
resume at another world size from its position, a plain count of consumed samples.
"""
from __future__ import annotations

import numpy as np
import mindspore.dataset as ds


class PackedWindows:
    columns = ["tokens"]

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (len(tokens) - 1) // seq_len

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        start = int(i) * self.seq_len
        return (np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32),)


class DocumentWindows(PackedWindows):
    """The same windows with each token attending only within its own document (data.document_attention):
    segments 1, 2, .. per document in the window (an EOS closes its document), positions restarting
    at each document, and every label counted (mask 1), the SFT step's inputs."""
    columns = ["tokens", "mask", "segments", "positions"]

    def __init__(self, tokens: np.ndarray, seq_len: int, eos: int):
        super().__init__(tokens, seq_len)
        self.eos = eos

    def __getitem__(self, i):
        from msllm.data.sft import positions

        (window,) = super().__getitem__(i)
        closes = window[:-2] == self.eos  # a token after an EOS starts the next document
        segments = np.concatenate([[1], 1 + np.cumsum(closes)]).astype(np.int32)
        return window, np.ones(self.seq_len, np.float32), segments, positions(segments)


def row_capacity(count: int, total: int, rows: int) -> int:
    """How many positions of a micro-batch of `total` go through the output head when `count` have a
    loss: the bucket above count among 64, 96, 128, 192, 256, 384, .. (so a run compiles a few step
    graphs, each computing at most 1.5x the positions it needs), a multiple of the batch's `rows`;
    `total` (every position) when that is no smaller."""
    bucket = 64
    while bucket < count:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket // 3 * 4  # 64, 96, 128, 192, ..
    bucket = -(-bucket // rows) * rows
    return total if bucket >= total else bucket


def most_loss_positions(mask: np.ndarray, micro_batches: int) -> int:
    """The largest count of positions with a loss among a batch's micro-batches (mask [m*b, ...])."""
    return int((mask.reshape(micro_batches, -1) != 0).sum(1).max())


def head_rows(mask: np.ndarray, micro_batches: int, most: int = 0) -> np.ndarray:
    """A batch's mask [m*b, ...] (m micro-batches of b rows: SFT's [b, s], DPO's pairs [b, 2, s]) -> the
    positions whose label has a loss, per micro-batch: C flat indices into its positions (C =
    row_capacity of the largest count among the micro-batches, or `most` when larger: under data
    parallel every worker's largest, so all compile the same graph), padded with distinct positions
    without a loss (scattered back they land on different positions), laid over the micro-batch's b
    rows as [b, C/b] so the dataset batches them and the step slices them like the other columns. With
    C = every position (more loss positions than the largest bucket) they are all positions in order."""
    micro = mask.reshape(micro_batches, -1)
    b = mask.shape[0] // micro_batches
    capacity = row_capacity(max(most, most_loss_positions(mask, micro_batches)), micro.shape[1], b)
    out = np.empty((micro_batches, capacity), np.int32)
    for i, m in enumerate(micro != 0):
        if capacity == m.size:
            out[i] = np.arange(m.size)
            continue
        hit = np.flatnonzero(m)
        out[i, :hit.size] = hit
        out[i, hit.size:] = np.flatnonzero(~m)[:capacity - hit.size]  # positions without a loss: add nothing
    return out.reshape(mask.shape[0], -1)


def global_order(num_samples: int, seed: int, shuffle: bool, epoch: int) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class RankSampler:
    """Sample indices rank `rank` of `world` reads for `steps` steps from global position `start`."""

    def __init__(self, num_samples: int, per_rank: int, *, world: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, start: int = 0, steps: int | None = None):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} not in [0, {world})")
        if num_samples < 1:
            raise ValueError("no samples")
        self.num_samples, self.per_rank, self.world, self.rank = num_samples, per_rank, world, rank
        self.seed, self.shuffle, self.start = seed, shuffle, start
        self.steps = steps if steps is not None else max(1, num_samples // (per_rank * world))
        self.epoch, self.order = -1, None  # the permutation of the epoch last read

    def global_positions(self, step: int) -> range:
        first = self.start + step * self.per_rank * self.world + self.rank * self.per_rank
        return range(first, first + self.per_rank)

    def step_samples(self, step: int) -> list[int]:
        """The sample indices this rank reads at `step` (counted from `start`)."""
        out = []
        for pos in self.global_positions(step):
            e, i = divmod(pos, self.num_samples)
            if e != self.epoch:
                self.epoch, self.order = e, global_order(self.num_samples, self.seed, self.shuffle, e)
            out.append(int(self.order[i]))
        return out

    def __iter__(self):
        self.epoch, self.order = -1, None
        for step in range(self.steps):
            yield from self.step_samples(step)

    def __len__(self):
        return self.steps * self.per_rank


def windows_of(data, seq_len: int):
    """Samples of a split: fixed windows over a token stream, or an SFT shard's packed windows as they are."""
    return data if hasattr(data, "columns") else PackedWindows(data, seq_len)


def make_dataset(tokens, seq_len: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 world: int = 1, rank: int = 0, start: int = 0, num_batches: int | None = None,
                 loss_rows: int = 0):
    """A mindspore.dataset pipeline yielding this rank's int32 [batch_size, seq_len + 1] batches, starting
    at global sample position `start` (batch_size is per rank; a step consumes batch_size * world).
    SFT windows (msllm.data.sft) also yield mask, segments and positions [batch_size, seq_len] (DPO pairs,
    msllm.data.preference: mask [batch_size, 2, seq_len]), and with loss_rows = m > 0 (the micro-batches
    of a batch) the positions with a loss (head_rows), in a capacity every rank's batch fits."""
    windows = windows_of(tokens, seq_len)
    samplers = [RankSampler(len(windows), batch_size, world=world, rank=r, seed=seed, shuffle=shuffle, start=start,
                            steps=num_batches) for r in range(world)]
    dataset = ds.GeneratorDataset(windows, column_names=windows.columns, sampler=samplers[rank],
                                  num_parallel_workers=1, python_multiprocessing=False)
    if not (loss_rows and "mask" in windows.columns):
        return dataset.batch(batch_size, drop_remainder=True)
    peers, column = samplers[:rank] + samplers[rank + 1:], windows.columns.index("mask")

    def add_rows(mask, info):
        # the other ranks' masks of this step, read from the shard: every rank picks the same capacity,
        # so the data-parallel ranks run one step graph
        step = info.get_batch_num()
        most = max((most_loss_positions(np.stack([windows[i][column] for i in peer.step_samples(step)]), loss_rows)
                    for peer in peers), default=0)
        return mask, list(head_rows(np.stack(mask), loss_rows, most))

    dataset = dataset.batch(batch_size, drop_remainder=True, per_batch_map=add_rows, input_columns=["mask"],
                            output_columns=["mask", "rows"])
    return dataset.project(windows.columns + ["rows"])
