"""The sharded-maths oracle: a numpy Llama run the way dp x tp ranks (and pipeline stages) would run
it, with every weight and activation slice taken from msllm.layout.table and the collectives
written out, forward and backward.

All ranks run in lockstep; an activation is a list with one array per rank. With dp = tp = 1 this
is the plain model (held against msllm's MindSpore Llama in test_layouts.py), so "sharded equals
unsharded" is this file against itself at two layouts.

Which collective goes where is the Megatron-LM scheme the table describes: column-parallel outputs
stay split (heads, ffn, vocab), row-parallel outputs are partial sums (all-reduce, or reduce-scatter
onto tokens under sequence parallel), the vocab-parallel loss takes its max, sum of exponentials
and target logit across shards, and a weight several ranks hold receives the sum of their
partial gradients (KV heads shared by a GQA group; norms under sequence parallel; everything over dp).

flash=True runs each rank's attention as the table's FlashAttentionScore rows lay it out (Ascend's
core): its q and K/V head slices (after repeat_kv) checked against what the rank's projections
hold, so no data moves between them, and its query heads grouped onto its K/V heads by the
primitive's own GQA rule within the rank (local head j reads local K/V head j // (n1 / n2)).

Context parallel (Ascend's ring attention, sh.cp > 1): a rank's rows are its chunk of its replica's
one sequence (the table's batch cut over dp x cp), its RoPE at those positions, and its attention
the ring's steps over the cp group's K/V chunks in natural order with the online-softmax merge,
its dK / dV shares carried back to each chunk's owner; weight gradients are summed over dp x cp.

The Gemma 3 / Qwen3 parts, forward and backward: q/k norms on the heads each rank holds, where the
table's q/k norm rows put them (checked against the rank's wq / wk slices; their replicated weights'
gradients summed over the ranks), sandwich norms on the residual stream, (offset + w) norms, GeGLU,
scaled embeddings and scores, and per layer its attention kind: a sliding window's mask and its RoPE base.

A hybrid's Gated DeltaNet layers: each rank runs the delta rule token by token (the recurrent form, not
msllm's chunked one) on the key heads and their value heads its weight slices hold, in torch for its
autograd; only wo's row-parallel sum (and the input gradient's) crosses ranks, and the gated norm's
whole weight gets the sum of the ranks' gradients.
"""
from __future__ import annotations

import math
from functools import reduce

import numpy as np
import torch

from msllm.config import ModelConfig
from msllm.layout import table as L
from msllm.backends.cpu import rotate_half_matrix
from msllm.models.decoder import attention_kinds
from msllm.models.layers import rope_tables

TP = ("tp_kv", "tp_rep")


