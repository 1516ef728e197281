"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) as MindSpore Cells.

Each matmul, norm and the attention core is its own Cell holding its own primitive,
so a parallel strategy can later be attached per op (e.g. `linear.matmul.shard(...)`).
Parameter names follow torchtitan: tok_embeddings, layers.N.attention.wq, ...,
layers.N.feed_forward.w1 (gate) / w2 (down) / w3 (up), norm, output. Linear weights
are [out, in]. The code is shape-agnostic in batch and sequence (tables and masks
are sliced by the runtime length), so the same Cells export with dynamic shapes.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from msllm.config import ModelConfig


def cast(x, dtype):
    """x in dtype, without a Cast node when it already is (decided at compile time)."""
    return x if x.dtype == dtype else x.astype(dtype)


class Linear(nn.Cell):
    """y = x @ W^T (+ b); W is [out, in]. 2-D x goes straight to the matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(Tensor(np.zeros((out_features, in_features), np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros((out_features,), np.float32)), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        if x.ndim != 2:
            return self.construct(x.reshape(-1, self.in_features)).reshape(x.shape[:-1] + (self.out_features,))
        y = self.matmul(x, cast(self.weight, x.dtype))
        if self.bias is not None:
            y = y + cast(self.bias, y.dtype)
        return y


class Embedding(nn.Cell):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((vocab_size, hidden_size), np.float32)), name="weight")
        self.gather = ops.Gather()

    def construct(self, input_ids):
        return self.gather(self.weight, input_ids, 0)


class RMSNormCore(nn.Cell):
    """x [N, h] fp32, weight [h] -> x / sqrt(mean(x^2) + eps) * weight.

    Written with two skinny MatMuls so every element-wise op is same-shape: the row sum of
    squares is (x*x) @ ones and the per-element scale is rsqrt(..) @ weight, an outer product.
    Why: MindSpore's CPU kernels run a broadcasting multiply ([N, h] * [N, 1] or * [h]) ~3.4x
    slower than a same-shape one, and the plain formula needs several of them forward and
    backward; measured forward+backward per norm on W1 2.0 ms instead of 4.0 ms. Training on
    CPU swaps in msllm.kernels.FusedRMSNormCore (same maths, one pass).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps, self.inv_dim = dim, eps, 1.0 / dim
        self.ones = Tensor(np.ones((dim, 1), np.float32))
        self.matmul = ops.MatMul()

    def construct(self, x, weight):
        inv_rms = ops.rsqrt(self.matmul(x * x, self.ones) * self.inv_dim + self.eps)  # [N, 1]
        return x * self.matmul(inv_rms, weight.reshape(1, self.dim))                  # scale [N, h]


