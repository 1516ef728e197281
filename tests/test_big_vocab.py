"""Big vocabularies: the output head and its loss fused (msllm.models.layers LinearCrossEntropy over a
head that never holds [tokens, vocab]: ChunkedHead, MindSpore ops by vocabulary chunks, or
msllm.kernels.FusedHead, the C++ kernel) give the loss and gradients of the logits path.

The reference is the path the train step took before: logits = hidden @ weight^T, then
CausalLMLoss (SparseSoftmaxCrossEntropyWithLogits) or MaskedCausalLMLoss, differentiated by
autodiff. Both are fp32 evaluations of the same maths in another summation order (the chunks'
logsumexps, the label's logit read from its block, dhidden summed block by block), so they are held
to tests/numerics.py's bounds: 2 u x the terms summed along the longest path (head_rtol here, and
decoder_rtol for a whole decoder), against each compared tensor's own scale."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from msllm import device, kernels
from msllm.config import DataConfig, ModelConfig, OptimConfig
from msllm.data import sft
from msllm.models.decoder import build_model
from msllm.models import layers
from msllm.models.layers import CausalLMLoss, ChunkedHead, LinearCrossEntropy, MaskedCausalLMLoss, head_chunks
from msllm.train import step as step_module
from msllm.train.build import build_train_step
from tests.conftest import step_config
from tests.numerics import U32, Recorded, assert_close_to_scale, decoder_rtol

LossCell = step_module.LossCell  # the step's own (the compiled-step test swaps the module's name)


@pytest.fixture
def eager():
    """PYNATIVE for the Cell-level comparisons: no graph compile per shape."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)


def head_rtol(n: int, h: int, v: int) -> tuple[float, float]:
    """(loss, gradient) rtol of the head alone: forward sums h (a logit), v (the logsumexp) and n
    (the mean); a gradient adds dlogits' own (the softmax at v terms) and its matmul's sum, v terms
    (dhidden) or n (dweight). Each K-term sum adds <= K u of its output's scale (numerics.py)."""
    forward = h + v + n
    return 2 * forward * U32, 2 * (forward + v + max(v, n)) * U32


