"""Multi-head latent attention (DeepSeek-V2/V3), the mixer a layer takes when the spec says
`attention: mla`.

Each token's keys and values come from one latent of kv_lora_rank features (wkv_a, normed), which
wkv_b expands per head into the key's "nope" part and the value; the key's RoPE part
(qk_rope_head_dim) is computed once per token and shared by every head. Queries have the same two
parts, through a normed low-rank bottleneck (wq_a, q_norm, wq_b) or one projection (wq). Scores are
over the nope + rope features, so q/k heads and value heads differ in size. The cache holds what a
token contributes, the latent and the rotated RoPE key, and is expanded to heads when read.

Names follow torchtitan's DeepSeek-V3: attention.wq_a, q_norm, wq_b (or wq), wkv_a, kv_norm, wkv_b, wo.
"""
from __future__ import annotations

from mindspore import nn, ops

from msllm.config import ModelConfig
from msllm.models.layers import AttentionCore, CacheWrite, Linear, OwnKeys, RMSNorm, Rope, split_heads

# transformers builds DeepSeek's q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not
# the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class Deinterleave(nn.Cell):
    """[.., n, d] rotary features stored as neighbour pairs (x0, x1), (x2, x3), .. -> evens then odds,
    the halves rotate-half RoPE rotates: transformers' rope_interleave, as a reshape and transpose
    (q and k are permuted alike, so the scores are unchanged)."""

    def construct(self, x):
        shape = x.shape
        return x.reshape(shape[:-1] + (shape[-1] // 2, 2)).swapaxes(-1, -2).reshape(shape)


class MLA(nn.Cell):
    """x [b*s, h] -> (out [b*s, h], latents [b, 1, t, kv_lora_rank], rope keys [b, 1, t, qk_rope_head_dim]).

    The latents and rope keys are what the cache holds (cache_k, cache_v, written as Attention
    writes its keys and values: CacheWrite). cos/sin are the rope tables of qk_rope_head_dim features."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.head_dim = n, cfg.head_size
        self.nope, self.rope_dim, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                           cfg.v_head_dim, cfg.kv_lora_rank)
        self.low_rank_q = cfg.q_lora_rank > 0
        if self.low_rank_q:
            self.wq_a = Linear(h, cfg.q_lora_rank)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = Linear(cfg.q_lora_rank, n * self.head_dim)
        else:
            self.wq = Linear(h, n * self.head_dim)
        self.wkv_a = Linear(h, self.rank + self.rope_dim)
        self.kv_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(self.rank, n * (self.nope + self.v_dim))
        self.wo = Linear(n * self.v_dim, h)
        self.rope_order = Deinterleave() if cfg.rope_interleave else nn.Identity()
        self.rope = Rope(self.rope_dim)
        self.whole_kv = OwnKeys()  # context parallel: the other ranks' latents joined in
        self.cache_write = CacheWrite()
        self.core = AttentionCore(n, n, self.head_dim, cfg.attn_scale)  # scale 1/sqrt(nope + rope)

    def query(self, x):
        if self.low_rank_q:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        n, s = self.num_heads, cos.shape[-2]
        q = self.query(x).reshape(-1, n, self.head_dim)
        q_nope = split_heads(q[:, :, :self.nope].reshape(-1, n * self.nope), self.nope, s)      # [b, n, s, nope]
        q_rot = self.rope(self.rope_order(q[:, :, self.nope:]).reshape(-1, n * self.rope_dim), cos, sin)
        kv = self.wkv_a(x)
        latent = split_heads(self.kv_norm(kv[:, :self.rank]), self.rank, s)                     # [b, 1, s, rank]
        if cos.ndim == 4 and cos.shape[1] > 1:  # tables broadcast to the query heads: the key has one
            cos, sin = cos[:, :1], sin[:, :1]
        k_rot = self.rope(self.rope_order(kv[:, self.rank:]), cos, sin)                          # [b, 1, s, rope]
        latent, k_rot = self.whole_kv(latent, k_rot)
        if cache_k is not None:  # written at the slots of the new tokens; the other slots kept
            latent, k_rot = self.cache_write(latent, k_rot, cache_k, cache_v, write)
        b, t = latent.shape[0], latent.shape[2]
        kv = split_heads(self.wkv_b(latent.reshape(-1, self.rank)), self.nope + self.v_dim, t)  # [b, n, t, nope + v]
        k = ops.concat((kv[..., :self.nope], ops.broadcast_to(k_rot, (b, n, t, self.rope_dim))), -1)
        v = kv[..., self.nope:]
        out = self.core(ops.concat((q_nope, q_rot), -1), k, v, mask)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(-1, n * self.v_dim)), latent, k_rot
