"""The specialisation seam: the CPU formulations compute the plain model's maths, forward and
backward, and specialise() swaps only parameter-free Cells, so the weights never move."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from msllm import backends, device, kernels
from msllm.backends import cpu
from msllm.config import ModelConfig
from msllm.models import decoder, layers
from tests.conftest import step_config

CFG = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=32)


@pytest.fixture(autouse=True)
def graph_mode():
    device.setup("cpu", "graph")


class Loss(nn.Cell):
    """sum(op(*inputs)[0 if tuple] * upstream): a non-uniform upstream gradient."""

    def __init__(self, op, *fixed):
        super().__init__()
        self.op, self.fixed = op, fixed

    def construct(self, x, y, upstream):
        out = self.op(x, y, *self.fixed)
        out = out[0] if isinstance(out, tuple) else out
        return (out * upstream).sum()


def grads(op, x, y, upstream, *fixed):
    return ops.value_and_grad(Loss(op, *fixed), grad_position=(0, 1))(x, y, upstream)


def assert_same(plain, special, rtol, atol):
    (lp, gp), (ls, gs) = plain, special
    np.testing.assert_allclose(ls.asnumpy(), lp.asnumpy(), rtol=rtol)
    for a, b in zip(gs, gp):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=rtol, atol=atol)


def test_rms_norm_core_matches_plain():
    rng = np.random.default_rng(0)
    x, up = (Tensor(rng.normal(0, 2, (50, 72)).astype(np.float32)) for _ in range(2))
    w = Tensor(rng.normal(1, 0.3, 72).astype(np.float32))
    assert_same(grads(layers.RMSNormCore(72, 1e-5), x, w, up), grads(cpu.RMSNormCore(72, 1e-5), x, w, up),
                1e-5, 1e-5)


def test_rope_matches_plain():
    rng = np.random.default_rng(1)
    s, d = 12, 16
    cos, sin = (Tensor(f(rng.uniform(0, 6, (s, d))).astype(np.float32)) for f in (np.cos, np.sin))
    x = Tensor(rng.normal(size=(2 * s, 3 * d)).astype(np.float32))
    up = Tensor(rng.normal(size=(2, 3, s, d)).astype(np.float32))
    plain = ops.value_and_grad(Loss(layers.Rope(d), sin), grad_position=(0, 1))(x, cos, up)
    special = ops.value_and_grad(Loss(cpu.Rope(d), sin), grad_position=(0, 1))(x, cos, up)
    assert_same(plain, special, 1e-6, 1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_softmax_attention_backward_matches_autodiff(heads, kv_heads):
    """The hand-written backward of the CPU core equals autodiff of the plain one (dq, dk, dv)."""
    rng = np.random.default_rng(2)
    b, s, d = 2, 10, 8
    q, up = (Tensor(rng.normal(size=(b, heads, s, d)).astype(np.float32)) for _ in range(2))
    k, v = (Tensor(rng.normal(size=(b, kv_heads, s, d)).astype(np.float32)) for _ in range(2))
    mask = ops.broadcast_to(Tensor(np.triu(np.full((s, s), -1e9, np.float32), k=1)),
                            layers.scores_shape(heads, kv_heads, b, s, s))

    class Core(nn.Cell):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def construct(self, q, k, v, upstream):
            return (self.attn(q, k, v, mask)[0] * upstream).sum()

    want = ops.grad(Core(layers.SoftmaxAttention(heads, kv_heads)), grad_position=(0, 1, 2))(q, k, v, up)
    got = ops.grad(Core(kernels.SoftmaxAttention(heads, kv_heads)), grad_position=(0, 1, 2))(q, k, v, up)
    # dS = P * (dP - rowsum(dO * O)) subtracts terms of the size of dP: its rounding error is
    # relative to the gradient's scale, not to each element (a row attending to one key has
    # dq = 0 exactly under autodiff, ~1e-7 here).
    for name, g, w in zip("qkv", got, want):
        scale = np.abs(w.asnumpy()).max()
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=f"d{name}")


def test_specialised_model_equals_plain_and_keeps_its_weights():
    plain = decoder.build_model(CFG, seed=4)
    ids = Tensor(np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 16)).astype(np.int32))
    want = plain(ids).asnumpy()
    special = decoder.build_model(CFG, seed=4)
    weights = [id(p) for p in special.trainable_params()]
    spec = backends.specialise(special, step_config(CFG, fused_kernels="off", block_graph="shared"))
    assert (spec.fused_kernels, spec.shared_blocks) == (False, True)
    assert isinstance(special.layers[0].attention.rope, cpu.Rope) and special.broadcast_tables
    assert all(block.no_inline for block in special.layers)
    np.testing.assert_allclose(special(ids).asnumpy(), want, rtol=1e-5, atol=1e-5)
    # Re-specialised for generation: blocks inlined, tables per use, the same Parameter objects.
    backends.specialise(special, step_config(CFG, fused_kernels="off", block_graph="shared"), training=False)
    assert not any(block.no_inline for block in special.layers) and not special.broadcast_tables
    assert [id(p) for p in special.trainable_params()] == weights
    np.testing.assert_allclose(special(ids).asnumpy(), want, rtol=1e-5, atol=1e-5)
