"""Prefill + one-token decode with the preallocated KV cache computes what full recompute does,
also for left-padded rows of a batch, and with a sliding layer's ring cache."""
import dataclasses

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


# One sliding layer (window 4: its cache a ring of 4 slots) before a full one.
SLIDING = dataclasses.replace(CFG, sliding_window=4, layer_types=["sliding", "full"])


def decode_rows(cfg):
    """Prompts of 8 and 3 tokens (left-padded to 16, beyond the window) and the 3 tokens fed after each."""
    rng = np.random.default_rng(6)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 6)]


def decodes_as_the_full_forward(model, rows, piece: int):
    """The engine prefills rows[:-3] (in calls of `piece` tokens; 0: one call) and decodes two of the last three
    tokens: asserts every step's logits are the full forward's; returns the engine."""
    fulls = [model(ms.Tensor(np.array([r], np.int32))).asnumpy()[0] for r in rows]
    engine = cell_engine(model)
    engine.tokens_per_call = piece
    steps = [engine.start([r[:-3] for r in rows], 3)] + [engine.step([r[k] for r in rows]) for k in (-3, -2)]
    for row, r in enumerate(rows):
        atol = REORDER_RTOL * np.abs(fulls[row]).max()
        for k, got in enumerate(steps):
            np.testing.assert_allclose(got[row], fulls[row][len(r) - 4 + k], atol=atol, err_msg=f"piece {piece}")
    return engine


def test_a_sliding_layer_keeps_only_its_window_in_a_ring():
    """Prompts of 8 and 3 tokens (left-padded to 16, beyond the window) prefilled in one call or in calls of
    3 tokens that wrap the ring, then decode steps: every step's logits are the full forward's, the
    sliding layer's cache holds 4 slots whatever the cache length, and slot j sits at j % 4, holding the
    keys the same layer computes when its cache keeps every slot."""
    device.setup("cpu", "pynative")
    model = build_model(SLIDING, seed=4)
    model.set_train(False)
    rows = decode_rows(SLIDING)
    rings = {}
    for piece in (0, 3):
        engine = decodes_as_the_full_forward(model, rows, piece)
        caches = dict(zip(SLIDING.cache_names(), (c.asnumpy() for c in engine.cache)))
        assert {name: c.shape for name, c in caches.items()} == {
            "keys": (1, 2, 2, 64, 16), "values": (1, 2, 2, 64, 16), "ring_keys": (1, 2, 2, 4, 16),
            "ring_values": (1, 2, 2, 4, 16)}
        rings[piece] = caches["ring_keys"][0]
    # layer 0 built full (the same weights) keeps its keys at every slot: 0 .. 17 written
    keeping_all = cell_engine(build_model(dataclasses.replace(SLIDING, layer_types=["full", "full"]), seed=4))
    keeping_all.start([r[:-3] for r in rows], 3)
    keeping_all.step([r[-3] for r in rows])
    keeping_all.step([r[-2] for r in rows])
    every_slot = keeping_all.cache[0].asnumpy()[0]
    for ring in rings.values():
        for slot in range(14, 18):
            np.testing.assert_allclose(ring[:, :, slot % 4], every_slot[:, :, slot], rtol=0,
                                       atol=REORDER_RTOL * np.abs(every_slot).max())


