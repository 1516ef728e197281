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

    def global_positions(self, step: int) -> range:
        first = self.start + step * self.per_rank * self.world + self.rank * self.per_rank
        return range(first, first + self.per_rank)

    def __iter__(self):
        epoch, order = -1, None
        for step in range(self.steps):
            for pos in self.global_positions(step):
                e, i = divmod(pos, self.num_samples)
                if e != epoch:
                    epoch, order = e, global_order(self.num_samples, self.seed, self.shuffle, e)
                yield int(order[i])

    def __len__(self):
        return self.steps * self.per_rank


def windows_of(data, seq_len: int):
    """Samples of a split: fixed windows over a token stream, or an SFT shard's packed windows as they are."""
    return data if hasattr(data, "columns") else PackedWindows(data, seq_len)


def make_dataset(tokens, seq_len: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 world: int = 1, rank: int = 0, start: int = 0, num_batches: int | None = None):
    """A mindspore.dataset pipeline yielding this rank's int32 [batch_size, seq_len + 1] batches, starting
    at global sample position `start` (batch_size is per rank; a step consumes batch_size * world).
    SFT windows (msllm.data.sft) also yield mask, segments and positions [batch_size, seq_len]."""
    windows = windows_of(tokens, seq_len)
    sampler = RankSampler(len(windows), batch_size, world=world, rank=rank, seed=seed, shuffle=shuffle,
                          start=start, steps=num_batches)
    dataset = ds.GeneratorDataset(windows, column_names=windows.columns, sampler=sampler,
                                  num_parallel_workers=1, python_multiprocessing=False)
    return dataset.batch(batch_size, drop_remainder=True)
