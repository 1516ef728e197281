"""Fixed-length windows over a token stream, sharded per rank, fed by mindspore.dataset.

Sample i is tokens[i*L : i*L + L + 1] (inputs plus the shifted labels). Each epoch is a
seeded permutation of all samples; rank r takes every num_shards-th entry of it, cut to
an equal length for all ranks (so at most num_shards-1 samples per epoch go unused).
The stream position is a plain sample count, which makes resuming a matter of `start`.
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


class ShardSampler:
    """Indices for one rank: positions start .. start+length-1 of its endless epoch stream."""

    def __init__(self, num_samples: int, num_shards: int = 1, shard_id: int = 0, seed: int = 0,
                 shuffle: bool = True, start: int = 0, length: int | None = None):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} not in [0, {num_shards})")
        self.num_samples, self.num_shards, self.shard_id = num_samples, num_shards, shard_id
        self.seed, self.shuffle, self.start = seed, shuffle, start
        self.per_epoch = num_samples // num_shards
        if self.per_epoch == 0:
            raise ValueError(f"{num_samples} samples cannot feed {num_shards} shards")
        self.length = self.per_epoch if length is None else length

    def epoch_indices(self, epoch: int) -> np.ndarray:
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                 if self.shuffle else np.arange(self.num_samples))
        return order[self.shard_id::self.num_shards][:self.per_epoch]

    def __iter__(self):
        pos, end = self.start, self.start + self.length
        while pos < end:
            epoch, offset = divmod(pos, self.per_epoch)
            take = self.epoch_indices(epoch)[offset:offset + (end - pos)]
            yield from (int(i) for i in take)
            pos += len(take)

    def __len__(self):
        return self.length


def windows_of(data, seq_len: int):
    """Samples of a split: fixed windows over a token stream, or an SFT shard's packed windows as they are."""
    return data if hasattr(data, "columns") else PackedWindows(data, seq_len)


def make_dataset(tokens, seq_len: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 num_shards: int = 1, shard_id: int = 0, start_batch: int = 0, num_batches: int | None = None):
    """A mindspore.dataset pipeline yielding int32 [batch, seq_len + 1] batches (SFT windows: also
    mask, segments and positions [batch, seq_len], msllm.data.sft)."""
    windows = windows_of(tokens, seq_len)
    sampler = ShardSampler(len(windows), num_shards, shard_id, seed, shuffle, start=start_batch * batch_size,
                           length=None if num_batches is None else num_batches * batch_size)
    dataset = ds.GeneratorDataset(windows, column_names=windows.columns, sampler=sampler,
                                  num_parallel_workers=1, python_multiprocessing=False)
    return dataset.batch(batch_size, drop_remainder=True)
