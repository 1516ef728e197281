import numpy as np
import pytest

from msllm.config import load_config
from msllm.data import shards
from msllm.data.corpus import DataError
from msllm.data.loader import ShardSampler, make_dataset
from msllm.staged import DiskFullError
from tests.conftest import leave_free, needed_bytes, tiny_overrides


@pytest.mark.parametrize("num_samples", [40, 41])
def test_two_shards_are_disjoint_and_complete(num_samples):
    per_rank = [list(ShardSampler(num_samples, 2, r, seed=5)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == num_samples // 2
    assert not set(per_rank[0]) & set(per_rank[1])
    union = set(per_rank[0]) | set(per_rank[1])
    assert len(union) == num_samples - num_samples % 2       # an odd sample out is dropped, never duplicated
    assert union <= set(range(num_samples))


def test_epochs_reshuffle_and_start_resumes_the_stream():
    full = list(ShardSampler(10, 1, 0, seed=3, length=30))
    assert sorted(full[:10]) == sorted(full[10:20]) == list(range(10))
    assert full[:10] != full[10:20]                           # a new permutation each epoch
    assert list(ShardSampler(10, 1, 0, seed=3, start=13, length=17)) == full[13:]


def test_dataset_batches_are_windows_of_the_stream():
    tokens = np.arange(1000, dtype=np.uint16)
    data = make_dataset(tokens, seq_len=8, batch_size=4, seed=0, shuffle=False, num_batches=3)
    batches = [b.asnumpy() for (b,) in data.create_tuple_iterator(num_epochs=1)]
    assert len(batches) == 3 and batches[0].shape == (4, 9) and batches[0].dtype == np.int32
    np.testing.assert_array_equal(batches[0][1], np.arange(8, 17))   # window 1 = tokens[8:17]


def test_shard_build_is_cached_and_split(tmp_path, corpus):
    cfg = load_config(None, tiny_overrides(tmp_path / "run", corpus))
    out = shards.build_shard(cfg, tmp_path / "shard")
    index = shards.read_index(out)
    train, val = shards.open_tokens(out, "train"), shards.open_tokens(out, "val")
    assert index["vocab_size"] == 384 and train.dtype == np.uint16
    assert len(val) / (len(train) + len(val)) == pytest.approx(0.1, abs=0.01)
    assert int(train.max()) < 384
    assert (train == index["eos_id"]).sum() + (val == index["eos_id"]).sum() == index["documents"]
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert shards.build_shard(cfg, tmp_path / "shard") == out
    assert (out / "train.bin").stat().st_mtime_ns == stamp       # reused, not rebuilt
    # A pretokenized shard dir is accepted as data.path directly.
    cfg2 = load_config(None, tiny_overrides(tmp_path / "run2", out))
    assert shards.build_shard(cfg2, tmp_path / "unused") == out


def test_missing_data_path_is_a_clear_error(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path / "run", tmp_path / "nope"))
    with pytest.raises(DataError, match="does not exist"):
        shards.build_shard(cfg, tmp_path / "shard")
    assert not (tmp_path / "shard").exists()


def test_full_disk_keeps_the_previous_shard(small_disk, corpus):
    """Out of space while rebuilding a shard: one line naming the shard dir and the space it needs
    (at least what the shard takes), no temporary dir, the previous shard untouched."""
    out = shards.build_shard(load_config(None, tiny_overrides(small_disk / "run", corpus)), small_disk / "shard")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    leave_free(small_disk, 32 * 1024)
    changed = load_config(None, tiny_overrides(small_disk / "run", corpus, **{"data.val_fraction": 0.2}))
    with pytest.raises(DiskFullError) as e:
        shards.build_shard(changed, small_disk / "shard")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{out}: no space left on the device")
    assert needed_bytes(message) >= sum(len(b) for b in before.values())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "shard"]
