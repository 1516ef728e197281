"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the linear-attention mixer of Qwen3.5's and
Qwen3-Next's "linear" layers.

Each value head keeps a state S [d_k, d_v] that every token first decays and then corrects toward its
value (the delta rule): S <- exp(g) S + beta k (v - exp(g) S^T k)^T, out = S^T q. q, k and v (wq, wk,
wv) go through a depthwise causal conv (SiLU), q and k L2-normalised per head; beta =
sigmoid(wb x), the decay g = -exp(A_log) softplus(wa x + dt_bias) per value head. The output is
RMS-normed per head and gated by silu(wz x) before wo. Value heads may outnumber key heads: each key
head serves a run of consecutive value heads.

Training and prefill use the chunked form: within a chunk of 64 tokens a few matmuls (the intra-chunk
part, a unit lower-triangular inverse), across chunks the state carried one chunk at a time, so no
tensor is larger than [chunk, chunk] per head and memory stays linear in the sequence; autodiff gives
the backward. Names: attention.wq, wk, wv, wz, wb, wa, conv_q, conv_k, conv_v, dt_bias, A_log, norm, wo.

The conv is three depthwise convs, one per projection (Hugging Face's conv1d is their channels
concatenated: interop/maps/qwen3_5.py), so every per-head tensor is a contiguous run of key heads and a
tensor-parallel rank's slice of each is one block (msllm.layout.table).
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from msllm.config import GATED_DELTA_CHUNK, ModelConfig
from msllm.models.layers import Linear, Projections, RMSNorm, SwiGLU, cast

L2_EPS = 1e-6  # q and k are normalised as the FLA kernels (and transformers' fallback) do


def l2_normalise(x):
    return x * ops.rsqrt(ops.sum(x * x, -1, keepdim=True) + L2_EPS)


