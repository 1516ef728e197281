"""msllm.kernels: the fused C++ CPU kernels agree with the portable MindSpore ops they replace,
built for this CPU (-march=native: AVX-512 here if it has it) and as the AVX2 build an AVX2-only
CPU such as AMD EPYC gets (-march=x86-64-v3); the cache never hands one CPU's build to another.

(AdamW fused vs portable vs torch is in test_step.py.)
"""
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from msllm import device, kernels
from msllm.backends.cpu import Rope, RMSNormCore
from msllm.kernels import SoftmaxAttention
from msllm.models import layers
from msllm.models.layers import CacheWrite, ClampedSwiGLU, GeGLU, SwiGLU, scores_shape
from tests.numerics import REORDER_RTOL, U32


@pytest.fixture(autouse=True)
def graph_mode():
    device.setup("cpu", "graph")


CPU_FLAGS = set(kernels.build._cpu_flags().split(b":", 1)[-1].split())


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def arch(request):
    """The kernels the test builds: MSLLM_KERNEL_MARCH as a user would set it (one g++ build each)."""
    if request.param != "native" and not {b"avx2", b"fma", b"bmi2"} <= CPU_FLAGS:
        pytest.skip(f"this CPU cannot run a -march={request.param} build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MSLLM_KERNEL_MARCH", request.param)
        kernels.library.cache_clear()
        yield request.param
    kernels.library.cache_clear()