class RMSNorm(nn.Cell):
    """Normalises in fp32 whatever the compute dtype, then casts back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = Parameter(Tensor(np.ones((dim,), np.float32)), name="weight")
        self.core = RMSNormCore(dim, eps)

    def construct(self, x):
        dtype, shape = x.dtype, x.shape
        x = cast(x, ms.float32).reshape(-1, self.dim)
        return cast(self.core(x, self.weight).reshape(shape), dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies in fp32, matching Hugging Face's default / linear / llama3 rope."""
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))
    inv_freq = inv_freq.astype(np.float32)
    if not scaling:
        return inv_freq
    kind = scaling.get("type", scaling.get("rope_type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = np.outer(np.arange(cfg.max_seq_len, dtype=np.float32), inv_freq).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R = concat(-x[half:], x[:half]): HF's rotate_half as a signed permutation."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


def split_heads(x, head_dim: int, s: int):
    """[b*s, n*d] (or [b, s, n*d]) projection -> [b, n, s, d] heads."""
    return x.reshape(-1, s, x.shape[-1] // head_dim, head_dim).transpose(0, 2, 1, 3)


class Rope(nn.Cell):
    """A q or k projection [b*s, n*d] -> heads [b, n, s, d] with rotate-half RoPE applied.

    cos/sin: [s, d] tables, or the same already broadcast to the heads' shape (training, see
    Llama). The rotation is one small MatMul with a signed permutation (exact in any float
    dtype): measured 25% faster forward+backward on CPU than slice + negate + concat and their
    gradients. Training on CPU swaps in msllm.kernels.FusedRope (split + rotate in one pass).
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.rotate = Tensor(rotate_half_matrix(head_dim))
        self.matmul = ops.MatMul()

    def construct(self, x, cos, sin):
        x = split_heads(x, self.head_dim, cos.shape[-2])
        rotated = self.matmul(x.reshape(-1, self.head_dim), cast(self.rotate, x.dtype)).reshape(x.shape)
        return x * cos + rotated * sin


class AttentionCore(nn.Cell):
    """softmax(q k^T / sqrt(d) + causal) v with grouped KV heads, no KV copy.

    q [b, nh, s, d], k/v [b, nkv, t, d], mask additive: [s, t], or already broadcast to the
    scores ([b, nh, s, t]; [b, nkv, rep, s, t] with GQA), as Llama does once per step. With GQA
    the `rep` query heads that share a KV head are folded into the row axis, so one BatchMatMul
    serves the group.
    Softmax runs in fp32. The scale is applied to q ([.., s, d]) rather than the scores ([.., s, t]).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        self.softmax_attention = SoftmaxAttention(num_heads, num_kv_heads)

    def construct(self, q, k, v, mask):
        return self.softmax_attention(q * self.scale, k, v, mask)[0]


def scores_shape(num_heads: int, num_kv_heads: int, b: int, s: int, t: int) -> tuple:
    """Shape of the attention scores (and of a pre-broadcast mask): GQA keeps the `rep` query
    heads of a KV head as their own axis, [b, nkv, rep, s, t]; MHA is [b, nh, s, t]."""
    rep = num_heads // num_kv_heads
    return (b, num_heads, s, t) if rep == 1 else (b, num_kv_heads, rep, s, t)


class SoftmaxAttention(nn.Cell):
    """(out, probs) = softmax(q k^T + mask) v, with a hand-written backward.

    Why: autodiff differentiates the softmax on the [.., s, t] probabilities (a multiply, a row
    sum, a subtract and a multiply over the whole score matrix). The backward below uses
    rowsum(dP * P) = rowsum(dO * O), a row sum over head_dim instead of over t, as FlashAttention
    does, and folds the subtraction of it into the dP matmul. Measured on W1 (2 cores): attention
    forward+backward 32 -> 19 ms per layer. `probs` is returned so the backward gets it without
    recomputing; callers take [0].
    """

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.rep = num_heads, num_kv_heads, num_heads // num_kv_heads
        self.qk = ops.BatchMatMul(transpose_b=True)   # scores = q k^T; also dP = dO v^T
        self.pv = ops.BatchMatMul()                   # out = P v; also dq = dS k
        self.pt_x = ops.BatchMatMul(transpose_a=True)  # dv = P^T dO, dk = dS^T q
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
        return out.reshape(b, self.num_heads, s, d), probs

    def masked_softmax(self, scores, mask):
        return self.softmax(scores + mask)

    def scores_grad(self, p, do, o, v):
        """dS = P * (dP - delta), delta = rowsum(dO * O); p [b, nkv, rows, t], do/o [b, nkv, rows, d]."""
        delta = ops.sum(cast(do, ms.float32) * cast(o, ms.float32), -1, keepdim=True)
        # dP - delta as one matmul, [dO, delta] @ [v, -1]^T: a broadcast subtract over the
        # [.., rows, t] matrix costs ~2.5x a same-shape elementwise op on CPU.
        minus_one = ops.full(v.shape[:-1] + (1,), -1.0, dtype=v.dtype)
        dp = self.qk(ops.concat((do, cast(delta, do.dtype)), -1), ops.concat((v, minus_one), -1))
        return p * cast(dp, ms.float32)

    def bprop(self, q, k, v, mask, out, dout):
        o, probs = out
        b, _, s, d = q.shape
        t = k.shape[2]
        rows = self.rep * s
        do = dout[0].reshape(b, self.num_kv_heads, rows, d)
        p = probs.reshape(b, self.num_kv_heads, rows, t)
        dv = self.pt_x(cast(p, v.dtype), do)
        ds = cast(self.scores_grad(p, do, o.reshape(b, self.num_kv_heads, rows, d), v), q.dtype)
        dq = self.pv(ds, k).reshape(q.shape)
        dk = self.pt_x(ds, q.reshape(b, self.num_kv_heads, rows, d))
        return dq, dk, dv, ops.zeros_like(mask)


class Attention(nn.Cell):
    """x [..., h] (2-D [b*s, h] or 3-D [b, s, h]); the sequence length comes from the rope table."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.wq = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.wk = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.wv = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.num_heads * d, h)
        self.rope = Rope(d)
        self.core = AttentionCore(cfg.num_heads, cfg.num_kv_heads, d)

    def qkv(self, x, cos, sin):
        """Projected heads with RoPE applied: q [b, nh, s, d], k/v [b, nkv, s, d].

        cos/sin: [s, d] tables, or the same already broadcast to q's shape (training, see Llama).
        """
        q = self.rope(self.wq(x), cos, sin)
        if cos.ndim == 4 and self.num_kv_heads != self.num_heads:  # per-head tables: take the KV heads' rows
            cos, sin = cos[:, :self.num_kv_heads], sin[:, :self.num_kv_heads]
        k = self.rope(self.wk(x), cos, sin)
        return q, k, split_heads(self.wv(x), self.head_dim, cos.shape[-2])

    def attend(self, q, k, v, mask, x_shape):
        """Attention core and output projection back to x's shape."""
        return self.wo(self.core(q, k, v, mask).transpose(0, 2, 1, 3).reshape(x_shape))

    def construct(self, x, cos, sin, mask):
        q, k, v = self.qkv(x, cos, sin)
        return self.attend(q, k, v, mask, x.shape)


class SwiGLU(nn.Cell):
    """silu(gate) * up. Training on CPU swaps in msllm.kernels.FusedSwiGLU (same maths, one pass)."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, gate, up):
        # silu(g) = g * sigmoid(g) written out: measured ~20% faster forward+backward on CPU than
        # nn.SiLU, whose kernels MindSpore expands into more element-wise passes.
        return gate * self.sigmoid(gate) * up


class FeedForward(nn.Cell):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.hidden_size, cfg.ffn_size)
        self.w2 = Linear(cfg.ffn_size, cfg.hidden_size)
        self.w3 = Linear(cfg.hidden_size, cfg.ffn_size)
        self.act = SwiGLU()

    def construct(self, x):
        return self.w2(self.act(self.w1(x), self.w3(x)))


class Block(nn.Cell):
    # lazy_inline: MindSpore builds one block graph for all layers, with each layer's weights as
    # its arguments. `no_inline` says what happens to it: False inlines it into the caller per
    # layer in the frontend (what lazy_inline's policy="front" sets); True keeps it one sub-graph
    # that every layer calls, compiled once (Llama.share_block_graph). Left unset, MindSpore
    # would treat it as Ascend cell reuse, which the CPU backend refuses.
    @ms.lazy_inline
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.no_inline = False
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def construct(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Cell):
    """input_ids [b, s] int32 -> logits [b, s, vocab] fp32.

    Parameters are always fp32 (the master copy); `compute_dtype` (fp32, fp16 or bf16) is what
    matmuls and the residual stream run in. Norms, softmax and logits stay fp32.
    """

    def __init__(self, cfg: ModelConfig, compute_dtype=ms.float32):
        super().__init__()
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.CellList([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_matmul = ops.MatMul(transpose_b=True)
        cos, sin = rope_tables(cfg)
        self.rope_cos, self.rope_sin = Tensor(cos), Tensor(sin)
        causal = np.triu(np.full((cfg.max_seq_len, cfg.max_seq_len), -1e9, np.float32), k=1)
        self.causal_mask = Tensor(causal)
        # False when every layer takes the [s, d] rope tables and the [s, s] mask as they are
        # (msllm.kernels' fused rope and softmax read them per row): no per-head copies are made.
        self.broadcast_tables = True

    def share_block_graph(self, shared: bool = True) -> None:
        """True: every layer calls one compiled block graph, so compile time barely grows with depth
        (CPU, W1 shape: 32 layers compile in 1.8x the time of 2; inlined 5.8x), at ~2% per step for
        copying each layer's weights into the call. False (default): blocks are inlined per layer;
        MindIR export needs that (MindSpore 2.10 fails the dynamic-shape compile of the shared
        call: "The actor already exists"). The train step picks it: device.shares_block_graph."""
        for block in self.layers:
            block.no_inline = shared

    def embed(self, input_ids):
        """Token embeddings in the compute dtype (input_ids of any shape)."""
        return cast(self.tok_embeddings(input_ids), self.compute_dtype)

    def rope_at(self, start, stop):
        """cos, sin [stop - start, head_dim] for positions start .. stop-1, in the compute dtype."""
        dtype = self.compute_dtype
        return cast(self.rope_cos[start:stop], dtype), cast(self.rope_sin[start:stop], dtype)

    def logits(self, h):
        """Final norm + output projection; h [..., hidden] -> fp32 logits [..., vocab]."""
        h = self.norm(h)
        if self.output is None:  # tied: reuse the embedding table as the output projection
            out = self.lm_matmul(h.reshape(-1, h.shape[-1]), cast(self.tok_embeddings.weight, h.dtype))
            return cast(out.reshape(h.shape[:-1] + (-1,)), ms.float32)
        return cast(self.output(h), ms.float32)

    def construct(self, input_ids):
        b, s = input_ids.shape
        cfg = self.cfg
        # Broadcast the rope tables and the mask once for all layers: on CPU a broadcasting
        # element-wise op costs ~2-3x a same-shape one, and every layer applies them.
        cos, sin = self.rope_at(0, s)
        mask = self.causal_mask[:s, :s]
        if self.broadcast_tables:
            head_shape = (b, cfg.num_heads, s, cfg.head_dim)
            cos, sin = ops.broadcast_to(cos, head_shape), ops.broadcast_to(sin, head_shape)
            mask = ops.broadcast_to(mask, scores_shape(cfg.num_heads, cfg.num_kv_heads, b, s, s))
        # The residual stream stays 2-D [b*s, hidden]: every projection is a plain 2-D matmul.
        h = self.embed(input_ids.reshape(-1))
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.logits(h).reshape(b, s, -1)


class CausalLMLoss(nn.Cell):
    """Mean next-token cross-entropy in fp32, as one fused softmax-cross-entropy kernel
    (forward and gradient), instead of separate max / exp / sum / gather passes over the logits."""

    def __init__(self):
        super().__init__()
        self.cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()

    def construct(self, logits, labels):
        return self.cross_entropy(cast(logits, ms.float32).reshape(-1, logits.shape[-1]), labels.reshape(-1))


def init_weights(model: Llama, seed: int) -> None:
    """GPT-2 style init from a seeded numpy RNG: N(0, 0.02); residual outputs N(0, 0.02/sqrt(2L))."""
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.num_layers)
    for name, p in model.parameters_and_names():
        if name.endswith("norm.weight"):
            continue  # ones
        if name.endswith(".bias"):
            value = np.zeros(p.shape, np.float32)
        else:
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            value = rng.normal(0.0, std, size=p.shape).astype(np.float32)
        p.set_data(Tensor(value))


def build_model(cfg: ModelConfig, seed: int = 0, compute_dtype=ms.float32) -> Llama:
    model = Llama(cfg, compute_dtype)
    init_weights(model, seed)
    return model
