"""The attention cores in C++: the softmax core's mask-add + softmax and its backward (FusedSoftmaxAttention,
on SoftmaxAttention's hand-written backward; FusedSinkSoftmaxAttention with gpt-oss's sinks), and
FlashAttention, by blocks of keys (flash_attention.cc), and a cached forward's RoPE, cache write and flash core in
one kernel (CachedAttend)."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from msllm.kernels.op import aot, differentiable, in_place
from msllm.models import layers
from msllm.models.layers import cast

class SoftmaxAttention(layers.SoftmaxAttention):
    """The attention core with a hand-written backward (portable MindSpore ops; FusedSoftmaxAttention
    does its two passes in C++).

    Autodiff differentiates the softmax on the [.., s, t] probabilities (a multiply, a row sum, a
    subtract and a multiply over the whole score matrix). This backward uses
    rowsum(dP * P) = rowsum(dO * O), a row sum over head_dim instead of over t (as FlashAttention
    does), and folds the subtraction into the dP matmul.
    """

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__(num_heads, num_kv_heads)
        self.pt_x = ops.BatchMatMul(transpose_a=True)  # dv = P^T dO, dk = dS^T q

    def scores_grad(self, p, do, o, v):
        """dS = P * (dP - delta), delta = rowsum(dO * O); p [b, nkv, rows, t], do/o [b, nkv, rows, d]."""
        delta = ops.sum(cast(do, ms.float32) * cast(o, ms.float32), -1, keepdim=True)
        # dP - delta as one matmul, [dO, delta] @ [v, -1]^T: a broadcast subtract over the
        # [.., rows, t] matrix costs more than a same-shape element-wise op on CPU.
        minus_one = ops.full(v.shape[:-1] + (1,), -1.0, dtype=v.dtype)
        dp = self.qk(ops.concat((do, cast(delta, do.dtype)), -1), ops.concat((v, minus_one), -1))
        return p * cast(dp, ms.float32)

    def bprop(self, q, k, v, mask, out, dout):
        return self.grads(q, k, v, out[0], out[1], dout[0]) + (ops.zeros_like(mask),)

    def grads(self, q, k, v, o, probs, d_out):
        """dq, dk, dv from the forward's output o and probabilities, and the output's gradient d_out."""
        b, _, s, d = q.shape
        t, dv = k.shape[2], v.shape[-1]  # value heads may differ from q/k heads (MLA)
        rows = self.rep * s
        do = d_out.reshape(b, self.num_kv_heads, rows, dv)
        p = probs.reshape(b, self.num_kv_heads, rows, t)
        dv = self.pt_x(cast(p, v.dtype), do)
        ds = cast(self.scores_grad(p, do, o.reshape(b, self.num_kv_heads, rows, -1), v), q.dtype)
        dq = self.pv(ds, k).reshape(q.shape)
        dk = self.pt_x(ds, q.reshape(b, self.num_kv_heads, rows, d))
        return dq, dk, dv


class FusedSoftmaxAttention(SoftmaxAttention):
    """SoftmaxAttention (fp32) with mask-add + softmax, and the softmax backward, as one C++ pass each.
    The mask is read unbroadcast: [s, t], or [b, 1, s, t] ([b, 1, 1, s, t] with GQA) when rows differ."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__(num_heads, num_kv_heads)
        self.masked_softmax_op = aot("MaskedSoftmax")
        self.scores_grad_op = aot("SoftmaxAttentionGrad")

    def masked_softmax(self, scores, mask):
        return self.masked_softmax_op(scores, mask)

    def scores_grad(self, p, do, o, v):
        return self.scores_grad_op(p, self.qk(do, v), do, o)


