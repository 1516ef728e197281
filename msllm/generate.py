"""Sampling: greedy or top-k, with a KV cache on any engine (msllm Cells, MindIR, onnxruntime).

`generate_ids` recomputes the whole prefix every token with the training model; it is the
reference the cached path (`generate_cached`) must reproduce token for token.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np


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
