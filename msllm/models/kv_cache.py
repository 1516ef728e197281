"""Incremental decoding for a trained Llama: a prefill Cell and a decode Cell with a KV cache.

Both Cells hold the trained `Llama` and call its own sub-Cells (norms, projections,
attention core, feed-forward) and its rope / mask tables, so they compute with exactly the
trained parameters under the same names and export to MindIR the way the model does.

The cache is two tensors, keys and values, each [layers, batch, kv_heads, length, head_dim],
in the model's compute dtype.
Decode appends the new positions with a concat, so the cache length is a dynamic dimension
instead of a preallocated maximum; it must stay <= max_seq_len (the rope table's length).
"""
from __future__ import annotations

from mindspore import nn, ops

from msllm.models.llama import Llama


def block_with_cache(block, x, cos, sin, mask, past_k=None, past_v=None):
    """Block.construct that also returns this layer's keys/values, with the past ones prepended."""
    attn = block.attention
    q, k, v = attn.qkv(block.attention_norm(x), cos, sin)
    if past_k is not None:
        k = ops.concat((past_k, k), 2)
        v = ops.concat((past_v, v), 2)
    x = x + attn.attend(q, k, v, mask, x.shape)
    return x + block.feed_forward(block.ffn_norm(x)), k, v


class Prefill(nn.Cell):
    """input_ids [b, s] -> (logits [b, s, vocab] fp32, keys, values [layers, b, kv_heads, s, head_dim])."""

    def __init__(self, model: Llama):
        super().__init__(auto_prefix=False)  # keep the trained parameter names
        self.model = model

    def construct(self, input_ids):
        m = self.model
        s = input_ids.shape[1]
        cos, sin = m.rope_at(0, s)
        mask = m.causal_mask[:s, :s]
        h = m.embed(input_ids)
        keys, values = (), ()
        for layer in m.layers:
            h, k, v = block_with_cache(layer, h, cos, sin, mask)
            keys += (k,)
            values += (v,)
        return m.logits(h), ops.stack(keys), ops.stack(values)


class Decode(nn.Cell):
    """(input_ids [b, s], keys, values [layers, b, kv_heads, t, head_dim]) -> (logits [b, s, vocab],
    keys, values with t + s positions). The s new tokens sit at positions t .. t+s-1; generation uses s = 1."""

    def __init__(self, model: Llama):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, keys, values):
        m = self.model
        s, t = input_ids.shape[1], keys.shape[3]
        cos, sin = m.rope_at(t, t + s)
        mask = m.causal_mask[t:t + s, :t + s]  # rows of the full causal mask for the new positions
        h = m.embed(input_ids)
        new_keys, new_values = (), ()
        for i, layer in enumerate(m.layers):
            h, k, v = block_with_cache(layer, h, cos, sin, mask, keys[i], values[i])
            new_keys += (k,)
            new_values += (v,)
        return m.logits(h), ops.stack(new_keys), ops.stack(new_values)
