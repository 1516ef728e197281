"""The decoder of every family as MindSpore Cells: blocks composed per layer from the family spec
in ModelConfig (the mixer each layer takes, q/k norm, norm offset, sandwich norms, MLP kind, dense or
MoE, embedding scale, sliding-window layers and their RoPE base, layers without RoPE) over the shared
Cells of layers.py.

Parameter names follow torchtitan: tok_embeddings, layers.N.attention.wq, ...,
layers.N.feed_forward.w1 (gate) / w2 (down) / w3 (up), norm, output. The KV cache is an optional,
preallocated input of the model's own forward: `model(ids, keys, values, start, pad)` writes the
new tokens' cache entries at slots start.. and attends to the filled part (litgpt's input_pos, as
data). Packed samples (SFT) are optional inputs too: `model(ids, segments=seg, positions=pos)` keeps
attention inside each sample and restarts its positions.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from msllm.config import ModelConfig
from msllm.models.layers import (AdditiveMask, Embedding, FeedForward, Linear, OneRankMean, RMSNorm, WholeSequence, cast,
                                 rope_attention_factor, rope_inv_freq, visibility)
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
        self.routed = mlp == "moe"
        self.feed_forward = MoE(cfg) if self.routed else FeedForward(cfg)
        self.ffn_out_norm = RMSNorm(h, eps, offset) if cfg.sandwich_norm else nn.Identity()

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        attn, k, v = self.attention(self.attention_norm(x), cos, sin, mask, cache_k, cache_v, write)
        x = x + self.attention_out_norm(attn)
        if not self.routed:
            return x + self.ffn_out_norm(self.feed_forward(self.ffn_norm(x))), k, v, None
        out, load = self.feed_forward(self.ffn_norm(x))
        return x + self.ffn_out_norm(out), k, v, load


class Decoder(nn.Cell):
    """input_ids [b, s] int32 -> logits [b, s, vocab] fp32 (under context parallel [b, q, vocab], of the
    q tokens `local_tokens` gives this rank).

    With a cache, keys / values [layers, b, kv_heads, max_len, head_dim] (preallocated; MLA's shapes:
    ModelConfig.cache_shapes), start
    int32 [1] and pad int32 [b]: the s new tokens sit at slots start .. start+s-1 of every row,
    whose first pad[r] slots are left padding (the token at slot j is at position j - pad[r]).
    A hybrid (Gated DeltaNet layers) also takes states and windows, its linear layers' recurrent states
    and conv windows (ModelConfig.cache_shapes; keys and values then hold its attention layers only).
    Returns (logits [b, vocab] of the last new token, keys, values with the new slots written[, states,
    windows after the new tokens]);
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
        self.recurrent = tuple(kind == "linear" for kind in cfg.layer_kinds())  # Gated DeltaNet layers
        # each layer's index in the caches of its kind (ModelConfig.cache_shapes stacks them per kind)
        self.cache_slot = tuple(self.recurrent[:i].count(self.recurrent[i]) for i in range(cfg.num_layers))
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

    def construct(self, input_ids, keys=None, values=None, start=None, pad=None, segments=None, positions=None,
                  states=None, windows=None):
        b, s = input_ids.shape
        h, caches, _ = self.decode(input_ids, keys, values, start, pad, segments, positions, states, windows)
        if keys is None:
            return self.logits(h).reshape(b, -1, self.cfg.vocab_size)
        last = h.reshape(b, s, -1)[:, -1]  # logits only where the next token is read
        return (self.logits(last),) + caches

    def features(self, input_ids, segments=None, positions=None):
        """Training: (the final-normed hidden states [b*q, hidden], which `project` turns into logits or
        a fused head reduces with head_weight, the MoE layers' routing loads)."""
        h, _, loads = self.decode(input_ids, None, None, None, None, segments, positions)
        return self.norm(h), loads

    def predict_ahead(self, h, tokens):
        """Multi-token prediction in training: h the final-normed states [b*s, hidden] of tokens[:, :-1]
        (tokens [b, s+1]) -> for each depth k = 1, 2, .. its final-normed states [b*s, hidden], whose targets
        are tokens[:, k+1:] at the first s - k positions of each row (mtp_targets). Every depth computes all s
        positions with the tables of the last layer's kind, as its blocks are built like that layer (and
        share its compiled graph); the last k - 1 take id 0 as the token k ahead, past the window: attention
        is causal, so the positions with a target never see them."""
        b, s = tokens.shape[0], tokens.shape[1] - 1
        cos, sin, mask = self.tables(self.layer_kind[-1], b, s, s, None, None, None, None)
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

    def decode(self, input_ids, keys, values, start, pad, segments, positions, states=None, windows=None):
        """The decoder layers: -> (residual stream [b*q, hidden], the caches given with the new tokens'
        entries written (keys and values; a hybrid's states and conv windows too), the MoE layers' routing loads).
        A linear layer takes, in the place of a mask, the packed samples' segments (training) or which new
        tokens are real (a cached forward)."""
        b, s = input_ids.shape
        t = s if keys is None else keys.shape[3]
        kinds = ()
        for kind in range(len(self.windows)):
            kinds += (self.tables(kind, b, s, t, start, pad, segments, positions),)
        input_ids = self.local_tokens(input_ids)  # context parallel: this rank's chunks of the sequence
        # The residual stream stays 2-D [b*q, hidden]: every projection is a plain 2-D matmul.
        h = self.embed(input_ids.reshape(-1))
        loads = ()
        if keys is None:
            for i, layer in enumerate(self.layers):
                cos, sin, mask = kinds[self.layer_kind[i]]
                out = layer(h, cos, sin, segments if self.recurrent[i] else mask)
                h = out[0]
                if layer.routed:  # a MoE layer's routing load
                    loads += (out[3],)
            return h, (), loads
        write = self.cache_write_slots(s, t, start)
        # one Unstack pass per cache: indexing keys[i] is a StridedSlice per layer, far slower on CPU
        keys, values = ops.unstack(keys, 0), ops.unstack(values, 0)
        real = None
        if states is not None:
            states, windows, real = ops.unstack(states, 0), ops.unstack(windows, 0), self.real_tokens(b, s, start, pad)
        new_keys, new_values, new_states, new_windows = (), (), (), ()
        for i, layer in enumerate(self.layers):
            cos, sin, mask = kinds[self.layer_kind[i]]
            slot = self.cache_slot[i]
            if self.recurrent[i]:
                out = layer(h, cos, sin, real, states[slot], windows[slot], write)
                new_states, new_windows = new_states + (out[1],), new_windows + (out[2],)
            else:
                out = layer(h, cos, sin, mask, keys[slot], values[slot], write)
                new_keys, new_values = new_keys + (out[1],), new_values + (out[2],)
            h = out[0]
            if layer.routed:
                loads += (out[3],)
        caches = (ops.stack(new_keys), ops.stack(new_values))
        if states is not None:
            caches += (ops.stack(new_states), ops.stack(new_windows))
        return h, caches, loads


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


def mtp_targets(tokens, k: int):
    """Depth k's targets of tokens [b, s+1]: labels [b*s], the token k + 1 ahead of each position (0 past the
    window), and mask [b*s] fp32, 1 at the s - k positions that have one."""
    b, s = tokens.shape[0], tokens.shape[1] - 1
    labels = ops.concat((tokens[:, k + 1:], ops.zeros((b, k), tokens.dtype)), 1)
    mask = (ops.arange(0, s, dtype=ms.int32) < s - k).astype(ms.float32)
    return labels.reshape(-1), ops.broadcast_to(mask.reshape(1, s), (b, s)).reshape(-1)


# The name the decoder had when Llama was its only family.
Llama = Decoder


def build_model(cfg: ModelConfig, seed: int = 0, compute_dtype=ms.float32) -> Decoder:
    model = Decoder(cfg, compute_dtype)
    init_weights(model, seed)
    return model
