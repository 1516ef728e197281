"""Grouped-query attention (MHA, GQA, MQA): the mixer of every family but DeepSeek's.

q/k/v projections (optional biases), optional q/k norms (per head, or over the whole projection),
RoPE (whole or partial), the shared attention core (with a sink logit per head, optionally), an
optional sigmoid output gate (Qwen3.5's gated attention) and the cache write; its cache holds each KV
head's keys and values.
"""
from __future__ import annotations

from mindspore import nn, ops

from msllm.config import ModelConfig
from msllm.models.layers import (Attend, AttentionCore, CacheWrite, HeadNorm, Linear, OwnKeys, Projections, RMSNorm,
                                 Rope, SinkAttentionCore)


def qk_norm(cfg: ModelConfig, width: int):
    """The norm of a q or k projection of `width` features: per head (HeadNorm), over all of them, or none."""
    if not cfg.qk_norm:
        return nn.Identity()
    if cfg.qk_norm_scope == "projection":
        return RMSNorm(width, cfg.norm_eps, cfg.norm_offset)
    return HeadNorm(cfg.head_size, cfg.norm_eps, cfg.norm_offset)


class Attention(nn.Cell):
    """x [b*s, h] -> (out [b*s, h], keys, values [b, nkv, t, d]).

    cache_k / cache_v [b, nkv, t, d]: a preallocated cache, into which `cache_write` puts the new
    keys and values (`write`: see CacheWrite). Without a cache t = s, the whole sequence (`whole_kv`
    joins the other ranks' keys under context parallel). The length of x's sequence comes from the rope table.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.wq = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.wk = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.wv = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        # Gated attention: each head's output feature x sigmoid(its gate), a projection of x like wq's
        self.wg = Linear(h, cfg.num_heads * d) if cfg.attn_output_gate else None
        self.wo = Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.project = Projections()  # q, k, v (and the gate) of x
        self.q_norm = qk_norm(cfg, cfg.num_heads * d)
        self.k_norm = qk_norm(cfg, cfg.num_kv_heads * d)
        self.rope = Rope(d, cfg.rope_dim)
        self.whole_kv = OwnKeys()  # context parallel: the other ranks' keys and values joined in
        self.cache_write = CacheWrite()
        self.core = (SinkAttentionCore if cfg.attention_sinks else AttentionCore)(cfg.num_heads, cfg.num_kv_heads, d,
                                                                                  cfg.attn_scale)
        self.attend = Attend(cfg.num_heads, cfg.num_kv_heads, d)  # rope, cache write and core of the projections

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        if self.wg is None:
            q, k, v = self.project(x, (self.wq, self.wk, self.wv))
        else:
            q, k, v, gate = self.project(x, (self.wq, self.wk, self.wv, self.wg))
        out, k, v = self.attend((self.rope, self.whole_kv, self.cache_write, self.core), self.q_norm(q), self.k_norm(k),
                                v, cos, sin, mask, cache_k, cache_v, write)
        out = out.transpose(0, 2, 1, 3).reshape(-1, self.num_heads * self.head_dim)
        if self.wg is not None:
            out = out * ops.sigmoid(gate)
        return self.wo(out), k, v

