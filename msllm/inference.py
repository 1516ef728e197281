"""Inference entry points over the model's own forward, and the engine interface generation uses.

Prefill and Decode are the model's forward with the KV cache turned on; export writes the same
Cells (graph_opt/export.py). Every engine (these Cells, a MindIR file, an onnxruntime session)
answers three calls on integer ids [batch, seq] and returns fp32 numpy logits:
  logits(ids)                 input_ids -> logits
  prefill(ids)                -> (logits, cache)
  decode(ids, cache)          -> (logits, cache grown by seq positions)
The cache is the engine's own (keys, values) pair, passed back unchanged. Graphs are built on
first use, so generation never compiles the plain `model` graph.
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import nn

from msllm.models.llama import Llama


class Prefill(nn.Cell):
    """input_ids [b, s] -> (logits [b, s, vocab] fp32, keys, values [layers, b, kv_heads, s, head_dim])."""

    def __init__(self, model: Llama):
        super().__init__(auto_prefix=False)  # keep the trained parameter names
        self.model = model

    def construct(self, input_ids):
        return self.model(input_ids, None, None, True)


class Decode(nn.Cell):
    """(input_ids [b, s], keys, values [layers, b, kv_heads, t, head_dim]) -> (logits, keys, values
    with t + s positions). The s new tokens sit at positions t .. t+s-1; generation uses s = 1."""

    def __init__(self, model: Llama):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, keys, values):
        return self.model(input_ids, keys, values, True)


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

    def start(self, prompts: list[list[int]], max_new: int) -> np.ndarray:
        """Prefill a batch of prompts; logits [b, vocab] of each one's last position."""
        self.graph("decode")  # a graph that cannot load fails before the first token, not after it
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("prompts of different lengths need a padding mask")
        logits, self.cache = self.prefill(np.array(prompts))
        return logits[:, -1]

    def step(self, tokens: list[int]) -> np.ndarray:
        """One new token per row; logits [b, vocab] at its position."""
        logits, self.cache = self.decode(np.array(tokens)[:, None], self.cache)
        return logits[:, -1]


class MindSporeEngine(Engine):
    """Cells or GraphCells; input_ids int32, cache kept as MindSpore tensors."""

    def run(self, kind, ids, *cache):
        out = self.graph(kind)(ms.Tensor(np.asarray(ids, np.int32)), *cache)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return (out[0].asnumpy(), *out[1:])


def cell_engine(model: Llama) -> MindSporeEngine:
    """The `msllm` engine: the model's own Cells, in whatever mode the process runs. Prefill and
    decode declare dynamic inputs, so in GRAPH_MODE each compiles once, not per length."""
    cfg = model.cfg
    ids = ms.Tensor(shape=[None, None], dtype=ms.int32)
    cache = ms.Tensor(shape=[cfg.num_layers, None, cfg.num_kv_heads, None, cfg.head_dim], dtype=model.compute_dtype)
    prefill, decode = Prefill(model), Decode(model)
    prefill.set_inputs(ids)
    decode.set_inputs(ids, cache, cache)
    return MindSporeEngine({"model": lambda: model, "prefill": lambda: prefill, "decode": lambda: decode})
