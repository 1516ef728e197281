"""MindSpore `.ckpt`: protobuf `Checkpoint { repeated Value value = 1; }`, read and written by hand.

Value { string tag = 1; TensorProto tensor = 2; }, TensorProto { repeated int64 dims = 1;
string tensor_type = 2; bytes tensor_content = 3; }. MindSpore writes a large tensor as several
consecutive Values with the same tag (each <= 512 MiB of content, joined on load) and may append
b"crc_num" + 10 bytes. Encoding the wire format directly lets us index a file without reading
tensor bytes, and write a record header followed by the tensor's own buffer (the protobuf library
would copy every tensor into a message first, and parse the whole file at once).
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

from interop import InteropError
from interop.formats import Writer, tensor_bytes
from msllm.errors import names_line
from msllm.safetensors_reader import TensorInfo

DTYPES = {"Float64": torch.float64, "Float32": torch.float32, "Float16": torch.float16,
          "BFloat16": torch.bfloat16, "Int64": torch.int64, "Int32": torch.int32, "Int16": torch.int16,
          "Int8": torch.int8, "UInt8": torch.uint8, "Bool": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
SLICE = 512 << 20          # content bytes per Value, as MindSpore slices
CRC_TRAILER = 17           # b"crc_num" + 10-byte big-endian CRC


def _read_exactly(f, offset: int, out: torch.Tensor, path) -> torch.Tensor:
    """Fill `out` with the bytes at `offset` of an unbuffered file, looping over short reads."""
    view = tensor_bytes(out)  # out is fresh and contiguous: this is its own memory
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise InteropError(f"{path}: truncated: file ends inside a tensor at byte {offset + done}")
        done += n
    return out


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, pos: int, end: int):
    """(field number, wire type, value) of a message in buf[pos:end]. Length-delimited values are
    (offset, length) pairs, left unread."""
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = (pos, length), pos + length
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"wire type {wire} at byte {pos}")
        if pos > end:
            raise ValueError(f"field {field} runs past its message (byte {pos} > {end})")
        yield field, wire, value


def _tensor_proto(buf, start: int, length: int):
    dims, type_name, content = [], None, None
    for field, wire, value in _fields(buf, start, start + length):
        if field == 1 and wire == 0:
            dims.append(value)
        elif field == 1:  # packed
            pos, end = value[0], value[0] + value[1]
            while pos < end:
                dim, pos = _varint(buf, pos)
                dims.append(dim)
        elif field == 2:
            type_name = bytes(buf[value[0]:value[0] + value[1]]).decode()
        elif field == 3:
            content = value
    return dims, type_name, content or (start, 0)


class CkptReader:
    def __init__(self, path: Path):
        self.path = str(path)
        self.infos, self.chunks = {}, {}
        if Path(path).stat().st_size == 0:
            raise InteropError(f"{path}: empty file")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                bad = self._index(buf)
            except (ValueError, IndexError) as e:
                raise InteropError(f"{path}: truncated or not a MindSpore checkpoint ({e})") from None
        if bad:
            raise InteropError(f"{path}: entries that are not plain tensors: {names_line(bad)}")
        wrong = [n for n, info in self.infos.items() if sum(c[1] for c in self.chunks[n]) != info.nbytes]
        if wrong:
            raise InteropError(f"{path}: content size does not match shape and dtype for {names_line(wrong)}")
        self._file = None

    def _index(self, buf) -> list:
        """Fill infos and chunks (content offsets) from the Value records; return unreadable names."""
        end, bad = len(buf), []
        if end >= CRC_TRAILER and bytes(buf[end - CRC_TRAILER:end - 10]) == b"crc_num":
            end -= CRC_TRAILER
        for field, _, value in _fields(buf, 0, end):
            if field != 1 or value is None:
                raise ValueError(f"unexpected top-level field {field}")
            name, tensor = None, None
            for vfield, _, vvalue in _fields(buf, value[0], value[0] + value[1]):
                if vfield == 1:
                    name = bytes(buf[vvalue[0]:vvalue[0] + vvalue[1]]).decode()
                elif vfield == 2:
                    tensor = vvalue
            dims, type_name, content = _tensor_proto(buf, *tensor) if tensor else ([], None, None)
            if type_name not in DTYPES:  # map tensors, strings
                bad.append(name)
                continue
            shape = () if dims == [0] else tuple(dims)  # MindSpore stores a scalar as [0]
            self.infos[name] = TensorInfo(shape, DTYPES[type_name])
            self.chunks.setdefault(name, []).append(content)
        return bad

    def read(self, name: str) -> torch.Tensor:
        if self._file is None:
            self._file = open(self.path, "rb", buffering=0)
        info = self.infos[name]
        out = torch.empty(info.shape, dtype=info.dtype)
        flat, done = out.reshape(-1).view(torch.uint8), 0
        for offset, length in self.chunks[name]:
            _read_exactly(self._file, offset, flat[done:done + length], self.path)
            done += length
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_head(field: int, length: int) -> bytes:
    """Key and length of a length-delimited field (wire type 2)."""
    return _uvarint(field << 3 | 2) + _uvarint(length)


class CkptWriter(Writer):
    def _write(self, name: str, t: torch.Tensor) -> None:
        data = tensor_bytes(t)
        tag, type_name = name.encode(), NAMES[t.dtype].encode()
        dims = b"".join(_uvarint(d) for d in t.shape)
        for start in range(0, max(len(data), 1), SLICE):
            chunk = data[start:start + SLICE]
            tensor_head = ((_field_head(1, len(dims)) + dims if dims else b"")
                           + _field_head(2, len(type_name)) + type_name + _field_head(3, len(chunk)))
            tensor_len = len(tensor_head) + len(chunk)
            value_head = _field_head(1, len(tag)) + tag + _field_head(2, tensor_len)
            self.file.write(_field_head(1, len(value_head) + tensor_len) + value_head + tensor_head)
            self.file.write(chunk)
