"""Fused CPU kernels (C++: cpu_kernels.cc, causal_conv.cc, flash_attention.cc, gated_delta_rule.cc,
grouped_matmul.cc, linear_cross_entropy.cc) as MindSpore AOT Custom ops.

MindSpore's CPU backend runs every element-wise op as its own kernel and pass over memory:
the optimizer tail of a step (clip multiply, decay multiply, write-back, Adam) touches each
parameter-sized tensor four times, the gradient norm twice, SwiGLU forward + backward takes
~8 kernels. These do each chain in one pass: AdamW (in place) and the sum of squares, each
one call for all parameters, and RMSNorm, SwiGLU, RoPE with the head split, and the attention
softmax, each with its gradient. They are a CPU-backend accelerator only: on other backends,
without g++, or with train.fused_kernels: off, msllm uses the portable MindSpore-op
formulation of the same maths (tests hold both against each other and against torch).

The library is compiled once per source version, build flags and CPU with the system g++ into
$MSLLM_CACHE/kernels (default ~/.cache/msllm/kernels), written to a temp file and renamed, so
a crash never leaves a half-written library behind. It targets -march=$MSLLM_KERNEL_MARCH
(default native: AVX-512 where the CPU has it, AVX2 on e.g. AMD EPYC); the file name hashes
the flags and the CPU's feature flags, so a home directory copied to another CPU rebuilds
rather than loading code its CPU may not run.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops import signature as sig

from msllm.config import GATED_DELTA_CHUNK
from msllm.errors import UserError
from msllm.staged import cache_root
from msllm.models import layers
from msllm.models.layers import cast

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_kernels.cc", "causal_conv.cc", "flash_attention.cc", "gated_delta_rule.cc", "grouped_matmul.cc",
                        "linear_cross_entropy.cc")]
HEADERS = [Path(__file__).with_name("common.h")]
# -fno-math-errno lets sqrt vectorize; no -ffast-math: results stay IEEE (same as the portable path).
FLAGS = ["-O3", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread"]


def march() -> str:
    """The build's -march: $MSLLM_KERNEL_MARCH, default native (e.g. x86-64-v3 for an AVX2 build)."""
    return os.environ.get("MSLLM_KERNEL_MARCH", "native")


def flags(arch: str | None = None) -> list[str]:
    return [*FLAGS, f"-march={arch or march()}"]