class ShiftedTaps(nn.Cell):
    """CausalConv's maths: x [b, s, c], weight [c, k], segments [b, s] or None, before [b, k - 1, c] (the
    inputs before x) -> silu(conv) [b, s, c], written as k shifted multiply-adds. With head_dim d, the
    output L2-normalised per head of d channels, in fp32 and head-major, [b, c / d, s, d] (q and k). A
    device may swap in a fused core of the same call (msllm.kernels.FusedCausalConv)."""

    def construct(self, x, weight, segments, before, head_dim: int = 0):
        b, s, c = x.shape
        k = weight.shape[-1]
        padded = ops.concat((before, x), 1)
        out = padded[:, k - 1:] * weight[:, k - 1]
        for j in range(k - 1):  # tap j reads the token k - 1 - j back
            tap = padded[:, j:j + s]
            if segments is not None:
                tap = tap * cast(same_sample_back(segments, k - 1 - j).expand_dims(-1), x.dtype)
            out = out + tap * weight[:, j]
        out = out * ops.sigmoid(out)
        if not head_dim:
            return out
        return l2_normalise(cast(out, ms.float32).reshape(b, s, c // head_dim, head_dim)).transpose(0, 2, 1, 3)


class CausalConv(nn.Cell):
    """Depthwise causal conv over the sequence, then SiLU, of one projection (q, k or v: each its own
    weight, so a tp cut by heads is a contiguous slice of each): x [b, s, c] -> [b, s, c] or, given
    head_dim, L2-normalised per head [b, heads, s, head_dim] in fp32; each channel the sum of its last
    `kernel` inputs weighted by weight[c, 0, :] (transformers' Conv1d layout). With packed samples
    (segments [b, s]) a token reads no input of an earlier sample, as if its sample ran alone. `window`
    [b, kernel - 1, c]: the inputs before x (a cached forward, taken as of the row's first sample; zeros
    otherwise). Returns (out, the last kernel - 1 inputs: the next window)."""

    def __init__(self, channels: int, kernel: int, head_dim: int = 0):
        super().__init__()
        self.kernel, self.head_dim = kernel, head_dim
        self.weight = Parameter(initializer("zeros", (channels, 1, kernel), ms.float32), name="weight")
        self.core = ShiftedTaps()

    def construct(self, x, segments=None, window=None):
        b, s, c = x.shape
        k = self.kernel
        before = ops.zeros((b, k - 1, c), x.dtype) if window is None else cast(window, x.dtype)
        out = self.core(x, cast(self.weight.reshape(c, k), x.dtype), segments, before, self.head_dim)
        return out, ops.concat((before, x), 1)[:, s:]


def same_sample_back(segments, back: int):
    """segments [b, s] -> whether the token `back` places earlier is of the same sample [b, s] (bool); a
    token before the row (the window) is of the row's first sample."""
    b, s = segments.shape
    earlier = ops.concat((ops.broadcast_to(segments[:, :1], (b, back)), segments[:, :s - back]), 1)
    return earlier == segments


def unit_lower_inverse(a, size: int):
    """(I + A)^-1 for strictly lower-triangular A [.., n, n]: A is nilpotent, so the inverse is the
    series sum_k (-A)^k, evaluated as (I - A)(I + A^2)(I + A^4).. in log2(n) matmul pairs."""
    power = -a
    inverse = ops.eye(size, size, a.dtype) + power
    for _ in range(max(0, math.ceil(math.log2(size)) - 1)):
        power = ops.matmul(power, power)
        inverse = inverse + ops.matmul(inverse, power)
    return inverse


class ChunkedGatedDeltaRule(nn.Cell):
    """The gated delta rule over a whole sequence by chunks (fp32): q, k [b, nk, s, dk] (normalised, q
    scaled; each key head serves a run of value_heads_per_key consecutive value heads), v [b, nv, s, dv], g, beta
    [b, nv, s] -> (out [b, nv, s, dv], final state [b, nv, dk, dv]).

    In a chunk with decays cumulated from its start (c_i) and the state S entering it, the WY form of
    the rule gives u = T (beta v), w = T (beta k exp(c)) with T = (I + tril(beta k k^T exp(c_i - c_j), -1))^-1;
    then v' = u - w S, out = (q exp(c)) S + (q k^T exp(c_i - c_j), causal) v', and the state leaving it is
    exp(c_last) S + (k exp(c_last - c))^T v'.

    Packed samples (segments [b, s]): every path from token j to token i of another sample is cut, the
    pairs within a chunk and the reads and writes of the carried state, so each sample starts from a
    zero state as if it ran alone."""

    def __init__(self, chunk: int = GATED_DELTA_CHUNK, value_heads_per_key: int = 1):
        super().__init__()
        self.chunk = chunk
        # of the config: an exported graph's shapes are dynamic, and a test on them would compile to a Switch
        self.value_heads_per_key = value_heads_per_key
        # [chunk, chunk] masks, sliced to a shorter sequence's one chunk: inclusive and strict lower
        # triangles, and -1e30 above the diagonal (exp() of it is 0, with no overflow)
        self.causal = Tensor(np.tril(np.ones((chunk, chunk), np.float32)))
        self.strict = Tensor(np.tril(np.ones((chunk, chunk), np.float32), -1))
        self.above = Tensor(np.triu(np.full((chunk, chunk), -1e30, np.float32), 1))

    def construct(self, q, k, v, g, beta, segments=None, initial=None):
        if self.value_heads_per_key > 1:
            q, k = repeat_heads(q, self.value_heads_per_key), repeat_heads(k, self.value_heads_per_key)
        b, n, s, dk = q.shape
        dv = v.shape[-1]
        size = min(self.chunk, s)
        pad = (size - s % size) % size
        if pad:  # padded tokens have beta 0 and decay 1: they change no state and are cut from the output
            q, k, v = (ops.concat((x, ops.zeros((b, n, pad, x.shape[-1]), x.dtype)), 2) for x in (q, k, v))
            g, beta = (ops.concat((x, ops.zeros((b, n, pad), x.dtype)), 2) for x in (g, beta))
            if segments is not None:  # the last sample goes on through the padding
                segments = ops.concat((segments, ops.broadcast_to(segments[:, -1:], (b, pad))), 1)
        chunks = (s + pad) // size
        q, k, v = (x.reshape(b, n, chunks, size, -1) for x in (q, k, v))
        g, beta = g.reshape(b, n, chunks, size), beta.reshape(b, n, chunks, size)

        causal, strict, above = (m[:size, :size] for m in (self.causal, self.strict, self.above))
        cum = ops.cumsum(g, -1)
        decay = ops.exp((cum.expand_dims(-1) - cum.expand_dims(-2)) * causal + above)  # [.., i, j]: c_i - c_j
        from_start = ops.exp(cum).expand_dims(-1)
        k_write = k * ops.exp(cum[..., -1:] - cum).expand_dims(-1)
        carry = ops.exp(cum[..., -1]).reshape(b, n, chunks, 1, 1)
        q_read = q * from_start
        if segments is not None:
            same, continues, to_last, carries = sample_masks(segments.reshape(b, 1, chunks, size))
            decay = decay * same
            from_start = from_start * continues  # a token of a new sample reads no carried state..
            q_read = q_read * continues
            k_write = k_write * to_last        # ..only the chunk's last sample writes the state it hands on
            carry = carry * carries
        k_beta = k * beta.expand_dims(-1)
        inverse = unit_lower_inverse(ops.matmul(k_beta, k.swapaxes(-1, -2)) * decay * strict, size)
        u = ops.matmul(inverse, v * beta.expand_dims(-1))
        w = ops.matmul(inverse, k_beta * from_start)
        intra = ops.matmul(q, k.swapaxes(-1, -2)) * decay

        state = ops.zeros((b, n, dk, dv), ms.float32) if initial is None else cast(initial, ms.float32)
        outs = []
        for i in range(chunks):
            fresh = u[:, :, i] - ops.matmul(w[:, :, i], state)
            outs.append(ops.matmul(q_read[:, :, i], state) + ops.matmul(intra[:, :, i], fresh))
            state = state * carry[:, :, i] + ops.matmul(k_write[:, :, i].swapaxes(-1, -2), fresh)
        out = ops.concat(outs, 2) if chunks > 1 else outs[0]
        return out[:, :, :s] if pad else out, state


def repeat_heads(x, times: int):
    """[b, key heads, s, d] -> [b, key heads * times, s, d], each key head repeated for its run of value heads."""
    b, n, s, d = x.shape
    return ops.broadcast_to(x.expand_dims(2), (b, n, times, s, d)).reshape(b, n * times, s, d)


def sample_masks(segments):
    """Packed samples' masks of the chunked rule from chunked segments [b, 1, chunks, size] (fp32):
    same sample for each pair of a chunk [.., size, size]; each token of the sample the state entering its
    chunk belongs to, and of the chunk's last sample [.., size, 1]; whether the chunk's last token is of the
    sample entering it (the carried state survives the chunk) [.., 1, 1]."""
    b, _, chunks, size = segments.shape
    same = cast(segments.expand_dims(-1) == segments.expand_dims(-2), ms.float32)
    last = segments[..., -1:]
    before = ops.concat((segments[:, :, :1, :1], last[:, :, :-1]), 2)  # the token before each chunk
    continues = segments == before
    carries = cast(continues[..., -1:], ms.float32).expand_dims(-1)
    return same, cast(continues, ms.float32).expand_dims(-1), cast(segments == last, ms.float32).expand_dims(-1), carries


class GatedDeltaNet(nn.Cell):
    """x [b*s, h] -> (out [b*s, h], state, window), the mixer interface (msllm.models.mixers). cos / sin
    only give the sequence length. A linear layer is causal by construction: in the place of a mask the
    decoder passes the packed samples' segments [b, s] (None: one sample per row), or, in a cached forward,
    which new tokens are real [b, s] (left padding is zeroed, so it changes neither state nor window).

    Its cache (cache_k, cache_v) is the recurrent state [b, value heads, d_k, d_v] and the conv window
    [b, kernel - 1, conv channels] the tokens before these left, returned updated; the state has no slots,
    so of `write` only its form is read: given the in-place form (Decoder.cache_write_places) the caches are
    Parameters and are written here. A prefill runs the chunked form; a decode step's one token is a chunk of
    one, which is the recurrent form."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_key_heads, self.num_value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.value_heads_per_key = self.num_value_heads // self.num_key_heads  # the rule's, whoever builds it
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        keys, values = self.num_key_heads * self.key_dim, self.num_value_heads * self.value_dim
        self.wq, self.wk, self.wv = Linear(h, keys), Linear(h, keys), Linear(h, values)
        self.wz = Linear(h, values)
        self.wb = Linear(h, self.num_value_heads)
        self.wa = Linear(h, self.num_value_heads)
        self.project = Projections()  # the six above, of one x
        self.conv_q = CausalConv(keys, cfg.linear_conv_kernel, self.key_dim)
        self.conv_k = CausalConv(keys, cfg.linear_conv_kernel, self.key_dim)
        self.conv_v = CausalConv(values, cfg.linear_conv_kernel)
        self.dt_bias = Parameter(Tensor(np.ones(self.num_value_heads, np.float32)), name="dt_bias")
        self.A_log = Parameter(Tensor(np.zeros(self.num_value_heads, np.float32)), name="A_log")
        self.norm = RMSNorm(self.value_dim, cfg.norm_eps)  # scales by w (not 1 + w) in every family that has it
        self.gate = SwiGLU()  # silu(z) * normed out (a device may fuse it)
        self.wo = Linear(values, h)
        self.rule = ChunkedGatedDeltaRule(value_heads_per_key=self.value_heads_per_key)
        # a device's one kernel for recurrence at one token a row, its caches written in place (msllm.backends):
        # (q, k, v, a, b projections, the convs' weights, A_log, dt_bias, state, window) -> read-out [b, heads, d_v]
        self.decode_step = None

    def projections(self, x):
        """x [b*s, h] -> its projections by wq, wk, wv, wz, wa, wb: (xq, xk, xv, xz, xa, xb), [b*s, width] each."""
        return self.project(x, (self.wq, self.wk, self.wv, self.wz, self.wa, self.wb))

    def recurrence(self, projected, b: int, s: int, segments, state, window):
        """The projections -> (the rule's read-out [b*s*value heads, d_v] in token order, its final state, the
        conv window the tokens leave): xq, xk, xv through the convs, xa and xb the decay and the rule's beta."""
        xq, xk, xv, _, xa, xb = projected
        keys = self.num_key_heads * self.key_dim
        # the cached window holds the three convs' channels side by side, q then k then v
        windows = (None,) * 3 if window is None else ops.split(window, (keys, keys, window.shape[-1] - 2 * keys), -1)
        q, window_q = self.conv_q(xq.reshape(b, s, -1), segments, windows[0])  # [b, key heads, s, dk]
        k, window_k = self.conv_k(xk.reshape(b, s, -1), segments, windows[1])  # normalised, fp32
        v, window_v = self.conv_v(xv.reshape(b, s, -1), segments, windows[2])
        q = q * self.key_dim ** -0.5  # q and k stay per key head: the rule serves each one's value heads
        v = cast(v, ms.float32).reshape(b, s, self.num_value_heads, self.value_dim).transpose(0, 2, 1, 3)
        beta = ops.sigmoid(cast(xb, ms.float32)).reshape(b, s, -1).transpose(0, 2, 1)
        g = -ops.exp(self.A_log) * ops.softplus(cast(xa, ms.float32) + self.dt_bias)
        out, state = self.rule(q, k, v, g.reshape(b, s, -1).transpose(0, 2, 1), beta, segments, state)
        window = None if window is None else ops.concat((window_q, window_k, window_v), -1)
        return out.transpose(0, 2, 1, 3).reshape(-1, self.value_dim), state, window

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        s = cos.shape[-2]
        b = x.shape[0] // s
        if cache_k is None:
            projected = self.projections(x)
            out, _, _ = self.recurrence(projected, b, s, mask, None, None)
            return self.wo(self.gated(out, projected[3])), cache_k, cache_v
        x = x * cast(mask.reshape(-1, 1), x.dtype)  # left padding zeroed: it changes neither state nor window
        projected = self.projections(x)
        if len(write) == 3:  # caches in and out (CachedForward: the exported graphs)
            out, state, window = self.recurrence(projected, b, s, None, cache_k, cache_v)
            return self.wo(self.gated(out, projected[3])), cast(state, cache_k.dtype), cast(window, cache_v.dtype)
        # the caches are Parameters, written here (msllm.inference.CachedInPlace)
        if s == 1 and self.decode_step is not None:
            xq, xk, xv, _, xa, xb = projected
            out = self.decode_step(xq, xk, xv, xa, xb, self.conv_q.weight, self.conv_k.weight, self.conv_v.weight,
                                   self.A_log, self.dt_bias, cache_k, cache_v)
            out = out.reshape(-1, self.value_dim)
        else:
            out, state, window = self.recurrence(projected, b, s, None, cache_k, cache_v)
            out = ops.depend(out, ops.assign(cache_k, cast(state, cache_k.dtype)))
            out = ops.depend(out, ops.assign(cache_v, cast(window, cache_v.dtype)))
        return self.wo(self.gated(out, projected[3])), ops.depend(cache_k, out), ops.depend(cache_v, out)

    def gated(self, out, z):
        """The read-out rows [.., d_v] RMS-normed per head and gated by silu(z), z the wz projection ->
        [b*s, value heads * d_v] in z's dtype."""
        z32 = cast(z, ms.float32).reshape(-1, self.value_dim)
        return cast(self.gate(z32, self.norm(out)), z.dtype).reshape(-1, self.num_value_heads * self.value_dim)
