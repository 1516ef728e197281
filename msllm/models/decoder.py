"""The decoder of every family as MindSpore Cells: blocks composed per layer from the family spec
in ModelConfig (the mixer each layer takes, q/k norm, norm offset, sandwich norms, MLP kind, dense or
MoE, embedding scale, sliding-window layers and their RoPE base, layers without RoPE) over the shared
Cells of layers.py.

Parameter names follow torchtitan: tok_embeddings, layers.N.attention.wq, ...,
layers.N.feed_forward.w1 (gate) / w2 (down) / w3 (up), norm, output. The KV cache is an optional,
preallocated input of the model's own forward: `model(ids, caches, start, pad)` writes the
new tokens' cache entries at slots start.. and attends to the filled part (litgpt's input_pos, as
data); a sliding layer's cache is a ring of its window's last slots (ModelConfig.caches). Packed
samples (SFT) are optional inputs too: `model(ids, segments=seg, positions=pos)` keeps attention
inside each sample and restarts its positions.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from msllm.config import CACHE_NAMES, ModelConfig
from msllm.models.layers import (AdditiveMask, CacheTables, Embedding, FeedForward, Linear, OneRankMean, ResidualNorm,
                                 RMSNorm, WholeSequence, cast, rope_attention_factor, rope_inv_freq, rope_rows,
                                 visibility)
from msllm.models.mixers import build_mixer
from msllm.models.moe import MoE
from msllm.models.mtp import MTPDepth


def attention_kinds(cfg: ModelConfig) -> tuple[list[tuple[int, float, dict | None]], list[int]]:
    """The distinct kinds of attention layer, (window, rope theta, rope scaling) with window 0 for
    full attention and theta 0 for no position encoding (NoPE: its tables are cos 1, sin 0), and the
    kind of each layer. Sliding layers take rope_local_theta unscaled when it is set (Gemma 3), the
    model's RoPE otherwise (Mistral)."""
    full = (0, cfg.rope_theta, cfg.rope_scaling)
    sliding = ((cfg.sliding_window, cfg.rope_local_theta, None) if cfg.rope_local_theta
               else (cfg.sliding_window, cfg.rope_theta, cfg.rope_scaling))
    per_layer = [(sliding if kind == "sliding" else full) if position == "rope"
                 else ((cfg.sliding_window if kind == "sliding" else 0), 0.0, None)
                 for kind, position in zip(cfg.layer_kinds(), cfg.position_kinds())]
    kinds = list(dict.fromkeys((w, t, repr(sc)) for w, t, sc in per_layer))
    by_key = {(w, t, repr(sc)): (w, t, sc) for w, t, sc in per_layer}
    return [by_key[k] for k in kinds], [kinds.index((w, t, repr(sc))) for w, t, sc in per_layer]


class Block(nn.Cell):
    """Pre-norm decoder block: the layer's token mixer (msllm.models.mixers: attention, MLA, ..) then
    its MLP (dense, or MoE: msllm.models.moe.MoE). With sandwich norms (Gemma) the mixer and MLP
    outputs are normed too before they join the residual stream; without pre norms (OLMo 2/3) they
    alone are.

    Returns one structure whatever the layer: (x, cache_k, cache_v, load), the mixer's two cache
    tensors (a KV cache's keys and values, MLA's latents and rope keys) and, for a MoE layer, its
    routing load [4, E]; a dense layer's load is None (the decoder reads it by the static `routed`)."""

    # lazy_inline: MindSpore builds one block graph for all layers, with each layer's weights as
    # its arguments. `no_inline` says what happens to it: False inlines it into the caller per
    # layer; True keeps one sub-graph that every layer calls (set by msllm.backends). Left unset,
    # MindSpore would treat it as Ascend cell reuse, which the CPU backend refuses.
    @ms.lazy_inline
    def __init__(self, cfg: ModelConfig, mixer: str = "gqa", mlp: str = "dense"):
        super().__init__()
        self.no_inline = False
        h, eps, offset = cfg.hidden_size, cfg.norm_eps, cfg.norm_offset
        self.attention_norm = RMSNorm(h, eps, offset) if cfg.pre_norm else nn.Identity()
        self.attention = build_mixer(cfg, mixer)  # named `attention` in every checkpoint, whatever it mixes with
        self.attention_out_norm = RMSNorm(h, eps, offset) if cfg.sandwich_norm else nn.Identity()
        self.ffn_norm = RMSNorm(h, eps, offset) if cfg.pre_norm else nn.Identity()
        self.residual_norm = ResidualNorm()  # the attention residual's add and ffn_norm of the sum
        self.routed = mlp == "moe"
        self.feed_forward = MoE(cfg) if self.routed else FeedForward(cfg)
        self.ffn_out_norm = RMSNorm(h, eps, offset) if cfg.sandwich_norm else nn.Identity()

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        attn, k, v = self.attention(self.attention_norm(x), cos, sin, mask, cache_k, cache_v, write)
        x, normed = self.residual_norm(x, self.attention_out_norm(attn), self.ffn_norm)
        if not self.routed:
            return x + self.ffn_out_norm(self.feed_forward(normed)), k, v, None
        out, load = self.feed_forward(normed)
        return x + self.ffn_out_norm(out), k, v, load