class KernelBuildError(UserError, RuntimeError):
    pass


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: part of the cache key, since -march=native code may not run elsewhere."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_bytes().splitlines() if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def library_path(arch: str | None = None) -> Path:
    """Where the build for -march=`arch` (default march()) on this CPU is cached."""
    build = " ".join(flags(arch)).encode()
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(code + b"\0" + build + b"\0" + _cpu_flags()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def library(arch: str | None = None) -> str:
    """Path of the compiled kernel library for -march=`arch` (default march()), built on first use."""
    return _library(arch or march())


@functools.lru_cache(maxsize=None)
def _library(arch: str) -> str:
    target = library_path(arch)
    if target.exists():
        return str(target)
    compiler = shutil.which("g++")
    if compiler is None:
        raise KernelBuildError("fused CPU kernels need g++ (apt install g++), or set train.fused_kernels: off")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags(arch), "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise KernelBuildError(f"building {SOURCES[0].parent}/*.cc failed: {first_error}; "
                                   f"set train.fused_kernels: off to train without it")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return str(target)


library.cache_clear = _library.cache_clear  # forget the paths built or found in this process


def enabled(mode: str = "auto") -> bool:
    """Whether to use the fused kernels: mode auto on the CPU backend with g++ present."""
    return (mode == "auto" and ms.get_context("device_target") == "CPU"
            and (library_path().exists() or shutil.which("g++") is not None))


def has_sgemm() -> bool:
    """Whether MindSpore's CPU backend carries oneDNN's dnnl_sgemm, which GroupedMatmul calls (its
    libdnnl.so.3, loaded with the backend)."""
    import ctypes
    try:
        return hasattr(ctypes.CDLL(str(Path(ms.__file__).parent / "lib" / "libdnnl.so.3")), "dnnl_sgemm")
    except OSError:
        return False


def _one_float(*_):
    return [1]


def _float32(*_):
    return ms.float32


def _same_as_first(*shapes):
    return shapes[0]


def _dtype_of_first(*dtypes):
    return dtypes[0]


def _aot(name: str, out_shape=_same_as_first, out_dtype=_dtype_of_first, bprop=None):
    """The kernel `name` of the library as a MindSpore op (output shape/dtype as inferred from the inputs)."""
    return ops.Custom(f"{library()}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot",
                      bprop=bprop)


class AdamWUpdate(ops.Custom):
    """(w_1..w_n, m_1..m_n, v_1..v_n, g_1..g_n, [lr_t, lr, beta1, beta2, eps_t, grad_coef], weight_decay [n]) -> [1].

    Updates the n parameters and their moments in place, all in one kernel call: one graph node
    for the whole optimizer instead of one per parameter, which keeps compile time flat in depth.
    """

    def __init__(self, n: int):
        super().__init__(f"{library()}:AdamWUpdate", out_shape=_one_float, out_dtype=_float32, func_type="aot")
        # Marking w, m, v as written makes MindSpore order this op like its own Adam kernel
        # (after every read of the old values, before the next step).
        written = [sig.make_sig(f"{name}{i}", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T)
                   for name in ("w", "m", "v") for i in range(n)]
        read = [sig.make_sig(f"g{i}", dtype=sig.sig_dtype.T) for i in range(n)]
        self.__mindspore_signature__ = tuple(written + read + [sig.make_sig("scalars", dtype=sig.sig_dtype.T),
                                                               sig.make_sig("weight_decay", dtype=sig.sig_dtype.T)])
        self.add_prim_attr("side_effect_mem", True)


def sum_of_squares_op():
    """(g_1, .., g_n) (fp32, any shapes) -> [1] the sum of all their squares, in one kernel call."""
    return _aot("SumOfSquares", _one_float, _float32)


class FusedSwiGLU(nn.Cell):
    """silu(gate) * up as one C++ pass forward and one backward (fp32); see msllm.models.layers.SwiGLU."""

    def __init__(self):
        super().__init__()
        grad = _aot("SwiGLUGrad", lambda g, u, d: (g, g), lambda g, u, d: (g, g))

        def bprop(gate, up, out, dout):
            return grad(gate, up, dout)

        self.swiglu = _aot("SwiGLU", bprop=bprop)

    def construct(self, gate, up):
        return self.swiglu(gate, up)


class FusedClampedSwiGLU(nn.Cell):
    """gpt-oss's clamped SwiGLU as one C++ pass forward and one backward (fp32); see
    msllm.models.layers.ClampedSwiGLU."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.alpha_limit = ms.Tensor([alpha, limit], ms.float32)
        grad = _aot("ClampedSwiGLUGrad", lambda g, u, c, d: (g, g, c), lambda g, u, c, d: (g, g, c))

        def bprop(gate, up, alpha_limit, out, dout):
            return grad(gate, up, alpha_limit, dout)

        self.clamped_swiglu = _aot("ClampedSwiGLU", bprop=bprop)

    def construct(self, gate, up):
        return self.clamped_swiglu(gate, up, self.alpha_limit)


class FusedGeGLU(nn.Cell):
    """gelu_tanh(gate) * up as one C++ pass forward and one backward (fp32); see msllm.models.layers.GeGLU."""

    def __init__(self):
        super().__init__()
        grad = _aot("GeGLUGrad", lambda g, u, d: (g, g), lambda g, u, d: (g, g))

        def bprop(gate, up, out, dout):
            return grad(gate, up, dout)

        self.geglu = _aot("GeGLU", bprop=bprop)

    def construct(self, gate, up):
        return self.geglu(gate, up)


class FusedRMSNormCore(nn.Cell):
    """x [N, h] fp32, weight [h] -> x / rms(x) * weight in one C++ pass each way; see msllm.backends.cpu.RMSNormCore."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = ms.Tensor([eps], ms.float32)
        grad = _aot("RMSNormGrad", lambda x, w, e, dy: (x, w, e), lambda x, w, e, dy: (x, w, e))

        def bprop(x, weight, eps, out, dout):
            return grad(x, weight, eps, dout)

        self.rms_norm = _aot("RMSNorm", bprop=bprop)

    def construct(self, x, weight):
        return self.rms_norm(x, weight, self.eps)


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
        o, probs = out
        b, _, s, d = q.shape
        t, dv = k.shape[2], v.shape[-1]  # value heads may differ from q/k heads (MLA)
        rows = self.rep * s
        do = dout[0].reshape(b, self.num_kv_heads, rows, dv)
        p = probs.reshape(b, self.num_kv_heads, rows, t)
        dv = self.pt_x(cast(p, v.dtype), do)
        ds = cast(self.scores_grad(p, do, o.reshape(b, self.num_kv_heads, rows, -1), v), q.dtype)
        dq = self.pv(ds, k).reshape(q.shape)
        dk = self.pt_x(ds, q.reshape(b, self.num_kv_heads, rows, d))
        return dq, dk, dv, ops.zeros_like(mask)


class FusedSoftmaxAttention(SoftmaxAttention):
    """SoftmaxAttention (fp32) with mask-add + softmax, and the softmax backward, as one C++ pass each.
    The mask is read unbroadcast: [s, t], or [b, 1, s, t] ([b, 1, 1, s, t] with GQA) when rows differ."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__(num_heads, num_kv_heads)
        self.masked_softmax_op = _aot("MaskedSoftmax")
        self.scores_grad_op = _aot("SoftmaxAttentionGrad")

    def masked_softmax(self, scores, mask):
        return self.masked_softmax_op(scores, mask)

    def scores_grad(self, p, do, o, v):
        return self.scores_grad_op(p, self.qk(do, v), do, o)


def _heads_shape(x, cos, sin):
    """[b*s, n*d] projection -> [b, n, s, d] given the [s, d] (or [b, 1, s, d]) rope table."""
    s, d = cos[-2:]
    rows = functools.reduce(lambda a, b: a * b, x[:-1])
    return [rows // s, x[-1] // d, s, d]


class LinearFewRows(nn.Cell):
    """x [m, k] @ w [n, k]^T (fp32) by the C++ kernel when m <= FEW_ROWS (a decode step: every
    weight row read once), by MindSpore's MatMul otherwise (prefill); m is fixed at compile time."""

    FEW_ROWS = 8

    def __init__(self):
        super().__init__()
        self.linear = _aot("LinearFewRows", lambda x, w: [x[0], w[0]])
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x, w):
        if x.shape[0] <= self.FEW_ROWS:
            return self.linear(x, w)
        return self.matmul(x, w)


class CacheWriteInPlace(ops.Custom):
    """(k, v [b, h, s, d], cache_k, cache_v [b, h, t, d] Parameters, start [1]) -> [1]: the new slots written into
    the caches themselves (fp32). Marked as writing them, as AdamWUpdate its parameters, so MindSpore
    orders it after the reads of the old caches and before those of the new."""

    def __init__(self):
        super().__init__(f"{library()}:CacheWriteInPlace", out_shape=_one_float, out_dtype=_float32, func_type="aot")
        self.__mindspore_signature__ = (sig.make_sig("k", dtype=sig.sig_dtype.T),
                                        sig.make_sig("v", dtype=sig.sig_dtype.T),
                                        sig.make_sig("cache_k", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T),
                                        sig.make_sig("cache_v", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T),
                                        sig.make_sig("start", dtype=sig.sig_dtype.T1))
        self.add_prim_attr("side_effect_mem", True)


class FusedCacheWrite(layers.CacheWrite):
    """msllm.models.layers.CacheWrite as one C++ copy of each cache with the new slots written (fp32, inference),
    or, given caches to write in place, a C++ write of the new slots alone (MindSpore's scatter on CPU copies
    the whole cache)."""

    def __init__(self):
        super().__init__()
        self.write = _aot("CacheWrite", lambda k, v, ck, cv, st: (ck, cv), lambda k, v, ck, cv, st: (ck, cv))
        self.write_in_place = CacheWriteInPlace()

    def construct(self, k, v, cache_k, cache_v, write):
        if len(write) == 2:
            done = self.write_in_place(k, v, cache_k, cache_v, write[1])
            return ops.depend(cache_k, done), ops.depend(cache_v, done)
        return self.write(k, v, cache_k, cache_v, write[2])


class FusedRope(nn.Cell):
    """msllm.backends.cpu.Rope (split into heads + rotate-half RoPE) as one C++ pass each way (fp32).
    Takes the [s, d] tables (the decoder passes them unbroadcast when this is in use), or [b, 1, s, d]
    tables of each row's positions (a cached forward; packed samples and DPO branches in training)."""

    def __init__(self):
        super().__init__()
        grad = _aot("RopeHeadsGrad", lambda dy, c, s: [dy[0] * dy[2], dy[1] * dy[3]])

        def bprop(x, cos, sin, out, dout):
            return grad(dout, cos, sin).reshape(x.shape), ops.zeros_like(cos), ops.zeros_like(sin)

        self.rope = _aot("RopeHeads", _heads_shape, bprop=bprop)

    def construct(self, x, cos, sin):
        return self.rope(x, cos, sin)


class FlashAttention(nn.Cell):
    """(out, lse) = softmax(q k^T over the visible keys) v, by blocks of keys with an online softmax:
    no [s, t] tensor forward or backward (flash_attention.cc says how). q [b, nh, s, d] already
    scaled, k [b, nkv, t, d], v [b, nkv, t, dv] (dv may differ from d: MLA), out [b, nh, s, dv]; `visibility` = (query slots [s], query segments [s] or [b, s],
    key segments [t] or [b, t], window [1]), int32 (msllm.models.layers.visibility). The same call as
    SoftmaxAttention, whose additive mask it replaces. Runs in fp32 whatever the compute dtype."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.attention = self.kernel()

    @staticmethod
    def kernel():
        grad = _aot("FlashAttentionGrad", lambda q, k, v, *_: (q, k, v), lambda q, k, v, *_: (q, k, v))

        def bprop(q, k, v, slot, q_seg, k_seg, window, out, dout):
            dq, dk, dv = grad(q, k, v, slot, q_seg, k_seg, window, out[0], out[1], dout[0])
            return (dq, dk, dv, ops.zeros_like(slot), ops.zeros_like(q_seg), ops.zeros_like(k_seg),
                    ops.zeros_like(window))

        return _aot("FlashAttention", lambda q, k, v, *_: (q[:3] + v[3:], q[:3]), lambda q, *_: (q, q), bprop=bprop)

    def construct(self, q, k, v, visibility):
        slot, q_seg, k_seg, window = visibility
        out, lse = self.attention(cast(q, ms.float32), cast(k, ms.float32), cast(v, ms.float32), slot, q_seg, k_seg,
                                  window)
        return cast(out, q.dtype), lse


class GatedDeltaRule(nn.Cell):
    """msllm.models.mixers.gated_deltanet.ChunkedGatedDeltaRule in C++ (gated_delta_rule.cc), the same call:
    token by token on the state, 32 value columns at a time (a block that stays in L1), forward and a
    hand-written backward, no [chunk, chunk] tensor.
    Training saves the state every `chunk` tokens ([b, heads, s / chunk, dk, dv]), from which backward
    recomputes a chunk at a time; inference (training False) saves none. Runs in fp32."""

    def __init__(self, chunk: int = GATED_DELTA_CHUNK, training: bool = True):
        super().__init__()
        self.chunk = chunk
        grad = _aot("GatedDeltaRuleGrad", lambda q, k, v, g, beta, seg, initial, *_: (q, k, v, g, beta, initial),
                    lambda *dtypes: (ms.float32,) * 6)

        def bprop(q, k, v, g, beta, segments, initial, out, dout):
            dq, dk, dv, dg, dbeta, d_initial = grad(q, k, v, g, beta, segments, initial, out[2], dout[0], dout[1])
            return dq, dk, dv, dg, dbeta, ops.zeros_like(segments), d_initial

        def shapes(q, k, v, g, beta, segments, initial):
            b, n, s, dk = q
            return v, initial, [b, n, -(-s // chunk), dk, v[-1]] if training else [1]

        self.rule = _aot("GatedDeltaRule", shapes, lambda *dtypes: (ms.float32,) * 3, bprop=bprop)

    def construct(self, q, k, v, g, beta, segments=None, initial=None):
        b, n, s, dk = q.shape
        segments = ops.zeros((b, s), ms.int32) if segments is None else segments.astype(ms.int32)
        initial = ops.zeros((b, n, dk, v.shape[-1]), ms.float32) if initial is None else cast(initial, ms.float32)
        out, state, _ = self.rule(q, k, v, g, beta, segments, initial)
        return out, state


class FusedCausalConv(nn.Cell):
    """msllm.models.mixers.gated_deltanet.ShiftedTaps in C++ (causal_conv.cc), the same call: the depthwise
    causal conv and its SiLU (and with head_dim, the per-head L2 norm and the head-major layout) in one
    pass, a backward that saves only the inputs (the graph form keeps each tap's shifted copy and a padded
    gradient per tap, the norm's and the transpose's tensors). Runs in fp32."""

    def __init__(self):
        super().__init__()
        grad = _aot("CausalConvSiLUGrad", lambda x, w, seg, before, dout: (x, w, before),
                    lambda *dtypes: (ms.float32,) * 3)

        def bprop(x, w, segments, before, out, dout):
            dx, dw, d_before = grad(x, w, segments, before, dout)
            return dx, dw, ops.zeros_like(segments), d_before

        def shape(x, *_):  # [b, s, heads, d] (normalised heads) -> [b, heads, s, d]
            return [x[0], x[2], x[1], x[3]] if len(x) == 4 else x

        self.conv = _aot("CausalConvSiLU", shape, bprop=bprop)

    def construct(self, x, weight, segments, before, head_dim: int = 0):
        b, s, c = x.shape
        segments = ops.zeros((b, s), ms.int32) if segments is None else segments.astype(ms.int32)
        x32 = cast(x, ms.float32)
        if head_dim:
            x32 = x32.reshape(b, s, c // head_dim, head_dim)
        out = self.conv(x32, cast(weight, ms.float32), segments, cast(before, ms.float32))
        return out if head_dim else cast(out, x.dtype)


class SinkFlashAttention(FlashAttention):
    """FlashAttention whose every row also holds its head's sink logit (`sinks` [num_heads]), with no
    value: msllm.models.layers.SinkSoftmaxAttention's maths, the call of that core. The kernel starts each
    row's online softmax from the sink, so lse includes it; the backward kernel also returns the sinks'
    gradient, -sum over each head's rows of exp(sink - lse) * rowsum(dO * O)."""

    @staticmethod
    def kernel():
        def grads(q, k, v, slot, q_seg, k_seg, window, sinks, *_):
            return q, k, v, sinks

        grad = _aot("FlashAttentionSinksGrad", grads, grads)

        def bprop(q, k, v, slot, q_seg, k_seg, window, sinks, out, dout):
            dq, dk, dv, d_sinks = grad(q, k, v, slot, q_seg, k_seg, window, sinks, out[0], out[1], dout[0])
            return (dq, dk, dv, ops.zeros_like(slot), ops.zeros_like(q_seg), ops.zeros_like(k_seg),
                    ops.zeros_like(window), d_sinks)

        return _aot("FlashAttentionSinks", lambda q, k, v, *_: (q[:3] + v[3:], q[:3]), lambda q, *_: (q, q),
                    bprop=bprop)

    def construct(self, q, k, v, visibility, sinks):
        slot, q_seg, k_seg, window = visibility
        out, lse = self.attention(cast(q, ms.float32), cast(k, ms.float32), cast(v, ms.float32), slot, q_seg, k_seg,
                                  window, cast(sinks, ms.float32))
        return cast(out, q.dtype), lse


class GroupedMatmul(nn.Cell):
    """xs [B, n, in] @ w[ids]^T -> [B, n, out]: block i of rows times expert ids[i]'s weights (w [E, out,
    in]), each run of adjacent blocks of one expert as one GEMM that reads the expert's weights once,
    forward and backward (grouped_matmul.cc); see msllm.models.moe.GatheredMatmul. Runs in fp32."""

    def __init__(self):
        super().__init__()
        grad = _aot("GroupedMatmulGrad", lambda x, w, ids, dy: (x, w), lambda x, w, ids, dy: (x, w))

        def bprop(xs, w, ids, out, dout):
            dx, dw = grad(xs, w, ids, dout)
            return dx, dw, ops.zeros_like(ids)

        self.matmul = _aot("GroupedMatmul", lambda x, w, ids: [x[0], x[1], w[1]], bprop=bprop)

    def construct(self, xs, w, ids):
        return cast(self.matmul(cast(xs, ms.float32), cast(w, ms.float32), ids.astype(ms.int32)), xs.dtype)


class FusedHead(nn.Cell):
    """msllm.models.layers.ChunkedHead in C++ (linear_cross_entropy.cc): hidden [N, H], weight [V, H],
    labels [N] -> (lse [N], target [N]) of the logits hidden @ weight^T (soft-capped with `softcap`),
    by blocks of ~1M logits per thread (4 MB), forward and backward: no [N, V] buffer, one graph node
    each way. Runs in fp32 (dnnl_sgemm: needs has_sgemm()). weight_grad False (a frozen head: LoRA):
    the forward also returns lse's gradient rows (expect [N, H], the softmax's mean of dz/dh), so the
    backward is dh = dlse * expect + dtarget * dz_label/dh, without a second pass over the vocabulary;
    the weight's gradient is returned as zeros, which nothing reads."""

    def __init__(self, softcap: float = 0.0, weight_grad: bool = True):
        super().__init__()
        self.softcap, self.weight_grad = softcap, weight_grad
        self.cap = ms.Tensor([softcap], ms.float32)
        if weight_grad:
            grad = _aot("LinearCrossEntropyGrad", lambda h, w, *_: (h, w), lambda h, w, *_: (h, w))

            def bprop(h, w, labels, cap, out, dout):  # dlogits = dlse * softmax + dtarget * onehot(label)
                dh, dw = grad(h, w, labels, cap, out[0], dout[0], -dout[1])
                return dh, dw, ops.zeros_like(labels), ops.zeros_like(cap)

            self.head = _aot("LinearCrossEntropy", lambda h, *_: (h[:1], h[:1]), lambda h, *_: (h, h), bprop=bprop)
        else:
            def bprop(h, w, labels, cap, out, dout):
                label_slope = dout[1]  # d target / d h = w[label] * (1 - tanh^2 of the capped label logit)
                if softcap > 0:
                    label_slope = label_slope * (1 - ops.square(out[1] / softcap))
                dh = dout[0].reshape(-1, 1) * out[2] + label_slope.reshape(-1, 1) * ops.gather(w, labels, 0)
                return dh, ops.zeros_like(w), ops.zeros_like(labels), ops.zeros_like(cap)

            self.head = _aot("LinearCrossEntropyFrozen", lambda h, *_: (h[:1], h[:1], h), lambda h, *_: (h, h, h),
                             bprop=bprop)

    def construct(self, h, weight, labels):
        out = self.head(cast(h, ms.float32), weight, labels.astype(ms.int32), self.cap)
        return out[0], out[1]
