"""PyTorch `.bin` / `.pt` state dicts, opened with torch.load(weights_only=True, mmap=True).

weights_only: the unpickler accepts tensors and plain containers only, so a checkpoint cannot run
code on load. mmap: tensor data stays on disk until a tensor is read, so listing names and shapes
costs nothing and reading touches one tensor's pages.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch

from interop import InteropError
from msllm.safetensors_reader import TensorInfo


def _reason(e: Exception) -> str:
    """torch's refusal is a page of advice; keep the line that says what was refused."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    specific = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
    return (specific or lines or [type(e).__name__])[0]


class TorchBinReader:
    def __init__(self, path: Path):
        self.path = str(path)
        self.state = self._load()
        if not isinstance(self.state, dict) or not all(isinstance(v, torch.Tensor) for v in self.state.values()):
            raise InteropError(f"{path}: not a flat state dict of tensors")
        self.infos = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in self.state.items()}

    def _load(self):
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            raise InteropError(f"{self.path}: refused by torch.load(weights_only=True): {_reason(e)}") from None
        except (RuntimeError, OSError, EOFError) as e:
            raise InteropError(f"{self.path}: unreadable torch checkpoint: {_reason(e)}") from None

    def read(self, name: str) -> torch.Tensor:
        if self.state is None:
            self.state = self._load()
        return self.state[name]

    def close(self) -> None:
        self.state = None  # drops the mapping once the tensors read from it are gone