def test_chunks_cover_the_vocabulary_in_a_few_tens_of_mb():
    n, vocab = 1024, 262_144
    chunks = head_chunks(n, vocab)
    assert chunks[0][0] == 0 and chunks[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all((end - start) % 256 == 0 for start, end in chunks[:-1])
    assert 16 << 20 <= 4 * n * (chunks[0][1] - chunks[0][0]) <= 32 << 20  # fp32 logits of one chunk
    assert head_chunks(1024, 4096) == ((0, 4096),)  # W1's logits (16 MB) are one chunk: computed whole
    assert head_chunks(64, 3000, 64 * 4 * 512) == tuple((s, min(s + 512, 3000)) for s in range(0, 3000, 512))


class Reference(nn.Cell):
    """Today's head: logits [N, V] in fp32 (soft-capped), then the (masked) cross-entropy or, for a
    head alone, its (logsumexp, label logit), by autodiff."""

    def __init__(self, softcap=0.0, z_loss=0.0):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        self.loss, self.masked_loss = CausalLMLoss(), MaskedCausalLMLoss()
        self.softcap, self.z_loss = softcap, z_loss

    def logits(self, h, weight):
        logits = self.matmul(h, weight)
        return ops.tanh(logits / self.softcap) * self.softcap if self.softcap > 0 else logits

    def head(self, h, weight, labels):
        logits = self.logits(h, weight)
        return ops.logsumexp(logits, -1), ops.gather_elements(logits, 1, labels.reshape(-1, 1)).reshape(-1)

    def construct(self, h, weight, labels, mask=None):
        if self.z_loss > 0:  # written out: z-loss needs the logsumexp
            lse, target = self.head(h, weight, labels)
            return ops.sum((lse - target + self.z_loss * lse * lse) * mask) / ops.sum(mask)
        logits = self.logits(h, weight)
        return self.loss(logits, labels) if mask is None else self.masked_loss(logits, labels, mask)


def head_inputs(n, h, v, seed=0):
    rng = np.random.default_rng(seed)
    hidden = Tensor(rng.normal(size=(n, h)).astype(np.float32))
    weight = Tensor((rng.normal(size=(v, h)) * 0.3).astype(np.float32))
    labels = Tensor(rng.integers(0, v, n).astype(np.int32))
    mask = Tensor((rng.random(n) < 0.3).astype(np.float32))
    return hidden, weight, labels, mask


def loss_and_grads(fn, *args):
    loss, (dh, dw) = ops.value_and_grad(fn, (0, 1))(*args)
    return float(loss.asnumpy()), {"hidden": dh.asnumpy(), "weight": dw.asnumpy()}


N, H, V = 48, 32, 3000
GRAPH_CHUNK = N * 4 * 256  # the graph form's chunks: 256 columns, 12 of them, the last ragged (184)


def heads(softcap=0.0):
    """The two forms of the fused head: MindSpore ops by chunks, and the C++ kernel."""
    forms = {"graph": ChunkedHead(softcap, GRAPH_CHUNK)}
    if kernels.enabled() and kernels.has_sgemm():
        forms["kernel"] = kernels.FusedHead(softcap)
    return forms


@pytest.mark.parametrize("mode", ["pynative", "graph"])
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
def test_heads_equal_the_logits_logsumexp_and_label_logit(mode, softcap):
    """(lse, target) and their gradients through any weights on them (a random linear read-out)."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        assert len(head_chunks(N, V, GRAPH_CHUNK)) == 12
        hidden, weight, labels, _ = head_inputs(N, H, V, seed=3)
        hidden = hidden * 2.0  # logits of a few units: a cap of 5 bends them
        rng = np.random.default_rng(4)
        a, b = (Tensor(rng.normal(size=(N,)).astype(np.float32)) for _ in range(2))
        ref = Reference(softcap)

        def read_out(head):
            def fn(h, w):
                lse, target = head(h, w, labels)
                return ops.sum(lse * a) + ops.sum(target * b)
            return ms.jit(fn) if mode == "graph" else fn

        want = ref.head(hidden, weight, labels)
        want_sum, want_grads = loss_and_grads(read_out(ref.head), hidden, weight)
        # forward: lse sums H (a logit) then V terms, a label logit H; backward adds the softmax and
        # dhidden's V terms, or dweight's N
        forward_rtol, grad_rtol = 2 * (H + V) * U32, 2 * (H + V + V + max(V, N)) * U32
        for name, head in heads(softcap).items():
            got = head(hidden, weight, labels)
            for g, w in zip(got, want):
                assert_close_to_scale({name: g.asnumpy()}, {name: w.asnumpy()}, forward_rtol, "value")
            _, got_grads = loss_and_grads(read_out(head), hidden, weight)
            assert_close_to_scale(got_grads, want_grads, grad_rtol)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_fused_loss_equals_the_logits_path(eager, monkeypatch, masked):
    monkeypatch.setattr(layers, "HEAD_CHUNK_BYTES", 0)  # these small logits would be computed whole
    hidden, weight, labels, mask = head_inputs(N, H, V)
    args = (hidden, weight, labels) + ((mask,) if masked else ())
    want_loss, want = loss_and_grads(Reference(), *args)
    loss_rtol, grad_rtol = head_rtol(N, H, V)
    for name, head in heads().items():
        got_loss, got = loss_and_grads(LinearCrossEntropy(head), *args)
        assert abs(got_loss - want_loss) <= loss_rtol * abs(want_loss), name
        assert_close_to_scale(got, want, grad_rtol)
        if masked:  # a masked-out row takes exactly no gradient
            assert np.all(got["hidden"][mask.asnumpy() == 0] == 0), name


@pytest.mark.parametrize("softcap,z_loss", [(30.0, 0.0), (0.0, 1e-3), (5.0, 1e-2)])
def test_soft_capping_and_z_loss(eager, softcap, z_loss):
    n, h, v = 40, 16, 1000
    hidden, weight, labels, mask = head_inputs(n, h, v, seed=1)
    hidden = hidden * 3.0
    want_loss, want = loss_and_grads(Reference(softcap, z_loss), hidden, weight, labels, mask)
    loss_rtol, grad_rtol = head_rtol(n, h, v)
    for name, head in heads(softcap).items():
        got_loss, got = loss_and_grads(LinearCrossEntropy(head, z_loss), hidden, weight, labels, mask)
        assert abs(got_loss - want_loss) <= loss_rtol * abs(want_loss), name
        assert_close_to_scale(got, want, grad_rtol)


class LogitsLossCell(LossCell):
    """The train step's loss cell as it was: the model's logits [b, s, vocab], then the loss."""

    def __init__(self, model, fused=False):
        super().__init__(model)
        self.loss, self.masked_loss = CausalLMLoss(), MaskedCausalLMLoss()

    def construct(self, tokens, scale, mask=None, segments=None, positions=None):
        labels = self.model.local_tokens(tokens[:, 1:])
        b = tokens.shape[0]
        h, _, _, _ = self.model.decode(tokens[:, :-1], None, None, None, None, segments, positions)
        logits = self.model.logits(h).reshape(b, -1, self.model.cfg.vocab_size)
        if mask is None:
            return self.loss(logits, labels) * scale
        mask = self.model.local_tokens(mask)
        return self.masked_loss(logits, labels, mask, ops.stop_gradient(ops.sum(mask))) * scale


def small_model(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=2000, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                       max_seq_len=32, tie_embeddings=tied, pad_token_id=1 if tied else -1)


def sft_batch(b=2, s=24, vocab=2000, seed=2):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, s + 1)).astype(np.int32)
    segments = np.zeros((b, s), np.int32)
    segments[0, :10], segments[0, 10:20], segments[1, :15] = 1, 2, 1
    mask = np.zeros((b, s), np.float32)
    mask[0, 5:9], mask[0, 14:19], mask[1, 8:14] = 1, 1, 1
    return [Tensor(tokens), Tensor(1.0, ms.float32), Tensor(mask), Tensor(segments), Tensor(sft.positions(segments))]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_loss_cell_gradients_equal_the_logits_path(eager, monkeypatch, tied, masked):
    """Every weight's gradient through the decoder, through either head form; tied, the embedding
    table's is the lookup's and the head's together (the pad row takes the head's only)."""
    monkeypatch.setattr(layers, "HEAD_CHUNK_BYTES", 0)  # these small logits would be computed whole
    cfg = small_model(tied)
    model = build_model(cfg, seed=3)
    args = sft_batch(vocab=cfg.vocab_size)
    if not masked:
        args = args[:2]
    params = model.trainable_params()

    def run(cell):
        loss, grads = ops.value_and_grad(cell, None, params)(*args)
        return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}

    want_loss, want = run(LogitsLossCell(model))
    loss_rtol, grad_rtol = decoder_rtol(cfg, 48, 24)
    for name, head in heads().items():
        cell = LossCell(model)
        cell.head_loss = LinearCrossEntropy(head)
        got_loss, got = run(cell)
        assert abs(got_loss - want_loss) <= loss_rtol * abs(want_loss), name
        assert_close_to_scale(got, want, grad_rtol)
        if tied:  # every row of the table takes the head's gradient, beside the looked-up rows' own
            assert np.abs(got["tok_embeddings.weight"]).sum(-1).min() > 0


@pytest.mark.skipif(not kernels.has_sgemm(), reason="MindSpore's CPU backend without oneDNN's dnnl_sgemm")
def test_compiled_train_step_trains_as_the_logits_path(monkeypatch):
    """GRAPH_MODE TrainStep (fused CPU kernels, AdamW, clipping), tied embeddings, packed SFT rows:
    the fused head kernel's losses and first applied gradients are the logits path's."""
    cfg_model = small_model(tied=True)
    opt = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=0.5)
    tokens, _, *rows = sft_batch(vocab=cfg_model.vocab_size)

    def run(loss_cell, chunk_bytes):
        device.setup("cpu", "graph")
        monkeypatch.setattr(step_module, "LossCell", loss_cell)
        monkeypatch.setattr(layers, "HEAD_CHUNK_BYTES", chunk_bytes)
        cfg = step_config(cfg_model, opt, steps=5)
        cfg.data = DataConfig(path="rows.jsonl", seq_len=24)
        built = build_train_step(cfg, build_model(cfg_model, seed=3), wrap_optimizer=Recorded)
        assert built.spec.fused_kernels
        outs = [tuple(float(x.asnumpy()) for x in built.train_step(tokens, *rows)) for _ in range(3)]
        return outs, built.train_step.optimizer.gradients(), built.train_step.loss_cell

    want_outs, want_grads, _ = run(LogitsLossCell, layers.HEAD_CHUNK_BYTES)
    got_outs, got_grads, cell = run(LossCell, 0)
    assert isinstance(cell.head_loss.head, kernels.FusedHead)
    loss_rtol, grad_rtol = decoder_rtol(cfg_model, 48, 24)
    np.testing.assert_allclose([o[0] for o in got_outs], [o[0] for o in want_outs], rtol=loss_rtol)
    assert_close_to_scale(got_grads, want_grads, grad_rtol)
    assert got_outs[-1][0] < got_outs[0][0]  # the same batch each step: the loss falls
