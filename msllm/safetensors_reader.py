"""The one safetensors reader: header checked up front, then one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {...}}, then the tensor bytes. `read` maps just one tensor's byte
range and returns a torch tensor on that mapping: no copy, no fresh memory to fault in, and the
mapping is released with the tensor. (`safe_open` maps the whole file and keeps every touched page
resident, so RSS climbs to the file size.) Tensors are torch tensors because torch has bf16 and
numpy does not; `read_arrays` gives numpy with bf16 widened to fp32 (exactly), one tensor per lookup.
Used by checkpoints (msllm), the resume check (header only) and interop's conversions.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from msllm.errors import UserError, names_line

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class SafetensorsError(UserError, ValueError):
    pass


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class SafetensorsReader:
    """`.path`, `.infos` (name -> TensorInfo, from the header), `.metadata`, `read(name)`, `close()`."""

    def __init__(self, path: Path):
        self.path = str(path)
        if not os.path.isfile(path):
            raise SafetensorsError(f"{path}: missing")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= n <= size - 8:
                raise SafetensorsError(f"{path}: truncated or not a safetensors file "
                                       f"(header length {n}, file {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + n
        self.infos, self.offsets, bad, beyond = {}, {}, [], []
        for name, entry in header.items():
            try:
                info = TensorInfo(tuple(int(d) for d in entry["shape"]), DTYPES[entry["dtype"]])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                bad.append(name)
                continue
            if begin < 0 or min(info.shape, default=0) < 0 or end - begin != info.nbytes:
                bad.append(name)
            elif data_start + end > size:
                beyond.append(name)
            self.infos[name], self.offsets[name] = info, data_start + begin
        if bad:
            raise SafetensorsError(f"{path}: corrupt header entries (dtype, shape or offsets) for {names_line(bad)}")
        if beyond:
            raise SafetensorsError(f"{path}: truncated ({size} bytes): data of {names_line(beyond)} lies past the end")
        self._file = None

    def read(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        count = info.nbytes // info.dtype.itemsize
        if count == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        if self._file is None:
            self._file = open(self.path, "rb")
        start = self.offsets[name]
        base = start - start % mmap.ALLOCATIONGRANULARITY
        # ACCESS_COPY: a private mapping, writable as torch wants, never written back to the file.
        mapped = mmap.mmap(self._file.fileno(), start + info.nbytes - base, offset=base, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mapped, dtype=info.dtype, count=count, offset=start - base).view(info.shape)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LazyArrays(Mapping):
    """name -> numpy array of a file, read on each access (bf16 widened to fp32): copying a model's
    tensors into Parameters one at a time keeps at most one tensor mapped, not the whole file."""

    def __init__(self, path: Path):
        self.reader = SafetensorsReader(path)

    def __getitem__(self, name: str) -> np.ndarray:
        t = self.reader.read(name)
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    def __iter__(self):
        return iter(self.reader.infos)

    def __len__(self) -> int:
        return len(self.reader.infos)


def read_arrays(path: Path) -> LazyArrays:
    """Every tensor of a file as numpy, read when looked up."""
    return LazyArrays(path)
