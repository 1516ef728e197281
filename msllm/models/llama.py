"""The decoder of every family (Llama 2/3, Mistral, Qwen2/3, Gemma 3, Phi-3) as MindSpore Cells:
plain, device-neutral maths, composed from the family spec in ModelConfig (head_dim, q/k norm,
norm offset, sandwich norms, MLP kind, embedding scale, sliding-window layers and their RoPE base).

Each matmul, the norm core, the rope, the attention softmax and the activation is its own Cell, so
msllm.backends can swap a device formulation in (msllm/backends/cpu.py) or attach a parallel
strategy (msllm/backends/ascend.py) without touching this file. Parameter names follow torchtitan:
tok_embeddings, layers.N.attention.wq, ..., layers.N.feed_forward.w1 (gate) / w2 (down) / w3 (up),
norm, output. Linear weights are [out, in]. The code is shape-agnostic in batch and sequence, so
the same Cells export with dynamic shapes. The KV cache is an optional, preallocated input of the
model's own forward: `model(ids, keys, values, start, pad)` writes the new tokens' keys and values
at slots start.. of the cache and attends to the filled part (litgpt's input_pos, as data). Packed
samples (SFT) are optional inputs too: `model(ids, segments=seg, positions=pos)` keeps attention
inside each sample and restarts its positions.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer  # zeros allocated untouched: set_data replaces them

from msllm.config import ModelConfig, yarn_mscale


def cast(x, dtype):
    """x in dtype, without a Cast node when it already is (decided at compile time)."""
    return x if x.dtype == dtype else x.astype(dtype)


class Linear(nn.Cell):
    """y = x @ W^T (+ b); W is [out, in]. 2-D x goes straight to the matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(initializer("zeros", (out_features, in_features), ms.float32), name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), ms.float32), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        if x.ndim != 2:
            return self.construct(x.reshape(-1, self.in_features)).reshape(x.shape[:-1] + (self.out_features,))
        y = self.matmul(x, cast(self.weight, x.dtype))
        if self.bias is not None:
            y = y + cast(self.bias, y.dtype)
        return y


class Embedding(nn.Cell):
    """Rows of the table by token id. Lookups of `padding_idx` (>= 0) pass no gradient to its row,
    as torch's nn.Embedding(padding_idx) does for the Hugging Face models that set pad_token_id."""

    def __init__(self, vocab_size: int, hidden_size: int, padding_idx: int = -1):
        super().__init__()
        self.weight = Parameter(initializer("zeros", (vocab_size, hidden_size), ms.float32), name="weight")
        self.gather = ops.Gather()
        self.padding_idx = padding_idx

    def construct(self, input_ids):
        out = self.gather(self.weight, input_ids, 0)
        if self.padding_idx >= 0:
            pad = ops.broadcast_to(ops.expand_dims(input_ids == self.padding_idx, -1), out.shape)
            out = ops.select(pad, ops.stop_gradient(out), out)
        return out