class WeightedSum(nn.Cell):
    """sum(op(*inputs) * upstream): a non-uniform upstream gradient for the backward of op."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, *inputs_and_upstream):
        return (self.op(*inputs_and_upstream[:-1]) * inputs_and_upstream[-1]).sum()


def value_and_grads(op, *inputs):
    return ms.jit(ops.value_and_grad(WeightedSum(op), grad_position=(0, 1)))(*inputs)


def test_swiglu_forward_and_backward_match_portable(arch):
    rng = np.random.default_rng(0)
    # Typical activations plus the tails: large |gate| saturates the sigmoid both ways.
    gate = np.concatenate([rng.normal(0, 3, 200_000), np.linspace(-90, 90, 2000)]).reshape(-1, 101)
    up, weights = rng.normal(size=(2, *gate.shape))
    inputs = [Tensor(x.astype(np.float32)) for x in (gate, up, weights)]
    h_ref = SwiGLU()(*inputs[:2]).asnumpy()
    h = kernels.FusedSwiGLU()(*inputs[:2]).asnumpy()
    np.testing.assert_allclose(h, h_ref, rtol=1e-6, atol=1e-6)
    loss_ref, (dgate_ref, dup_ref) = value_and_grads(SwiGLU(), *inputs)
    loss, (dgate, dup) = value_and_grads(kernels.FusedSwiGLU(), *inputs)
    np.testing.assert_allclose(loss.asnumpy(), loss_ref.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(dup.asnumpy(), dup_ref.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dgate.asnumpy(), dgate_ref.asnumpy(), rtol=1e-4, atol=1e-5)


def test_clamped_swiglu_forward_and_backward_match_portable(arch):
    """gpt-oss's activation at limit 0.5 (most inputs clamped, some exactly on a bound) and its alpha: the
    kernel's output and both gradients equal the portable Cell's autodiff, zero where a clamp cuts."""
    rng = np.random.default_rng(2)
    gate = np.concatenate([rng.normal(0, 1, 20_000), [0.5, -0.5, 0.0, 40.0, -40.0]]).reshape(-1, 5)
    up = np.concatenate([rng.normal(0, 1, 20_000), [0.5, -0.5, 0.5, -0.5, 7.0]]).reshape(-1, 5)
    inputs = [Tensor(x.astype(np.float32)) for x in (gate, up, rng.normal(size=gate.shape))]
    portable, fused = ClampedSwiGLU(1.702, 0.5), kernels.FusedClampedSwiGLU(1.702, 0.5)
    np.testing.assert_allclose(fused(*inputs[:2]).asnumpy(), portable(*inputs[:2]).asnumpy(), rtol=1e-6, atol=1e-6)
    loss_ref, (dgate_ref, dup_ref) = value_and_grads(portable, *inputs)
    loss, (dgate, dup) = value_and_grads(fused, *inputs)
    np.testing.assert_allclose(loss.asnumpy(), loss_ref.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(dup.asnumpy(), dup_ref.asnumpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dgate.asnumpy(), dgate_ref.asnumpy(), rtol=1e-5, atol=1e-6)
    assert (dup.asnumpy()[np.abs(up) > 0.5] == 0).all() and (dgate.asnumpy()[gate > 0.5] == 0).all()
    assert (dup.asnumpy()[np.abs(up) < 0.5] != 0).mean() > 0.99


def test_geglu_forward_and_backward_match_portable_and_torch(arch):
    import torch

    rng = np.random.default_rng(1)
    gate = np.concatenate([rng.normal(0, 3, 200_000), np.linspace(-40, 40, 2000)]).reshape(-1, 101)
    up, weights = rng.normal(size=(2, *gate.shape))
    inputs = [Tensor(x.astype(np.float32)) for x in (gate, up, weights)]
    h_ref = GeGLU()(*inputs[:2]).asnumpy()
    h = kernels.FusedGeGLU()(*inputs[:2]).asnumpy()
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-6)
    g = torch.tensor(gate, dtype=torch.float32)
    np.testing.assert_allclose(h, (torch.nn.functional.gelu(g, approximate="tanh") * torch.tensor(up).float()).numpy(),
                               rtol=1e-5, atol=1e-6)
    loss_ref, (dgate_ref, dup_ref) = value_and_grads(GeGLU(), *inputs)
    loss, (dgate, dup) = value_and_grads(kernels.FusedGeGLU(), *inputs)
    np.testing.assert_allclose(loss.asnumpy(), loss_ref.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(dup.asnumpy(), dup_ref.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dgate.asnumpy(), dgate_ref.asnumpy(), rtol=1e-4, atol=1e-5)


def test_rms_norm_forward_and_backward_match_portable(arch):
    rng = np.random.default_rng(2)
    x = rng.normal(0, 2, (300, 72)).astype(np.float32)  # 72: not a multiple of the 16 lanes
    x[0] *= 1e-3  # a row where eps matters
    weight = rng.normal(1, 0.3, 72).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    for offset in (0.0, 1.0):  # Gemma's and Qwen3.5's (1 + w): the same scales from weights near 0
        inputs = [Tensor(x), Tensor(weight - offset), Tensor(upstream)]
        portable, fused = RMSNormCore(72, 1e-5, offset), kernels.FusedRMSNormCore(1e-5, offset)
        plain = portable(*inputs[:2]).asnumpy()
        np.testing.assert_allclose(fused(*inputs[:2]).asnumpy(), plain, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(plain[1] * np.sqrt(np.mean(x[1] ** 2) + 1e-5) / x[1], weight, rtol=1e-4)
        grads = [value_and_grads(core, *inputs)[1] for core in (portable, fused)]
        for (name, want), got in zip((("dx", grads[0][0]), ("dweight", grads[0][1])), grads[1]):
            np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-4, atol=1e-4, err_msg=name)


class AttentionLoss(nn.Cell):
    def __init__(self, attention, mask):
        super().__init__()
        self.attention, self.mask = attention, mask

    def construct(self, q, k, v, upstream):
        return (self.attention(q, k, v, self.mask)[0] * upstream).sum()


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_softmax_attention_matches_portable(arch, heads, kv_heads):
    rng = np.random.default_rng(3)
    b, s, d = 2, 40, 16
    q, upstream = (rng.normal(size=(b, heads, s, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(b, kv_heads, s, d)).astype(np.float32) for _ in range(2))
    shape = scores_shape(heads, kv_heads, b, s, s)
    causal = np.triu(np.full((s, s), -1e9, np.float32), k=1)
    packed = causal.copy()
    packed[15:, :15] = -1e9  # the second row holds two samples: its queries from 15 on see only keys from 15 on
    rows = Tensor(np.stack([causal, packed]).reshape((b,) + (1,) * (len(shape) - 3) + (s, s)))
    inputs = [Tensor(x) for x in (q, k, v, upstream)]
    # The fused softmax takes the mask as Llama passes it ([s, s]), already broadcast, or each batch row's
    # own ([b, 1, s, s], [b, 1, 1, s, s] with GQA: packed samples).
    for masks in ((Tensor(causal), ops.broadcast_to(Tensor(causal), shape)), (rows,)):
        broadcast = ops.broadcast_to(masks[0], shape)
        want = ops.grad(AttentionLoss(SoftmaxAttention(heads, kv_heads), broadcast), grad_position=(0, 1, 2))(*inputs)
        want_out = SoftmaxAttention(heads, kv_heads)(*inputs[:3], broadcast)[0].asnumpy()
        for mask in masks:
            fused = kernels.FusedSoftmaxAttention(heads, kv_heads)
            np.testing.assert_allclose(fused(*inputs[:3], mask)[0].asnumpy(), want_out, rtol=1e-5, atol=1e-5)
            got = ops.grad(AttentionLoss(fused, mask), grad_position=(0, 1, 2))(*inputs)
            for name, g, w in zip("qkv", got, want):
                np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


class RopeLoss(nn.Cell):
    def __init__(self, rope, cos, sin):
        super().__init__()
        self.rope, self.cos, self.sin = rope, cos, sin

    def construct(self, x, upstream):
        return (self.rope(x, self.cos, self.sin) * upstream).sum()


# [b*s, n*d], [b, s, n*d]; rows' own tables; partial RoPE (Qwen3.5's quarter of each head), rows' own tables
@pytest.mark.parametrize("x_shape,table", [((2 * 24, 3 * 16), (24, 16)), ((2, 24, 3 * 16), (24, 16)),
                                           ((2 * 24, 3 * 16), (2, 1, 24, 16)), ((2 * 24, 3 * 16), (2, 1, 24, 4))])
def test_rope_matches_portable(arch, x_shape, table):
    rng = np.random.default_rng(4)
    s, d, rope_dim = 24, 16, table[-1]
    angles = rng.uniform(0, 6, table).astype(np.float32)  # any table: checks the indexing, not RoPE's values
    cos, sin = Tensor(np.cos(angles)), Tensor(np.sin(angles))
    x = Tensor(rng.normal(size=x_shape).astype(np.float32))
    upstream = Tensor(rng.normal(size=(2, 3, s, d)).astype(np.float32))
    portable = Rope(d) if rope_dim == d else layers.Rope(d, rope_dim)
    want = portable(x, cos, sin).asnumpy()
    fused = kernels.FusedRope(d, rope_dim)
    np.testing.assert_allclose(fused(x, cos, sin).asnumpy(), want, rtol=1e-6, atol=1e-6)
    grads = [ops.grad(RopeLoss(rope, cos, sin))(x, upstream) for rope in (portable, fused)]
    assert grads[1].shape == x.shape
    np.testing.assert_allclose(grads[1].asnumpy(), grads[0].asnumpy(), rtol=1e-5, atol=1e-6)


# Below one 16-lane block, ragged, several threads' worth, tiny again: the kernels split the
# tensors laid end to end across threads, so chunk borders fall inside and between tensors.
SHAPES = [(3,), (777, 33), (2_000_000,), (5,)]


@pytest.mark.parametrize("s, start", [(1, 0), (1, 9), (5, 11), (16, 0)])
def test_cache_write_matches_portable(arch, s, start):
    """New keys and values land in the same slots, bit for bit; the other slots are kept."""
    rng = np.random.default_rng(s + start)
    b, h, t, d = 2, 3, 16, 8
    k, v = (Tensor(rng.normal(size=(b, h, s, d)).astype(np.float32)) for _ in range(2))
    cache_k, cache_v = (Tensor(rng.normal(size=(b, h, t, d)).astype(np.float32)) for _ in range(2))
    slots = np.arange(t)
    write = (Tensor(np.clip(slots - start, 0, s - 1).astype(np.int32)),
             Tensor(((slots >= start) & (slots < start + s)).reshape(t, 1)), Tensor(np.array([start], np.int32)))
    portable = [x.asnumpy() for x in CacheWrite()(k, v, cache_k, cache_v, write)]
    fused = [x.asnumpy() for x in kernels.FusedCacheWrite()(k, v, cache_k, cache_v, write)]
    for got, ref, new, old in zip(fused, portable, (k, v), (cache_k, cache_v)):
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got[:, :, start:start + s], new.asnumpy())
        kept = np.r_[0:start, start + s:t]
        np.testing.assert_array_equal(got[:, :, kept], old.asnumpy()[:, :, kept])


class Projected(nn.Cell):
    """x -> the projections of x by `linears` (a layer's, each Parameter under its own name)."""

    def __init__(self, linears):
        super().__init__()
        self.linears = nn.CellList(linears)
        self.project = kernels.ProjectionsFewRows()

    def construct(self, x):
        return self.project(x, tuple(self.linears))


@pytest.mark.parametrize("m, k, sizes, biased", [(1, 576, (1536, 256, 7), None), (7, 100, (37, 5), 1),
                                                 (5, 6, (9,), None), (16, 2001, (576, 13), None),
                                                 (17, 64, (20, 8), None)])
def test_few_rows_linears_match_float64(arch, m, k, sizes, biased):
    """A decode step's projections of one x in one kernel (register tiles of 3, 2 + 2 and 1 rows, leftover
    weight rows by the plain dots; k not a multiple of 8, and k = 6 < 8: the tiles' masked first and last
    loads), each as x @ W^T in float64; one Linear by LinearFewRows; more rows than FEW_ROWS (17), or a Linear
    with a bias, by the Linears' own matmuls. From 4 rows the weights are packed into panels (leftover outputs:
    37, 9, 13; 16 rows of k = 2001: x too long to keep whole, in 256-deep slices, the last partial), and new
    weights after a forget are packed again."""
    rng = np.random.default_rng(m)
    x = rng.normal(size=(m, k)).astype(np.float32)
    linears = [layers.Linear(k, n, bias=i == biased) for i, n in enumerate(sizes)]
    projected = Projected(linears)
    for new_weights in range(2):  # then new weights after a prefill's forget: from 4 rows, into the packed buffers
        kernels.forget_packed_weights()
        for linear in linears:
            for p in linear.get_parameters():
                p.set_data(Tensor(rng.normal(size=p.shape).astype(np.float32)))
        got = projected(Tensor(x))
        one = kernels.LinearFewRows()(Tensor(x), linears[0].weight)
        assert len(got) == len(sizes)
        for y, linear in zip((*got, one), (*linears, linears[0])):
            w = linear.weight.asnumpy().astype(np.float64)
            ref = x.astype(np.float64) @ w.T + (0 if linear.bias is None else linear.bias.asnumpy())
            np.testing.assert_allclose(y.asnumpy(), ref, rtol=0,
                                       atol=1e-5 * np.abs(x).max() * np.abs(w).max() * k ** 0.5)


def test_sum_of_squares_matches_float64(arch):
    rng = np.random.default_rng(1)
    op = kernels.sum_of_squares_op()
    xs = [rng.normal(0, 0.01, shape).astype(np.float32) for shape in SHAPES]
    # Each fp32 lane sums at most 256 squares (positive terms: relative error <= 256 u whatever the
    # thread split of this machine), then the lanes and blocks are added in double.
    rtol = 256 * U32
    for x in xs:
        got = float(op(Tensor(x)).asnumpy()[0])
        want = float(np.sum(x.astype(np.float64) ** 2))
        assert abs(got - want) <= rtol * want, (x.shape, got, want)
    got = float(op(*[Tensor(x) for x in xs]).asnumpy()[0])  # all at once, as the train step calls it
    want = sum(float(np.sum(x.astype(np.float64) ** 2)) for x in xs)
    assert abs(got - want) <= rtol * want, (got, want)


class AdamWCall(nn.Cell):
    """One AdamWUpdate call over n Parameters and their moments (as AdamW's fused path makes it)."""

    def __init__(self, ws, ms_, vs):
        super().__init__()
        self.w, self.m, self.v = (ms.ParameterTuple([ms.Parameter(Tensor(a), name=f"{k}{i}") for i, a in enumerate(xs)])
                                  for k, xs in (("w", ws), ("m", ms_), ("v", vs)))
        self.update = kernels.AdamWUpdate(len(ws))

    def construct(self, grads, scalars, weight_decay):
        return self.update(*self.w, *self.m, *self.v, *grads, scalars, weight_decay)


def test_adamw_update_of_many_parameters_matches_numpy(arch):
    rng = np.random.default_rng(4)
    w, m, g = ([rng.normal(0, 1, s).astype(np.float32) for s in SHAPES] for _ in range(3))
    v = [rng.uniform(0, 1, s).astype(np.float32) for s in SHAPES]
    wd = np.array([0.1, 0.0, 0.1, 0.05], np.float32)
    lr_t, lr, b1, b2, eps_t, coef = 2e-3, 1e-3, 0.9, 0.95, 1e-8, 0.5
    cell = AdamWCall(w, m, v)
    cell([Tensor(x) for x in g], Tensor(np.array([lr_t, lr, b1, b2, eps_t, coef], np.float32)), Tensor(wd))
    for i in range(len(SHAPES)):
        g64 = g[i].astype(np.float64) * coef
        m_want = b1 * m[i] + (1 - b1) * g64
        v_want = b2 * v[i] + (1 - b2) * g64 ** 2
        w_want = w[i] * (1 - lr * wd[i]) - lr_t * m_want / (np.sqrt(v_want) + eps_t)
        np.testing.assert_allclose(cell.m[i].asnumpy(), m_want, rtol=1e-5, atol=1e-7, err_msg=f"m{i}")
        np.testing.assert_allclose(cell.v[i].asnumpy(), v_want, rtol=1e-5, atol=1e-7, err_msg=f"v{i}")
        np.testing.assert_allclose(cell.w[i].asnumpy(), w_want, rtol=1e-5, atol=1e-6, err_msg=f"w{i}")


class RuleLoss(nn.Cell):
    """(sum(out * probe) + sum(final state * state_probe), out, state) of a gated delta rule Cell over fixed
    segments."""

    def __init__(self, rule, segments, probe, state_probe):
        super().__init__()
        self.rule, self.segments, self.probe, self.state_probe = rule, segments, probe, state_probe

    def construct(self, q, k, v, g, beta, initial):
        out, state = self.rule(q, k, v, g, beta, self.segments, initial)
        return (out * self.probe).sum() + (state * self.state_probe).sum(), out, state


def rule_results(rule, case) -> list[np.ndarray]:
    """out, state and the gradients of q, k, v, g, beta and the initial state of RuleLoss(rule) on `case`."""
    inputs, segments, probe, state_probe = case
    (_, out, state), grads = ms.jit(ops.value_and_grad(RuleLoss(rule, segments, probe, state_probe),
                                                       grad_position=tuple(range(6)), has_aux=True))(*inputs)
    return [t.asnumpy() for t in (out, state, *grads)]


@pytest.fixture(scope="module")
def gated_delta_case():
    """20 tokens in chunks of 8 (two chunks and a ragged tail of 4, so three checkpoints), 2 key heads each serving
    2 of 4 value heads (q and k per key head: the kernel sums a key head's value heads into their gradients) with
    dk 20 != dv 42 (the kernel's blocks of 32 value columns: a full one and one of 10, 2 past its backward's groups
    of 4 columns; dk not a multiple of its 8-float vectors: test_hybrid's kernel test has dk 16),
    a non-zero initial state and a final-state gradient, row 1 packed with samples starting on a chunk
    boundary (8) and inside a chunk (13); and the chunked graph form's results on it (autodiff, fp32)."""
    from msllm.models.mixers.gated_deltanet import ChunkedGatedDeltaRule
    rng = np.random.default_rng(7)
    b, nk, n, s, dk, dv, chunk = 2, 2, 4, 20, 20, 42, 8
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = l2(rng.normal(size=(2, b, nk, s, dk)))
    q = q * dk ** -0.5
    v = rng.normal(size=(b, n, s, dv))
    g = -rng.uniform(0.01, 2, (b, n, 1)) * np.log1p(np.exp(rng.normal(size=(b, n, s))))  # Qwen3.5's decay range
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, n, s))))
    initial = rng.normal(size=(b, n, dk, dv)) / 4
    segments = Tensor(np.array([[0] * s, [0] * 8 + [1] * 5 + [2] * 7], np.int32))
    probe, state_probe = (Tensor(rng.normal(size=shape).astype(np.float32)) for shape in ((b, n, s, dv), initial.shape))
    case = [Tensor(x.astype(np.float32)) for x in (q, k, v, g, beta, initial)], segments, probe, state_probe
    device.setup("cpu", "graph")
    return chunk, case, rule_results(ChunkedGatedDeltaRule(chunk, n // nk), case)


def test_gated_delta_rule_matches_the_chunked_graph_form(arch, gated_delta_case):
    """The C++ rule (token by token, hand-written backward) against the chunked graph form with autodiff
    (gated_delta_case): output, final state and the gradients of q, k, v, the decay, beta and the initial state
    agree to REORDER_RTOL of each tensor's scale; the inference build (no checkpoints)
    gives the same output and state."""
    chunk, case, want = gated_delta_case
    got = rule_results(kernels.GatedDeltaRule(chunk), case)
    names = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dinitial")
    for name, w, g in zip(names, want, got):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= REORDER_RTOL, f"{name}: max_rel {err:.2e}"
    inputs, segments = case[:2]
    inference = ms.jit(kernels.GatedDeltaRule(chunk, training=False))(*inputs[:5], segments, inputs[5])
    for name, w, g in zip(names, want, inference):
        np.testing.assert_allclose(g.asnumpy(), w, rtol=0, atol=REORDER_RTOL * np.abs(w).max(), err_msg=name)


class ConvLoss(nn.Cell):
    """(sum(out * probe), out) of a causal conv core over fixed segments."""

    def __init__(self, core, segments, probe, head_dim):
        super().__init__()
        self.core, self.segments, self.probe, self.head_dim = core, segments, probe, head_dim

    def construct(self, x, weight, before):
        out = self.core(x, weight, self.segments, before, self.head_dim)
        return (out * self.probe).sum(), out


@pytest.mark.parametrize("head_dim", [0, 5])
def test_causal_conv_matches_the_shifted_taps(head_dim):
    """The C++ conv + SiLU (plain loops the compiler vectorizes: one build, no arch variants; one pass,
    backward from its inputs) against the graph form's shifted taps with autodiff: 20 channels (not a
    multiple of a vector), 4 taps, 11 tokens; row 1 packed with samples starting at tokens 1 and 6 (a tap
    reads neither the window nor an earlier sample past a start), a non-zero window; as is (v) and
    L2-normalised per head of 5 into [b, heads, s, 5] (q, k). Output and the gradients of x, the weight
    and the window agree to REORDER_RTOL of each one's scale."""
    from msllm.models.mixers.gated_deltanet import ShiftedTaps
    device.setup("cpu", "graph")
    rng = np.random.default_rng(5)
    b, s, c, k = 2, 11, 20, 4
    out_shape = (b, c // head_dim, s, head_dim) if head_dim else (b, s, c)
    x, w, before, probe = (Tensor(rng.normal(size=shape).astype(np.float32))
                           for shape in ((b, s, c), (c, k), (b, k - 1, c), out_shape))
    segments = Tensor(np.array([[0] * s, [0] + [1] * 5 + [2] * 5], np.int32))
    results = []
    for core in (ShiftedTaps(), kernels.FusedCausalConv()):
        loss = ConvLoss(core, segments, probe, head_dim)
        (_, out), grads = ms.jit(ops.value_and_grad(loss, grad_position=(0, 1, 2), has_aux=True))(x, w, before)
        results.append([t.asnumpy() for t in (out, *grads)])
    for name, want, got in zip(("out", "dx", "dw", "dbefore"), *results):
        assert got.shape == want.shape, name
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= REORDER_RTOL, f"{name}: max_rel {err:.2e}"



@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """An empty kernel cache dir, and library() forgetting the process's already-built path."""
    monkeypatch.setenv("MSLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("MSLLM_KERNEL_MARCH", raising=False)
    kernels.library.cache_clear()
    yield tmp_path / "kernels"
    kernels.library.cache_clear()


def test_packed_sgemm_matches_float64_in_the_three_training_forms(arch):
    """sgemm.cc's GEMM (panels.h: 6 x 16 tiles, 256-deep slices, 144-row blocks, 512-column units) on shapes that
    are no multiple of any of them, K = 1 and tiny ones, in training's three layouts: y = x W^T, dx = dy W and
    dW = dy^T x, against float64; then PackedLinear's forward and both gradients."""
    sgemm = ctypes.CDLL(str(kernels.library())).Sgemm
    sgemm.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    rng = np.random.default_rng(5)
    for m, k, n in [(301, 515, 531), (7, 1, 20), (1, 3, 1), (150, 260, 17)]:
        x, w, dy = (rng.normal(size=shape).astype(np.float32) for shape in ((m, k), (n, k), (m, n)))
        for inner, a, a_rows, a_cols, b, b_rows, b_cols, want in [
                (k, x, k, 1, w, 1, k, x.astype(np.float64) @ w.T),      # forward: x [m, k], W [n, k]
                (n, dy, n, 1, w, k, 1, dy.astype(np.float64) @ w),      # dx: dy [m, n], W as it is
                (m, dy, 1, n, x, k, 1, dy.T.astype(np.float64) @ x)]:   # dW: dy read transposed
            got = np.full(want.shape, np.nan, np.float32)
            sgemm(*want.shape, inner, a.ctypes.data, a_rows, a_cols, b.ctypes.data, b_rows, b_cols, got.ctypes.data,
                  want.shape[1], 2)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * inner ** 0.5)
    m, k, n = 37, 300, 21
    x, w, upstream = (rng.normal(size=shape).astype(np.float32) for shape in ((m, k), (n, k), (m, n)))
    loss, (dx, dw) = value_and_grads(kernels.PackedLinear(), Tensor(x), Tensor(w), Tensor(upstream))
    x64, w64, up64 = x.astype(np.float64), w.astype(np.float64), upstream.astype(np.float64)
    np.testing.assert_allclose(loss.asnumpy(), ((x64 @ w64.T) * up64).sum(), rtol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), up64 @ w64, rtol=0, atol=1e-4)
    np.testing.assert_allclose(dw.asnumpy(), up64.T @ x64, rtol=0, atol=1e-4)


@pytest.mark.skipif(not kernels.has_sgemm(), reason="MindSpore's CPU backend without oneDNN's dnnl_sgemm")
def test_grouped_matmul_matches_gathered_weights():
    """GroupedMatmul against the portable GatheredMatmul, forward and both gradients: blocks of one expert
    adjacent (one GEMM per run, longer than a work unit), an expert in two separate runs (its weight
    gradient summed over both), an expert with no block (gradient 0), the ids in int64 (what ReduceSum
    gives BlockDispatch; the kernel reads int32). Held against float64 numpy as well."""
    from msllm.models.moe import GatheredMatmul
    rng = np.random.default_rng(0)
    e, n, d_in, d_out = 5, 96, 48, 300  # 300 output rows: two dw units per expert
    ids = [0, 0, 0, 1, 3, 3, 1, 4]        # expert 0: 288 rows, two chunks; 1 in two runs; 2 unused
    xs = rng.normal(size=(len(ids), n, d_in)).astype(np.float32)
    w = (rng.normal(size=(e, d_out, d_in)) / 7).astype(np.float32)
    upstream = rng.normal(size=(len(ids), n, d_out)).astype(np.float32)
    inputs = (Tensor(xs), Tensor(w), Tensor(np.array(ids, np.int64)), Tensor(upstream))
    loss, (dx, dw) = value_and_grads(kernels.GroupedMatmul(), *inputs)
    loss_ref, (dx_ref, dw_ref) = value_and_grads(GatheredMatmul(), *inputs)
    want = np.einsum("bni,boi->bno", xs.astype(np.float64), w.astype(np.float64)[ids])
    np.testing.assert_allclose(kernels.GroupedMatmul()(*inputs[:3]).asnumpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss.asnumpy(), loss_ref.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.asnumpy(), dw_ref.asnumpy(), rtol=1e-5, atol=1e-5)
    assert not dw.asnumpy()[2].any()

    # with each expert's bias (gpt-oss): added in the kernel, its gradient summed in the weight-gradient pass
    bias = rng.normal(size=(e, d_out)).astype(np.float32)
    biased = (*inputs[:3], Tensor(bias), inputs[3])
    grads = ms.jit(ops.value_and_grad(WeightedSum(kernels.GroupedMatmul()), grad_position=(0, 1, 3)))(*biased)
    grads_ref = ms.jit(ops.value_and_grad(WeightedSum(GatheredMatmul()), grad_position=(0, 1, 3)))(*biased)
    np.testing.assert_allclose(kernels.GroupedMatmul()(*biased[:4]).asnumpy(), want + bias[ids][:, None],
                               rtol=1e-5, atol=1e-5)
    for got, ref in zip((grads[0], *grads[1]), (grads_ref[0], *grads_ref[1])):
        np.testing.assert_allclose(got.asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-5)
    db_want = np.zeros((e, d_out))
    np.add.at(db_want, ids, upstream.astype(np.float64).sum(1))
    np.testing.assert_allclose(grads[1][2].asnumpy(), db_want, rtol=1e-5, atol=1e-4)
    assert not grads[1][2].asnumpy()[2].any()


def test_without_compiler_training_falls_back_and_building_says_why(monkeypatch, empty_cache):
    monkeypatch.setattr(kernels.build.shutil, "which", lambda name: None)
    assert kernels.enabled("auto") is False
    assert kernels.enabled("off") is False
    with pytest.raises(kernels.KernelBuildError, match="g\\+\\+"):
        kernels.library()
    assert not empty_cache.exists()


def test_failed_build_says_so_and_leaves_nothing(monkeypatch, empty_cache):
    monkeypatch.setattr(kernels.build.shutil, "which", lambda name: "false")  # a "compiler" that fails
    with pytest.raises(kernels.KernelBuildError, match="failed.*fused_kernels: off"):
        kernels.library()
    assert not any(empty_cache.iterdir())  # no library, no temp file


@pytest.fixture
def recording_compiler(monkeypatch, tmp_path):
    """A g++ stand-in that logs each command line and writes this session's real build (already in the
    default cache) to its -o path: a build's bookkeeping without the ~24 s g++ run."""
    real = kernels.library()
    log = tmp_path / "g++.log"
    script = tmp_path / "g++"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nwhile [ "$1" != -o ]; do shift; done\ncp {real} "$2"\n')
    script.chmod(0o755)
    monkeypatch.setattr(kernels.build.shutil, "which", lambda name: str(script) if name == "g++" else shutil.which(name))
    return log


def test_library_is_built_once_per_source(recording_compiler, empty_cache):
    first = kernels.library()
    built_at = kernels.library_path().stat().st_mtime_ns
    kernels.library.cache_clear()
    assert kernels.library() == first
    assert kernels.library_path().stat().st_mtime_ns == built_at  # reused, not rebuilt
    [build] = recording_compiler.read_text().splitlines()         # one compiler run for both calls
    args = build.split()
    out = args.index("-o") + 1                                    # a temp file beside the library, renamed
    assert args[:out] == [*kernels.flags(), "-o"] and Path(args[out]).parent == empty_cache
    assert args[out + 1:] == [str(source) for source in kernels.build.SOURCES]
    assert [p.name for p in empty_cache.iterdir()] == [kernels.library_path().name]  # no temp file left
    assert kernels.enabled("auto") is True


def test_builds_use_the_instruction_set_of_their_march(arch):
    """The AVX2 build has no AVX-512 instruction (it runs on an AVX2-only CPU); native on an
    AVX-512 CPU uses them (g++ compares into mask registers %k1-7), so the -march reaches g++."""
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils)")
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", kernels.library()], capture_output=True, text=True,
                         check=True).stdout
    avx512 = "%zmm" in asm or re.search(r"%k[1-7]\b", asm) is not None
    if arch == "x86-64-v3":
        assert "%ymm" in asm and not avx512
    else:
        assert avx512 == ({b"avx512f", b"avx512vl"} <= CPU_FLAGS)


