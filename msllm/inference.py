"""The cached forward every engine runs, and the `msllm` engine over the model's own Cells.

`CachedForward` is the model's own forward with a preallocated KV cache: prefill (the padded
prompts at slot 0) and decode (one token per row at the next slot) are the same Cell with fixed
shapes, so in GRAPH_MODE each compiles once per shape and the cache never grows. Export writes
the same Cell (graph_opt/export.py). The engine interface is msllm.engine.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn

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


def cell_engine(model: Decoder) -> MindSporeEngine:
    """The `msllm` engine: the model's own Cells, in whatever mode the process runs. Prefill and
    decode are one CachedForward; in GRAPH_MODE it compiles once per (batch, prompt bucket,
    cache bucket) shape."""
    cached = CachedForward(model)
    return MindSporeEngine({"model": lambda: model, "prefill": lambda: cached, "decode": lambda: cached}, model.cfg,
                           ms.dtype_to_nptype(model.compute_dtype))
