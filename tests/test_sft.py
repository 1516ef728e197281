"""SFT data: JSONL rows -> packed windows with loss masks; segment-aware attention and positions."""
import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from msllm import backends
from msllm.config import Config, DataConfig, ModelConfig, TrainConfig
from msllm.data import sft
from msllm.data.corpus import DataError
from msllm.models.decoder import build_model
from msllm.models.layers import MaskedCausalLMLoss
from msllm.train.step import LossCell
from tests.hf_models import save_tokenizer

@pytest.fixture
def eager():
    """PYNATIVE for these few tiny forward / backward calls: no graph compile per shape."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=ms.GRAPH_MODE)


MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                    max_seq_len=32)


def packed_config(fused="auto") -> Config:
    return Config(model=MODEL, data=DataConfig(path="rows.jsonl", seq_len=24),
                  train=TrainConfig(fused_kernels=fused))


def specialised(fused="auto"):
    model = build_model(MODEL, seed=3)
    spec = backends.specialise(model, packed_config(fused), training=True)
    assert spec.packed
    return model


def logits_np(model, ids, segments=None):
    ids = Tensor(np.asarray([ids], np.int32))
    if segments is None:
        return model(ids).asnumpy()[0]
    seg = np.asarray([segments], np.int32)
    return model(ids, None, None, None, Tensor(seg), Tensor(sft.positions(seg))).asnumpy()[0]


def test_packed_samples_equal_the_samples_run_one_by_one(eager):
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 64, n).tolist() for n in (7, 11)]
    model = specialised()
    width = 24
    ids = samples[0] + samples[1] + [0] * (width - 18)
    segments = [1] * 7 + [2] * 11 + [0] * (width - 18)
    packed = logits_np(model, ids, segments)
    alone = [logits_np(model, s + [0] * (width - len(s)), [1] * len(s) + [0] * (width - len(s)))[:len(s)]
             for s in samples]
    np.testing.assert_allclose(packed[:7], alone[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[7:18], alone[1], rtol=1e-5, atol=1e-5)
    # ... and equal the plain causal model on the sample alone (positions 0.., no mask beyond causal)
    plain = build_model(MODEL, seed=3)
    np.testing.assert_allclose(packed[7:18], logits_np(plain, samples[1]), rtol=1e-5, atol=1e-5)
    # per-sample losses: the mean next-token loss of each sample, from the packed row and alone
    def loss(logits, labels):
        z = logits - logits.max(-1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(-1)) - z[np.arange(len(labels)), labels]))
    assert loss(packed[7:17], samples[1][1:]) == pytest.approx(loss(logits_np(plain, samples[1])[:10], samples[1][1:]),
                                                               rel=1e-5)


def grads(model, tokens, mask, segments):
    cell = LossCell(model)
    params = model.trainable_params()
    grad = ops.value_and_grad(cell, None, params)
    seg = np.asarray(segments, np.int32)
    loss, g = grad(Tensor(np.asarray(tokens, np.int32)), Tensor(1.0, ms.float32), Tensor(np.asarray(mask, np.float32)),
                   Tensor(seg), Tensor(sft.positions(seg)))
    return float(loss.asnumpy()), [x.asnumpy() for x in g]


def test_masked_tokens_contribute_exactly_zero_gradient(eager):
    rng = np.random.default_rng(1)
    model = specialised()
    tokens = rng.integers(0, 64, (2, 25))
    segments = np.zeros((2, 24), np.int64)
    segments[0, :10], segments[0, 10:20], segments[1, :15] = 1, 2, 1
    mask = np.zeros((2, 24))
    mask[0, 5:9], mask[0, 14:19], mask[1, 8:14] = 1, 1, 1   # response labels, within each sample
    # The loss's gradient at a masked position is exactly zero, everywhere else it is not.
    logits = Tensor(rng.normal(size=(2, 24, 64)).astype(np.float32))
    d_logits = ops.grad(MaskedCausalLMLoss())(logits, Tensor(tokens[:, 1:].astype(np.int32)),
                                             Tensor(mask.astype(np.float32))).asnumpy()
    touched = np.abs(d_logits).sum(-1) > 0
    assert np.array_equal(touched, mask == 1)
    # Padding (segment 0, after the samples) reaches neither the loss nor any weight's gradient.
    loss, base = grads(model, tokens, mask, segments)
    changed = tokens.copy()
    changed[0, 21:] = rng.integers(0, 64, 4)
    changed[1, 16:] = rng.integers(0, 64, 9)
    again_loss, again = grads(model, changed, mask, segments)
    assert again_loss == loss and all(np.array_equal(a, b) for a, b in zip(base, again))
    changed[0, 16] = (tokens[0, 16] + 1) % 64  # a response token: the gradient must move
    _, moved = grads(model, changed, mask, segments)
    assert not all(np.array_equal(a, b) for a, b in zip(base, moved))


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, corpus):
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))[:6]]
    return save_tokenizer(tmp_path_factory.mktemp("tok"), texts)


def test_shard_masks_exactly_the_responses(tmp_path, tokenizer):
    rows = [{"prompt": "def add(a, b):", "response": " return a + b"},
            {"messages": [{"role": "user", "content": "name?"}, {"role": "assistant", "content": "msllm"},
                          {"role": "user", "content": "again?"}, {"role": "assistant", "content": "yes"}]},
            {"prompt": "x = ", "response": "1"}] * 3
    path = write_rows(tmp_path / "rows.jsonl", rows)
    shard = sft.prepare(path, str(tokenizer), tmp_path / "shard", 64, 0.2, 300, log=lambda line: None)
    index = json.loads((shard / "index.json").read_text())
    assert index["kind"] == "sft" and index["samples"] == 9
    from msllm.data.tokenizer import load_tokenizer
    tok = load_tokenizer(tokenizer)
    learned = []
    for split in ("train", "val"):
        windows = sft.SFTWindows(shard, split, index)
        for i in range(len(windows)):
            tokens, mask, segments, positions = windows[i]
            assert positions[0] == 0 and all(positions[j] == 0 for j in range(1, 64) if segments[j] != segments[j - 1])
            labels = tokens[1:][mask == 1]
            learned.append(tok.decode(labels.tolist(), skip_special_tokens=False))
    text = "".join(learned)
    assert text.count(" return a + b<|endoftext|>") == 3 and text.count("1<|endoftext|>") == 3
    assert text.count("msllm<|im_end|>\n") == 3 and text.count("yes<|im_end|>\n") == 3
    assert "name?" not in text and "def add" not in text and "<|im_start|>" not in text
    assert index["response_tokens"] == sum(len(tok.encode(t, add_special_tokens=False).ids) for t in learned)


def test_bad_rows_are_one_line(tmp_path, tokenizer, corpus):
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"question": "a"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected string fields"):
        sft.prepare(bad, str(tokenizer), tmp_path / "s1", 40, 0.2, 300, log=print)
    long = write_rows(tmp_path / "long.jsonl", [{"prompt": "word " * 50, "response": "b"}])
    with pytest.raises(DataError, match=r"long.jsonl:1: sample of \d+ tokens does not fit data.seq_len 40"):
        sft.prepare(long, str(tokenizer), tmp_path / "s2", 40, 0.2, 300, log=print)
    plain = save_tokenizer(tmp_path / "plain", [p.read_text() for p in sorted(corpus.glob("*.py"))[:2]],
                           chat_template=None)
    chat = write_rows(tmp_path / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(DataError, match="chat rows need a chat template"):
        sft.prepare(chat, str(plain), tmp_path / "s3", 40, 0.2, 300, log=print)
    assert not (tmp_path / "s1").exists() and not (tmp_path / "s1.tmp").exists()
