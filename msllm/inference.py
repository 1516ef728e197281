"""The cached forwards every engine runs, and the `msllm` engine over the model's own Cells.

`CachedForward` is the model's own forward with a preallocated KV cache: prefill (the padded
prompts at slot 0) and decode (one token per row at the next slot) are the same Cell with fixed
shapes, so in GRAPH_MODE each compiles once per shape and the cache never grows. Its caches are
inputs and outputs, as export writes it (graph_opt/export.py). `CachedInPlace` is the same forward
with the caches kept in the Cell and written in place, which the `msllm` engine runs: a step then
moves the new tokens' entries instead of copying every cache in and out. The engine interface is
msllm.engine.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, nn, ops

from msllm import kernels
from msllm.engine import Engine
from msllm.models.decoder import Decoder


class CachedForward(nn.Cell):
    """(input_ids [b, s], *caches, start [1], pad [b]) -> (logits [b, vocab] of the last token, *caches with the
    slots start .. start+s-1 written): the caches ModelConfig.caches lists, in its order (keys and values
    [layers, b, kv_heads, max_len, head_dim]; a sliding layers' ring; a hybrid's Gated DeltaNet states and
    conv windows)."""

    def __init__(self, model: Decoder):
        super().__init__(auto_prefix=False)  # keep the trained parameter names
        self.model = model

    def construct(self, input_ids, *inputs):
        return self.model(input_ids, inputs[:-2], inputs[-2], inputs[-1])


class LayerCaches:
    """One of ModelConfig.caches held as a Parameter per layer; reads as the stacked cache."""

    def __init__(self, layers: tuple):
        self.layers = layers

    @property
    def shape(self) -> tuple:
        return (len(self.layers),) + tuple(self.layers[0].shape)

    @property
    def dtype(self):
        return self.layers[0].dtype

    def asnumpy(self) -> np.ndarray:
        return np.stack([p.asnumpy() for p in self.layers])

    def load(self, stacked) -> None:
        """stacked: another LayerCaches (its layers' tensors become these Parameters' data: no copy) or the
        stacked cache as a Tensor or an array (the zeros Engine.start allocates)."""
        if isinstance(stacked, LayerCaches):
            for p, value in zip(self.layers, stacked.layers):
                p.set_data(value)
            return
        stacked = stacked.asnumpy() if isinstance(stacked, ms.Tensor) else np.asarray(stacked)
        for p, value in zip(self.layers, stacked):
            p.set_data(ms.Tensor(value.astype(ms.dtype_to_nptype(p.dtype))))


class CachedInPlace(nn.Cell):
    """(input_ids [b, s], start [1], pad [b]) -> logits [b, vocab] of the last token: CachedForward with
    its caches (ModelConfig.caches of `shapes`) kept here, a Parameter per layer and cache (`caches`).
    Given them with the in-place form of `write` (CacheWrite's places), the layers write them: the full
    layers' keys and values (MLA's latents and rope keys) at the new slots, a Gated DeltaNet layer its state
    and conv window. A ring, read and written unrolled, is replaced here by its update."""

    # instances so far: each names its caches apart (every family's engine in one process once compiled a graph
    # with another model's cache shape; with distinct names not seen again, the cause not pinned down)
    made = 0

    def __init__(self, model: Decoder, shapes: tuple, dtype):
        super().__init__(auto_prefix=False)  # keep the trained parameter names
        self.model = model
        self.caches, flat, self.spans = [], [], ()
        CachedInPlace.made += 1
        for name, shape in zip(model.cfg.cache_names(), shapes):
            layers = tuple(Parameter(ms.Tensor(np.zeros(shape[1:], dtype)), name=f"cache{self.made}.{name}.{i}",
                                     requires_grad=False) for i in range(shape[0]))
            self.spans += ((len(flat), len(flat) + len(layers)),)
            self.caches.append(LayerCaches(layers))
            flat += layers
        self.flat = ParameterTuple(flat)
        self.full_heads = shapes[model.full_keys][2] if model.full_keys >= 0 else 0
        kinds = model.cache_kinds
        # each layer's two Parameters in `flat`, and whether its caches are replaced (not written in place)
        self.layer_params = tuple((self.spans[2 * p][0] + slot, self.spans[2 * p + 1][0] + slot)
                                  for p, slot in zip(model.cache_pair, model.cache_slot))
        self.replaced = tuple(kinds[p] == "sliding" for p in model.cache_pair)

    def layers_of(self, cache: int) -> tuple:
        # one by one: a slice of the ParameterTuple compiles to a Stack and an Unstack of the whole cache
        layers = ()
        for j in range(self.spans[cache][0], self.spans[cache][1]):
            layers += (self.flat[j],)
        return layers

    def construct(self, input_ids, start, pad):
        b, s = input_ids.shape
        pairs = ()
        for p in range(len(self.spans) // 2):
            pairs += ((self.layers_of(2 * p), self.layers_of(2 * p + 1)),)
        write = self.model.cache_write_places(b, max(self.full_heads, 1), s, start)  # its form: write in place
        h, written, _ = self.model.decode_cached(input_ids, pairs, start, pad, write)
        last = h if s == 1 else h.reshape(b, s, -1)[:, -1]  # a decode step's rows are its last tokens: no slice kernel
        logits = self.model.logits(last)
        for i in range(len(self.replaced)):
            if self.replaced[i]:
                k, v = self.layer_params[i]
                logits = ops.depend(logits, ops.assign(self.flat[k], written[i][0]))
                logits = ops.depend(logits, ops.assign(self.flat[v], written[i][1]))
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


class InPlaceEngine(MindSporeEngine):
    """The model's own Cells, prefill and decode a CachedInPlace per set of cache shapes (each compiled once in
    GRAPH_MODE). The caches it returns are its CachedInPlace's (LayerCaches): given back, they are used where
    they are; any other caches given (the zeros Engine.start allocates) are loaded into it first."""

    def __init__(self, model: Decoder):
        super().__init__({kind: lambda: model for kind in ("model", "prefill", "decode")}, model.cfg,
                         ms.dtype_to_nptype(model.compute_dtype))
        self.model, self.in_place = model, {}

    def run(self, kind, ids, *cache):
        if kind == "model":
            return super().run(kind, ids)
        *caches, start, pad = cache
        shapes = tuple(tuple(c.shape) for c in caches)
        if shapes not in self.in_place:
            self.in_place[shapes] = CachedInPlace(self.model, shapes, self.cache_dtype)
        cell = self.in_place[shapes]
        if kind == "prefill":  # a generation's start: the weights may have changed since the last one
            kernels.forget_packed_weights()
        for given, held in zip(caches, cell.caches):
            if given is not held:
                held.load(given)
        # MindSpore's "increment" phase runs the graph it compiled first for the phase without re-checking the
        # inputs: safe for decode, whose shapes the caches fix; a prefill's prompt bucket may change
        cell.phase = "increment" if kind == "decode" else "predict"
        logits = cell(*(ms.Tensor(np.asarray(x, np.int32)) for x in (ids, start, pad)))
        return (logits.asnumpy(), *cell.caches)

    def take_rows(self, caches, rows):
        """Each layer's rows gathered by MindSpore where the caches are (not through host numpy arrays)."""
        index = ms.Tensor(rows.astype(np.int32))
        return [LayerCaches(tuple(ops.gather(layer, index, 0) for layer in c.layers)) for c in caches]


def cell_engine(model: Decoder) -> InPlaceEngine:
    """The `msllm` engine: the model's own Cells, in whatever mode the process runs, with the caches written in
    place. In GRAPH_MODE it compiles once per (batch, prompt bucket, cache bucket) shape."""
    return InPlaceEngine(model)