class FusedSinkSoftmaxAttention(FusedSoftmaxAttention):
    """msllm.models.layers.SinkSoftmaxAttention (gpt-oss's sink logit per head, `sinks` [num_heads]) as
    FusedSoftmaxAttention: the softmax with the sinks in one C++ pass, which also returns each row's sink
    probability. The backward is FusedSoftmaxAttention's (a sink has no value, so dS = P (dP - delta) holds
    as it is), plus the sinks' gradient: -sum over each head's rows of sink probability x delta,
    delta = rowsum(dO * O). The mask is read unbroadcast, as FusedSoftmaxAttention reads it."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__(num_heads, num_kv_heads)
        self.sink_softmax = aot("MaskedSinkSoftmax", lambda scores, *_: (scores, scores[:-1]),
                                lambda *_: (ms.float32, ms.float32))

    def construct(self, q, k, v, mask, sinks):
        b, _, s, d = q.shape
        rows = self.rep * s
        scores = cast(self.qk(q.reshape(b, self.num_kv_heads, rows, d), k), ms.float32)
        probs, sink_probs = self.sink_softmax(scores, mask, cast(sinks, ms.float32))
        out = self.pv(cast(probs, v.dtype), v)
        return out.reshape(b, self.num_heads, s, v.shape[-1]), probs, sink_probs

    def bprop(self, q, k, v, mask, sinks, out, dout):
        o, probs, sink_probs = out
        b, _, s, _ = q.shape
        dq, dk, dv = self.grads(q, k, v, o, probs, dout[0])
        delta = ops.sum(cast(dout[0], ms.float32) * cast(o, ms.float32), -1)                   # [b, heads, s]
        d_sinks = -ops.sum(sink_probs.reshape(b, self.num_heads, s) * delta, (0, 2))
        return dq, dk, dv, ops.zeros_like(mask), cast(d_sinks, sinks.dtype)


def _out_and_lse_shapes(q, k, v, *_):
    """out [b, nh, s, dv], lse [b, nh, s]."""
    return q[:3] + v[3:], q[:3]


def _two_like_first(q, *_):
    return q, q


def _out_lse_and_its_grad(out, dout):
    """What the flash backward reads: out, lse and the gradient of out (lse's own is unused)."""
    return out[0], out[1], dout[0]


class FlashAttention(nn.Cell):
    """(out, lse) = softmax(q k^T over the visible keys) v, by blocks of keys with an online softmax:
    no [s, t] tensor forward or backward (flash_attention.cc says how). q [b, nh, s, d] already
    scaled, k [b, nkv, t, d], v [b, nkv, t, dv] (dv may differ from d: MLA), out [b, nh, s, dv]; `visibility` = (query slots [s], query segments [s] or [b, s],
    key segments [t] or [b, t], window [1]), int32 (msllm.models.layers.visibility). The same call as
    SoftmaxAttention, whose additive mask it replaces. Runs in fp32 whatever the compute dtype."""

    KERNEL, INPUTS = "FlashAttention", "q k v slot q_seg k_seg window"

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.attention = differentiable(self.KERNEL, self.INPUTS, _out_and_lse_shapes, _two_like_first,
                                        constant="slot q_seg k_seg window", reads=_out_lse_and_its_grad)

    def construct(self, q, k, v, visibility):
        slot, q_seg, k_seg, window = visibility
        out, lse = self.attention(cast(q, ms.float32), cast(k, ms.float32), cast(v, ms.float32), slot, q_seg, k_seg,
                                  window)
        return cast(out, q.dtype), lse


class SinkFlashAttention(FlashAttention):
    """FlashAttention whose every row also holds its head's sink logit (`sinks` [num_heads]), with no
    value: msllm.models.layers.SinkSoftmaxAttention's maths, the call of that core. The kernel starts each
    row's online softmax from the sink, so lse includes it; the backward kernel also returns the sinks'
    gradient, -sum over each head's rows of exp(sink - lse) * rowsum(dO * O)."""

    KERNEL, INPUTS = "FlashAttentionSinks", "q k v slot q_seg k_seg window sinks"

    def construct(self, q, k, v, visibility, sinks):
        slot, q_seg, k_seg, window = visibility
        out, lse = self.attention(cast(q, ms.float32), cast(k, ms.float32), cast(v, ms.float32), slot, q_seg, k_seg,
                                  window, cast(sinks, ms.float32))
        return cast(out, q.dtype), lse


def _cached_attention_shapes(q, k, v, cos, sin, cache_k, *_):
    """out [b, heads, s, h], lse [b, heads, s] of q [b*s, heads*h], with s the tables' and h the caches'."""
    s, h = cos[-2], cache_k[3]
    return [q[0] // s, q[1] // h, s, h], [q[0] // s, q[1] // h, s]


class CachedAttend(layers.Attend):
    """layers.Attend of a cached forward whose caches are written in place (msllm.inference.CachedInPlace), with a
    FlashAttention core (fp32, no sinks): RoPE, q's scale, the cache write and the core in one C++ kernel
    (cached_attention.cc) instead of five; other calls as layers.Attend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.scale = ms.Tensor([scale], ms.float32)
        inputs = "q k v cos sin cache_k cache_v start slot q_seg k_seg window scale"
        self.attention = in_place("CachedAttention", inputs, "cache_k cache_v", _cached_attention_shapes,
                                  _two_like_first, ints="start slot q_seg k_seg window")

    def construct(self, parts, q, k, v, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        if cache_k is None or len(write) != 2:
            return super().construct(parts, q, k, v, cos, sin, mask, cache_k, cache_v, write)
        slot, q_seg, k_seg, window = mask
        out, _ = self.attention(q, k, v, cos, sin, cache_k, cache_v, write[1], slot, q_seg, k_seg, window, self.scale)
        return out, ops.depend(cache_k, out), ops.depend(cache_v, out)