class RMSNormCore(nn.Cell):
    """x [N, h] fp32, weight [h] -> x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps

    def construct(self, x, weight):
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps) * weight


class RMSNorm(nn.Cell):
    """Normalises in fp32 whatever the compute dtype, then casts back. The scale is offset + weight
    (Gemma stores w of (1 + w), offset 1; its weights start at 0 so the scale starts at 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.dim, self.eps, self.offset = dim, eps, offset
        self.weight = Parameter(Tensor(np.full((dim,), 1.0 - offset, np.float32)), name="weight")
        self.core = RMSNormCore(dim, eps)

    def scale(self):
        return self.weight + self.offset if self.offset else self.weight

    def construct(self, x):
        if x.ndim == 2:  # the residual stream: no reshapes (with dynamic shapes each is a kernel)
            return cast(self.core(cast(x, ms.float32), self.scale()), x.dtype)
        dtype, shape = x.dtype, x.shape
        x = cast(x, ms.float32).reshape(-1, self.dim)
        return cast(self.core(x, self.scale()).reshape(shape), dtype)


class HeadNorm(RMSNorm):
    """RMSNorm over each head of a projection [rows, n*d] (Qwen3 / Gemma 3 q and k norms).
    `heads_axis`: normalise the [rows, n, d] view instead of [rows*n, d], the same maths, whose heads
    axis a layout cuts as the projection's columns are cut (a device formulation; msllm.backends.ascend)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__(dim, eps, offset)
        self.heads_axis = False

    def construct(self, x):
        shape = x.shape
        if self.heads_axis:
            heads = cast(x, ms.float32).reshape(-1, shape[-1] // self.dim, self.dim)
            return cast(self.core(heads, self.scale()), x.dtype).reshape(shape)
        return super().construct(x.reshape(-1, self.dim)).reshape(shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies in fp32, matching Hugging Face's default / linear / llama3 / yarn rope."""
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))
    inv_freq = inv_freq.astype(np.float32)
    if not scaling:
        return inv_freq
    kind = scaling.get("type", scaling.get("rope_type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters): each frequency is interpolated (divided by factor) or
    kept (extrapolated), by how many turns it makes within the original context: a linear ramp between the
    dims of beta_fast and beta_slow turns, rounded outward unless truncate is false."""
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(turns):
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    extrapolated, interpolated = np.float32(1.0) / pos_freqs, np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: 1, but under YaRN its attention factor (given, or from factor,
    mscale and mscale_all_dim as transformers infers it)."""
    if not scaling or scaling.get("type", scaling.get("rope_type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def attention_kinds(cfg: ModelConfig) -> tuple[list[tuple[int, float, dict | None]], list[int]]:
    """The distinct kinds of attention layer, (window, rope theta, rope scaling) with window 0 for
    full attention, and the kind of each layer. Sliding layers take rope_local_theta unscaled when
    it is set (Gemma 3), the model's RoPE otherwise (Mistral)."""
    full = (0, cfg.rope_theta, cfg.rope_scaling)
    sliding = ((cfg.sliding_window, cfg.rope_local_theta, None) if cfg.rope_local_theta
               else (cfg.sliding_window, cfg.rope_theta, cfg.rope_scaling))
    per_layer = [sliding if kind == "sliding" else full for kind in cfg.layer_kinds()]
    kinds = list(dict.fromkeys((w, t, repr(sc)) for w, t, sc in per_layer))
    by_key = {(w, t, repr(sc)): (w, t, sc) for w, t, sc in per_layer}
    return [by_key[k] for k in kinds], [kinds.index((w, t, repr(sc))) for w, t, sc in per_layer]


def rope_tables(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, head_dim] for RoPE base `theta` (default: the model's, with its scaling):
    the tables of graphs that store them (ONNX); Llama computes its rows from positions."""
    if theta is None:
        theta, scaling = cfg.rope_theta, cfg.rope_scaling
    inv_freq = rope_inv_freq(cfg.rope_dim, theta, scaling)
    freqs = np.outer(np.arange(cfg.max_seq_len, dtype=np.float32), inv_freq).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    factor = np.float32(rope_attention_factor(scaling))
    return (np.cos(emb) * factor).astype(np.float32), (np.sin(emb) * factor).astype(np.float32)


def split_heads(x, head_dim: int, s: int):
    """[b*s, n*d] (or [b, s, n*d]) projection -> [b, n, s, d] heads."""
    return x.reshape(-1, s, x.shape[-1] // head_dim, head_dim).transpose(0, 2, 1, 3)


def rotate_half(x):
    """HF's rotate_half: concat(-x[..., half:], x[..., :half])."""
    half = x.shape[-1] // 2
    return ops.concat((-x[..., half:], x[..., :half]), -1)


def additive(visible):
    """A boolean visibility [.., s, t] as the additive mask: 0 where visible, -1e9 elsewhere."""
    return ops.select(visible, ops.zeros(visible.shape, ms.float32), ops.full(visible.shape, -1e9, dtype=ms.float32))


NO_WINDOW = 2**31 - 1


def visibility(slots, query_segments, key_segments, window):
    """Which keys each query sees, as indices (int32): query slots [s], query segments [s] or [b, s],
    key segments [t] or [b, t] (1-D: shared by every row; key j sits at slot j), window [1] (0: none).
    Key j is visible from query i when j <= slot[i], slot[i] - j < window, and the segments match:
    causal attention, sliding windows (as Hugging Face counts them), packed samples and left padding
    (key segment -1) alike. The attention core reads it through `attention_mask`: as an additive mask
    for the softmax core, as is by a flash core (msllm.kernels.FlashAttention), which never builds
    [s, t]. Whether rows share it is told by rank, not by a dimension's size, which may be dynamic."""
    return slots, query_segments, key_segments, window


class AdditiveMask(nn.Cell):
    """A visibility as the additive mask of the softmax core: [s, t] when every row of the batch
    sees alike, else [b, 1, s, t] broadcast to the scores' shape (scores_shape). `broadcast`: also
    broadcast the shared [s, t] mask once for all layers (a device formulation; msllm.backends)."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.broadcast = False

    def construct(self, visibility, b: int):
        slots, query_segments, key_segments, window = visibility
        s, t = slots.shape[-1], key_segments.shape[-1]
        query = slots.reshape(s, 1)
        keys = ops.arange(0, t, dtype=ms.int32).reshape(1, t)
        reach = ops.select(window > 0, window, ops.full(window.shape, NO_WINDOW, dtype=ms.int32))
        causal = ops.logical_and(keys <= query, query - keys < reach)                     # [s, t]
        shape = scores_shape(self.num_heads, self.num_kv_heads, b, s, t)
        if query_segments.ndim == 1 and key_segments.ndim == 1:
            mask = additive(ops.logical_and(causal, query_segments.reshape(s, 1) == key_segments.reshape(1, t)))
            return ops.broadcast_to(mask, shape) if self.broadcast else mask
        same = query_segments.reshape(-1, s, 1) == key_segments.reshape(-1, 1, t)        # [b, s, t]
        mask = additive(ops.logical_and(causal, same))
        return ops.broadcast_to(mask.reshape((-1,) + (1,) * (len(shape) - 3) + (s, t)), shape)


class WholeSequence(nn.Cell):
    """Token-aligned inputs [.., s] -> the tokens this process computes: all of them. Context parallel
    (msllm.parallel.cp, through msllm.backends) swaps in its rank's chunks of the sequence."""

    def construct(self, x):
        return x


class OwnKeys(nn.Cell):
    """Keys and values [b, nkv, q, d] of the tokens this process computes -> those of the whole
    sequence: the same, when the process holds all of it (context parallel swaps in an exchange)."""

    def construct(self, k, v):
        return k, v


class OneRankMean(nn.Cell):
    """A scalar -> its mean over the processes that share one sequence: itself, unless context parallel
    splits the sequence (then the loss of each rank's tokens is averaged over the cp group)."""

    def construct(self, x):
        return x


class Rope(nn.Cell):
    """A q or k projection [b*s, n*d] -> heads [b, n, s, d] with rotate-half RoPE applied.

    cos/sin: [s, d] tables, or the same already broadcast to the heads' shape.
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def construct(self, x, cos, sin):
        x = split_heads(x, self.head_dim, cos.shape[-2])
        return x * cos + rotate_half(x) * sin


class AttentionCore(nn.Cell):
    """softmax(q k^T / sqrt(d) + causal) v with grouped KV heads, no KV copy.

    q [b, nh, s, d], k/v [b, nkv, t, d], mask additive: [s, t], or already broadcast to the
    scores ([b, nh, s, t]; [b, nkv, rep, s, t] with GQA), as Llama does once per step. With GQA
    the `rep` query heads that share a KV head are folded into the row axis, so one BatchMatMul
    serves the group.
    Softmax runs in fp32. The scale is applied to q ([.., s, d]) rather than the scores ([.., s, t]).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float = 0.0):
        super().__init__()
        self.scale = scale or 1.0 / math.sqrt(head_dim)
        self.softmax_attention = SoftmaxAttention(num_heads, num_kv_heads)

    def construct(self, q, k, v, mask):
        return self.softmax_attention(q * self.scale, k, v, mask)[0]


def scores_shape(num_heads: int, num_kv_heads: int, b: int, s: int, t: int) -> tuple:
    """Shape of the attention scores (and of a pre-broadcast mask): GQA keeps the `rep` query
    heads of a KV head as their own axis, [b, nkv, rep, s, t]; MHA is [b, nh, s, t]."""
    rep = num_heads // num_kv_heads
    return (b, num_heads, s, t) if rep == 1 else (b, num_kv_heads, rep, s, t)


class SoftmaxAttention(nn.Cell):
    """(out, probs) = softmax(q k^T + mask) v; `probs` is returned for backward formulations that
    reuse it (callers take [0]). With GQA the `rep` query heads of a KV head are folded into the row
    axis, so one BatchMatMul serves the group and K/V are never copied."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.rep = num_heads, num_kv_heads, num_heads // num_kv_heads
        self.qk = ops.BatchMatMul(transpose_b=True)   # scores = q k^T
        self.pv = ops.BatchMatMul()                   # out = P v
        self.softmax = ops.Softmax(-1)

    def construct(self, q, k, v, mask):
        b, _, s, d = q.shape
        t = k.shape[2]
        rows = self.rep * s
        scores = self.qk(q.reshape(b, self.num_kv_heads, rows, d), k)
        if self.rep > 1:  # the mask broadcasts over the rep query heads folded into the rows
            scores = scores.reshape(scores_shape(self.num_heads, self.num_kv_heads, b, s, t))
        probs = self.masked_softmax(cast(scores, ms.float32), mask)
        out = self.pv(cast(probs, v.dtype).reshape(b, self.num_kv_heads, rows, t), v)
        return out.reshape(b, self.num_heads, s, v.shape[-1]), probs  # MLA's value heads differ from q's

    def masked_softmax(self, scores, mask):
        return self.softmax(scores + mask)


class CacheWrite(nn.Cell):
    """New keys and values k, v [b, nkv, s, d] into the cache [b, nkv, t, d] at slots start ..
    start+s-1, the other slots kept. `write` = (source [t] int32, fresh [t, 1] bool, start [1]):
    which slots take a new value (fresh) and from which of the s new positions (source), computed
    once for all layers."""

    def construct(self, k, v, cache_k, cache_v, write):
        source, fresh, _ = write
        return ops.select(fresh, ops.gather(k, source, 2), cache_k), ops.select(fresh, ops.gather(v, source, 2), cache_v)


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
        self.wo = Linear(cfg.num_heads * d, h)
        self.q_norm = HeadNorm(d, cfg.norm_eps, cfg.norm_offset) if cfg.qk_norm else nn.Identity()
        self.k_norm = HeadNorm(d, cfg.norm_eps, cfg.norm_offset) if cfg.qk_norm else nn.Identity()
        self.rope = Rope(d)
        self.whole_kv = OwnKeys()  # context parallel: the other ranks' keys and values joined in
        self.cache_write = CacheWrite()
        self.core = AttentionCore(cfg.num_heads, cfg.num_kv_heads, d, cfg.attn_scale)

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        q = self.rope(self.q_norm(self.wq(x)), cos, sin)
        if cos.ndim == 4 and cos.shape[1] == self.num_heads != self.num_kv_heads:  # per-head tables: take the KV heads' rows
            cos, sin = cos[:, :self.num_kv_heads], sin[:, :self.num_kv_heads]
        k = self.rope(self.k_norm(self.wk(x)), cos, sin)
        v = split_heads(self.wv(x), self.head_dim, cos.shape[-2])
        k, v = self.whole_kv(k, v)
        if cache_k is not None:  # written at the slots of the new tokens; the other slots kept
            k, v = self.cache_write(k, v, cache_k, cache_v, write)
        out = self.core(q, k, v, mask).transpose(0, 2, 1, 3).reshape(-1, self.num_heads * self.head_dim)
        return self.wo(out), k, v


class SwiGLU(nn.Cell):
    """silu(gate) * up, with silu(g) = g * sigmoid(g) written out."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, gate, up):
        return gate * self.sigmoid(gate) * up


class GeGLU(nn.Cell):
    """gelu_tanh(gate) * up (Gemma): 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), written as
    g * sigmoid(2u), the same function: MindSpore's CPU Tanh is off by up to ~1e-4 near +-1, which
    1 + tanh(u) turns into a large relative error for negative g."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, gate, up):
        inner = (2.0 * math.sqrt(2.0 / math.pi)) * (gate + 0.044715 * gate * gate * gate)
        return gate * self.sigmoid(inner) * up


ACTIVATIONS = {"swiglu": SwiGLU, "geglu_tanh": GeGLU}


class FeedForward(nn.Cell):
    """Gated MLP: w2(act(w1 x, w3 x)), act SwiGLU or GeGLU (ModelConfig.mlp)."""

    def __init__(self, cfg: ModelConfig, ffn_size: int = 0):
        super().__init__()
        f = ffn_size or cfg.ffn_size  # a MoE layer's shared experts have their own size
        self.w1 = Linear(cfg.hidden_size, f)
        self.w2 = Linear(f, cfg.hidden_size)
        self.w3 = Linear(cfg.hidden_size, f)
        self.activation = cfg.mlp  # which one, for the backends that swap in a fused kernel
        self.act = ACTIVATIONS[cfg.mlp]()

    def construct(self, x):
        return self.w2(self.act(self.w1(x), self.w3(x)))


class Block(nn.Cell):
    """Pre-norm transformer block; returns (x, keys, values) as its attention (Attention, or MLA:
    msllm/models/mla.py) gives them, and a MoE layer also its routing load (msllm.models.moe.MoE).
    With sandwich norms (Gemma) the attention and MLP outputs are normed too before they join the
    residual stream."""

    # lazy_inline: MindSpore builds one block graph for all layers, with each layer's weights as
    # its arguments. `no_inline` says what happens to it: False inlines it into the caller per
    # layer; True keeps one sub-graph that every layer calls (set by msllm.backends). Left unset,
    # MindSpore would treat it as Ascend cell reuse, which the CPU backend refuses.
    @ms.lazy_inline
    def __init__(self, cfg: ModelConfig, mlp: str = "dense"):
        super().__init__()
        from msllm.models.mla import MLA  # mla.py and moe.py build on this file's Cells
        from msllm.models.moe import MoE
        self.no_inline = False
        h, eps, offset = cfg.hidden_size, cfg.norm_eps, cfg.norm_offset
        self.attention_norm = RMSNorm(h, eps, offset)
        self.attention = {"gqa": Attention, "mla": MLA}[cfg.attention](cfg)
        self.attention_out_norm = RMSNorm(h, eps, offset) if cfg.sandwich_norm else nn.Identity()
        self.ffn_norm = RMSNorm(h, eps, offset)
        self.routed = mlp == "moe"
        self.feed_forward = MoE(cfg) if self.routed else FeedForward(cfg)
        self.ffn_out_norm = RMSNorm(h, eps, offset) if cfg.sandwich_norm else nn.Identity()

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        attn, k, v = self.attention(self.attention_norm(x), cos, sin, mask, cache_k, cache_v, write)
        x = x + self.attention_out_norm(attn)
        if not self.routed:
            return x + self.ffn_out_norm(self.feed_forward(self.ffn_norm(x))), k, v
        out, load = self.feed_forward(self.ffn_norm(x))
        return x + self.ffn_out_norm(out), k, v, load


class Llama(nn.Cell):
    """input_ids [b, s] int32 -> logits [b, s, vocab] fp32 (under context parallel [b, q, vocab], of the
    q tokens `local_tokens` gives this rank).

    With a cache, keys / values [layers, b, kv_heads, max_len, head_dim] (preallocated; MLA's shapes:
    ModelConfig.cache_shapes), start
    int32 [1] and pad int32 [b]: the s new tokens sit at slots start .. start+s-1 of every row,
    whose first pad[r] slots are left padding (the token at slot j is at position j - pad[r]).
    Returns (logits [b, vocab] of the last new token, keys, values with the new slots written);
    each token attends to the filled, unpadded slots up to its own (within its layer's window).
    This is how an engine prefills (start 0) and decodes (s = 1), with the same shapes at every step.
    Parameters are always fp32 (the master copy); `compute_dtype` (fp32, fp16 or bf16) is what
    matmuls and the residual stream run in. Norms, softmax and logits stay fp32.

    Layers of one attention kind (window, RoPE base: attention_kinds) share their rope tables and
    mask, built once per forward for each kind.
    """

    def __init__(self, cfg: ModelConfig, compute_dtype=ms.float32):
        super().__init__()
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        self.layers = nn.CellList([Block(cfg, mlp) for mlp in cfg.mlp_kinds()])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_offset)
        self.output = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_matmul = ops.MatMul(transpose_b=True)
        kinds, layer_kind = attention_kinds(cfg)
        self.layer_kind = tuple(layer_kind)
        self.windows = tuple(window for window, _, _ in kinds)
        # [kinds, head_dim / 2]: RoPE rows are computed from positions, so an unused context costs nothing
        self.inv_freq = Tensor(np.stack([rope_inv_freq(cfg.rope_dim, theta, scaling) for _, theta, scaling in kinds]))
        self.rope_factors = tuple(rope_attention_factor(scaling) for _, _, scaling in kinds)  # YaRN scales cos, sin
        self.kind_windows = Tensor(np.array(self.windows, np.int32))
        self.attention_mask = AdditiveMask(cfg.num_heads, cfg.num_kv_heads)  # a flash core takes the indices as is
        # Which tokens of each sequence this process computes, and the mean of a loss over the processes
        # sharing a sequence: all, and itself, unless context parallel splits it (msllm.backends).
        self.local_tokens = WholeSequence()
        self.sequence_mean = OneRankMean()
        # True: the rope tables are broadcast to the heads' shape once for all layers instead of
        # per use (a device formulation; msllm.backends sets it).
        self.broadcast_tables = False

    def embed(self, input_ids):
        """Token embeddings in the compute dtype (input_ids of any shape), times the embedding scale."""
        x = self.tok_embeddings(input_ids)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        return cast(x, self.compute_dtype)

    def logits(self, h):
        """Final norm + output projection; h [..., hidden] -> fp32 logits [..., vocab]."""
        h = self.norm(h)
        if self.output is None:  # tied: reuse the embedding table as the output projection
            out = self.lm_matmul(h.reshape(-1, h.shape[-1]), cast(self.tok_embeddings.weight, h.dtype))
            return cast(out.reshape(h.shape[:-1] + (-1,)), ms.float32)
        return cast(self.output(h), ms.float32)

    def rope_at(self, kind: int, positions):
        """cos, sin [.., d] of attention kind `kind` at int32 positions [..] (fp32, as HF: the angle
        position * inv_freq rounded to fp32, then its cosine and sine)."""
        freqs = positions.astype(ms.float32).reshape(positions.shape + (1,)) * self.inv_freq[kind]
        angles = ops.concat((freqs, freqs), -1)
        if self.rope_factors[kind] != 1.0:
            return ops.cos(angles) * self.rope_factors[kind], ops.sin(angles) * self.rope_factors[kind]
        return ops.cos(angles), ops.sin(angles)

    def window_of(self, kind: int):
        return self.kind_windows[kind:kind + 1]

    def plain_tables(self, s: int, kind: int):
        """One sequence of s tokens per row: rope tables [q, d] of the q tokens computed here
        (local_tokens) and their causal visibility over all s keys, for attention kind `kind`."""
        slots = ops.arange(0, s, dtype=ms.int32)
        mine = self.local_tokens(slots)
        cos, sin = self.rope_at(kind, mine)
        zeros = ops.zeros_like(slots)
        return cos, sin, visibility(mine, self.local_tokens(zeros), zeros, self.window_of(kind))

    def sample_tables(self, segments, positions, kind: int):
        """Packed samples: segments, positions [b, s] int32 (a sample's tokens share a segment id, and
        count their positions from 0) -> rope tables [b, 1, s, d] at those positions and a visibility
        causal within a sample (and its window) and closed between samples; the rows are the tokens
        computed here (local_tokens), the keys all s."""
        b, s = segments.shape
        cos, sin = self.rope_at(kind, self.local_tokens(positions))
        q = cos.shape[-2]
        slots = self.local_tokens(ops.arange(0, s, dtype=ms.int32))
        seen = visibility(slots, self.local_tokens(segments), segments, self.window_of(kind))
        return cos.reshape(b, 1, q, -1), sin.reshape(b, 1, q, -1), seen

    def cache_tables(self, b: int, s: int, t: int, start, pad, kind: int):
        """cos / sin [b, 1, s, d] at each row's positions and the visibility of the cache slots
        (filled, unpadded and within the kind's window; padding is key segment -1)."""
        new_slots = start + ops.arange(0, s, dtype=ms.int32)                       # [s]
        positions = ops.maximum(new_slots.reshape(1, s) - pad.reshape(b, 1), 0)    # [b, s], padding at 0
        cos, sin = self.rope_at(kind, positions)
        slots = ops.arange(0, t, dtype=ms.int32).reshape(1, t)
        key_segments = ops.select(slots >= pad.reshape(b, 1), ops.zeros((b, t), ms.int32), ops.full((b, t), -1, dtype=ms.int32))
        seen = visibility(new_slots, ops.zeros_like(new_slots), key_segments, self.window_of(kind))
        return cos.reshape(b, 1, s, -1), sin.reshape(b, 1, s, -1), seen

    @staticmethod
    def cache_write_slots(s: int, t: int, start):
        """Where the new tokens are written (CacheWrite's `write`)."""
        slots = ops.arange(0, t, dtype=ms.int32)
        fresh = ops.logical_and(slots >= start, slots < start + s).reshape(t, 1)
        return ops.clip(slots - start, 0, s - 1), fresh, start

    def tables(self, kind: int, b: int, s: int, t: int, start, pad, segments, positions):
        """(cos, sin, mask) of one attention kind, in the compute dtype and broadcast as the backend asks."""
        cfg, dtype = self.cfg, self.compute_dtype
        if start is not None:
            cos, sin, seen = self.cache_tables(b, s, t, start, pad, kind)
        elif segments is not None:
            cos, sin, seen = self.sample_tables(segments, positions, kind)
        else:
            cos, sin, seen = self.plain_tables(s, kind)
        cos, sin = cast(cos, dtype), cast(sin, dtype)
        mask = self.attention_mask(seen, b)
        if self.broadcast_tables:
            q = cos.shape[-2]  # the tokens computed here
            cos = ops.broadcast_to(cos, (b, cfg.num_heads, q, cfg.rope_dim))
            sin = ops.broadcast_to(sin, (b, cfg.num_heads, q, cfg.rope_dim))
        return cos, sin, mask

    def construct(self, input_ids, keys=None, values=None, start=None, pad=None, segments=None, positions=None):
        b, s = input_ids.shape
        h, new_keys, new_values, _ = self.decode(input_ids, keys, values, start, pad, segments, positions)
        if keys is None:
            return self.logits(h).reshape(b, -1, self.cfg.vocab_size)
        last = h.reshape(b, s, -1)[:, -1]  # logits only where the next token is read
        return self.logits(last), new_keys, new_values

    def with_loads(self, input_ids, segments=None, positions=None):
        """Training a MoE model: (logits as construct gives them, the routing loads of its MoE layers,
        one [4, E] per layer: msllm.models.moe.MoE)."""
        b = input_ids.shape[0]
        h, _, _, loads = self.decode(input_ids, None, None, None, None, segments, positions)
        return self.logits(h).reshape(b, -1, self.cfg.vocab_size), loads

    def decode(self, input_ids, keys, values, start, pad, segments, positions):
        """The decoder layers: -> (residual stream [b*q, hidden], each layer's keys and values when a
        cache is given, the MoE layers' routing loads)."""
        b, s = input_ids.shape
        t = s if keys is None else keys.shape[3]
        kinds = ()
        for kind in range(len(self.windows)):
            kinds += (self.tables(kind, b, s, t, start, pad, segments, positions),)
        write = None if keys is None else self.cache_write_slots(s, t, start)
        input_ids = self.local_tokens(input_ids)  # context parallel: this rank's chunks of the sequence
        # The residual stream stays 2-D [b*q, hidden]: every projection is a plain 2-D matmul.
        h = self.embed(input_ids.reshape(-1))
        new_keys, new_values, loads = (), (), ()
        if keys is not None:  # one Unstack pass: indexing keys[i] is a StridedSlice per layer, far slower on CPU
            keys, values = ops.unstack(keys, 0), ops.unstack(values, 0)
        for i, layer in enumerate(self.layers):
            cos, sin, mask = kinds[self.layer_kind[i]]
            out = layer(h, cos, sin, mask) if keys is None else layer(h, cos, sin, mask, keys[i], values[i], write)
            h = out[0]
            if keys is not None:
                new_keys += (out[1],)
                new_values += (out[2],)
            if len(out) == 4:  # a MoE layer's routing load
                loads += (out[3],)
        if keys is None:
            return h, None, None, loads
        return h, ops.stack(new_keys), ops.stack(new_values), loads


class CausalLMLoss(nn.Cell):
    """Mean next-token cross-entropy in fp32, as one fused softmax-cross-entropy kernel
    (forward and gradient), instead of separate max / exp / sum / gather passes over the logits."""

    def __init__(self):
        super().__init__()
        self.cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()

    def construct(self, logits, labels):
        return self.cross_entropy(cast(logits, ms.float32).reshape(-1, logits.shape[-1]), labels.reshape(-1))



class MaskedCausalLMLoss(nn.Cell):
    """Next-token cross-entropy in fp32 averaged over the positions where mask is 1 (SFT: the
    response tokens); masked positions contribute exactly nothing, to the loss or its gradient.
    `count`: what to divide by instead of this mask's sum (context parallel: the cp group's mean)."""

    def construct(self, logits, labels, mask, count=None):
        logits = cast(logits, ms.float32).reshape(-1, logits.shape[-1])
        log_probs = ops.log_softmax(logits, -1)
        nll = -ops.gather_elements(log_probs, 1, labels.reshape(-1, 1)).reshape(-1)
        mask = mask.reshape(-1)
        if count is None:
            count = ops.sum(mask)
        # no label at all: 0 / tiny = 0 (a cp group's mean count may be a fraction, so not max(count, 1))
        return ops.sum(nll * mask) / ops.maximum(count, 1e-6)


def init_weights(model: Llama, seed: int) -> None:
    """GPT-2 style init from a seeded numpy RNG: N(0, 0.02); residual outputs N(0, 0.02/sqrt(2L))."""
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.num_layers)
    for name, p in model.parameters_and_names():
        if name.endswith("norm.weight"):
            continue  # ones
        if name.endswith("bias"):  # also a MoE router's expert_bias
            value = np.zeros(p.shape, np.float32)
        else:
            std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
            value = rng.normal(0.0, std, size=p.shape).astype(np.float32)
        p.set_data(Tensor(value))


def build_model(cfg: ModelConfig, seed: int = 0, compute_dtype=ms.float32) -> Llama:
    model = Llama(cfg, compute_dtype)
    init_weights(model, seed)
    return model
