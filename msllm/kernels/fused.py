"""One C++ pass each way for the element- and row-wise chains of a decoder layer (fp32): SwiGLU, GeGLU and
gpt-oss's clamped SwiGLU, RMSNorm, RoPE with the head split, the KV-cache write and a decode step's few-row
matmuls (a layer's projections of one input in one). MindSpore's CPU backend runs every element-wise op as its
own kernel and pass over memory (SwiGLU forward + backward takes ~8 kernels)."""
from __future__ import annotations

import ctypes
import functools
import os

import mindspore as ms
from mindspore import nn, ops
from msllm.kernels import build
from msllm.kernels.op import aot, differentiable, in_place
from msllm.models import layers


class _FusedGLU(nn.Cell):
    """act(gate) * up by the kernel KERNEL, one C++ pass forward and one backward (fp32)."""

    KERNEL: str

    def __init__(self):
        super().__init__()
        self.glu = differentiable(self.KERNEL, "gate up")

    def construct(self, gate, up):
        return self.glu(gate, up)


class FusedSwiGLU(_FusedGLU):
    """silu(gate) * up as one C++ pass forward and one backward (fp32); see msllm.models.layers.SwiGLU."""

    KERNEL = "SwiGLU"


class FusedGeGLU(_FusedGLU):
    """gelu_tanh(gate) * up as one C++ pass forward and one backward (fp32); see msllm.models.layers.GeGLU."""

    KERNEL = "GeGLU"


class FusedClampedSwiGLU(nn.Cell):
    """gpt-oss's clamped SwiGLU as one C++ pass forward and one backward (fp32); see
    msllm.models.layers.ClampedSwiGLU."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.alpha_limit = ms.Tensor([alpha, limit], ms.float32)
        self.clamped_swiglu = differentiable("ClampedSwiGLU", "gate up alpha_limit")

    def construct(self, gate, up):
        return self.clamped_swiglu(gate, up, self.alpha_limit)


class FusedRMSNormCore(nn.Cell):
    """x [N, h] fp32, weight [h] -> x / rms(x) * (offset + weight) in one C++ pass each way; see
    msllm.backends.cpu.RMSNormCore."""

    def __init__(self, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps_offset = ms.Tensor([eps, offset], ms.float32)
        self.rms_norm = differentiable("RMSNorm", "x weight eps_offset", constant="eps_offset")

    def construct(self, x, weight):
        return self.rms_norm(x, weight, self.eps_offset)


class FusedRope(nn.Cell):
    """msllm.models.layers.Rope (split into heads of head_dim + rotate-half RoPE of their first rope_dim
    features, partial when fewer) as one C++ pass each way (fp32). Takes the [s, rope_dim] tables (the
    decoder passes them unbroadcast when this is in use), or [b, 1, s, rope_dim] tables of each row's
    positions (a cached forward; packed samples and DPO branches in training)."""

    def __init__(self, head_dim: int, rope_dim: int = 0):
        super().__init__()
        self.head_dim, self.rope_dim = head_dim, rope_dim or head_dim

        def heads_shape(x, cos, sin):  # [b*s, n*head_dim] -> [b, n, s, head_dim]
            s = cos[-2]
            rows = functools.reduce(lambda a, b: a * b, x[:-1])
            return [rows // s, x[-1] // head_dim, s, head_dim]

        # The backward reads only the output gradient and the tables, and gives [b*s, n*head_dim] back.
        grad = aot("RopeHeadsGrad", lambda dy, c, s: [dy[0] * dy[2], dy[1] * dy[3]])

        def bprop(x, cos, sin, out, dout):
            return grad(dout, cos, sin).reshape(x.shape), ops.zeros_like(cos), ops.zeros_like(sin)

        self.rope = aot("RopeHeads", heads_shape, bprop=bprop, shape_by={"head_dim": head_dim})

    def construct(self, x, cos, sin):
        return self.rope(x, cos, sin)


class FusedCacheWrite(layers.CacheWrite):
    """msllm.models.layers.CacheWrite as one C++ copy of each cache with the new slots written (fp32, inference),
    or, given caches to write in place, a C++ write of the new slots alone (MindSpore's scatter on CPU copies
    the whole cache)."""

    def __init__(self):
        super().__init__()
        self.write = aot("CacheWrite", lambda k, v, ck, cv, st: (ck, cv), lambda k, v, ck, cv, st: (ck, cv))
        self.write_in_place = in_place("CacheWriteInPlace", "k v cache_k cache_v start", "cache_k cache_v",
                                       ints="start")

    def construct(self, k, v, cache_k, cache_v, write):
        if len(write) == 2:
            done = self.write_in_place(k, v, cache_k, cache_v, write[1])
            return ops.depend(cache_k, done), ops.depend(cache_v, done)
        return self.write(k, v, cache_k, cache_v, write[2])


def few_rows_outputs(x, *weights):
    """LinearsFewRows' output shapes (or dtypes) from its inputs': [m, n_i] for each weight [n_i, k]."""
    return tuple([x[0], w[0]] for w in weights)


def weights_dtypes(x, *weights):
    """LinearsFewRows' output dtypes: each weight's."""
    return weights


def forget_packed_weights() -> None:
    """Mark LinearsFewRows' packed copies of the weights stale (from 4 rows it multiplies by each weight packed once
    into panels, kept in the kernel library: as much memory as those weights), so each is packed again at its next
    use; those unused since the last call are freed. Call before weights that may have changed are used again.
    Only the libraries this process has loaded hold any."""
    for path in build.given:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:  # not loaded
            continue
        lib.ForgetPackedWeights()


class LinearFewRows(nn.Cell):
    """x [m, k] @ w [n, k]^T (fp32) by the C++ kernel when m <= FEW_ROWS (a decode step: every
    weight row read once), by MindSpore's MatMul otherwise (prefill); m is fixed at compile time."""

    FEW_ROWS = 16  # a GRPO rollout's batch: the kernel's register tiles beat MatMul there (benchmarks/)

    def __init__(self):
        super().__init__()
        self.linear = aot("LinearsFewRows", lambda x, w: [x[0], w[0]])
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x, w):
        if x.shape[0] <= self.FEW_ROWS:
            return self.linear(x, w)
        return self.matmul(x, w)


