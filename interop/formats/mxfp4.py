"""MXFP4 weights (OCP microscaling FP4), dequantized on read: gpt-oss's published checkpoints store each
expert matrix X as

    X_blocks [E, rows, groups, 16] uint8   two e2m1 values a byte, the even one in the low nibble
    X_scales [E, rows, groups]     uint8   an e8m0 power of two (exponent + 127) per group of 32 values

and transformers (integrations/mxfp4.py, convert_moe_packed_tensors) dequantizes them to the values
e2m1 x 2^(scale - 127), [E, rows, groups x 32], then swaps the last two dims into the layout its experts
compute with ([E, h, 2f] gate_up_proj, [E, f, h] down_proj). Mxfp4Reader presents each pair as that
full-precision X, so the family table, the plan's checks and every writer see ordinary tensors: a
conversion writes full precision. One expert is dequantized at a time into the tensor being read."""
from __future__ import annotations

import torch

from interop import InteropError
from msllm.errors import names_line
from msllm.safetensors_reader import TensorInfo

# e2m1: sign, 2 exponent bits, 1 mantissa bit; codes 0-7 are the positive values, 8-15 their negatives
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, groups, 16] nibbles and [E, rows, groups] exponents -> [E, groups x 32, rows] in `dtype`.
    Each value is exact in fp32 (a 2-bit mantissa times a power of two) and rounded once to `dtype`, as
    transformers' ldexp into a `dtype` output rounds it."""
    experts, rows, groups, half = blocks.shape
    values = torch.tensor(E2M1, dtype=torch.float32)
    out = torch.empty(experts, groups * half * 2, rows, dtype=dtype)
    for e in range(experts):  # one expert's fp32 values at a time
        codes = blocks[e].to(torch.int32)
        pairs = torch.stack((values[codes & 0x0F], values[codes >> 4]), -1)        # [rows, groups, 16, 2]
        exponents = scales[e].to(torch.int32)[..., None, None] - E8M0_BIAS
        out[e] = torch.ldexp(pairs, exponents).reshape(rows, -1).T.to(dtype)
    return out


class Mxfp4Reader:
    """A reader (interop.formats) whose X_blocks / X_scales pairs read as the dequantized X in `dtype`;
    every other tensor reads as it is stored."""

    def __init__(self, reader, dtype: torch.dtype):
        self.reader, self.path, self.dtype = reader, reader.path, dtype
        self.infos, self.packed = {}, {}
        stored, bad = reader.infos, []
        for name, info in stored.items():
            if name.endswith(SCALES) and name[:-len(SCALES)] + BLOCKS in stored:
                continue
            if not name.endswith(BLOCKS):
                self.infos[name] = info
                continue
            base = name[:-len(BLOCKS)]
            scales = stored.get(base + SCALES)
            if (scales is None or len(info.shape) != 4 or scales.shape != info.shape[:-1]
                    or {info.dtype, scales.dtype} != {torch.uint8}):
                bad.append(f"{name} {list(info.shape)} with {base + SCALES} "
                           f"{list(scales.shape) if scales else 'missing'}")
                continue
            experts, rows, groups, half = info.shape
            self.packed[base] = (name, base + SCALES)
            self.infos[base] = TensorInfo((experts, groups * half * 2, rows), dtype)
        if bad:
            raise InteropError(f"{self.path}: MXFP4 tensors not in the published layout (uint8 blocks [E, rows, "
                               f"groups, 16], uint8 scales [E, rows, groups]): {names_line(bad)}")

    @property
    def owner(self):  # a sharded reader's files (interop.pretrained.weight_files hashes them)
        return getattr(self.reader, "owner", None)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.packed:
            return self.reader.read(name)
        blocks, scales = (self.reader.read(n) for n in self.packed[name])
        return dequantize(blocks, scales, self.dtype)

    def close(self) -> None:
        self.reader.close()
