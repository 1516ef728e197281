"""Streaming tensor readers and writers. Tensors travel as torch tensors (torch has bf16; numpy does not).

Every reader has `.path`, `.infos` (name -> TensorInfo, read from headers only), `read(name)`
and `close()`. Every writer is told all names, shapes and dtypes up front and then takes
tensors one at a time in that order, so nothing holds more than one tensor.
"""
from __future__ import annotations

from pathlib import Path

import torch

from interop import InteropError
from msllm.safetensors_reader import TensorInfo


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is already contiguous."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class Writer:
    """Base of the streaming writers: checks each tensor against the announced list and order."""

    def __init__(self, path: Path, infos: dict[str, TensorInfo]):
        self.path, self.infos = Path(path), dict(infos)
        self._order = iter(self.infos)
        self.file = open(self.path, "wb")

    def write(self, name: str, t: torch.Tensor) -> None:
        want = next(self._order, None)
        info = TensorInfo(tuple(t.shape), t.dtype)
        if name != want or info != self.infos.get(name):
            raise InteropError(f"{self.path}: expected {want} {self.infos.get(want)}, got {name} {info}")
        self._write(name, t)

    def _write(self, name: str, t: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        left = next(self._order, None)
        self.file.close()
        if left is not None:
            raise InteropError(f"{self.path}: closed before {left} was written")


class DictReader:
    """An in-memory state dict (e.g. `hf_model.state_dict()`) behind the reader interface."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: str = "<state dict>"):
        self.path, self.tensors = path, tensors
        self.infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        pass


class MultiFileReader:
    """Tensors spread over several files (shards). At most one file is open at a time, which keeps
    memory-mapped formats (.bin) from accumulating every shard's pages."""

    def __init__(self, path, readers: list):
        self.path, self.owner, self.infos, self.current = str(path), {}, {}, None
        for reader in readers:
            for name, info in reader.infos.items():
                self.owner[name] = reader
                self.infos[name] = info
            reader.close()

    def read(self, name: str) -> torch.Tensor:
        reader = self.owner[name]
        if self.current is not None and self.current is not reader:
            self.current.close()
        self.current = reader
        return reader.read(name)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
