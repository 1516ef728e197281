"""The engine interface generation drives, over any runtime: msllm Cells (msllm.inference),
MindIR GraphCells and onnxruntime sessions (graph_opt.runtime). No MindSpore here, so an
onnxruntime engine runs without it.

An engine answers two calls on integer arrays and returns fp32 numpy logits:
  run("model", ids)                              input_ids [b, s] -> logits [b, s, vocab]
  run("prefill" | "decode", ids, *caches, start, pad) -> (logits [b, vocab], *caches)
(caches: ModelConfig.caches, two per kind of layer: keys and values, a sliding layers' ring of its window's
last slots, a hybrid's recurrent states and conv windows)
and `Engine.start` / `Engine.step` drive them for generation: prompts of any lengths are
left-padded to a bucketed length, and the cache length is bucketed too, so a handful of shapes
cover every request. Graphs are loaded on first use, and kinds served by one graph share it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

# Prompt and cache lengths are rounded up to a power of two from these: few distinct shapes
# (each compiled once), at most twice the work of the exact length.
PROMPT_BUCKET, CACHE_BUCKET = 16, 64


def bucket(n: int, smallest: int) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


class Engine:
    """Graph loaders by kind ("model", "prefill", "decode"); kinds given the same loader share
    what it loads. `run` is the runtime's own call. tokens_per_call: the tokens per row the prefill graph
    takes in one call when it is fixed (a hybrid's MindIR: 1), so a prompt is fed in pieces of it; 0: any."""

    def __init__(self, loaders: dict[str, Callable], cfg, cache_dtype=np.float32, tokens_per_call: int = 0):
        self.loaders, self.graphs, self.cfg, self.cache_dtype = loaders, {}, cfg, cache_dtype
        self.tokens_per_call = tokens_per_call

    def graph(self, kind: str):
        load = self.loaders[kind]
        if load not in self.graphs:
            self.graphs[load] = load()
        return self.graphs[load]

    def run(self, kind: str, ids: np.ndarray, *cache) -> tuple:
        raise NotImplementedError

    def logits(self, ids):
        return self.run("model", ids)[0]

    def start(self, prompts: list[list[int]], max_new: int) -> np.ndarray:
        """Prefill a batch of prompts (lengths may differ) with room for max_new tokens after the
        longest; logits [b, vocab] of each prompt's last token. A prompt given more than once (a GRPO
        group's rows) is prefilled once and its caches copied to each of its rows: a row's prefill does
        not depend on the rows beside it."""
        self.graph("decode")  # a graph that cannot load fails before the first token, not after it
        longest = max(len(p) for p in prompts)
        if longest + max_new > self.cfg.max_seq_len:
            raise ValueError(f"{longest} + {max_new} tokens exceed the context of {self.cfg.max_seq_len}")
        distinct = {tuple(p): None for p in prompts}
        if len(distinct) == len(prompts):
            return self.prefill(prompts, max_new)
        rows = {p: i for i, p in enumerate(distinct)}
        rows = np.array([rows[tuple(p)] for p in prompts])
        logits = self.prefill([list(p) for p in distinct], max_new)
        self.cache = self.take_rows(self.cache, rows)
        self.pad = self.pad[rows]
        return logits[rows]

    def take_rows(self, caches: list, rows: np.ndarray) -> list:
        """caches [layers, b, ..] -> their batch rows `rows` (a row may repeat), gathered on the host; an engine
        whose runtime keeps the caches on its device gathers them there."""
        return [np.take(c.asnumpy() if hasattr(c, "asnumpy") else c, rows, axis=1) for c in caches]

    def prefill(self, prompts: list[list[int]], max_new: int) -> np.ndarray:
        """start's prefill of every row as given."""
        longest = max(len(p) for p in prompts)
        width = bucket(longest, PROMPT_BUCKET)
        ids = np.zeros((len(prompts), width), np.int64)
        self.pad = np.array([width - len(p) for p in prompts], np.int64)  # left padding: last tokens line up
        for row, p in enumerate(prompts):
            ids[row, self.pad[row]:] = p
        cfg = self.cfg
        caches = [np.zeros(shape, self.cache_dtype)
                  for shape in cfg.cache_shapes(len(prompts), bucket(width + max_new, CACHE_BUCKET))]
        piece = self.tokens_per_call or width
        for at in range(0, width, piece):  # at once, or piece by piece into the cache
            logits, *caches = self.run("prefill", ids[:, at:at + piece], *caches, np.array([at], np.int64), self.pad)
        self.cache, self.next_slot = caches, width
        return logits

    def step(self, tokens: list[int]) -> np.ndarray:
        """One new token per row; logits [b, vocab] at its position."""
        ids = np.array(tokens, np.int64)[:, None]
        logits, *self.cache = self.run("decode", ids, *self.cache, np.array([self.next_slot], np.int64), self.pad)
        self.next_slot += 1
        return logits
