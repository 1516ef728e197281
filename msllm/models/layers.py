"""The shared Cells every decoder layer is built from: plain, device-neutral maths.

Linear, Embedding, RMSNorm (and its per-head form), RoPE kinds (default, linear, llama3, YaRN), the
attention core (softmax over [s, t] scores, grouped KV heads, no KV copy), the KV-cache write, the
gated MLP kinds, and the losses. Mixers (msllm/models/mixers/), MoE (moe.py) and the decoder
(decoder.py) build on this file and nothing here imports them.

Each matmul, the norm core, the rope, the attention softmax and the activation is its own Cell, so
msllm.backends can swap a device formulation in (msllm/backends/cpu.py) or attach a parallel
strategy (msllm/backends/ascend.py) without touching the model. Linear weights are [out, in]. The
code is shape-agnostic in batch and sequence, so the same Cells export with dynamic shapes.
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


class Projections(nn.Cell):
    """(x, linears) -> each Linear's projection of x, in order: a layer's projections of one input (attention's
    q, k, v; an MLP's gate and up), each its own matmul. A device may compute the group at once
    (msllm.backends)."""

    def construct(self, x, linears):
        return tuple(linear(x) for linear in linears)  # noqa: GL106 (a layer's few Linears)


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
    """x [N, h] fp32, weight [h] -> x / sqrt(mean(x^2) + eps) * (offset + weight). The offset is the core's,
    so a fused core takes it inside its one kernel (the add was a kernel of its own in every norm's call)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.dim, self.eps, self.offset = dim, eps, offset

    def construct(self, x, weight):
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps) * offset_scale(weight, self.offset)


def offset_scale(weight, offset: float):
    """A norm's scale: offset + weight (Gemma stores w of (1 + w), offset 1)."""
    return weight + offset if offset else weight


class RMSNorm(nn.Cell):
    """Normalises in fp32 whatever the compute dtype, then casts back. The scale is offset + weight
    (Gemma stores w of (1 + w), offset 1; its weights start at 0 so the scale starts at 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.dim, self.eps, self.offset = dim, eps, offset
        self.weight = Parameter(Tensor(np.full((dim,), 1.0 - offset, np.float32)), name="weight")
        self.core = RMSNormCore(dim, eps, offset)

    def construct(self, x):
        if x.ndim == 2:  # the residual stream: no reshapes (with dynamic shapes each is a kernel)
            return cast(self.core(cast(x, ms.float32), self.weight), x.dtype)
        dtype, shape = x.dtype, x.shape
        x = cast(x, ms.float32).reshape(-1, self.dim)
        return cast(self.core(x, self.weight).reshape(shape), dtype)


class ResidualNorm(nn.Cell):
    """(x, delta, norm) -> (x + delta, norm(x + delta)): a residual stream's add and the norm of the sum (a block's
    attention residual and its MLP's pre-norm). One Cell, so that a device can do both at once (msllm.backends)."""

    def construct(self, x, delta, norm):
        x = x + delta
        return x, norm(x)


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
            return cast(self.core(heads, self.weight), x.dtype).reshape(shape)
        return super().construct(x.reshape(-1, self.dim)).reshape(shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies in fp32, matching Hugging Face's default / linear / llama3 / yarn rope.
    Theta 0: no position encoding (NoPE layers), every frequency 0, so cos is 1 and sin 0 and RoPE
    returns its input bit for bit."""
    if theta == 0:
        return np.zeros(head_dim // 2, np.float32)
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

def rope_tables(cfg, theta: float | None = None, scaling: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, head_dim] for RoPE base `theta` (default: the model's, with its scaling):
    the tables of graphs that store them (ONNX); the decoder computes its rows from positions."""
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
    (key segment -1) alike. Segments match when equal, or when the query's is a branch of the key's
    (sees_segment): segment q <= -2 is branch (-q - 2) % 2 of segment (-q - 2) // 2, which it sees
    but no sibling branch sees it (a DPO pair's chosen and rejected completions after their shared
    prompt: msllm.data.preference). Ids >= -1 (every other input) match only when equal. The attention
    core reads it through `attention_mask`: as an additive mask for the softmax core, as is by a flash
    core (msllm.kernels.FlashAttention), which never builds [s, t]. Whether rows share it is told by
    rank, not by a dimension's size, which may be dynamic."""
    return slots, query_segments, key_segments, window


def rope_rows(positions, inv_freq):
    """cos, sin [.., d] at int32 positions [..] of the inverse frequencies inv_freq [d / 2] (fp32, as HF: the angle
    position * inv_freq rounded to fp32, then its cosine and sine)."""
    freqs = positions.astype(ms.float32).reshape(positions.shape + (1,)) * inv_freq
    angles = ops.concat((freqs, freqs), -1)
    return ops.cos(angles), ops.sin(angles)


class CacheTables(nn.Cell):
    """A cached forward's rope tables and visibility: cos / sin [b, 1, s, d] at each row's positions and the
    visibility of the t cached keys, key j holding slot first + j (a full cache: 0; a ring read in slot order:
    start - its length), of b rows of s new tokens at slots start .. start+s-1, left-padded by pad [b]: those
    keys filled, unpadded and within `window` (padding, and slots before 0, are key segment -1). One Cell, so
    that a device can compute them at once (msllm.backends)."""

    def construct(self, b: int, s: int, t: int, start, pad, inv_freq, window, first=0):
        new_slots = start + ops.arange(0, s, dtype=ms.int32)                       # [s]
        positions = ops.maximum(new_slots.reshape(1, s) - pad.reshape(b, 1), 0)    # [b, s], padding at 0
        cos, sin = rope_rows(positions, inv_freq)
        slots = first + ops.arange(0, t, dtype=ms.int32).reshape(1, t)
        key_segments = ops.select(slots >= pad.reshape(b, 1), ops.zeros((b, t), ms.int32),
                                  ops.full((b, t), -1, dtype=ms.int32))
        seen = visibility(new_slots - first, ops.zeros_like(new_slots), key_segments, window)
        return cos.reshape(b, 1, s, -1), sin.reshape(b, 1, s, -1), seen


def sees_segment(query_segments, key_segments):
    """Whether queries of these segments see keys of those (broadcast): equal, or the query a branch of the key's."""
    branch_of = ops.floor_divide(-query_segments - 2, 2)
    return ops.logical_or(query_segments == key_segments,
                          ops.logical_and(query_segments <= -2, branch_of == key_segments))


class AdditiveMask(nn.Cell):
    """A visibility as the additive mask of the softmax core: [s, t] when every row of the batch
    sees alike, else [b, 1, s, t] broadcast to the scores' shape (scores_shape). `broadcast`: also
    broadcast the shared [s, t] mask once for all layers; `broadcast_rows` false: leave the rows' mask
    [b, 1, s, t] ([b, 1, 1, s, t] with GQA) for a core that reads it so (device formulations; msllm.backends)."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.broadcast, self.broadcast_rows = False, True

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
        q_seg, k_seg = query_segments.reshape(-1, s, 1), key_segments.reshape(-1, 1, t)
        # branches exist only in per-row segments (training rows); shared query ids (plain, cached) never branch
        same = sees_segment(q_seg, k_seg) if query_segments.ndim == 2 else q_seg == k_seg  # [b, s, t]
        mask = additive(ops.logical_and(causal, same)).reshape((-1,) + (1,) * (len(shape) - 3) + (s, t))
        return ops.broadcast_to(mask, shape) if self.broadcast_rows else mask


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
    """A q or k projection [b*s, n*d] -> heads [b, n, s, d] with rotate-half RoPE applied to the first
    `rope_dim` features of each head (partial RoPE, ModelConfig.rope_fraction); the rest pass as they are.

    cos/sin: [s, rope_dim] tables, or the same already broadcast to the heads' shape.
    """

    def __init__(self, head_dim: int, rope_dim: int = 0):
        super().__init__()
        self.head_dim, self.rope_dim = head_dim, rope_dim or head_dim

    def construct(self, x, cos, sin):
        x = split_heads(x, self.head_dim, cos.shape[-2])
        if self.rope_dim == self.head_dim:
            return x * cos + rotate_half(x) * sin
        rotated = x[..., :self.rope_dim]
        return ops.concat((rotated * cos + rotate_half(rotated) * sin, x[..., self.rope_dim:]), -1)


class AttentionCore(nn.Cell):
    """softmax(q k^T / sqrt(d) + causal) v with grouped KV heads, no KV copy.

    q [b, nh, s, d], k/v [b, nkv, t, d], mask additive: [s, t], or already broadcast to the
    scores ([b, nh, s, t]; [b, nkv, rep, s, t] with GQA), as the decoder does once per step. With GQA
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


class SinkSoftmaxAttention(SoftmaxAttention):
    """SoftmaxAttention whose every row also holds its head's sink logit (`sinks` [num_heads]), which
    takes a share of the softmax and contributes no value: softmax([scores + mask, sink]) without its
    last column. The portable core (autodiff), kept by msllm.backends unless the CPU flash core is on
    (msllm.kernels.SinkFlashAttention, the same maths by blocks of keys)."""

    def construct(self, q, k, v, mask, sinks):
        return super().construct(q, k, v, (mask, sinks))  # the sinks travel with the mask to masked_softmax

    def masked_softmax(self, scores, mask_and_sinks):
        mask, sinks = mask_and_sinks
        scores = scores + mask
        per_head = sinks.reshape(scores_shape(self.num_heads, self.num_kv_heads, 1, 1, 1))
        sink = ops.broadcast_to(cast(per_head, ms.float32), scores.shape[:-1] + (1,))
        return self.softmax(ops.concat((scores, sink), -1))[..., :-1]


class SinkAttentionCore(AttentionCore):
    """AttentionCore with a learned sink logit per head (gpt-oss), its parameter `sinks` [num_heads]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float = 0.0):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.softmax_attention = SinkSoftmaxAttention(num_heads, num_kv_heads)
        self.sinks = Parameter(initializer("zeros", (num_heads,), ms.float32), name="sinks")

    def construct(self, q, k, v, mask):
        return self.softmax_attention(q * self.scale, k, v, mask, self.sinks)[0]


class CacheWrite(nn.Cell):
    """New keys and values k, v [b, nkv, s, d] into the cache [b, nkv, t, d] at slots start ..
    start+s-1, the other slots kept. `write` = (source [t] int32, fresh [t, 1] bool, start [1]):
    which slots take a new value (fresh) and from which of the s new positions (source), computed
    once for all layers: returns new caches. Or `write` = (places, start) (Decoder.cache_write_places):
    the caches are Parameters, written there in place and returned (msllm.inference.CachedInPlace)."""

    def construct(self, k, v, cache_k, cache_v, write):
        if len(write) == 2:
            return self.in_place(k, v, cache_k, cache_v, write[0])
        source, fresh, _ = write
        return ops.select(fresh, ops.gather(k, source, 2), cache_k), ops.select(fresh, ops.gather(v, source, 2), cache_v)

    def in_place(self, k, v, cache_k, cache_v, places):
        # the caches as read after the scatters (depend orders their readers after the writes)
        return (ops.depend(cache_k, ops.scatter_nd_update(cache_k, places, cast(k, cache_k.dtype))),
                ops.depend(cache_v, ops.scatter_nd_update(cache_v, places, cast(v, cache_v.dtype))))


class Attend(nn.Cell):
    """An attention layer's q, k, v projections [b*s, n*d] (q and k normed) -> (the core's output [b, nh, s, dv],
    the keys and values it attended to [b, nkv, t, d]) through the layer's Cells `parts` = (rope, whole_kv,
    cache_write, core): RoPE into heads, the other ranks' keys joined (context parallel), the new keys and values
    written into the cache when one is given (`write`: see CacheWrite), the core. One Cell, so that a device can
    run the chain at once (msllm.backends)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def construct(self, parts, q, k, v, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        rope, whole_kv, cache_write, core = parts
        q = rope(q, cos, sin)
        if cos.ndim == 4 and cos.shape[1] == self.num_heads != self.num_kv_heads:  # per-head tables: KV heads' rows
            cos, sin = cos[:, :self.num_kv_heads], sin[:, :self.num_kv_heads]
        k = rope(k, cos, sin)
        v = split_heads(v, self.head_dim, cos.shape[-2])
        k, v = whole_kv(k, v)
        if cache_k is not None:  # written at the slots of the new tokens; the other slots kept
            k, v = cache_write(k, v, cache_k, cache_v, write)
        return core(q, k, v, mask), k, v


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


class ClampedSwiGLU(nn.Cell):
    """gpt-oss's gated activation: gate clipped to <= limit, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.sigmoid = ops.Sigmoid()

    def construct(self, gate, up):
        gate = ops.clamp(gate, max=self.limit)
        up = ops.clamp(up, -self.limit, self.limit)
        return gate * self.sigmoid(gate * self.alpha) * (up + 1)


def activation(cfg: ModelConfig) -> nn.Cell:
    """The gated activation model.mlp names: swiglu, geglu_tanh or swiglu_clamped."""
    if cfg.mlp == "swiglu_clamped":
        return ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
    return GeGLU() if cfg.mlp == "geglu_tanh" else SwiGLU()


class ActivatedLinear(nn.Cell):
    """(gate, up, act, linear) -> linear(act(gate, up)): a gated MLP's activation and down projection. One Cell, so
    that a device can do both at once (msllm.backends)."""

    def construct(self, gate, up, act, linear):
        return linear(act(gate, up))


class FeedForward(nn.Cell):
    """Gated MLP: w2(act(w1 x, w3 x)), act SwiGLU or GeGLU (ModelConfig.mlp)."""

    def __init__(self, cfg: ModelConfig, ffn_size: int = 0):
        super().__init__()
        f = ffn_size or cfg.ffn_size  # a MoE layer's shared experts have their own size
        self.w1 = Linear(cfg.hidden_size, f)
        self.w2 = Linear(f, cfg.hidden_size)
        self.w3 = Linear(cfg.hidden_size, f)
        self.activation = cfg.mlp  # which one, for the backends that swap in a fused kernel
        self.act = activation(cfg)
        self.project = Projections()
        self.down = ActivatedLinear()  # w2 of the activation

    def construct(self, x):
        gate, up = self.project(x, (self.w1, self.w3))
        return self.down(gate, up, self.act, self.w2)


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


# Logits [N, vocab] up to this size are computed whole (Decoder.project; W1's are 16 MB), larger ones by
# a fused head when there is one. Also the graph form's chunk: a few tens of MB, full-speed matmuls.
HEAD_CHUNK_BYTES = 32 << 20


@ms.constexpr  # runs in Python at compile time: the chunks are static
def head_chunks(n: int, vocab: int, chunk_bytes: int = HEAD_CHUNK_BYTES) -> tuple:
    """The [start, end) vocabulary ranges the graph form computes one at a time for n rows: columns
    a multiple of 256, ~chunk_bytes of fp32 logits each (one range when the whole vocabulary fits)."""
    cols = min(vocab, max(256, chunk_bytes // (4 * max(n, 1)) // 256 * 256))
    return tuple((start, min(start + cols, vocab)) for start in range(0, vocab, cols))


class ChunkedHead(nn.Cell):
    """The output head reduced as a cross-entropy needs it, by chunks of the vocabulary:
    hidden [N, H], weight [V, H], labels [N] int32 -> (lse [N], target [N]), the logsumexp of each
    row's logits hidden @ weight^T and the label's logit, fp32. With `softcap` the logits are
    softcap * tanh(logits / softcap) (Gemma 2's final soft-capping).

    Backward recomputes each chunk's logits and turns them into that chunk's logit gradient,
    dlse * softmax + dtarget * onehot(label), which feeds dhidden (summed over chunks) and the chunk's
    rows of dweight. Each chunk waits for the previous one's result (ops.depend).

    This is the portable graph form; msllm.kernels.FusedHead is the same in C++. On MindSpore's CPU
    backend the graph form does NOT save memory: its chunks' buffers were measured to stay alive
    (docs/big-vocab.md), so the CPU step takes the kernel, or the whole logits without it."""

    def __init__(self, softcap: float = 0.0, chunk_bytes: int = HEAD_CHUNK_BYTES):
        super().__init__()
        self.softcap, self.chunk_bytes = softcap, chunk_bytes
        self.logits_of = ops.MatMul(transpose_b=True)   # [N, H] x [C, H]^T
        self.rows_grad = ops.MatMul()                   # dlogits [N, C] x [C, H]
        self.weight_grad = ops.MatMul(transpose_a=True)  # dlogits^T [C, N] x [N, H]

    def chunk_logits(self, h, w):
        """fp32 logits of one chunk, and tanh(z / softcap) when soft-capping (for its slope)."""
        z = cast(self.logits_of(h, cast(w, h.dtype)), ms.float32)
        if self.softcap > 0:
            t = ops.tanh(z / self.softcap)
            return t * self.softcap, t
        return z, z

    def construct(self, h, weight, labels):
        parts, done = [], None
        for start, end in head_chunks(h.shape[0], weight.shape[0], self.chunk_bytes):
            z, _ = self.chunk_logits(h if done is None else ops.depend(h, done), weight[start:end])
            done = ops.logsumexp(z, -1)
            parts.append(done)
        lse = ops.logsumexp(ops.stack(parts, -1), -1) if len(parts) > 1 else parts[0]
        target = ops.sum(cast(h, ms.float32) * ops.gather(weight, labels, 0), -1)
        if self.softcap > 0:
            target = ops.tanh(target / self.softcap) * self.softcap
        return lse, target

    def bprop(self, h, weight, labels, out, dout):
        lse = out[0].reshape(-1, 1)
        d_lse, d_target = dout[0].reshape(-1, 1), dout[1].reshape(-1, 1)
        dh, dw, done = None, [], None
        for start, end in head_chunks(h.shape[0], weight.shape[0], self.chunk_bytes):
            w = weight[start:end]
            z, t = self.chunk_logits(h if done is None else ops.depend(h, done), w)
            onehot = ops.one_hot(labels - start, end - start, ops.ones((), ms.float32), ops.zeros((), ms.float32))
            dz = ops.exp(z - lse) * d_lse + onehot * d_target
            if self.softcap > 0:
                dz = dz * (1.0 - t * t)
            dz = cast(dz, h.dtype)
            part = self.rows_grad(dz, cast(w, h.dtype))
            dh = part if dh is None else dh + part
            done = self.weight_grad(dz, h)
            dw.append(cast(done, ms.float32))
        dw = ops.concat(dw, 0) if len(dw) > 1 else dw[0]
        return cast(dh, h.dtype), dw, ops.zeros_like(labels)


def fits_whole(n: int, vocab: int) -> bool:
    """Whether n rows' fp32 logits are small enough to compute whole (HEAD_CHUNK_BYTES)."""
    return n * vocab * 4 <= HEAD_CHUNK_BYTES


class HeadCrossEntropy(nn.Cell):
    """The mean next-token cross-entropy from a fused head's (lse, target) [N] (ChunkedHead,
    msllm.kernels.FusedHead): lse - target averaged, over the rows where mask is 1 when a mask is
    given (divided by count, as MaskedCausalLMLoss); with `z_loss`, z_loss * lse^2 added per counted
    row (PaLM's z-loss)."""

    def __init__(self, z_loss: float = 0.0):
        super().__init__()
        self.z_loss = z_loss

    def construct(self, lse, target, mask=None, count=None):
        nll = lse - target
        if self.z_loss > 0:
            nll = nll + self.z_loss * lse * lse
        if mask is None:
            return ops.mean(nll)
        if count is None:
            count = ops.sum(mask)
        return ops.sum(nll * mask) / ops.maximum(count, 1e-6)