# A Gated DeltaNet layer, a sliding layer (ring of 4) and a full one: every kind of cache.
HYBRID = dataclasses.replace(SLIDING, num_layers=3, layer_types=["linear", "sliding", "full"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def test_a_hybrid_with_a_sliding_layer_decodes_as_its_full_forward():
    """A Gated DeltaNet layer, a sliding layer (ring of 4) and a full one (transformers has no such hybrid msllm
    reads): 16-token left-padded prompts prefilled in one call (the window's last 4 slots left in the ring), then
    decode steps that hand on the recurrent state and conv window and wrap the ring, each step's logits the full
    forward's; the caches are the ring, the full layer's slots and the linear layer's state and conv window.
    The first prompt given twice (a GRPO group's rows) is prefilled once, every cache copied to both rows."""
    hybrid = HYBRID
    device.setup("cpu", "pynative")
    model = build_model(hybrid, seed=5)
    model.set_train(False)
    rows = decode_rows(hybrid)
    engine = decodes_as_the_full_forward(model, rows + rows[:1], 0)
    assert sorted(shapes[0][1] for shapes in engine.in_place) == [2, 3]  # the prefill's rows, the decode's
    assert {name: c.shape for name, c in zip(hybrid.cache_names(), engine.cache)} == {
        "keys": (1, 3, 2, 64, 16), "values": (1, 3, 2, 64, 16), "ring_keys": (1, 3, 2, 4, 16),
        "ring_values": (1, 3, 2, 4, 16), "states": (1, 3, 4, 8, 8), "windows": (1, 3, 3, 64)}


def test_caches_come_two_per_kind_of_layer_and_a_ring_holds_the_window():
    """ModelConfig.caches: full layers keep every slot, sliding ones min(window, length) (a symbolic length of
    an exported graph stays symbolic), Gated DeltaNet layers a state and conv window of fixed size."""
    gemma = dataclasses.replace(CFG, num_layers=3, sliding_window=4, layer_types=["sliding", "full", "sliding"])
    assert gemma.caches(2, 64) == {"keys": (1, 2, 2, 64, 16), "values": (1, 2, 2, 64, 16),
                                   "ring_keys": (2, 2, 2, 4, 16), "ring_values": (2, 2, 2, 4, 16)}
    assert gemma.caches(1, 3)["ring_keys"] == (2, 1, 2, 3, 16)  # a cache shorter than the window
    assert gemma.caches(None, None)["ring_keys"][3] is None
    assert gemma.caches("batch", "max_len")["ring_keys"][3] == "min(max_len, 4)"
    mistral = dataclasses.replace(CFG, sliding_window=4)  # every layer slides: the rings alone
    assert mistral.cache_names() == ("ring_keys", "ring_values") and mistral.cache_shapes(1, 64)[0][3] == 4
    hybrid = dataclasses.replace(CFG, num_layers=3, layer_types=["linear", "sliding", "linear"], sliding_window=4,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=8)
    assert hybrid.caches(1, 64) == {"ring_keys": (1, 1, 2, 4, 16), "ring_values": (1, 1, 2, 4, 16),
                                    "states": (2, 1, 4, 8, 8), "windows": (2, 1, 3, 64)}


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
    """specialise(training=False) on CPU: the formulations, the norm / SwiGLU / softmax kernels,
    the few-rows linear of decode steps, the one-kernel cached attention, tables, residual norm and SwiGLU + w2
    (prefill and decode), in GRAPH_MODE with fixed shapes, against the plain model."""
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
    assert isinstance(model.layers[0].attention.project, kernels.ProjectionsFewRows)
    assert isinstance(model.layers[0].attention.attend, kernels.CachedAttend)  # rope, cache write and core: one kernel
    assert isinstance(model.cached_tables, kernels.FusedCacheTables)  # the tables and visibility: one kernel
    assert isinstance(model.layers[0].residual_norm, kernels.FusedResidualNorm)  # residual add + ffn_norm: one
    assert isinstance(model.layers[0].feed_forward.down, kernels.SwiGLUFewRows)  # SwiGLU + w2: one
    engine = cell_engine(model)
    got = [engine.start([r[:-3] for r in rows], 3)] + [engine.step([r[k] for r in rows]) for k in (-3, -2)]
    for row, r in enumerate(rows):
        atol = 1e-4 * np.abs(plain[row]).max()  # exp_approx in the softmax kernel: within 1e-4 relative
        for k, logits in enumerate(got):
            np.testing.assert_allclose(logits[row], plain[row][len(r) - 4 + k], atol=atol)


def test_the_engine_keeps_its_caches_in_place_and_steps_as_the_exported_forward():
    """The CPU decode kernels, every kind of cache (HYBRID): each decode step of the msllm engine,
    whose caches are Parameters written in place, gives the logits and caches of CachedForward (the exported
    graphs' form, caches in and out) from the same caches; the engine holds the same Parameters throughout, and
    the full layer's slots past the written ones keep the garbage loaded there (masked, never copied over)."""
    from msllm.backends import specialise
    from msllm.config import Config

    device.setup("cpu", "pynative")  # GRAPH_MODE's: test_hybrid's and test_families' engine tests
    model = build_model(HYBRID, seed=5)
    model.set_train(False)
    specialise(model, Config(model=HYBRID), training=False)
    rows = decode_rows(HYBRID)
    engine = cell_engine(model)
    engine.start([r[:-3] for r in rows], 3)
    held = [p for cache in engine.cache for p in cache.layers]
    caches = [cache.asnumpy() for cache in engine.cache]
    later = engine.next_slot + 2  # the slots the two steps leave alone
    garbage = np.random.default_rng(0).normal(size=caches[0][..., later:, :].shape).astype(np.float32)
    caches[0][..., later:, :] = garbage
    engine.cache[0].load(caches[0])
    forward = CachedForward(model)
    for k in (-3, -2):
        tokens = np.array([[r[k]] for r in rows], np.int32)
        want, *caches = forward(*tensors(tokens, *caches, np.array([engine.next_slot], np.int32),
                                         engine.pad.astype(np.int32)))
        got = engine.step(tokens[:, 0].tolist())
        np.testing.assert_allclose(got, want.asnumpy(), rtol=0, atol=REORDER_RTOL * np.abs(got).max())
        for name, mine, theirs in zip(HYBRID.cache_names(), engine.cache, caches):
            np.testing.assert_allclose(mine.asnumpy(), theirs.asnumpy(), rtol=0, err_msg=name,
                                       atol=REORDER_RTOL * np.abs(theirs.asnumpy()).max())
    assert all(p is q for p, q in zip([p for cache in engine.cache for p in cache.layers], held))
    assert (engine.cache[0].asnumpy()[..., later:, :] == garbage).all()
