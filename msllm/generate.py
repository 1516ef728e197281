"""Sampling from a trained run: greedy or top-k, recomputing the prefix each token.

(The KV-cache path for deployment lives with export; this is the sanity check.)
"""
from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np

from msllm import checkpoint
from msllm.config import config_from_dict
from msllm.data.tokenizer import load_tokenizer
from msllm.models.llama import Llama


def load_run(ckpt: str | Path):
    """(config, model, tokenizer) from a run dir or a checkpoint dir; tokenizer None if it has none."""
    path = checkpoint.latest(Path(ckpt))
    state = checkpoint.read_state(path)
    cfg = config_from_dict(state["config"], str(path / checkpoint.STATE_FILE))
    model = Llama(cfg.model)
    checkpoint.load_into(model.trainable_params(), checkpoint.load_arrays(path / checkpoint.MODEL_FILE), str(path))
    model.set_train(False)
    # Training records an absolute path, conversion a name inside the checkpoint dir, or None.
    tok_path = path / state["tokenizer"] if state.get("tokenizer") else None
    if tok_path is None or not tok_path.exists():  # run dir moved: fall back to its own copy
        tok_path = path.parent.parent / "data" / "tokenizer.json"
    return cfg, model, load_tokenizer(tok_path) if tok_path.exists() else None


def generate_ids(model, ids: list[int], max_new: int, top_k: int = 0, temperature: float = 1.0,
                 seed: int = 0, max_len: int | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    ids = list(ids)
    for _ in range(max_new):
        window = ids[-max_len:] if max_len else ids
        logits = model(ms.Tensor(np.array([window], np.int32))).asnumpy()[0, -1]
        if top_k <= 0:
            ids.append(int(np.argmax(logits)))
            continue
        top = np.argpartition(-logits, top_k - 1)[:top_k]
        z = logits[top] / max(temperature, 1e-6)
        p = np.exp(z - z.max())
        ids.append(int(rng.choice(top, p=p / p.sum())))
    return ids


def generate_text(model, tokenizer, prompt: str, max_new: int, top_k: int = 0, temperature: float = 1.0,
                  seed: int = 0, max_len: int | None = None) -> str:
    ids = tokenizer.encode(prompt).ids or [0]
    out = generate_ids(model, ids, max_new, top_k, temperature, seed, max_len)
    return tokenizer.decode(out)
