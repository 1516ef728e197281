"""Checkpoint interop: Hugging Face / PyTorch / MindFormers checkpoints <-> msllm, verified.

maps/         one declarative tensor table per model family (msllm <-> HF <-> MindFormers)
table.py      what a table row means: names, shapes, concat / transpose rules
formats/      streaming readers and writers: safetensors, torch .bin, MindSpore .ckpt
hf_config.py  HF config.json <-> msllm ModelConfig
layouts.py    where each layout keeps its files: open a source, write a destination
convert.py    the one conversion engine, driven by the tables
verify.py     HF torch model vs msllm model on the same tokens, layer by layer
"""

import json
from pathlib import Path

from msllm.errors import UserError


class InteropError(UserError, RuntimeError):
    """A checkpoint that cannot be converted. str() is one line naming the file and tensors."""


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a JSON object")
    return data