class PackedLinear(nn.Cell):
    """x [m, k] @ w [n, k]^T (fp32) by msllm's packed sgemm (sgemm.cc), and its backward's dx = dy w and
    dw = dy^T x. Not swapped into training: in the quiet W1 step it lost to MindSpore's MatMul on Llama and won on
    the hybrid (docs/cpu-backend.md)."""

    def __init__(self):
        super().__init__()
        self.linear = differentiable("PackedLinear", "x w", lambda x, w: [x[0], w[0]])

    def construct(self, x, w):
        if x.shape[-1] != w.shape[-1]:  # MatMul's check, in its words: msllm lint --compile finds the caller's line
            raise ValueError(f"For 'MatMul' the input dimensions must be equal, but got 'x1_col': {x.shape[-1]} "
                             f"and 'x2_row': {w.shape[-1]}.")
        return self.linear(x, w)


class ProjectionsFewRows(layers.Projections):
    """layers.Projections of a decode step's few rows (m <= LinearFewRows.FEW_ROWS, fp32) as one C++ kernel over
    all the Linears' weights, each read once, in place of a kernel launch per Linear; more rows, or a Linear with
    a bias or an adapter, go through the Linears."""

    def __init__(self):
        super().__init__()
        self.linears = aot("LinearsFewRows", few_rows_outputs, weights_dtypes)

    def construct(self, x, linears):
        # a Linear without a bias or an adapter projects by x @ W^T; a loop, not all(), folds to a constant
        few = x.shape[0] <= LinearFewRows.FEW_ROWS
        for linear in linears:  # noqa: GL106 (a layer's few Linears)
            few = few and isinstance(linear, layers.Linear) and linear.bias is None
        if few:
            return self.linears(x, *[linear.weight for linear in linears])  # noqa: GL106 (a layer's few Linears)
        return tuple(linear(x) for linear in linears)  # noqa: GL106 (a layer's few Linears)


def _cache_tables_shapes(start, pad, inv_freq, query_segments, key_slots):
    """cos, sin [b, 1, s, d], slots [s], key segments [b, t]."""
    b, s, d = pad[0], query_segments[0], 2 * inv_freq[0]
    return [b, 1, s, d], [b, 1, s, d], [s], [b, key_slots[0]]


def _cache_tables_dtypes(*_):
    return ms.float32, ms.float32, ms.int32, ms.int32


class FusedCacheTables(layers.CacheTables):
    """layers.CacheTables of a full cache (first 0) as one C++ kernel (cached_attention.cc) instead of ~11; a ring's
    (first a tensor) as layers.CacheTables."""

    def __init__(self):
        super().__init__()
        self.tables = aot("CacheTables", _cache_tables_shapes, _cache_tables_dtypes)

    def construct(self, b: int, s: int, t: int, start, pad, inv_freq, window, first=0):
        if not isinstance(first, int):
            return super().construct(b, s, t, start, pad, inv_freq, window, first)
        query_segments = ops.zeros((s,), ms.int32)
        cos, sin, slots, key_segments = self.tables(start, pad, inv_freq, query_segments, ops.zeros((t,), ms.int32))
        return cos, sin, layers.visibility(slots, query_segments, key_segments, window)


class FusedResidualNorm(layers.ResidualNorm):
    """layers.ResidualNorm of a 2-D fp32 residual stream with a FusedRMSNormCore norm as one C++ kernel
    (cached_attention.cc's AddRMSNorm, no backward: inference); any other as layers.ResidualNorm."""

    def __init__(self):
        super().__init__()
        self.add_norm = aot("AddRMSNorm", lambda x, *_: (x, x), lambda x, *_: (x, x))

    def construct(self, x, delta, norm):
        fused = isinstance(norm, layers.RMSNorm) and isinstance(norm.core, FusedRMSNormCore)
        if not fused or x.ndim != 2 or x.dtype != ms.float32 or delta.dtype != ms.float32:
            return super().construct(x, delta, norm)
        return self.add_norm(x, delta, norm.weight, norm.core.eps_offset)


class SwiGLUFewRows(layers.ActivatedLinear):
    """layers.ActivatedLinear of a decode step's few rows (m <= LinearFewRows.FEW_ROWS, fp32) with FusedSwiGLU and
    a Linear without a bias or an adapter as one C++ kernel (cached_attention.cc's SwiGLULinear); any other as
    layers.ActivatedLinear."""

    def __init__(self):
        super().__init__()
        self.swiglu_linear = aot("SwiGLULinear", lambda gate, up, w: [gate[0], w[0]], lambda gate, up, w: w)

    def construct(self, gate, up, act, linear):
        few = gate.shape[0] <= LinearFewRows.FEW_ROWS and isinstance(act, FusedSwiGLU)
        if few and isinstance(linear, layers.Linear) and linear.bias is None:
            return self.swiglu_linear(gate, up, linear.weight)
        return super().construct(gate, up, act, linear)
