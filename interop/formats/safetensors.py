"""safetensors, written one tensor at a time (read with msllm.safetensors_reader, the one reader).

The writer knows every shape and dtype up front, so it writes the header first and then each
tensor as it arrives; `safetensors.save_file` needs the whole state dict in memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from interop.formats import Writer, tensor_bytes
from msllm.safetensors_reader import DTYPES, TensorInfo

NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsWriter(Writer):
    def __init__(self, path: Path, infos: dict[str, TensorInfo]):
        super().__init__(path, infos)
        header, offset = {"__metadata__": {"format": "pt"}}, 0  # transformers requires format=pt
        for name, info in self.infos.items():
            header[name] = {"dtype": NAMES[info.dtype], "shape": list(info.shape),
                            "data_offsets": [offset, offset + info.nbytes]}
            offset += info.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned, as safetensors writes it
        self.file.write(len(blob).to_bytes(8, "little") + blob)

    def _write(self, name: str, t: torch.Tensor) -> None:
        self.file.write(tensor_bytes(t))
