"""The one safetensors reader: header checked up front, then one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {...}}, then the tensor bytes. `read` maps just one tensor's byte
range and returns a torch tensor on that mapping: no copy, no fresh memory to fault in, and the
mapping is released with the tensor. (`safe_open` maps the whole file and keeps every touched page
resident, so RSS climbs to the file size.) Interop reads torch tensors, because torch has bf16 and
numpy does not; `read_numpy` and `read_arrays` (one tensor per lookup) give numpy with bf16 widened to
fp32, exactly, and never import torch: loading an msllm checkpoint to generate skips its ~1.5 s import.
Used by checkpoints (msllm), the resume check (header only) and interop's conversions.
"""
from __future__ import annotations

import functools
import json
import mmap
import os
from pathlib import Path
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from msllm.errors import UserError, names_line

# The file's dtype codes as numpy types; BF16 (which numpy lacks) is read as its raw 16 bits.
NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
         "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


@functools.cache
def torch_dtypes() -> dict:
    """Dtype code -> torch dtype, built on first use."""
    import torch

    return {code: getattr(torch, t) for code, t in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"))}


def __getattr__(name: str):  # DTYPES, without importing torch with this module
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(name)


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
    """`.path`, `.shapes` and `.codes` (name -> shape / dtype code, from the header), `.infos` (name ->
    TensorInfo with a torch dtype), `.metadata`, `read(name)` (torch), `read_numpy(name)`, `close()`."""

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
        self.shapes, self.codes, self.offsets, self.nbytes, bad, beyond = {}, {}, {}, {}, [], []
        for name, entry in header.items():
            try:
                shape, code = tuple(int(d) for d in entry["shape"]), entry["dtype"]
                nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(NUMPY[code]).itemsize
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                bad.append(name)
                continue
            if begin < 0 or min(shape, default=0) < 0 or end - begin != nbytes:
                bad.append(name)
            elif data_start + end > size:
                beyond.append(name)
            self.shapes[name], self.codes[name], self.nbytes[name] = shape, code, nbytes
            self.offsets[name] = data_start + begin
        if bad:
            raise SafetensorsError(f"{path}: corrupt header entries (dtype, shape or offsets) for {names_line(bad)}")
        if beyond:
            raise SafetensorsError(f"{path}: truncated ({size} bytes): data of {names_line(beyond)} lies past the end")
        self._file = None

    @functools.cached_property
    def infos(self) -> dict[str, TensorInfo]:
        dtypes = torch_dtypes()
        return {name: TensorInfo(shape, dtypes[self.codes[name]]) for name, shape in self.shapes.items()}

    def _map(self, name: str) -> tuple[mmap.mmap, int, int]:
        """(a private mapping of the tensor's bytes, the tensor's offset in it, its element count)."""
        if self._file is None:
            self._file = open(self.path, "rb")
        start = self.offsets[name]
        base = start - start % mmap.ALLOCATIONGRANULARITY
        count = self.nbytes[name] // np.dtype(NUMPY[self.codes[name]]).itemsize
        # ACCESS_COPY: a private mapping, writable as torch wants, never written back to the file.
        mapped = mmap.mmap(self._file.fileno(), start + self.nbytes[name] - base, offset=base, access=mmap.ACCESS_COPY)
        return mapped, start - base, count

    def read(self, name: str) -> torch.Tensor:
        import torch

        dtype = self.infos[name].dtype
        if 0 in self.shapes[name]:
            return torch.empty(self.shapes[name], dtype=dtype)
        mapped, offset, count = self._map(name)
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).view(self.shapes[name])

    def read_numpy(self, name: str) -> np.ndarray:
        """The tensor as numpy on its own mapping; BF16 widened to fp32 (exactly: bf16 is fp32's top half)."""
        code, shape = self.codes[name], self.shapes[name]
        if 0 in shape:
            return np.empty(shape, np.float32 if code == "BF16" else NUMPY[code])
        mapped, offset, count = self._map(name)
        array = np.frombuffer(mapped, NUMPY[code], count, offset).reshape(shape)
        return (array.astype(np.uint32) << 16).view(np.float32) if code == "BF16" else array

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LazyArrays(Mapping):
    """name -> numpy array of a file, read on each access (bf16 widened to fp32): copying a model's
    tensors into Parameters one at a time keeps at most one tensor mapped, not the whole file.
    `with` closes the file at the end of the block (arrays already read stay valid)."""

    def __init__(self, path: Path):
        self.reader = SafetensorsReader(path)
        self.shapes = self.reader.shapes  # name -> shape, from the header: nothing read

    def __getitem__(self, name: str) -> np.ndarray:
        return self.reader.read_numpy(name)

    def __iter__(self):
        return iter(self.reader.shapes)

    def __len__(self) -> int:
        return len(self.reader.shapes)

    def __enter__(self) -> "LazyArrays":
        return self

    def __exit__(self, *exc) -> None:
        self.reader.close()


def read_arrays(path: Path) -> LazyArrays:
    """Every tensor of a file as numpy, read when looked up."""
    return LazyArrays(path)
