"""Prefill + one-token decode with the preallocated KV cache computes what full recompute does,
also for left-padded rows of a batch."""
import mindspore as ms
import numpy as np

from msllm import device
from msllm.config import ModelConfig
from msllm.inference import CachedForward, cell_engine
from msllm.models.decoder import build_model
from tests.numerics import FP16_RTOL, REORDER_RTOL

# Qwen2-style bias and tied embeddings plus llama3 rope scaling: every optional path at once.
CFG = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=32, qkv_bias=True, tie_embeddings=True,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8})


def tensors(*arrays):
    return [ms.Tensor(a) for a in arrays]


def test_decode_equals_full_recompute():
    device.setup("cpu", "pynative")
    model = build_model(CFG, seed=1)
    model.set_train(False)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
    full = model(ms.Tensor(ids)).asnumpy()
    # fp32, other matmul shapes (one row vs the whole sequence) sum in other orders: REORDER_RTOL.
    atol = REORDER_RTOL * np.abs(full).max()
    forward = CachedForward(model)
    garbage = np.random.default_rng(1).normal(0, 100, (2, 2, 2, 16, 16)).astype(np.float32)
    cache = garbage  # the slots not written yet must stay unread
    no_pad = np.zeros(2, np.int32)
    logits, keys, values = forward(*tensors(ids[:, :7], cache, cache, np.array([0], np.int32), no_pad))
    assert keys.shape == (2, 2, 2, 16, 16) and values.shape == keys.shape
    np.testing.assert_allclose(logits.asnumpy(), full[:, 6], atol=atol)
    for i in range(7, 11):  # one token at a time, written in place at slot i
        logits, keys, values = forward(*tensors(ids[:, i:i + 1]), keys, values, *tensors(np.array([i], np.int32),
                                                                                          no_pad))
        np.testing.assert_allclose(logits.asnumpy(), full[:, i], atol=atol)
    assert (keys.asnumpy()[:, :, :, 11:] == garbage[:, :, :, 11:]).all()  # written in place, the rest kept
    # several new tokens in one step: the matching rows of the causal mask
    _, keys, values = forward(*tensors(ids[:, :3], cache, cache, np.array([0], np.int32), no_pad))
    logits, _, _ = forward(*tensors(ids[:, 3:]), keys, values, *tensors(np.array([3], np.int32), no_pad))
    np.testing.assert_allclose(logits.asnumpy(), full[:, 11], atol=atol)
    # the wrapper keeps the trained parameter names
    assert [p.name for p in forward.trainable_params()] == [p.name for p in model.trainable_params()]


def test_padded_batch_equals_each_prompt_alone():
    """Prompts of 3, 9 and 5 tokens in one batch: each row's logits are its own full forward's."""
    device.setup("cpu", "pynative")
    model = build_model(CFG, seed=2)
    model.set_train(False)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 9, 5)]
    engine = cell_engine(model)
    logits = engine.start([r[:-2] for r in rows], 4)
    assert engine.pad.tolist() == [16 - 1, 16 - 7, 16 - 3] and engine.cache[0].shape[3] == 64  # buckets
    steps = [logits, engine.step([r[-2] for r in rows]), engine.step([r[-1] for r in rows])]
    for row, r in enumerate(rows):
        full = model(ms.Tensor(np.array([r], np.int32))).asnumpy()[0]
        atol = REORDER_RTOL * np.abs(full).max()
        for k, got in enumerate(steps):
            np.testing.assert_allclose(got[row], full[len(r) - 3 + k], atol=atol)


def test_decode_follows_the_compute_dtype():
    """A model trained with train.precision fp16: the cache and the decode math are fp16 too."""
    device.setup("cpu", "pynative")
    model = build_model(CFG, seed=1, compute_dtype=ms.float16)
    model.set_train(False)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (1, 9)).astype(np.int32)
    full = model(ms.Tensor(ids)).asnumpy()
    # Each side rounds to fp16 along its own path (forward only: half of numerics.FP16_RTOL's count).
    atol = FP16_RTOL / 2 * np.abs(full).max()
    engine = cell_engine(model)
    logits = engine.start([ids[0, :6].tolist()], 3)
    assert engine.cache[0].dtype == ms.float16
    for i in range(6, 9):
        np.testing.assert_allclose(logits[0], full[0, i - 1], atol=atol)
        logits = engine.step([int(ids[0, i])])


def test_cpu_inference_specialisation_decodes_the_same():
    """specialise(training=False) on CPU: the formulations, the norm / SwiGLU / softmax kernels and
    the few-rows linear of decode steps, in GRAPH_MODE with fixed shapes, against the plain model."""
    from msllm.backends import specialise
    from msllm.config import Config
    from msllm import kernels

    device.setup("cpu", "graph")
    model = build_model(CFG, seed=3)
    model.set_train(False)
    rows = [np.random.default_rng(2).integers(0, CFG.vocab_size, n).tolist() for n in (20, 13)]
    plain = [model(ms.Tensor(np.array([r], np.int32))).asnumpy()[0] for r in rows]
    spec = specialise(model, Config(model=CFG), training=False)
    assert spec.fused_kernels and isinstance(model.layers[0].attention.wq.matmul, kernels.LinearFewRows)
    engine = cell_engine(model)
    got = [engine.start([r[:-3] for r in rows], 3)] + [engine.step([r[k] for r in rows]) for k in (-3, -2)]
    for row, r in enumerate(rows):
        atol = 1e-4 * np.abs(plain[row]).max()  # exp_approx in the softmax kernel: within 1e-4 relative
        for k, logits in enumerate(got):
            np.testing.assert_allclose(logits[row], plain[row][len(r) - 4 + k], atol=atol)
