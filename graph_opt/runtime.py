"""Engines over exported graphs (MindIR GraphCells, onnxruntime sessions), with the interface of
msllm.engine.Engine; and loading any engine by name for `msllm generate`. The onnxruntime engine
never imports MindSpore (its import alone is ~0.4 GB and ~2 s).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import numpy as np

from graph_opt import ExportError
from graph_opt.manifest import MANIFEST, check_sizes, read_manifest
from msllm.engine import Engine

ENGINES = {"msllm": None, "mindir": "mindir", "onnxruntime": "onnx"}  # engine -> export format it runs
MINDSPORE_ENGINES = ("msllm", "mindir")


class OnnxEngine(Engine):
    """onnxruntime sessions; input_ids int64, cache kept as numpy arrays."""

    def run(self, kind, ids, *cache):
        feeds = {"input_ids": np.asarray(ids, np.int64)}
        if cache:  # the caches (ModelConfig.caches), start, pad
            names = [f"past_{name}" for name in self.cfg.cache_names()]
            feeds.update(zip(names + ["start", "pad"], cache))
        return tuple(self.graph(kind).run(None, feeds))


def export_engine(export_dir: Path, manifest: dict) -> Engine:
    """A MindIR or onnxruntime engine over the graph files of an export dir. Kinds served by the
    same file (prefill and decode) share one loaded graph."""
    from msllm.config_file import config_from_dict

    check_sizes(export_dir, manifest)
    files = {kind: str(Path(export_dir) / name) for kind, name in manifest["files"].items()}
    cfg = config_from_dict(manifest["config"], str(Path(export_dir) / MANIFEST)).model
    # exports written before sliding layers kept a ring name no caches: keys, values (a hybrid's states, windows)
    made_with = manifest.get("caches") or ["keys", "values"] + (["states", "windows"] if cfg.hybrid else [])
    if made_with != list(cfg.cache_names()):
        raise ExportError(f"{export_dir}: its cached graph takes the caches {', '.join(made_with)}, this msllm gives "
                          f"{', '.join(cfg.cache_names())} (sliding layers keep a ring); export the run again")
    cache_dtype = np.float16 if manifest["dtype"] == "fp16" else np.float32
    if manifest["format"] == "mindir":
        import mindspore as ms

        from msllm.inference import MindSporeEngine

        engine, open_graph = MindSporeEngine, lambda f: ms.nn.GraphCell(ms.load(f))
    else:
        import onnxruntime as ort

        engine, open_graph = OnnxEngine, lambda f: ort.InferenceSession(f, providers=["CPUExecutionProvider"])
    loaders = {f: functools.partial(_load, f, open_graph) for f in set(files.values())}
    return engine({kind: loaders[f] for kind, f in files.items()}, cfg, cache_dtype, manifest.get("tokens_per_call", 0))


def _load(path: str, open_graph: Callable):
    """One graph file; a missing, truncated or corrupt file is one line naming it."""
    try:
        return open_graph(path)
    except Exception as e:  # onnxruntime and MindSpore raise their own types (InvalidProtobuf, RuntimeError)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        raise ExportError(f"{path}: cannot load this graph ({reason}); export the run again") from None


def load_engine(engine: str, path: str | Path):
    """(engine, model config, tokenizer, text conventions): `msllm` reads a run/checkpoint dir,
    mindir/onnxruntime an export dir."""
    from msllm import chat
    from msllm.config_file import config_from_dict
    from msllm.data.tokenizer import load_tokenizer

    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "msllm":
        from msllm.backends import specialise
        from msllm.checkpoint import load_run
        from msllm.inference import cell_engine

        cfg, model, tokenizer, conventions = load_run(path)
        specialise(model, cfg, training=False)
        return cell_engine(model), cfg.model, tokenizer, conventions
    manifest = read_manifest(Path(path))
    if manifest["format"] != ENGINES[engine]:
        raise ExportError(f"{path}: is a {manifest['format']} export; --engine {engine} runs "
                          f"{ENGINES[engine]} exports")
    tokenizer = Path(path) / "tokenizer.json"
    if not tokenizer.exists():
        raise ExportError(f"{path}: export has no tokenizer.json (its run had none)")
    cfg = config_from_dict(manifest["config"], str(Path(path) / "export.json"))
    tokenizer = load_tokenizer(tokenizer)
    conventions = (chat.TextConventions(**manifest["text"]) if "text" in manifest  # older exports: <|endoftext|>
                   else chat.read(Path(path), None, tokenizer))
    return export_engine(Path(path), manifest), cfg.model, tokenizer, conventions
