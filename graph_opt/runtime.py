"""Inference engines over one interface: msllm Cells, MindIR GraphCells, onnxruntime sessions.

Every engine answers three calls on integer ids [batch, seq] and returns fp32 numpy logits:
  logits(ids)                 the `model` graph, input_ids -> logits
  prefill(ids)                -> (logits, cache)
  decode(ids, cache)          -> (logits, cache grown by seq positions)
The cache is the engine's own (keys, values) pair, passed back unchanged. Graphs are loaded
on first use, so generation never loads the `model` graph.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mindspore as ms
import numpy as np

from msllm.errors import UserError

MANIFEST = "export.json"
ENGINES = {"msllm": None, "mindir": "mindir", "onnxruntime": "onnx"}  # engine -> export format it runs


class ExportError(UserError, RuntimeError):
    """A bad export request or a failed verification. str() is the one-line message."""


class Engine:
    def __init__(self, loaders: dict[str, Callable]):
        self.loaders, self.graphs = loaders, {}

    def graph(self, kind: str):
        if kind not in self.graphs:
            self.graphs[kind] = self.loaders[kind]()
        return self.graphs[kind]

    def run(self, kind: str, ids: np.ndarray, *cache) -> tuple:
        raise NotImplementedError

    def logits(self, ids):
        return self.run("model", ids)[0]

    def prefill(self, ids):
        logits, *cache = self.run("prefill", ids)
        return logits, cache

    def decode(self, ids, cache):
        logits, *cache = self.run("decode", ids, *cache)
        return logits, cache


class MindSporeEngine(Engine):
    """Cells or GraphCells; input_ids int32, cache kept as MindSpore tensors."""

    def run(self, kind, ids, *cache):
        out = self.graph(kind)(ms.Tensor(np.asarray(ids, np.int32)), *cache)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return (out[0].asnumpy(), *out[1:])


class OnnxEngine(Engine):
    """onnxruntime sessions; input_ids int64, cache kept as numpy arrays."""

    def run(self, kind, ids, *cache):
        feeds = {"input_ids": np.asarray(ids, np.int64)}
        if cache:
            feeds["past_keys"], feeds["past_values"] = cache
        return tuple(self.graph(kind).run(None, feeds))


def cell_engine(model) -> MindSporeEngine:
    """The `msllm` engine: the trained model's own Cells, in whatever mode the process runs.
    Prefill and decode declare dynamic inputs, so in GRAPH_MODE each compiles once, not per length."""
    from msllm.models.kv_cache import Decode, Prefill

    cfg = model.cfg
    ids = ms.Tensor(shape=[None, None], dtype=ms.int32)
    cache = ms.Tensor(shape=[cfg.num_layers, None, cfg.num_kv_heads, None, cfg.head_dim],
                      dtype=model.compute_dtype)
    prefill, decode = Prefill(model), Decode(model)
    prefill.set_inputs(ids)
    decode.set_inputs(ids, cache, cache)
    return MindSporeEngine({"model": lambda: model, "prefill": lambda: prefill, "decode": lambda: decode})


def read_manifest(export_dir: Path) -> dict:
    path = Path(export_dir) / MANIFEST
    if not path.exists():
        raise ExportError(f"{export_dir}: not an msllm export (no {MANIFEST}); make one with msllm export")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ExportError(f"{path}: unreadable ({e})") from None


def export_engine(export_dir: Path, manifest: dict) -> Engine:
    """A MindIR or onnxruntime engine over the graph files of an export dir."""
    files = {kind: str(Path(export_dir) / name) for kind, name in manifest["files"].items()}
    if manifest["format"] == "mindir":
        return MindSporeEngine({kind: (lambda f=f: _load(f, lambda: ms.nn.GraphCell(ms.load(f))))
                                for kind, f in files.items()})
    import onnxruntime as ort

    def session(f):
        return ort.InferenceSession(f, providers=["CPUExecutionProvider"])

    return OnnxEngine({kind: (lambda f=f: _load(f, lambda: session(f))) for kind, f in files.items()})


def _load(path: str, load: Callable):
    """One graph file; a missing, truncated or corrupt file is one line naming it."""
    try:
        return load()
    except Exception as e:  # onnxruntime and MindSpore raise their own types (InvalidProtobuf, RuntimeError)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        raise ExportError(f"{path}: cannot load this graph ({reason}); export the run again") from None