def init_params(m: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in L.param_shapes(m).items():
        scale = 1.0 if name.endswith("norm.weight") else 0.1
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    return out


class Ranks:
    """The dp x cp x tp ranks of the mesh, in rank order (dp, cp, tp_kv, tp_rep)."""

    def __init__(self, sh: L.Sharding):
        self.sh = sh
        self.coords = [{"dp": i, "cp": c, "tp_kv": j, "tp_rep": k} for i in range(sh.dp) for c in range(sh.cp)
                       for j in range(sh.tp_kv) for k in range(sh.tp_rep)]

    def groups(self, axes):
        """Ranks that differ only along `axes`, each group in chunk order."""
        found = {}
        for r, c in enumerate(self.coords):
            key = tuple(v for a, v in c.items() if a not in axes)
            found.setdefault(key, []).append(r)
        return list(found.values())

    def all_reduce(self, xs, axes=TP, op=np.add):
        out = list(xs)
        for g in self.groups(axes):
            total = reduce(op, [xs[r] for r in g])
            for r in g:
                out[r] = total
        return out

    def all_gather(self, xs, axes=TP):
        out = list(xs)
        for g in self.groups(axes):
            full = np.concatenate([xs[r] for r in g], axis=0)
            for r in g:
                out[r] = full
        return out

    def reduce_scatter(self, xs, axes=TP):
        out = list(xs)
        for g in self.groups(axes):
            parts = np.split(reduce(np.add, [xs[r] for r in g]), len(g), axis=0)
            for r, part in zip(g, parts):
                out[r] = part
        return out

    def chunk(self, xs, axes=TP):
        """Each rank keeps its own rows of a value it holds whole (no communication)."""
        out = list(xs)
        for g in self.groups(axes):
            for r, part in zip(g, np.split(xs[g[0]], len(g), axis=0)):
                out[r] = part
        return out


def each(fn, *lists):
    return [fn(*args) for args in zip(*lists)]


# ---- per-rank maths -----------------------------------------------------------------------------

def rmsnorm(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return x * r * w, (x, r, w)


def rmsnorm_back(dy, cache):
    """Over the last axis of rows of any rank; dw sums every other axis."""
    x, r, w = cache
    dw = np.sum((dy * x * r).reshape(-1, x.shape[-1]), 0)
    g = dy * w
    return r * g - x * r ** 3 * np.mean(g * x, -1, keepdims=True), dw


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_tanh_back(x):
    """d gelu_tanh / dx."""
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * np.sqrt(2.0 / np.pi) * (1.0 + 3 * 0.044715 * x ** 2)


def silu(x):
    return x * sigmoid(x)


def silu_back(x):
    """d silu / dx."""
    sx = sigmoid(x)
    return sx + x * sx * (1 - sx)


ACTIVATIONS = {"swiglu": (silu, silu_back), "geglu_tanh": (gelu_tanh, gelu_tanh_back)}  # the gate's, and its derivative


def causal_mask(s: int, window: int) -> np.ndarray:
    """Additive [s, s]: key j visible from query i when j <= i and (a window w > 0) i - j < w."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    visible = (j <= i) & ((window == 0) | (i - j < window))
    return np.where(visible, 0.0, -1e9).astype(np.float32)


class Rope:
    """RoPE at `positions` (a rank's rows of the sequence)."""

    def __init__(self, m: ModelConfig, positions: np.ndarray, theta: float | None = None, scaling: dict | None = None):
        cos, sin = rope_tables(m, theta, scaling)
        self.cos, self.sin, self.rot = cos[positions], sin[positions], rotate_half_matrix(m.head_size)

    def __call__(self, x):  # [b, n, s, d]
        return x * self.cos + (x @ self.rot) * self.sin

    def back(self, dy):
        return dy * self.cos + (dy * self.sin) @ self.rot.T


def attention(q, k, v, kv_of, mask):
    """q [b, nq, s, d] (scaled), k/v [b, nk, s, d]; query head j reads KV head kv_of[j]."""
    p = np.stack([_softmax(q[:, j] @ k[:, kv_of[j]].transpose(0, 2, 1) + mask) for j in range(q.shape[1])], 1)
    o = np.stack([p[:, j] @ v[:, kv_of[j]] for j in range(q.shape[1])], 1)
    return o, p


def attention_back(do, q, k, v, p, kv_of):
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j in range(q.shape[1]):
        kv = kv_of[j]
        dv[:, kv] += p[:, j].transpose(0, 2, 1) @ do[:, j]
        dp = do[:, j] @ v[:, kv].transpose(0, 2, 1)
        ds = p[:, j] * (dp - np.sum(dp * p[:, j], -1, keepdims=True))
        dq[:, j] = ds @ k[:, kv]
        dk[:, kv] += ds.transpose(0, 2, 1) @ q[:, j]
    return dq, dk, dv


def ring_attention(q, ks, vs, kv_of, own):
    """Rank `own` of a cp ring as MindSpore's ring attention runs it: q [b, nq, c, d] (scaled) its chunk
    of the sequence in natural order, ks / vs the K/V chunks in chunk order, visited as they arrive
    around the ring (own, own - 1, ..); a chunk after its own is hidden by causality, its own chunk is
    causal, earlier chunks whole. Online softmax: a running row max and sum, the output rescaled as
    each chunk merges. Returns (o, row log-sum-exp)."""
    b, nq, c, _ = q.shape
    row_max = np.full((b, nq, c, 1), -np.inf, np.float32)
    row_sum = np.zeros((b, nq, c, 1), np.float32)
    acc = np.zeros(q.shape[:3] + (vs[0].shape[-1],), np.float32)
    for j in ring_order(own, len(ks)):
        scores = _ring_scores(q, ks[j], kv_of, j == own)
        new_max = np.maximum(row_max, scores.max(-1, keepdims=True))
        p = np.exp(scores - new_max)
        rescale = np.exp(row_max - new_max)
        row_sum = row_sum * rescale + p.sum(-1, keepdims=True)
        acc = acc * rescale + np.stack([p[:, h] @ vs[j][:, kv_of[h]] for h in range(nq)], 1)
        row_max = new_max
    return acc / row_sum, row_max + np.log(row_sum)


def ring_attention_back(do, q, ks, vs, o, lse, kv_of, own):
    """Backward of ring_attention: dq, and per K/V chunk this rank's share of its dK / dV (the ring
    carries them back to the chunk's owner, which sums the shares)."""
    dq = np.zeros_like(q)
    dks, dvs = [np.zeros_like(k) for k in ks], [np.zeros_like(v) for v in vs]
    row_dot = np.sum(do * o, -1, keepdims=True)
    for j in ring_order(own, len(ks)):
        p = np.exp(_ring_scores(q, ks[j], kv_of, j == own) - lse)
        for h, kv in enumerate(kv_of):
            dvs[j][:, kv] += p[:, h].transpose(0, 2, 1) @ do[:, h]
            ds = p[:, h] * (do[:, h] @ vs[j][:, kv].transpose(0, 2, 1) - row_dot[:, h])
            dq[:, h] += ds @ ks[j][:, kv]
            dks[j][:, kv] += ds.transpose(0, 2, 1) @ q[:, h]
    return dq, dks, dvs


def ring_order(own: int, cp: int) -> list[int]:
    """The K/V chunks rank `own` computes with, in the order the ring brings them; chunks after its
    own arrive too but causality hides every key in them."""
    return [j for j in ((own - step) % cp for step in range(cp)) if j <= own]


def _ring_scores(q, k, kv_of, diagonal):
    scores = np.stack([q[:, h] @ k[:, kv].transpose(0, 2, 1) for h, kv in enumerate(kv_of)], 1)
    return scores + causal_mask(q.shape[2], 0) if diagonal else scores


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def heads(x, d, b, s):  # [b*s, n*d] -> [b, n, s, d]
    return x.reshape(b, s, -1, d).transpose(0, 2, 1, 3)


def merge(x):  # [b, n, s, d] -> [b*s, n*d]
    b, n, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * s, n * d)


def causal_conv(x, w):
    """Depthwise causal conv then SiLU: x [b, s, c], w [c, 1, kernel] (tap kernel - 1 reads the token itself)."""
    kernel = w.shape[-1]
    padded = torch.nn.functional.pad(x, (0, 0, kernel - 1, 0))
    out = sum(padded[:, j:j + x.shape[1]] * w[:, 0, j] for j in range(kernel))
    return torch.nn.functional.silu(out)


def gated_deltanet(a, w, m: ModelConfig, b: int, s: int):
    """A Gated DeltaNet layer on the heads of weights `w` (the rank's slices, torch): a [b*s, h] -> the rank's
    partial output [b*s, h] (its heads' share of wo). Per value head a state S [dk, dv]: each token decays
    it by exp(g), writes beta k (v - S^T k)^T, reads S^T q."""
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    nk, nv = w["wq.weight"].shape[0] // dk, w["wv.weight"].shape[0] // dv

    def part(which, d):  # projection, its conv, [b, s, heads, d]
        projected = (a @ w[f"w{which}.weight"].T).reshape(b, s, -1)
        return causal_conv(projected, w[f"conv_{which}.weight"]).reshape(b, s, -1, d)

    def unit(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q = unit(part("q", dk)).repeat_interleave(nv // nk, 2) * dk ** -0.5
    k = unit(part("k", dk)).repeat_interleave(nv // nk, 2)
    v = part("v", dv)
    beta = torch.sigmoid(a @ w["wb.weight"].T).reshape(b, s, nv)
    g = (-torch.exp(w["A_log"]) * torch.nn.functional.softplus(a @ w["wa.weight"].T + w["dt_bias"])).reshape(b, s, nv)
    state, outs = torch.zeros(b, nv, dk, dv, dtype=a.dtype), []
    for t in range(s):
        state = state * torch.exp(g[:, t, :, None, None])
        error = v[:, t] - torch.einsum("bnkv,bnk->bnv", state, k[:, t])
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        outs.append(torch.einsum("bnkv,bnk->bnv", state, q[:, t]))
    out = torch.stack(outs, 1)                                       # [b, s, nv, dv]
    out = out * torch.rsqrt((out * out).mean(-1, keepdim=True) + m.norm_eps) * w["norm.weight"]
    z = (a @ w["wz.weight"].T).reshape(b, s, nv, dv)
    return (out * torch.nn.functional.silu(z)).reshape(b * s, nv * dv) @ w["wo.weight"].T


# ---- the sharded model --------------------------------------------------------------------------

class ShardedLlama:
    """Llama split as the table says over `sh`'s dp x tp ranks; pipeline stages are subsets of its
    units (embed, block i, head) run in order. Gradients accumulate per rank in `grads`."""

    def __init__(self, params: dict, m: ModelConfig, sh: L.Sharding, seq: int, flash: bool = False):
        self.m, self.sh, self.ranks, self.flash = m, sh, Ranks(sh), flash or sh.cp > 1
        kinds, self.layer_kind = attention_kinds(m)
        # a rank's positions: its chunk of the sequence under cp (rows cut over dp x cp), else all
        chunk = seq // sh.cp
        self.positions = [np.arange(c["cp"] * chunk, (c["cp"] + 1) * chunk) for c in self.ranks.coords]
        self.ropes = [[Rope(m, pos, theta, scaling) for pos in self.positions] for _, theta, scaling in kinds]
        assert sh.cp == 1 or all(window == 0 for window, _, _ in kinds), "ring attention is causal only"
        self.masks = [causal_mask(seq, window) for window, _, _ in kinds]
        self.weights, self.starts = [], []
        for c in self.ranks.coords:
            w, st = {}, {}
            for name, full in params.items():
                layout, _ = L.param_entry(name)
                sl = L.shard_slices(full.shape, layout, sh, c)
                w[name], st[name] = full[sl].copy(), tuple(x.start for x in sl)
            self.weights.append(w)
            self.starts.append(st)
        self.grads = [{k: np.zeros_like(v) for k, v in w.items()} for w in self.weights]
        self.caches = {}

    # Weights a unit may touch; a pipeline stage restricts them to its own.
    def w(self, name):
        return [w[name] for w in self.weights]

    def add_grad(self, name, gs):
        for acc, g in zip(self.grads, gs):
            acc[name] += g

    def split_tokens(self):
        return self.sh.sequence_parallel

    # -- embedding: vocab-parallel lookup, summed over the tp group (fallback: every rank whole)
    def embed(self, ids_per_rank, key):
        name = "tok_embeddings.weight"
        if self.sh.vocab_split:
            parts = []
            for ids, w, st in zip(ids_per_rank, self.w(name), self.starts):
                local = ids - st[name][0]
                own = (local >= 0) & (local < w.shape[0])
                parts.append(np.where(own[:, None], w[np.clip(local, 0, w.shape[0] - 1)], 0).astype(np.float32))
            x = self.ranks.reduce_scatter(parts) if self.split_tokens() else self.ranks.all_reduce(parts)
        else:
            x = [w[ids] for ids, w in zip(ids_per_rank, self.w(name))]
            if self.split_tokens():
                x = self.ranks.chunk(x)
        self.caches[key, "embed"] = ids_per_rank
        return [xi * np.float32(self.m.embed_scale) for xi in x]

    def embed_back(self, dx, key):
        name = "tok_embeddings.weight"
        ids_per_rank = self.caches.pop((key, "embed"))
        dx = [g * np.float32(self.m.embed_scale) for g in dx]
        if self.sh.vocab_split:
            # forward summed partials (all-reduce / reduce-scatter): backward hands every rank the whole gradient
            full = self.ranks.all_gather(dx) if self.split_tokens() else dx
            gs = []
            for ids, g, w, st in zip(ids_per_rank, full, self.w(name), self.starts):
                local = ids - st[name][0]
                own = (local >= 0) & (local < w.shape[0])
                dw = np.zeros_like(w)
                np.add.at(dw, local[own], g[own])
                gs.append(dw)
        else:
            rows = self.ranks.chunk(ids_per_rank) if self.split_tokens() else ids_per_rank
            gs = []
            for ids, g, w in zip(rows, dx, self.w(name)):
                dw = np.zeros_like(w)
                np.add.at(dw, ids, g)
                gs.append(dw)
            if self.split_tokens():  # each rank saw its own tokens: partial sums
                gs = self.ranks.all_reduce(gs)
        self.add_grad(name, gs)

    # -- norms: replicated, or on each rank's tokens under sequence parallel
    def norm(self, x, name, key, gather=True):
        """gather: for column matmuls, which read whole rows; a sandwich norm's output stays on the
        residual stream's rows."""
        out = each(lambda xi, w: rmsnorm(xi, w + np.float32(self.m.norm_offset), self.m.norm_eps), x, self.w(name))
        self.caches[key, name] = [c for _, c in out]
        y = [yi for yi, _ in out]
        return self.ranks.all_gather(y) if self.split_tokens() and gather else y

    def norm_back(self, dy, name, key):
        caches = self.caches.pop((key, name))
        out = each(rmsnorm_back, dy, caches)
        dw = [g for _, g in out]
        if self.split_tokens():
            dw = self.ranks.all_reduce(dw)
        self.add_grad(name, dw)
        return [g for g, _ in out]

    def row_out(self, parts):
        """A row-parallel matmul's partial sums: all-reduced, or reduce-scattered onto tokens."""
        return self.ranks.reduce_scatter(parts) if self.split_tokens() else self.ranks.all_reduce(parts)

    def column_in_back(self, parts):
        """Gradient into a column-parallel matmul's (gathered / replicated) input: partial sums."""
        return self.ranks.reduce_scatter(parts) if self.split_tokens() else self.ranks.all_reduce(parts)

    def row_out_back(self, dy):
        """Backward of row_out: every rank needs the whole output gradient."""
        return self.ranks.all_gather(dy) if self.split_tokens() else dy

    # -- a Gated DeltaNet layer's mixer: each rank's heads in torch (autograd), wo's partial sums reduced
    def linear_mixer(self, a, i, b, s):
        p = f"layers.{i}.attention."
        leaves = []
        for r, ai in enumerate(a):
            w = {n[len(p):]: torch.tensor(v, requires_grad=True) for n, v in self.weights[r].items() if n.startswith(p)}
            at = torch.tensor(ai, requires_grad=True)
            leaves.append((at, w, gated_deltanet(at, w, self.m, b, s)))
        self.caches[(b, s, i), "linear"] = leaves
        return self.row_out([out.detach().numpy() for _, _, out in leaves])

    def linear_mixer_back(self, dy, i, b, s):
        p = f"layers.{i}.attention."
        leaves = self.caches.pop(((b, s, i), "linear"))
        for (at, w, out), dyi in zip(leaves, self.row_out_back(dy)):
            out.backward(torch.tensor(dyi))
        names = list(leaves[0][1])
        for name in names:
            grads = [w[name].grad.numpy() for _, w, _ in leaves]
            if L.param_entry(p + name)[1] == "replicated":  # the gated norm: every rank's heads used it
                grads = self.ranks.all_reduce(grads)
            self.add_grad(p + name, grads)
        return self.column_in_back([at.grad.numpy() for at, _, _ in leaves])

    # -- a transformer block
    def block(self, i, x, b, s):
        m, p = self.m, f"layers.{i}."
        d = m.head_size
        a = self.norm(x, p + "attention_norm.weight", (b, s, i))
        if m.layer_kinds()[i] == "linear":
            x = [xi + yi for xi, yi in zip(x, self.linear_mixer(a, i, b, s))]
            return self.mlp(i, x, b, s, (a,))
        proj = {}
        for name in ("wq", "wk", "wv"):
            w = self.w(p + f"attention.{name}.weight")
            y = [ai @ wi.T for ai, wi in zip(a, w)]
            if m.qkv_bias:
                y = [yi + bi for yi, bi in zip(y, self.w(p + f"attention.{name}.bias"))]
            proj[name] = [heads(yi, d, b, s) for yi in y]
        if m.qk_norm:
            for name, which in (("wq", "q"), ("wk", "k")):
                self.check_head_norm_layout(p, which)
                w = [wi + np.float32(m.norm_offset) for wi in self.w(p + f"attention.{which}_norm.weight")]
                normed = [rmsnorm(t, wi, m.norm_eps) for t, wi in zip(proj[name], w)]
                proj[name] = [y for y, _ in normed]
                self.caches[(b, s, i), f"{which}_norm"] = [c for _, c in normed]
        ropes, mask = self.ropes[self.layer_kind[i]], self.masks[self.layer_kind[i]]
        scale = np.float32(m.attn_scale or 1.0 / math.sqrt(d))
        q = [rope(t) * scale for t, rope in zip(proj["wq"], ropes)]
        k = [rope(t) for t, rope in zip(proj["wk"], ropes)]
        v = proj["wv"]
        kv_of = [self.kv_of(r, p) for r in range(len(a))]
        copies = [1] * len(a)
        if self.flash:
            kv_of, copies = zip(*[self.flash_layout(r, p, s) for r in range(len(a))])
            k = [np.repeat(ki, c, axis=1) for ki, c in zip(k, copies)]  # repeat_kv: copies of the rank's own heads
            v = [np.repeat(vi, c, axis=1) for vi, c in zip(v, copies)]
        if self.sh.cp > 1:
            att = self.ring(q, k, v, kv_of)
        else:
            att = each(lambda qi, ki, vi, kvi: attention(qi, ki, vi, kvi, mask), q, k, v, kv_of)
        o = [merge(oi) for oi, _ in att]
        attn_out = self.row_out([oi @ wi.T for oi, wi in zip(o, self.w(p + "attention.wo.weight"))])
        if m.o_bias:  # whole on every rank, added once after the row reduction (gpt-oss)
            attn_out = [yi + bi for yi, bi in zip(attn_out, self.w(p + "attention.wo.bias"))]
        if m.sandwich_norm:
            attn_out = self.norm(attn_out, p + "attention_out_norm.weight", (b, s, i, "attn_out"), gather=False)
        x = [xi + yi for xi, yi in zip(x, attn_out)]
        return self.mlp(i, x, b, s, (a, q, k, v, kv_of, copies, att, o))

    def mlp(self, i, x, b, s, mixer_cache):
        m, p = self.m, f"layers.{i}."
        a2 = self.norm(x, p + "ffn_norm.weight", (b, s, i, "ffn"))
        g = [ai @ wi.T for ai, wi in zip(a2, self.w(p + "feed_forward.w1.weight"))]
        u = [ai @ wi.T for ai, wi in zip(a2, self.w(p + "feed_forward.w3.weight"))]
        act, _ = ACTIVATIONS[m.mlp]
        hmid = [act(gi) * ui for gi, ui in zip(g, u)]
        mlp_out = self.row_out([hi @ wi.T for hi, wi in zip(hmid, self.w(p + "feed_forward.w2.weight"))])
        if m.sandwich_norm:
            mlp_out = self.norm(mlp_out, p + "ffn_out_norm.weight", (b, s, i, "ffn_out"), gather=False)
        x = [xi + yi for xi, yi in zip(x, mlp_out)]
        self.caches[(b, s, i), "block"] = mixer_cache + (a2, g, u, hmid)
        return x

    # -- context parallel: each cp group is a ring over its ranks' chunks, in chunk order
    def ring(self, q, k, v, kv_of):
        att = [None] * len(q)
        for group in self.ranks.groups(("cp",)):
            ks, vs = [k[r] for r in group], [v[r] for r in group]
            for own, r in enumerate(group):
                att[r] = ring_attention(q[r], ks, vs, kv_of[r], own)
        return att

    def ring_back(self, do, q, k, v, att, kv_of):
        dq, dk, dv = [None] * len(q), [None] * len(q), [None] * len(q)
        for group in self.ranks.groups(("cp",)):
            ks, vs = [k[r] for r in group], [v[r] for r in group]
            shares = {}
            for own, r in enumerate(group):
                o, lse = att[r]
                dq[r], shares[own, "k"], shares[own, "v"] = ring_attention_back(do[r], q[r], ks, vs, o, lse,
                                                                                kv_of[r], own)
            for j, r in enumerate(group):  # the ring brings every rank's share of chunk j back to its owner
                dk[r] = sum(shares[own, "k"][j] for own in range(len(group)))
                dv[r] = sum(shares[own, "v"][j] for own in range(len(group)))
        return list(zip(dq, dk, dv))

    def check_head_norm_layout(self, p, which):
        """The heads each rank's q / k norm reads, as the table's row cuts its [N, heads, d] input,
        are the heads of the rank's wq / wk slice: the norm needs no data from another rank."""
        m, d = self.m, self.m.head_size
        row = next(op for op in L.ops_for(m) if op.path == f"layers.*.attention.{which}_norm.core.square")
        n = m.num_heads if which == "q" else m.num_kv_heads
        for r, c in enumerate(self.ranks.coords):
            cut = L.shard_slices((self.sh.dp, n, d), row.inputs[0], self.sh, c)[1]
            first = self.starts[r][p + f"attention.w{which}.weight"][0] // d
            held = self.weights[r][p + f"attention.w{which}.weight"].shape[0] // d
            assert (cut.start, cut.stop) == (first, first + held), (which, c)

    def flash_layout(self, r, p, s):
        """Rank r's FlashAttentionScore as the table lays it out: (kv_of, K/V copies the rank holds).
        Checks that the primitive's q heads are the rank's wq heads, its K/V heads the repeat_kv
        copies of the rank's wk heads, and (ring attention) the sequence of q, k and v the rank's own
        rows (same slices: nothing to redistribute). s: the rank's tokens of a sequence."""
        m, sh, d = self.m, self.sh, self.m.head_size
        rows = {op.prim: op for op in L.ops_for(m, sh.core(True))}
        flash, repeat, c = rows["flash"], rows["repeat_kv"], self.ranks.coords[r]
        nh, kv, n = m.num_heads, m.num_kv_heads, sh.tp_rep
        q0 = self.starts[r][p + "attention.wq.weight"][0] // d
        k0 = self.starts[r][p + "attention.wk.weight"][0] // d
        nq = self.weights[r][p + "attention.wq.weight"].shape[0] // d
        nk = self.weights[r][p + "attention.wk.weight"].shape[0] // d
        q_heads = L.shard_slices((sh.dp, nh, 1, d), flash.inputs[0], sh, c, flat=flash.flat)[1]
        assert (q_heads.start, q_heads.stop) == (q0, q0 + nq)
        kv_in = L.shard_slices((sh.dp, kv, 1, 1, d), repeat.inputs[0], sh, c)[1]
        held = L.shard_slices((1, 1, n, 1, 1), repeat.inputs[1], sh, c)[2]
        assert (kv_in.start, kv_in.stop) == (k0, k0 + nk)
        repeated = [h * n + j for h in range(kv_in.start, kv_in.stop) for j in range(held.start, held.stop)]
        k_heads = L.shard_slices((sh.dp, kv * n, 1, d), flash.inputs[1], sh, c, flat=flash.flat)[1]
        assert flash.inputs[1] == flash.inputs[2] and list(range(k_heads.start, k_heads.stop)) == repeated
        for layout in flash.inputs[:3]:
            seq = L.shard_slices((sh.dp, nh, s * sh.cp, d), layout, sh, c, flat=flash.flat)[2]
            assert (seq.start, seq.stop) == (self.positions[r][0], self.positions[r][-1] + 1)
        group = nq // len(repeated)
        return [j // group for j in range(nq)], held.stop - held.start

    def kv_of(self, r, p):
        """Local KV head of each local query head on rank r, from where the table put their rows."""
        d, rep = self.m.head_size, self.m.num_heads // self.m.num_kv_heads
        q0 = self.starts[r][p + "attention.wq.weight"][0] // d
        k0 = self.starts[r][p + "attention.wk.weight"][0] // d
        nq = self.weights[r][p + "attention.wq.weight"].shape[0] // d
        return [(q0 + j) // rep - k0 for j in range(nq)]

    def block_back(self, i, dx, b, s):
        m, p = self.m, f"layers.{i}."
        d = m.head_size
        *mixer_cache, a2, g, u, hmid = self.caches.pop(((b, s, i), "block"))
        # MLP (its sandwich norm first: it normed the MLP's output on the residual stream's rows)
        dy = dx
        if m.sandwich_norm:
            dy = self.norm_back(dy, p + "ffn_out_norm.weight", (b, s, i, "ffn_out"))
        dy = self.row_out_back(dy)
        w2 = self.w(p + "feed_forward.w2.weight")
        self.add_grad(p + "feed_forward.w2.weight", [dyi.T @ hi for dyi, hi in zip(dy, hmid)])
        dh = [dyi @ wi for dyi, wi in zip(dy, w2)]
        act, act_back = ACTIVATIONS[m.mlp]
        dg = [dhi * ui * act_back(gi) for dhi, ui, gi in zip(dh, u, g)]
        du = [dhi * act(gi) for dhi, gi in zip(dh, g)]
        self.add_grad(p + "feed_forward.w1.weight", [dgi.T @ ai for dgi, ai in zip(dg, a2)])
        self.add_grad(p + "feed_forward.w3.weight", [dui.T @ ai for dui, ai in zip(du, a2)])
        da2 = self.column_in_back([dgi @ w1 + dui @ w3 for dgi, dui, w1, w3 in zip(
            dg, du, self.w(p + "feed_forward.w1.weight"), self.w(p + "feed_forward.w3.weight"))])
        dx = [dxi + gi for dxi, gi in zip(dx, self.norm_back(da2, p + "ffn_norm.weight", (b, s, i, "ffn")))]
        if m.layer_kinds()[i] == "linear":
            da = self.linear_mixer_back(dx, i, b, s)
            return [dxi + gi for dxi, gi in zip(dx, self.norm_back(da, p + "attention_norm.weight", (b, s, i)))]
        a, q, k, v, kv_of, copies, att, o = mixer_cache
        # attention
        dy = dx
        if m.sandwich_norm:
            dy = self.norm_back(dy, p + "attention_out_norm.weight", (b, s, i, "attn_out"))
        if m.o_bias:  # each rank's rows' share (its tokens under sequence parallel: summed over tp)
            shares = [dyi.sum(0) for dyi in dy]
            self.add_grad(p + "attention.wo.bias", self.ranks.all_reduce(shares) if self.split_tokens() else shares)
        dy = self.row_out_back(dy)
        wo = self.w(p + "attention.wo.weight")
        self.add_grad(p + "attention.wo.weight", [dyi.T @ oi for dyi, oi in zip(dy, o)])
        do = [heads(dyi @ wi, d, b, s) for dyi, wi in zip(dy, wo)]
        if self.sh.cp > 1:
            back = self.ring_back(do, q, k, v, att, kv_of)
        else:
            back = each(attention_back, do, q, k, v, [pi for _, pi in att], kv_of)
        ropes, scale = self.ropes[self.layer_kind[i]], np.float32(m.attn_scale or 1.0 / math.sqrt(d))
        dq = [rope.back(dqi * scale) for (dqi, _, _), rope in zip(back, ropes)]
        # repeat_kv's backward sums a rank's copies (the copies other ranks hold: the tp_rep sum below)
        dk = [rope.back(dki.reshape(b, -1, c, s, d).sum(2)) for (_, dki, _), c, rope in zip(back, copies, ropes)]
        dv = [dvi.reshape(b, -1, c, s, d).sum(2) for (_, _, dvi), c in zip(back, copies)]
        if m.qk_norm:  # per head; the replicated weights' gradients are partial over the ranks' heads
            for which, grads in (("q", dq), ("k", dk)):
                out = each(rmsnorm_back, grads, self.caches.pop(((b, s, i), f"{which}_norm")))
                grads[:] = [gi for gi, _ in out]
                self.add_grad(p + f"attention.{which}_norm.weight", self.ranks.all_reduce([dw for _, dw in out]))
        da = [np.zeros_like(ai) for ai in a]
        for name, grads in (("wq", dq), ("wk", dk), ("wv", dv)):
            flat = [merge(gi) for gi in grads]
            wg = [fi.T @ ai for fi, ai in zip(flat, a)]
            bg = [fi.sum(0) for fi in flat] if m.qkv_bias else None
            if name != "wq" and self.sh.tp_rep > 1:  # a KV head serves tp_rep ranks' query heads: sum them
                wg = self.ranks.all_reduce(wg, ("tp_rep",))
                bg = None if bg is None else self.ranks.all_reduce(bg, ("tp_rep",))
            self.add_grad(p + f"attention.{name}.weight", wg)
            if bg is not None:
                self.add_grad(p + f"attention.{name}.bias", bg)
            w = self.w(p + f"attention.{name}.weight")
            # the input gradient needs no such sum here: column_in_back adds all ranks' shares
            da = [dai + fi @ wi for dai, fi, wi in zip(da, flat, w)]
        da = self.column_in_back(da)
        return [dxi + gi for dxi, gi in zip(dx, self.norm_back(da, p + "attention_norm.weight", (b, s, i)))]

    # -- final norm, LM head and the loss (vocab-parallel, or whole on every rank)
    def head(self, x, labels_per_rank, n_total, key):
        xf = self.norm(x, "norm.weight", key)
        logits = [xi @ wi.T for xi, wi in zip(xf, self.w("output.weight"))]
        if self.sh.vocab_split:
            mx = self.ranks.all_reduce([l.max(-1, keepdims=True) for l in logits], op=np.maximum)
            ex = [np.exp(l - mi) for l, mi in zip(logits, mx)]
            se = self.ranks.all_reduce([e.sum(-1, keepdims=True) for e in ex])
            onehot = []
            for lab, l, st in zip(labels_per_rank, logits, self.starts):
                local = lab - st["output.weight"][0]
                oh = np.zeros_like(l)
                own = (local >= 0) & (local < l.shape[1])
                oh[np.nonzero(own)[0], local[own]] = 1.0
                onehot.append(oh)
            tgt = self.ranks.all_reduce([np.sum(l * oh, -1, keepdims=True) for l, oh in zip(logits, onehot)])
        else:
            mx = [l.max(-1, keepdims=True) for l in logits]
            ex = [np.exp(l - mi) for l, mi in zip(logits, mx)]
            se = [e.sum(-1, keepdims=True) for e in ex]
            onehot = [np.eye(l.shape[1], dtype=np.float32)[lab] for l, lab in zip(logits, labels_per_rank)]
            tgt = [np.sum(l * oh, -1, keepdims=True) for l, oh in zip(logits, onehot)]
        loss_rows = [np.log(s_) + mi - t for s_, mi, t in zip(se, mx, tgt)]
        dlogits = [(e / s_ - oh) / n_total for e, s_, oh in zip(ex, se, onehot)]
        self.caches[key, "head"] = (xf, dlogits)
        # the loss: every dp replica's row sum, once per replica (tp ranks hold the same value)
        first_of_replica = [g[0] for g in self.ranks.groups(TP)]
        return float(sum(loss_rows[r].sum() for r in first_of_replica) / n_total)

    def head_back(self, key):
        xf, dlogits = self.caches.pop((key, "head"))
        w = self.w("output.weight")
        self.add_grad("output.weight", [dl.T @ xi for dl, xi in zip(dlogits, xf)])
        dxf = [dl @ wi for dl, wi in zip(dlogits, w)]
        if self.sh.vocab_split:
            dxf = self.column_in_back(dxf)  # partial over vocab shards
        elif self.split_tokens():
            dxf = self.ranks.chunk(dxf)    # every rank computed the whole, identical: keep its rows
        return self.norm_back(dxf, "norm.weight", key)

    def reduce_dp(self):
        """Data and context parallel: every weight's gradient summed over the dp replicas and the cp chunks."""
        if self.sh.dp * self.sh.cp > 1:
            for name in self.grads[0]:
                for acc, g in zip(self.grads, self.ranks.all_reduce([gr[name] for gr in self.grads], ("dp", "cp"))):
                    acc[name] = g

    # -- one step over a batch
    def rows(self, ids: np.ndarray) -> list[np.ndarray]:
        """Each rank's token rows (the table's batch split of the [b*s] rows: its replica's sequences,
        under cp its chunk of its replica's one sequence)."""
        flat = ids.reshape(-1)
        return [flat[L.shard_slices(flat.shape, ("batch",), self.sh, c)[0]] for c in self.ranks.coords]

    def units(self):
        """The model in order: ("embed",), ("block", i), ("head",)."""
        return [("embed",)] + [("block", i) for i in range(self.m.num_layers)] + [("head",)]


def run_units(model: ShardedLlama, units, ids, labels, n_total, key, x=None):
    """Forward through `units` (a pipeline stage, or the whole model); returns the output activation
    (or the loss after the head)."""
    b_local, s = ids.shape[0] // model.sh.dp, ids.shape[1] // model.sh.cp
    for unit in units:
        if unit[0] == "embed":
            x = model.embed(model.rows(ids), key)
        elif unit[0] == "block":
            x = model.block(unit[1], x, b_local, s)
        else:
            return model.head(x, model.rows(labels), n_total, key)
    return x


def back_units(model: ShardedLlama, units, ids, key, dx=None):
    b_local, s = ids.shape[0] // model.sh.dp, ids.shape[1] // model.sh.cp
    for unit in reversed(units):
        if unit[0] == "head":
            dx = model.head_back(key)
        elif unit[0] == "block":
            dx = model.block_back(unit[1], dx, b_local, s)
        else:
            model.embed_back(dx, key)
    return dx


def loss_and_grads(params, m, sh, ids, labels, flash=False):
    """One forward and backward of the whole batch on every rank; returns (loss, per-rank grads)."""
    model = ShardedLlama(params, m, sh, ids.shape[1], flash)
    loss = run_units(model, model.units(), ids, labels, ids.size, "all")
    back_units(model, model.units(), ids, "all")
    model.reduce_dp()
    return loss, model
