"""Gated DeltaNet's two cores in C++: the gated delta rule (gated_delta_rule.cc) and the causal conv with its
SiLU (causal_conv.cc), each the same call as its graph form in msllm.models.mixers.gated_deltanet; and a decode
step's whole recurrence (gated_delta_rule.cc) as one kernel."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from msllm.config import GATED_DELTA_CHUNK
from msllm.kernels.op import differentiable, in_place
from msllm.models.layers import cast


def _state_and_grads(out, dout):
    """What the rule's backward reads: the saved states and the gradients of out and the final state."""
    return out[2], dout[0], dout[1]


class GatedDeltaRule(nn.Cell):
    """msllm.models.mixers.gated_deltanet.ChunkedGatedDeltaRule in C++ (gated_delta_rule.cc), the same call:
    token by token on the state, 32 value columns at a time (a block that stays in L1), forward and a
    hand-written backward, no [chunk, chunk] tensor. q and k stay per key head: a value head reads its key
    head's rows, and backward sums a key head's value heads into its gradients (no repeated copy and no
    ReduceSum of its gradient, which took ~2 % of the W1 hybrid step).
    Training saves the state every `chunk` tokens ([b, heads, s / chunk, dk, dv]), from which backward
    recomputes a chunk at a time; inference (training False) saves none. Runs in fp32."""

    def __init__(self, chunk: int = GATED_DELTA_CHUNK, training: bool = True):
        super().__init__()
        self.chunk = chunk

        def shapes(q, k, v, g, beta, segments, initial):  # out, final state, saved states
            b, n, s, dv = v
            return v, initial, [b, n, -(-s // chunk), q[-1], dv] if training else [1]

        self.rule = differentiable("GatedDeltaRule", "q k v g beta segments initial", shapes,
                                   lambda *dtypes: (ms.float32,) * 3, constant="segments", reads=_state_and_grads,
                                   grad_dtype=lambda *dtypes: (ms.float32,) * 6,
                                   shape_by={"chunk": chunk, "training": training})

    def construct(self, q, k, v, g, beta, segments=None, initial=None):
        b, n, s, dv = v.shape
        segments = ops.zeros((b, s), ms.int32) if segments is None else segments.astype(ms.int32)
        initial = ops.zeros((b, n, q.shape[-1], dv), ms.float32) if initial is None else cast(initial, ms.float32)
        out, state, _ = self.rule(q, k, v, g, beta, segments, initial)
        return out, state


def _conv_shape(x, *_):
    """[b, s, c] as is; [b, s, heads, d] (normalised heads) -> [b, heads, s, d]."""
    return [x[0], x[2], x[1], x[3]] if len(x) == 4 else x


class FusedCausalConv(nn.Cell):
    """msllm.models.mixers.gated_deltanet.ShiftedTaps in C++ (causal_conv.cc), the same call: the depthwise
    causal conv and its SiLU (and with head_dim, the per-head L2 norm and the head-major layout) in one
    pass, a backward that saves only the inputs (the graph form keeps each tap's shifted copy and a padded
    gradient per tap, the norm's and the transpose's tensors). Runs in fp32."""

    def __init__(self):
        super().__init__()
        self.conv = differentiable("CausalConvSiLU", "x weight segments before", _conv_shape, constant="segments")

    def construct(self, x, weight, segments, before, head_dim: int = 0):
        b, s, c = x.shape
        segments = ops.zeros((b, s), ms.int32) if segments is None else segments.astype(ms.int32)
        x32 = cast(x, ms.float32)
        if head_dim:
            x32 = x32.reshape(b, s, c // head_dim, head_dim)
        out = self.conv(x32, cast(weight, ms.float32), segments, cast(before, ms.float32))
        return out if head_dim else cast(out, x.dtype)


def _read_out_shape(q, k, v, a, b, conv_q, conv_k, conv_v, a_log, dt_bias, state, window):
    return [state[0], state[1], state[3]]


class GatedDeltaStep(nn.Cell):
    """msllm.models.mixers.gated_deltanet.GatedDeltaNet.recurrence for one token a row with its caches written in
    place, as one C++ kernel (gated_delta_rule.cc, forward only): the conv window's shift, the three causal convs
    and their SiLU, q's and k's L2 norms, the decay and beta, the state update and its read-out, where the separate
    kernels and graph ops launched ~30. q, k, v, a, b: the token's projections [b, width]; state and window: the
    layer's cache Parameters -> the read-out [b, value heads, d_v]. fp32."""

    def __init__(self):
        super().__init__()
        self.step = in_place("GatedDeltaStep", "q k v a b conv_q conv_k conv_v A_log dt_bias state window",
                             "state window", _read_out_shape)

    def construct(self, q, k, v, a, b, conv_q, conv_k, conv_v, a_log, dt_bias, state, window):
        return self.step(q, k, v, a, b, conv_q, conv_k, conv_v, a_log, dt_bias, state, window)
