"""Prefill + one-token decode with a KV cache computes what full recompute does."""
import mindspore as ms
import numpy as np

from msllm import device
from msllm.config import ModelConfig
from msllm.inference import Decode, Prefill
from msllm.models.llama import build_model
from tests.numerics import FP16_RTOL, REORDER_RTOL

# Qwen2-style bias and tied embeddings plus llama3 rope scaling: every optional path at once.
CFG = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=32, qkv_bias=True, tie_embeddings=True,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8})


def test_decode_equals_full_recompute():
    device.setup("cpu", "pynative")
    model = build_model(CFG, seed=1)
    model.set_train(False)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
    full = model(ms.Tensor(ids)).asnumpy()
    # fp32, other matmul shapes (one row vs the whole sequence) sum in other orders: REORDER_RTOL.
    atol = REORDER_RTOL * np.abs(full).max()
    logits, keys, values = Prefill(model)(ms.Tensor(ids[:, :7]))
    assert keys.shape == (2, 2, 2, 7, 16) and values.shape == keys.shape
    np.testing.assert_allclose(logits.asnumpy(), full[:, :7], atol=atol)
    decode = Decode(model)
    for i in range(7, 11):  # one token at a time
        logits, keys, values = decode(ms.Tensor(ids[:, i:i + 1]), keys, values)
        np.testing.assert_allclose(logits.asnumpy()[:, 0], full[:, i], atol=atol)
    assert keys.shape[3] == 11
    logits, _, _ = decode(ms.Tensor(ids[:, 11:]), keys, values)
    np.testing.assert_allclose(logits.asnumpy()[:, 0], full[:, 11], atol=atol)
    # several new tokens in one step use the matching rows of the causal mask
    logits, _, _ = decode(ms.Tensor(ids[:, 3:]), *Prefill(model)(ms.Tensor(ids[:, :3]))[1:])
    np.testing.assert_allclose(logits.asnumpy(), full[:, 3:], atol=atol)
    # the wrappers keep the trained parameter names
    assert [p.name for p in Prefill(model).trainable_params()] == [p.name for p in model.trainable_params()]


def test_decode_follows_the_compute_dtype():
    """A model trained with train.precision fp16: the cache and the decode math are fp16 too."""
    device.setup("cpu", "pynative")
    model = build_model(CFG, seed=1, compute_dtype=ms.float16)
    model.set_train(False)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (1, 9)).astype(np.int32)
    full = model(ms.Tensor(ids)).asnumpy()
    # Each side rounds to fp16 along its own path (forward only: half of numerics.FP16_RTOL's count).
    atol = FP16_RTOL / 2 * np.abs(full).max()
    logits, keys, values = Prefill(model)(ms.Tensor(ids[:, :6]))
    assert keys.dtype == ms.float16
    for i in range(6, 9):
        logits, keys, values = Decode(model)(ms.Tensor(ids[:, i:i + 1]), keys, values)
        np.testing.assert_allclose(logits.asnumpy()[:, 0], full[:, i], atol=atol)