class Decoder(nn.Cell):
    """input_ids [b, s] int32 -> logits [b, s, vocab] fp32 (under context parallel [b, q, vocab], of the
    q tokens `local_tokens` gives this rank).

    With a cache: caches, the tuple ModelConfig.caches lists (preallocated; two per kind of layer: the full
    layers' keys and values [layers, b, kv_heads, max_len, head_dim], the sliding layers' rings of their
    window's last slots, a hybrid's Gated DeltaNet states and conv windows), start int32 [1] and pad int32
    [b]: the s new tokens sit at slots start .. start+s-1 of every row, whose first pad[r] slots are left
    padding (the token at slot j is at position j - pad[r]; a ring keeps slot j at j % its length).
    Returns (logits [b, vocab] of the last new token, *caches with the new tokens written);
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
        self.layers = nn.CellList([Block(cfg, mixer, mlp) for mixer, mlp in zip(cfg.mixer_kinds(), cfg.mlp_kinds())])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_offset)
        self.output = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_matmul = ops.MatMul(transpose_b=True)
        # multi-token prediction depths (msllm.models.mtp), each over a block built like the last layer
        mlp, mixer = cfg.mtp_layer_kind()
        self.mtp = nn.CellList([MTPDepth(cfg, Block(cfg, mixer, mlp)) for _ in range(cfg.mtp_depths)])
        kinds, layer_kind = attention_kinds(cfg)
        self.layer_kind = tuple(layer_kind)
        layer_kinds = cfg.layer_kinds()
        self.recurrent = tuple(kind == "linear" for kind in layer_kinds)  # Gated DeltaNet layers
        self.hybrid = cfg.hybrid
        # A cached forward's caches come two per kind of layer (ModelConfig.caches): each layer's pair, and
        # its index in them (they stack the layers of their kind).
        self.cache_kinds = tuple(kind for kind in CACHE_NAMES if kind in layer_kinds)
        self.cache_pair = tuple(self.cache_kinds.index(kind) for kind in layer_kinds)
        self.cache_slot = tuple(layer_kinds[:i].count(layer_kinds[i]) for i in range(cfg.num_layers))
        self.pair_layers = tuple(tuple(i for i, kind in enumerate(layer_kinds) if kind == cache_kind)
                                 for cache_kind in self.cache_kinds)
        # which of the caches are the full layers' keys and the rings' (-1: none)
        self.full_keys, self.ring_keys = (2 * self.cache_kinds.index(kind) if kind in self.cache_kinds else -1
                                          for kind in ("full", "sliding"))
        self.windows = tuple(window for window, _, _ in kinds)
        # [head_dim / 2] per kind: RoPE rows are computed from positions, so an unused context costs nothing.
        # A tuple per kind, not one tensor: indexing a tensor is a slice kernel in every forward.
        self.inv_freq = tuple(Tensor(rope_inv_freq(cfg.rope_dim, theta, scaling)) for _, theta, scaling in kinds)
        self.rope_factors = tuple(rope_attention_factor(scaling) for _, _, scaling in kinds)  # YaRN scales cos, sin
        self.kind_windows = tuple(Tensor(np.array([window], np.int32)) for window in self.windows)
        self.attention_mask = AdditiveMask(cfg.num_heads, cfg.num_kv_heads)  # a flash core takes the indices as is
        self.cached_tables = CacheTables()  # a cached forward's rope tables and visibility (cache_tables)
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
        return self.project(self.norm(h))

    def project(self, h):
        """The output projection of final-normed h [..., hidden] -> fp32 logits [..., vocab]."""
        if self.output is None:  # tied: reuse the embedding table as the output projection
            out = self.lm_matmul(h.reshape(-1, h.shape[-1]), cast(self.tok_embeddings.weight, h.dtype))
            return cast(out.reshape(h.shape[:-1] + (-1,)), ms.float32)
        return cast(self.output(h), ms.float32)

    def rope_at(self, kind: int, positions):
        """cos, sin [.., d] of attention kind `kind` at int32 positions [..] (fp32, as HF: the angle
        position * inv_freq rounded to fp32, then its cosine and sine)."""
        cos, sin = rope_rows(positions, self.inv_freq[kind])
        return self.rope_scaled(kind, cos, sin)

    def rope_scaled(self, kind: int, cos, sin):
        """cos, sin times attention kind `kind`'s YaRN attention factor, when it has one."""
        if self.rope_factors[kind] != 1.0:
            return cos * self.rope_factors[kind], sin * self.rope_factors[kind]
        return cos, sin

    def window_of(self, kind: int):
        return self.kind_windows[kind]

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

    def cache_tables(self, b: int, s: int, t: int, start, pad, kind: int, first=0):
        """(cos, sin, visibility) of attention kind `kind` for a cached forward (CacheTables: key j holds slot
        first + j)."""
        cos, sin, seen = self.cached_tables(b, s, t, start, pad, self.inv_freq[kind], self.window_of(kind), first)
        return self.rope_scaled(kind, cos, sin) + (seen,)

    @staticmethod
    def cache_write_slots(s: int, t: int, start):
        """Where the new tokens are written (CacheWrite's `write`)."""
        slots = ops.arange(0, t, dtype=ms.int32)
        fresh = ops.logical_and(slots >= start, slots < start + s).reshape(t, 1)
        return ops.clip(slots - start, 0, s - 1), fresh, start

    @staticmethod
    def cache_write_places(b: int, heads: int, s: int, start):
        """CacheWrite's `write` for caches written in place: (places [b, heads, s, 3] int32, start): the (row,
        head, slot) of each new token's entry, slots start .. start+s-1."""
        rows = ops.broadcast_to(ops.arange(0, b, dtype=ms.int32).reshape(b, 1, 1, 1), (b, heads, s, 1))
        cols = ops.broadcast_to(ops.arange(0, heads, dtype=ms.int32).reshape(1, heads, 1, 1), (b, heads, s, 1))
        slots = ops.broadcast_to((start + ops.arange(0, s, dtype=ms.int32)).reshape(1, 1, s, 1), (b, heads, s, 1))
        return ops.concat((rows, cols, slots), -1), start

    @staticmethod
    def ring_slots(s: int, r: int, start):
        """A sliding layer's ring of r slots (slot j kept at j % r) around s new tokens at slots start..:
        `unroll` [r + s], the ring entries to gather as slots start - r .. start - 1 in order, then s places
        for the new tokens (the cache write fills them: `write`), and `keep` [r], the entries of that
        unrolled cache the ring keeps: the last r slots, each at its slot % r. A prompt longer than the
        window attends within its own new keys, then leaves its last r in the ring."""
        ring = ops.arange(0, r, dtype=ms.int32)
        unroll = ops.concat((ops.floor_mod(start + ring, r), ops.zeros((s,), ms.int32)))
        keep = s + ops.floor_mod(ring - start - s, r)
        return unroll, keep, Decoder.cache_write_slots(s, r + s, ops.ones_like(start) * r)

    def tables(self, kind: int, b: int, s: int, t: int, start, pad, segments, positions, first=0):
        """(cos, sin, mask) of one attention kind, in the compute dtype and broadcast as the backend asks."""
        cfg, dtype = self.cfg, self.compute_dtype
        if start is not None:
            cos, sin, seen = self.cache_tables(b, s, t, start, pad, kind, first)
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

    def construct(self, input_ids, caches=None, start=None, pad=None, segments=None, positions=None):
        b, s = input_ids.shape
        h, written, _ = self.decode(input_ids, caches, start, pad, segments, positions)
        if caches is None:
            return self.logits(h).reshape(b, -1, self.cfg.vocab_size)
        last = h.reshape(b, s, -1)[:, -1]  # logits only where the next token is read
        return (self.logits(last),) + written

    def features(self, input_ids, segments=None, positions=None):
        """Training: (the final-normed hidden states [b*q, hidden], which `project` turns into logits or
        a fused head reduces with head_weight, the MoE layers' routing loads)."""
        h, _, loads = self.decode(input_ids, None, None, None, segments, positions)
        return self.norm(h), loads

    def predict_ahead(self, h, tokens, segments=None, positions=None):
        """Multi-token prediction in training: h the final-normed states [b*s, hidden] of tokens[:, :-1]
        (tokens [b, s+1]) -> for each depth k = 1, 2, .. its final-normed states [b*s, hidden], whose targets
        are tokens[:, k+1:] at the first s - k positions of each row (mtp_targets). Every depth computes all s
        positions with the tables of the last layer's kind, as its blocks are built like that layer (and
        share its compiled graph); the last k - 1 take id 0 as the token k ahead, past the window: attention
        is causal, so the positions with a target never see them. Packed samples (segments, positions [b, s])
        attend within their own sample as in the layers; a position whose token k ahead lies in the next
        sample mixes it in, but has no target (mtp_targets), and no position with one attends to it."""
        b, s = tokens.shape[0], tokens.shape[1] - 1
        cos, sin, mask = self.tables(self.layer_kind[-1], b, s, s, None, None, segments, positions)
        ahead = ()
        for i, depth in enumerate(self.mtp):
            ids = tokens[:, i + 1:]                                              # the token i + 1 ahead
            if i > 0:
                ids = ops.concat((ids, ops.zeros((b, i), ids.dtype)), 1)
            h = depth(h, self.embed(ids.reshape(-1)), cos, sin, mask)
            ahead += (h,)
        return ahead

    def blocks(self) -> list:
        """Every Block: the layers', then the MTP depths' (a backend specialises them alike)."""
        return list(self.layers) + [depth.layer for depth in self.mtp]

    def head_weight(self):
        """The output projection [vocab, hidden]: the embedding table when the embeddings are tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @staticmethod
    def real_tokens(b: int, s: int, start, pad):
        """Which of the s new tokens of each row are not left padding [b, s] (a recurrent layer skips those)."""
        return (start + ops.arange(0, s, dtype=ms.int32)).reshape(1, s) >= pad.reshape(b, 1)

    def decode(self, input_ids, caches=None, start=None, pad=None, segments=None, positions=None):
        """The decoder layers: -> (residual stream [b*q, hidden], the caches given with the new tokens'
        entries written (ModelConfig.caches: keys and values, a ring's, a hybrid's states and conv windows),
        the MoE layers' routing loads)."""
        b, s = input_ids.shape
        if caches is None:
            return self.decode_whole(input_ids, segments, positions)
        # one Unstack pass per cache: indexing keys[i] is a StridedSlice per layer, far slower on CPU
        pairs = ()
        for p in range(len(self.cache_kinds)):
            pairs += ((ops.unstack(caches[2 * p], 0), ops.unstack(caches[2 * p + 1], 0)),)
        t = caches[self.full_keys].shape[3] if self.full_keys >= 0 else s
        h, written, loads = self.decode_cached(input_ids, pairs, start, pad, self.cache_write_slots(s, t, start))
        caches = ()
        for members in self.pair_layers:  # each pair restacked over its layers
            firsts, seconds = (), ()
            for i in members:
                firsts, seconds = firsts + (written[i][0],), seconds + (written[i][1],)
            caches += (ops.stack(firsts), ops.stack(seconds))
        return h, caches, loads

    def decode_cached(self, input_ids, pairs, start, pad, write):
        """The decoder layers over per-layer caches: pairs, for each kind of cache (cache_kinds), its two
        caches as tuples over the layers of that kind; `write` where the full layers write (CacheWrite) ->
        (residual stream [b*q, hidden], each layer's two caches with the new tokens written, the MoE
        layers' routing loads). A linear layer takes, in the place of a mask, which new tokens are real."""
        b, s = input_ids.shape
        t = pairs[self.full_keys // 2][0][0].shape[2] if self.full_keys >= 0 else s
        r, ring = 0, None
        if self.ring_keys >= 0:  # the sliding layers read and write their rings through these
            r = pairs[self.ring_keys // 2][0][0].shape[2]
            ring = self.ring_slots(s, r, start)
        kinds = ()
        for kind in range(len(self.windows)):
            if self.windows[kind]:  # a sliding kind's keys: its ring unrolled (slots start - r ..), then the new ones
                kinds += (self.tables(kind, b, s, r + s, start, pad, None, None, start - r),)
            else:
                kinds += (self.tables(kind, b, s, t, start, pad, None, None),)
        real = self.real_tokens(b, s, start, pad) if self.hybrid else None
        input_ids = self.local_tokens(input_ids)
        h = self.embed(input_ids.reshape(-1))
        loads, written = (), ()
        for i, layer in enumerate(self.layers):
            cos, sin, mask = kinds[self.layer_kind[i]]
            pair, slot = pairs[self.cache_pair[i]], self.cache_slot[i]
            cache_k, cache_v = pair[0][slot], pair[1][slot]
            if self.recurrent[i]:  # its state and conv window
                out = layer(h, cos, sin, real, cache_k, cache_v, write)
            elif self.windows[self.layer_kind[i]]:  # a ring
                unroll, keep, ring_write = ring
                cache_k, cache_v = ops.gather(cache_k, unroll, 2), ops.gather(cache_v, unroll, 2)
                out = layer(h, cos, sin, mask, cache_k, cache_v, ring_write)
                out = (out[0], ops.gather(out[1], keep, 2), ops.gather(out[2], keep, 2), out[3])
            else:
                out = layer(h, cos, sin, mask, cache_k, cache_v, write)
            h = out[0]
            written += ((out[1], out[2]),)
            if layer.routed:
                loads += (out[3],)
        return h, written, loads

    def decode_whole(self, input_ids, segments, positions):
        """decode without a cache: each row's whole sequence, or its packed samples."""
        b, s = input_ids.shape
        kinds = ()
        for kind in range(len(self.windows)):
            kinds += (self.tables(kind, b, s, s, None, None, segments, positions),)
        input_ids = self.local_tokens(input_ids)  # context parallel: this rank's chunks of the sequence
        # The residual stream stays 2-D [b*q, hidden]: every projection is a plain 2-D matmul.
        h = self.embed(input_ids.reshape(-1))
        loads = ()
        for i, layer in enumerate(self.layers):
            cos, sin, mask = kinds[self.layer_kind[i]]
            out = layer(h, cos, sin, segments if self.recurrent[i] else mask)
            h = out[0]
            if layer.routed:  # a MoE layer's routing load
                loads += (out[3],)
        return h, (), loads


def init_weights(model: Decoder, seed: int) -> None:
    """GPT-2 style init from a seeded numpy RNG: N(0, 0.02); residual outputs N(0, 0.02/sqrt(2L)). A Gated
    DeltaNet layer's decay as transformers starts Qwen3.5's: rates A = exp(A_log) ~ U(0.01, 16) per head, dt_bias 1
    (at A = 16 a head forgets within a token, at 0.01 it keeps a token for ~75)."""
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.num_layers)
    for name, p in model.parameters_and_names():
        if name.endswith("norm.weight"):
            continue  # their Cells' scale 1 (weight 1, or 0 under a (1 + w) offset)
        if name.endswith("A_log"):
            value = np.log(rng.uniform(0.01, 16.0, p.shape)).astype(np.float32)
        elif name.endswith("dt_bias"):
            value = np.ones(p.shape, np.float32)
        elif name.endswith("bias"):  # also a MoE router's expert_bias
            value = np.zeros(p.shape, np.float32)
        else:
            std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
            value = rng.normal(0.0, std, size=p.shape).astype(np.float32)
        p.set_data(Tensor(value))


def mtp_targets(tokens, k: int, mask=None, segments=None):
    """Depth k's targets of tokens [b, s+1]: labels [b*s], the token k + 1 ahead of each position (0 past the
    window), and mask [b*s] fp32, 1 at the s - k positions that have one. With the next-token mask [b, s]
    (SFT's response labels), position j has one where the label of j + k is learnt, and with segments [b, s]
    (packed samples) where j + k is also in j's sample: no target crosses into the next sample."""
    b, s = tokens.shape[0], tokens.shape[1] - 1
    labels = ops.concat((tokens[:, k + 1:], ops.zeros((b, k), tokens.dtype)), 1)
    if mask is None:
        ahead = (ops.arange(0, s, dtype=ms.int32) < s - k).astype(ms.float32)
        return labels.reshape(-1), ops.broadcast_to(ahead.reshape(1, s), (b, s)).reshape(-1)
    ahead = cast(mask[:, k:], ms.float32)
    if segments is not None:
        ahead = ahead * (segments[:, k:] == segments[:, :-k]).astype(ms.float32)
    return labels.reshape(-1), ops.concat((ahead, ops.zeros((b, k), ms.float32)), 1).reshape(-1)


# The name the decoder had when Llama was its only family.
Llama = Decoder


def build_model(cfg: ModelConfig, seed: int = 0, compute_dtype=ms.float32) -> Decoder:
    model = Decoder(cfg, compute_dtype)
    init_weights(model, seed)
    return model
