"""What a pretokenized shard directory is: index.json and its token files. Read by the shard
builders (shards.py, sft.py), the loader and the preflight checks; numpy and the standard library only.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from msllm.data.corpus import DataError

INDEX = "index.json"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65535 else np.uint32


def read_index(shard_dir: Path) -> dict:
    try:
        return json.loads((shard_dir / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{shard_dir / INDEX}: unreadable shard index ({e})") from None


def open_tokens(shard_dir: Path, split: str) -> np.ndarray:
    index = read_index(shard_dir)
    path = shard_dir / f"{split}.bin"
    try:
        count, dtype = int(index[f"{split}_tokens"]), np.dtype(index["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{shard_dir / INDEX}: bad {split}_tokens or dtype entry ({e}); rebuild the shard") from None
    if not path.exists() or path.stat().st_size != count * dtype.itemsize:
        raise DataError(f"{path}: missing or wrong size (index says {count} tokens of {dtype}); rebuild the shard")
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


SFT_KIND = "sft"  # index.json "kind" of a shard of packed SFT windows (msllm.data.sft)


def is_sft(path: str | None) -> bool:
    """data.path names JSONL SFT rows, or a shard built from them."""
    if not path:
        return False
    p = Path(path).expanduser()
    if p.suffix == ".jsonl":
        return True
    try:
        return json.loads((p / "index.json").read_text()).get("kind") == SFT_KIND
    except (OSError, ValueError, AttributeError):
        return False
