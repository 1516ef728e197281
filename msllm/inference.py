"""The cached forward every engine runs, and the engine interface generation uses.

`CachedForward` is the model's own forward with a preallocated KV cache: prefill (the padded
prompts at slot 0) and decode (one token per row at the next slot) are the same Cell with fixed
shapes, so in GRAPH_MODE each compiles once per shape and the cache never grows. Export writes
the same Cell (graph_opt/export.py). Every engine (these Cells, MindIR files, onnxruntime
sessions) answers two calls on integer arrays and returns fp32 numpy logits:
  run("model", ids)                              input_ids [b, s] -> logits [b, s, vocab]
  run("prefill" | "decode", ids, keys, values, start, pad) -> (logits [b, vocab], keys, values)
and `Engine.start` / `Engine.step` drive them for generation: prompts of any lengths are
left-padded to a bucketed length, and the cache length is bucketed too, so a handful of shapes
cover every request. Graphs are built on first use, so generation never compiles the plain
`model` graph.
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import nn

from msllm.models.llama import Llama

# Prompt and cache lengths are rounded up to a power of two from these: few distinct shapes
# (each compiled once), at most twice the work of the exact length.
PROMPT_BUCKET, CACHE_BUCKET = 16, 64


class CachedForward(nn.Cell):
    """(input_ids [b, s], keys, values [layers, b, kv_heads, max_len, head_dim], start [1], pad [b])
    -> (logits [b, vocab] of the last token, keys, values with slots start .. start+s-1 written)."""

    def __init__(self, model: Llama):
        super().__init__(auto_prefix=False)  # keep the trained parameter names
        self.model = model

    def construct(self, input_ids, keys, values, start, pad):
        return self.model(input_ids, keys, values, start, pad)


def bucket(n: int, smallest: int) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


class Engine:
    """Graph loaders by kind ("model", "prefill", "decode"); `run` is the runtime's own call."""

    def __init__(self, loaders: dict[str, Callable], cfg, cache_dtype=np.float32):
        self.loaders, self.graphs, self.cfg, self.cache_dtype = loaders, {}, cfg, cache_dtype

    def graph(self, kind: str):
        if kind not in self.graphs:
            self.graphs[kind] = self.loaders[kind]()
        return self.graphs[kind]

    def run(self, kind: str, ids: np.ndarray, *cache) -> tuple:
        raise NotImplementedError

    def logits(self, ids):
        return self.run("model", ids)[0]

    def start(self, prompts: list[list[int]], max_new: int) -> np.ndarray:
        """Prefill a batch of prompts (lengths may differ) with room for max_new tokens after the
        longest; logits [b, vocab] of each prompt's last token."""
        self.graph("decode")  # a graph that cannot load fails before the first token, not after it
        longest = max(len(p) for p in prompts)
        if longest + max_new > self.cfg.max_seq_len:
            raise ValueError(f"{longest} + {max_new} tokens exceed the context of {self.cfg.max_seq_len}")
        width = bucket(longest, PROMPT_BUCKET)
        ids = np.zeros((len(prompts), width), np.int64)
        self.pad = np.array([width - len(p) for p in prompts], np.int64)  # left padding: last tokens line up
        for row, p in enumerate(prompts):
            ids[row, self.pad[row]:] = p
        cfg = self.cfg
        shape = (cfg.num_layers, len(prompts), cfg.num_kv_heads, bucket(width + max_new, CACHE_BUCKET), cfg.head_dim)
        cache = np.zeros(shape, self.cache_dtype)
        logits, *self.cache = self.run("prefill", ids, cache, cache, np.zeros(1, np.int64), self.pad)
        self.next_slot = width
        return logits

    def step(self, tokens: list[int]) -> np.ndarray:
        """One new token per row; logits [b, vocab] at its position."""
        ids = np.array(tokens, np.int64)[:, None]
        logits, *self.cache = self.run("decode", ids, *self.cache, np.array([self.next_slot], np.int64), self.pad)
        self.next_slot += 1
        return logits


class MindSporeEngine(Engine):
    """Cells or GraphCells; integer inputs int32, the cache kept as MindSpore tensors between steps."""

    def run(self, kind, ids, *cache):
        inputs = [ms.Tensor(np.asarray(ids, np.int32))]
        for x in cache:
            is_int = isinstance(x, np.ndarray) and x.dtype.kind == "i"
            inputs.append(ms.Tensor(x.astype(np.int32)) if is_int else ms.Tensor(x) if isinstance(x, np.ndarray) else x)
        out = self.graph(kind)(*inputs)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return (out[0].asnumpy(), *out[1:])


def cell_engine(model: Llama) -> MindSporeEngine:
    """The `msllm` engine: the model's own Cells, in whatever mode the process runs. Prefill and
    decode are one CachedForward; in GRAPH_MODE it compiles once per (batch, prompt bucket,
    cache bucket) shape."""
    cached = CachedForward(model)
    return MindSporeEngine({"model": lambda: model, "prefill": lambda: cached, "decode": lambda: cached}, model.cfg,
                           ms.dtype_to_nptype(model.compute_dtype))
