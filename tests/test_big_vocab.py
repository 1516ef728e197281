"""Big vocabularies: the output head and its loss fused (a head that never holds [tokens, vocab]:
msllm.models.layers.ChunkedHead, MindSpore ops by vocabulary chunks, or msllm.kernels.FusedHead, the
C++ kernel; then layers.HeadCrossEntropy) give the loss and gradients of the logits path.

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
from msllm.data.loader import head_rows, make_dataset, row_capacity
from msllm.models.decoder import build_model
from msllm.models import layers
from msllm.models.layers import CausalLMLoss, ChunkedHead, HeadCrossEntropy, MaskedCausalLMLoss, head_chunks
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


class FusedLoss(nn.Cell):
    """A head's (lse, target) into the loss, as the step's LossCell composes them."""

    def __init__(self, head, z_loss=0.0):
        super().__init__()
        self.head, self.loss = head, HeadCrossEntropy(z_loss)

    def construct(self, h, weight, labels, mask=None):
        lse, target = self.head(h, weight, labels)
        return self.loss(lse, target, mask)


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


@pytest.mark.skipif(not kernels.has_sgemm(), reason="MindSpore's CPU backend without oneDNN's dnnl_sgemm")
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
def test_frozen_head_kernel_gives_the_hidden_gradient_in_one_pass(softcap):
    """A frozen head (LoRA): the forward also returns lse's gradient rows, from which the backward
    forms dhidden without a second pass over the vocabulary. Any per-row weights on lse and on the
    label's logit (a, b below, as a masked or DPO loss puts them) give the logits path's dhidden."""
    n = 1024  # the kernel's blocks are then 1,024 columns: 3 of them, over both threads, merged at the end
    hidden, weight, labels, _ = head_inputs(n, H, V, seed=5)
    hidden = hidden * 2.0  # logits of a few units: a cap of 5 bends them
    rng = np.random.default_rng(6)
    a, b = (Tensor(rng.normal(size=(n,)).astype(np.float32)) for _ in range(2))

    def dhidden(head):
        def fn(h):
            lse, target = head(h, weight, labels)
            return ops.sum(lse * a) + ops.sum(target * b)
        return ms.jit(ops.grad(fn))(hidden).asnumpy()

    frozen = kernels.FusedHead(softcap, weight_grad=False)
    for got, want in zip(frozen(hidden, weight, labels), Reference(softcap).head(hidden, weight, labels)):
        assert_close_to_scale({"value": got.asnumpy()}, {"value": want.asnumpy()}, 2 * (H + V) * U32)
    grad_rtol = 2 * (H + V + V + V) * U32  # the softmax's mean of dz/dh is itself a V-term sum
    assert_close_to_scale({"hidden": dhidden(frozen)}, {"hidden": dhidden(Reference(softcap).head)}, grad_rtol)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_fused_loss_equals_the_logits_path(eager, masked):
    hidden, weight, labels, mask = head_inputs(N, H, V)
    args = (hidden, weight, labels) + ((mask,) if masked else ())
    want_loss, want = loss_and_grads(Reference(), *args)
    loss_rtol, grad_rtol = head_rtol(N, H, V)
    for name, head in heads().items():
        got_loss, got = loss_and_grads(FusedLoss(head), *args)
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
        got_loss, got = loss_and_grads(FusedLoss(head, z_loss), hidden, weight, labels, mask)
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
        h, _, _ = self.model.decode(tokens[:, :-1], segments=segments, positions=positions)
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
        cell.head = head
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
    assert isinstance(cell.head, kernels.FusedHead)
    loss_rtol, grad_rtol = decoder_rtol(cfg_model, 48, 24)
    np.testing.assert_allclose([o[0] for o in got_outs], [o[0] for o in want_outs], rtol=loss_rtol)
    assert_close_to_scale(got_grads, want_grads, grad_rtol)
    assert got_outs[-1][0] < got_outs[0][0]  # the same batch each step: the loss falls


# (b) Only the positions with a loss go through the head.

def test_head_rows_hold_every_loss_position_in_a_few_buckets():
    assert [row_capacity(c, 1024, 8) for c in (1, 64, 65, 97, 129, 200, 257, 700, 769)] == \
        [64, 64, 96, 128, 192, 256, 384, 768, 1024]
    assert row_capacity(70, 1024, 3) == 96 and row_capacity(100, 1024, 5) == 130  # a multiple of the rows
    rng = np.random.default_rng(5)
    mask = (rng.random((6, 64)) < 0.2).astype(np.float32)  # 2 micro-batches of 3 rows
    rows = head_rows(mask, 2)
    micro = mask.reshape(2, -1)
    capacity = row_capacity(int(micro.sum(1).max()), 3 * 64, 3)
    assert rows.shape == (6, capacity // 3) and capacity < 3 * 64
    for i, picked in enumerate(rows.reshape(2, -1)):
        hit = np.flatnonzero(micro[i])
        assert np.array_equal(picked[:hit.size], hit)      # every loss position, in order
        assert np.all(micro[i][picked[hit.size:]] == 0)     # padding: positions without a loss
    full = np.ones((2, 64), np.float32)  # more than the largest bucket below every position: all of them
    assert np.array_equal(head_rows(full, 1).reshape(-1), np.arange(128))


class Windows:
    """SFT windows as msllm.data.sft.SFTWindows yields them, from arrays."""
    columns = ["tokens", "mask", "segments", "positions"]

    def __init__(self, n, s, vocab, seed=6):
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, vocab, (n, s + 1)).astype(np.int32)
        self.segments = np.ones((n, s), np.int32)
        self.segments[:, s // 2:] = 2
        self.mask = np.zeros((n, s), np.float32)
        for i in range(n):  # a response of a few tokens at the end of each sample
            k = 3 + i % 5
            self.mask[i, s // 2 - k - 1:s // 2 - 1] = 1
            self.mask[i, s - k - 1:s - 1] = 1

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i], self.mask[i], self.segments[i], sft.positions(self.segments[i])


@pytest.mark.parametrize("head", ["whole", "kernel"])
@pytest.mark.parametrize("accum", [1, 2])
def test_compiled_step_with_loss_rows_trains_as_all_positions(monkeypatch, accum, head):
    """The same batches through the compiled step with all positions and with only the loss positions
    (the dataset's rows column), the logits whole or through the head kernel: same losses, same
    applied gradients."""
    if head == "kernel":
        if not kernels.has_sgemm():
            pytest.skip("MindSpore's CPU backend without oneDNN's dnnl_sgemm")
        monkeypatch.setattr(layers, "HEAD_CHUNK_BYTES", 0)
    cfg_model = ModelConfig(vocab_size=2000, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                            max_seq_len=64, tie_embeddings=True)
    windows = Windows(8, 64, cfg_model.vocab_size)
    opt = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=0.5)

    def run(rows):
        device.setup("cpu", "graph")
        cfg = step_config(cfg_model, opt, steps=5, batch_size=2, accum_steps=accum)
        cfg.data = DataConfig(path="rows.jsonl", seq_len=64)
        built = build_train_step(cfg, build_model(cfg_model, seed=3), wrap_optimizer=Recorded)
        data = make_dataset(windows, 64, 2 * accum, seed=0, shuffle=False, num_batches=2, loss_rows=accum if rows else 0)
        outs, shapes, grads = [], [], None
        for batch in data.create_tuple_iterator(num_epochs=1):
            shapes.append(tuple(x.shape for x in batch))
            outs.append(float(built.train_step(*batch)[0].asnumpy()))
            grads = grads or built.train_step.optimizer.gradients()
        return outs, grads, shapes

    want_outs, want_grads, want_shapes = run(False)
    got_outs, got_grads, shapes = run(True)
    assert len(shapes[0]) == 5 and shapes[0][:4] == want_shapes[0]  # tokens, mask, segments, positions, rows
    assert shapes[0][4] == (2 * accum, 32)                            # 64 of the 128 positions per micro-batch
    loss_rtol, grad_rtol = decoder_rtol(cfg_model, 128, 64)
    np.testing.assert_allclose(got_outs, want_outs, rtol=loss_rtol)
    assert_close_to_scale(got_grads, want_grads, grad_rtol)


# (c) DPO's and GRPO's completions, and data-parallel workers' shared capacity.

def lora_adapters_moved(model, seed=8):
    """LoRA B matrices away from 0, the same in every run: the policy differs from its reference."""
    rng = np.random.default_rng(seed)
    for p in model.trainable_params():
        if p.name.endswith("lora_b"):
            p.set_data(Tensor(rng.normal(0, 0.3, p.shape).astype(np.float32)))


class Pairs:
    """Preference pairs as msllm.data.preference.PairRows yields them, from arrays: per pair a prompt then
    a chosen and a rejected completion of different lengths (their EOS included), padded; with_ref: the
    reference log-probs as dpo.precompute_ref stores them."""

    def __init__(self, n, s, vocab, with_ref, seed=7):
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, vocab, (n, 2, s + 1)).astype(np.int32)
        self.mask = np.zeros((n, 2, s), np.float32)
        for i in range(n):
            prompt = 4 + i % 6
            for side in (0, 1):
                self.mask[i, side, prompt - 1:prompt - 1 + 2 + (3 * i + 5 * side) % 8] = 1
        self.ref = rng.normal(-60.0, 3.0, (n, 2)).astype(np.float32)
        self.columns = ["tokens", "mask"] + (["ref"] if with_ref else [])

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return (self.tokens[i], self.mask[i]) + ((self.ref[i],) if "ref" in self.columns else ())


def need_kernel(monkeypatch, head):
    """head == "kernel": every logits size takes the fused head kernel's branch (HEAD_CHUNK_BYTES 0)."""
    if head == "kernel":
        if not kernels.has_sgemm():
            pytest.skip("MindSpore's CPU backend without oneDNN's dnnl_sgemm")
        monkeypatch.setattr(layers, "HEAD_CHUNK_BYTES", 0)


@pytest.mark.parametrize("head,accum,reference", [("whole", 1, "precomputed"), ("kernel", 2, "lora")])
def test_dpo_step_with_completion_rows_trains_as_all_positions(monkeypatch, head, accum, reference):
    """DPO's compiled step fed by the dataset with and without the rows column (the completion positions of
    chosen and rejected, EOS included): same losses, TRL metrics and applied gradients. Whole logits with
    precomputed reference log-probs (rows after ref), and the head kernel with LoRA, whose reference is the
    base with the adapters off computed in the step through the same rows (rows before its output), over
    two micro-batches."""
    from msllm.config import Config, DPOConfig, LoraConfig, TrainConfig

    need_kernel(monkeypatch, head)
    cfg_model = small_model(tied=True)
    s = 32
    pairs = Pairs(8, s, cfg_model.vocab_size, with_ref=reference == "precomputed")
    lora = LoraConfig(rank=4, targets=["q", "v", "down"]) if reference == "lora" else LoraConfig()
    opt = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=0.5)

    def run(rows):
        device.setup("cpu", "graph")
        cfg = Config(model=cfg_model, optim=opt, lora=lora, data=DataConfig(path="pairs.jsonl", seq_len=s),
                     train=TrainConfig(objective="dpo", batch_size=2, accum_steps=accum, steps=5),
                     dpo=DPOConfig(beta=0.1, precompute_ref=reference == "precomputed"))
        built = build_train_step(cfg, build_model(cfg_model, seed=3), wrap_optimizer=Recorded)
        lora_adapters_moved(built.model)
        data = make_dataset(pairs, s, 2 * accum, seed=0, shuffle=False, num_batches=2, loss_rows=accum if rows else 0)
        outs, stats, shapes, grads = [], [], [], None
        for batch in data.create_tuple_iterator(num_epochs=1):
            shapes.append(tuple(x.shape for x in batch))
            loss, *_, metrics = built.train_step(*batch)
            outs.append(float(loss.asnumpy()))
            stats.append(metrics.asnumpy())
            grads = grads or built.train_step.optimizer.gradients()
        return outs, np.array(stats), grads, shapes

    want_outs, want_stats, want_grads, want_shapes = run(False)
    got_outs, got_stats, got_grads, shapes = run(True)
    # 2 pairs x 2 rows x 32 positions per micro-batch; at most 2 x 2 x 9 completion labels: 64 of the 128
    assert shapes[0][:len(want_shapes[0])] == want_shapes[0] and shapes[0][-1] == (2 * accum, 32)
    loss_rtol, grad_rtol = decoder_rtol(cfg_model, 128 * accum, s)
    np.testing.assert_allclose(got_outs, want_outs, rtol=loss_rtol)
    scale = np.abs(want_stats[:, 4:]).max()  # the summed log-probs: rewards and margins are differences of them
    np.testing.assert_allclose(got_stats, want_stats, rtol=loss_rtol, atol=loss_rtol * scale)
    assert_close_to_scale(got_grads, want_grads, grad_rtol)


