"""Sampling: greedy or top-k, with a KV cache on any engine (msllm Cells, MindIR, onnxruntime).

`generate_ids` recomputes the whole prefix every token with the training model; it is the
reference the cached path (`generate_cached`) must reproduce token for token.
"""
from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np

from msllm import checkpoint
from msllm.config import config_from_dict
from msllm.data.tokenizer import load_tokenizer
from msllm.models.llama import Llama


def find_tokenizer(ckpt_dir: Path, state: dict) -> Path | None:
    """The checkpoint's tokenizer.json, or None if it has none.

    Training records an absolute path, conversion a name inside the checkpoint dir; when a
    run dir was moved, its own copy under data/ is used.
    """
    ckpt_dir = Path(ckpt_dir)
    for candidate in (ckpt_dir / state["tokenizer"] if state.get("tokenizer") else None,
                      ckpt_dir.parent.parent / "data" / "tokenizer.json"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def load_model(ckpt: str | Path):
    """(config, eval-mode model, checkpoint dir, train state) from a run dir or a checkpoint dir."""
    path = checkpoint.latest(Path(ckpt))
    state = checkpoint.read_state(path)
    cfg = config_from_dict(state["config"], str(path / checkpoint.STATE_FILE))
    model = Llama(cfg.model)
    checkpoint.load_into(model.trainable_params(), checkpoint.load_arrays(path / checkpoint.MODEL_FILE), str(path))
    model.set_train(False)
    return cfg, model, path, state


def load_run(ckpt: str | Path):
    """(config, model, tokenizer) from a run dir or a checkpoint dir."""
    cfg, model, path, state = load_model(ckpt)
    tokenizer = find_tokenizer(path, state)
    if tokenizer is None:
        raise checkpoint.CheckpointError(f"{path}: no tokenizer.json (state.json 'tokenizer'); put the model's "
                                         f"tokenizer.json in the checkpoint dir to generate text")
    return cfg, model, load_tokenizer(tokenizer)


def load_engine(engine: str, path: str | Path):
    """(engine, model config, tokenizer): `msllm` reads a run/checkpoint dir, mindir/onnxruntime an export dir."""
    from graph_opt.runtime import ENGINES, ExportError, cell_engine, export_engine, read_manifest

    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "msllm":
        cfg, model, tokenizer = load_run(path)
        return cell_engine(model), cfg.model, tokenizer
    manifest = read_manifest(Path(path))
    if manifest["format"] != ENGINES[engine]:
        raise ExportError(f"{path}: is a {manifest['format']} export; --engine {engine} runs "
                          f"{ENGINES[engine]} exports")
    tokenizer = Path(path) / "tokenizer.json"
    if not tokenizer.exists():
        raise ExportError(f"{path}: export has no tokenizer.json (its run had none)")
    cfg = config_from_dict(manifest["config"], str(Path(path) / "export.json"))
    return export_engine(Path(path), manifest), cfg.model, load_tokenizer(tokenizer)


def pick_next(logits: np.ndarray, top_k: int, temperature: float, rng: np.random.Generator) -> int:
    """Greedy (top_k <= 0) or a temperature sample from the top_k logits of one position."""
    if top_k <= 0:
        return int(np.argmax(logits))
    top = np.argpartition(-logits, top_k - 1)[:top_k]
    z = logits[top] / max(temperature, 1e-6)
    p = np.exp(z - z.max())
    return int(rng.choice(top, p=p / p.sum()))


def generate_ids(model, ids: list[int], max_new: int, top_k: int = 0, temperature: float = 1.0,
                 seed: int = 0, max_len: int | None = None) -> list[int]:
    """Full recompute of the last max_len tokens for every new token."""
    rng = np.random.default_rng(seed)
    ids = list(ids)
    for _ in range(max_new):
        window = ids[-max_len:] if max_len else ids
        logits = model(ms.Tensor(np.array([window], np.int32))).asnumpy()[0, -1]
        ids.append(pick_next(logits, top_k, temperature, rng))
    return ids


def generate_cached(engine, ids: list[int], max_new: int, top_k: int = 0, temperature: float = 1.0,
                    seed: int = 0, max_len: int = 256) -> list[int]:
    """Prefill the prompt, then one decode step per token. A full cache (max_len positions) is
    replaced by a prefill of the last max_len tokens: the window full recompute would see."""
    rng = np.random.default_rng(seed)
    ids = list(ids)
    logits, cache = engine.prefill(np.array([ids[-max_len:]]))
    cached = min(len(ids), max_len)
    for step in range(max_new):
        ids.append(pick_next(logits[0, -1], top_k, temperature, rng))
        if step == max_new - 1:
            break
        if cached < max_len:
            logits, cache = engine.decode(np.array([ids[-1:]]), cache)
            cached += 1
        else:
            logits, cache = engine.prefill(np.array([ids[-max_len:]]))
    return ids


def generate_text(engine, tokenizer, prompt: str, max_new: int, top_k: int = 0, temperature: float = 1.0,
                  seed: int = 0, max_len: int = 256) -> str:
    ids = tokenizer.encode(prompt).ids or [0]
    return tokenizer.decode(generate_cached(engine, ids, max_new, top_k, temperature, seed, max_len))
