import numpy as np
import pytest

from msllm.config_file import load_config
from msllm.data import shards
from msllm.data.corpus import DataError
from msllm.data.loader import RankSampler, make_dataset
from msllm.staged import DiskFullError
from tests.conftest import leave_free, needed_bytes, tiny_overrides


def positions(world, per_rank, steps, **kw):
    """The samples each step reads, as one list per step (ranks' slices concatenated in rank order)."""
    ranks = [list(RankSampler(10, per_rank, world=world, rank=r, seed=3, steps=steps, **kw)) for r in range(world)]
    return [sum((rank[s * per_rank:(s + 1) * per_rank] for rank in ranks), []) for s in range(steps)]


def test_global_order_does_not_depend_on_the_world_size():
    one = positions(1, 4, steps=7)                      # 28 samples: crosses two epoch boundaries
    assert positions(2, 2, steps=7) == one == positions(4, 1, steps=7)
    flat = sum(one, [])
    assert sorted(flat[:10]) == sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]                     # a new permutation each epoch
    ranks = [set(RankSampler(10, 2, world=2, rank=r, seed=3, steps=2)) for r in range(2)]
    assert not ranks[0] & ranks[1]                      # within an epoch the ranks read disjoint samples


def test_start_resumes_the_stream_at_any_world_size():
    flat = sum(positions(1, 4, steps=7), [])
    assert list(RankSampler(10, 4, seed=3, start=12, steps=4)) == flat[12:28]
    resumed = sum(positions(2, 1, steps=8, start=12), [])    # saved by 1 rank at 4, resumed by 2 at 1
    assert resumed == flat[12:28]


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