@pytest.mark.skipif(not kernels.has_sgemm(), reason="MindSpore's CPU backend without oneDNN's dnnl_sgemm")
def test_grpo_step_with_completion_rows_trains_as_all_positions(monkeypatch):
    """GRPO (dapo over two micro-batches, a KL term to the LoRA base, two updates per rollout batch) through
    the head kernel with and without completion rows, inputs laid out by the loop's own step_inputs: the
    old log-probs are the policy's at the completion positions (0 elsewhere with rows), and both updates'
    losses, metrics and applied gradients are all positions'."""
    from msllm.config import Config, GRPOConfig, LoraConfig, TrainConfig
    from msllm.train.grpo_loop import step_inputs
    from msllm.train.rollout import rollout_rows

    need_kernel(monkeypatch, "kernel")
    cfg_model = small_model(tied=False)
    s, group, accum = 32, 4, 2
    rng = np.random.default_rng(9)
    prompts = [list(rng.integers(2, cfg_model.vocab_size, 5 + 3 * k)) for k in range(2)]
    completions = [list(rng.integers(2, cfg_model.vocab_size, 1 + (5 * i) % 8)) for i in range(2 * group)]
    tokens, mask = rollout_rows(prompts, completions, group, s, 0)
    advantages = rng.normal(size=2 * group).astype(np.float32)

    def run(head_rows):
        device.setup("cpu", "graph")
        cfg = Config(model=cfg_model, optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.0),
                     lora=LoraConfig(rank=4, targets=["q", "v", "down"]),
                     train=TrainConfig(objective="grpo", batch_size=group, accum_steps=accum, steps=5,
                                       head_rows=head_rows),
                     grpo=GRPOConfig(beta=0.04, num_iterations=2, temperature=0.9, max_new_tokens=8))
        built = build_train_step(cfg, build_model(cfg_model, seed=3), wrap_optimizer=Recorded)
        lora_adapters_moved(built.model)
        inputs = step_inputs(built.train_step.loss_cell, tokens, mask, advantages, accum, 2)
        outs, stats, grads = [], [], []
        for _ in range(2):
            loss, *_, metrics = built.train_step(*inputs)
            outs.append(float(loss.asnumpy()))
            stats.append(metrics.asnumpy())
            grads.append(built.train_step.optimizer.gradients())
        return inputs, outs, np.array(stats), grads

    want_inputs, want_outs, want_stats, want_grads = run("all")
    got_inputs, got_outs, got_stats, got_grads = run("loss")
    assert len(got_inputs) == len(want_inputs) + 1 and got_inputs[3].shape == (2 * group, 64 // group)
    old, want_old = got_inputs[-1].asnumpy(), want_inputs[-1].asnumpy()
    kept = np.zeros(mask.size, bool)
    kept[head_rows(mask, 1).reshape(-1)] = True
    assert np.all(old.reshape(-1)[~kept] == 0) and (mask.reshape(-1)[kept] == 0).any()  # padded with non-loss rows
    loss_rtol, grad_rtol = decoder_rtol(cfg_model, 4 * s * accum, s)
    np.testing.assert_allclose(old[mask == 1], want_old[mask == 1], rtol=loss_rtol)
    np.testing.assert_allclose(got_outs, want_outs, rtol=loss_rtol, atol=loss_rtol * np.abs(advantages).max())
    np.testing.assert_allclose(got_stats, want_stats, rtol=loss_rtol, atol=loss_rtol)
    for got, want in zip(got_grads, want_grads):
        assert_close_to_scale(got, want, grad_rtol)
    assert want_stats[:, 0].min() > 0  # the adapters move the policy from its base: the KL term acts


def test_data_parallel_ranks_agree_on_the_head_capacity():
    """Two data-parallel ranks' datasets (one process builds both): each step both get rows of one capacity,
    the larger of what each rank's own batch needs (read from the shard), each rank's rows holding its own
    loss positions, padded with distinct positions without one."""
    s, b = 32, 4
    windows = Windows(16, s, 500)
    windows.mask[:] = 0
    for i in range(16):  # samples 4..7 (rank 1's at step 0): 20 loss labels each, the others 8
        windows.mask[i, 2:2 + (20 if 4 <= i < 8 else 8)] = 1
    batches = [list(make_dataset(windows, s, b, seed=0, shuffle=False, world=2, rank=r, num_batches=2,
                                 loss_rows=1).create_tuple_iterator(num_epochs=1, output_numpy=True))
               for r in (0, 1)]
    own = [[row_capacity(int(batch[1].sum()), b * s, b) for batch in rank] for rank in batches]
    assert own == [[64, 64], [96, 64]]  # alone, rank 0 would compile another graph at step 0
    for step in range(2):
        capacity = max(own[0][step], own[1][step])
        for rank in batches:
            mask, rows = rank[step][1].reshape(-1), rank[step][4].reshape(-1)
            assert rows.size == capacity and len(set(rows)) == capacity
            hit = np.flatnonzero(mask)
            assert np.array_equal(rows[:hit.size], hit) and np.all(mask[rows[hit.size:]] == 0)


# (d) Generation: the prefill's head sees each prompt's last position only.

class RecordingHead(nn.Cell):
    """The model's output Cell, recording the shape of what reaches it."""

    def __init__(self, head):
        super().__init__(auto_prefix=False)
        self.head, self.seen = head, []

    def construct(self, h):
        self.seen.append(tuple(h.shape))
        return self.head(h)


def test_prefill_sends_only_the_last_positions_through_the_head(eager):
    from msllm.inference import cell_engine

    cfg = small_model(tied=False)
    model = build_model(cfg, seed=3)
    prompts = [[5, 17, 42, 9, 3, 11, 8], [80, 81]]
    want = [model(Tensor(np.array([p], np.int32))).asnumpy()[0, -1] for p in prompts]
    model.output = head = RecordingHead(model.output)
    logits = cell_engine(model).start(prompts, 4)
    assert head.seen == [(2, cfg.hidden_size)]  # not the [2 * 16, hidden] of the padded prompts
    forward_rtol, _ = decoder_rtol(cfg, 16, 16)  # the padded prompts' sums in another order
    assert_close_to_scale({"logits": logits}, {"logits": np.stack(want)}, forward_rtol, "logit")
