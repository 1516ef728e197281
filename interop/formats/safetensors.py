"""safetensors, read and written one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {...}}, then the tensor bytes. `read` maps just one tensor's byte
range and returns a tensor on that mapping: no copy, no fresh memory to fault in, and the mapping
is released with the tensor. (`safe_open` maps the whole file and keeps every touched page
resident, so RSS climbs to the file size: +516 MB reading a 512 MB file, measured; a readinto
into fresh memory per tensor was ~2x slower than this, see tools/bench_convert.py.)
The writer knows every shape and dtype up front, so it writes the header first and then each
tensor as it arrives; `safetensors.save_file` needs the whole state dict in memory.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import torch

from interop import InteropError, names_line
from interop.formats import TensorInfo, Writer, tensor_bytes

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsReader:
    def __init__(self, path: Path):
        self.path = str(path)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= n <= size - 8:
                raise InteropError(f"{path}: truncated or not a safetensors file "
                                   f"(header length {n}, file {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise InteropError(f"{path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.infos, self.offsets, bad, beyond = {}, {}, [], []
        for name, entry in header.items():
            try:
                info = TensorInfo(tuple(entry["shape"]), DTYPES[entry["dtype"]])
                begin, end = entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                bad.append(name)
                continue
            if begin < 0 or end - begin != info.nbytes:
                bad.append(name)
            elif self.data_start + end > size:
                beyond.append(name)
            self.infos[name], self.offsets[name] = info, self.data_start + begin
        if bad:
            raise InteropError(f"{path}: corrupt header entries (dtype, shape or offsets) for {names_line(bad)}")
        if beyond:
            raise InteropError(f"{path}: truncated ({size} bytes): data of {names_line(beyond)} lies past the end")
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