def test_a_build_for_another_cpu_is_not_loaded(monkeypatch, empty_cache):
    """A home directory copied from an AVX-512 machine to an AVX2-only one (e.g. AMD EPYC): the
    build cached there is not loaded; the kernels are built for this CPU (here: cannot be, no g++)."""
    avx512 = b"flags\t\t: fpu sse2 avx avx2 fma bmi2 avx512f avx512vl"
    avx2 = b"flags\t\t: fpu sse2 avx avx2 fma bmi2"
    monkeypatch.setattr(kernels.build.shutil, "which", lambda name: None)  # any build attempt fails
    monkeypatch.setattr(kernels.build, "_cpu_flags", lambda: avx512)
    copied = kernels.library_path()
    copied.parent.mkdir(parents=True)
    copied.write_bytes(b"the AVX-512 machine's build")
    assert kernels.library() == str(copied) and kernels.enabled("auto")  # on its own CPU it is used
    kernels.library.cache_clear()
    monkeypatch.setattr(kernels.build, "_cpu_flags", lambda: avx2)
    assert kernels.library_path() != copied
    assert kernels.enabled("auto") is False
    with pytest.raises(kernels.KernelBuildError, match="g\\+\\+"):
        kernels.library()
    # The -march is part of the key too: an AVX2 build and a native one never share a file.
    assert kernels.library_path("x86-64-v3") != kernels.library_path("native") == kernels.library_path()
    monkeypatch.setenv("MSLLM_KERNEL_MARCH", "x86-64-v3")
    assert kernels.library_path() == kernels.library_path("x86-64-v3")
    assert "-march=x86-64-v3" in kernels.flags() and "-march=native" not in kernels.flags()
