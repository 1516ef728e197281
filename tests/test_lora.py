"""LoRA inside the one compiled train step: only adapters learn, with the fused kernels, recompute,
accumulation and fp16 loss scaling; and merging gives the model the adapters computed."""
import dataclasses

import mindspore as ms
import numpy as np
import pytest

from msllm.checkpoint import load_into
from msllm.config import LoraConfig, ModelConfig, OptimConfig
from msllm.lora import LoRALinear, adapter_params, apply_lora, merge_lora
from msllm.models.decoder import build_model
from msllm.train.build import build_train_step
from tests.conftest import step_config

CFG = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                  max_seq_len=32)
OPT = OptimConfig(lr=1e-2, warmup_steps=0, decay="constant", weight_decay=0.0, grad_clip=1.0)
ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def lora_step(accum=1, batch=4, **train):
    cfg = dataclasses.replace(step_config(CFG, OPT, steps=4, accum_steps=accum, batch_size=batch, **train),
                              lora=LoraConfig(rank=4, alpha=8.0, targets=ALL))
    return build_train_step(cfg, build_model(CFG, seed=3))


def snapshot(params):
    return {p.name: p.asnumpy().copy() for p in params}


@pytest.mark.parametrize("train", [{"recompute": "selective"}, {"precision": "fp16", "fused_kernels": "off"}],
                         ids=["fp32-fused-recompute", "fp16-loss-scale"])
def test_only_adapters_learn(train):
    built = lora_step(accum=2, batch=2, **train)
    model = built.model
    adapters = {p.name for p in adapter_params(model)}
    base = snapshot([p for p in model.get_parameters() if p.name not in adapters])
    assert {p.name for p in built.optimizer.params} == {p.name for p in adapter_params(model)}
    assert len(adapter_params(model)) == 2 * 7 * CFG.num_layers
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32))
    losses = [float(built.train_step(tokens)[0].asnumpy()) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(np.array_equal(p.asnumpy(), base[p.name]) for p in model.get_parameters() if p.name in base)
    assert all(np.abs(p.asnumpy()).max() > 0 for p in adapter_params(model) if p.name.endswith("lora_b"))


def test_merge_computes_what_the_adapters_did():
    model = build_model(CFG, seed=5)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=ALL), seed=1)
    rng = np.random.default_rng(2)
    for p in adapter_params(model):
        p.set_data(ms.Tensor(rng.normal(0, 0.1, p.shape).astype(np.float32)))
    ids = ms.Tensor(rng.integers(0, 128, (2, 12)).astype(np.int32))
    adapted = model(ids).asnumpy()
    merge_lora(model)
    assert not any(isinstance(c, LoRALinear) for _, c in model.cells_and_names())
    plain = build_model(CFG)  # a new Cell: graph mode would reuse `model`'s compiled graph
    load_into(plain.trainable_params(), snapshot(model.trainable_params()), "merged")  # same names, no adapters
    np.testing.assert_allclose(plain(ids).asnumpy(), adapted, rtol=1e-5, atol=1e-5)


# a dense and a MoE layer: gate / up / down adapt the dense MLP, experts_* each expert of the MoE one
MOE = dataclasses.replace(CFG, num_experts=4, experts_per_token=2, moe_ffn_size=24, mlp_types=["dense", "moe"])
MOE_TARGETS = ["q", "gate", "experts_gate", "experts_up", "experts_down"]


def test_expert_adapters_learn_alone_and_merge_into_the_experts():
    """LoRA on stacked experts: one adapter per expert and projection, trained in the compiled step
    with the base frozen; merging gives the plain model what the adapted one computed."""
    cfg = dataclasses.replace(step_config(MOE, OPT, steps=3, batch_size=4), lora=LoraConfig(rank=4, alpha=8.0,
                                                                                           targets=MOE_TARGETS))
    model = build_model(MOE, seed=3)
    base = snapshot(model.trainable_params())
    built = build_train_step(cfg, model)
    names = {p.name: p.shape for p in adapter_params(model)}
    assert names["layers.1.feed_forward.experts.w1.lora_a"] == (4, 4, 32)    # [E, rank, hidden]
    assert names["layers.1.feed_forward.experts.w2.lora_b"] == (4, 32, 4)    # [E, hidden, rank]
    assert "layers.0.feed_forward.w1.lora_a" in names and len(names) == 2 * (2 + 1 + 3)
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32))
    losses = [float(built.train_step(tokens)[0].asnumpy()) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert all(np.array_equal(p.asnumpy(), base[p.name]) for p in model.get_parameters() if p.name in base)
    assert all(np.abs(p.asnumpy()).max() > 0 for p in adapter_params(model) if p.name.endswith("lora_b"))

    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ids = ms.Tensor(np.random.default_rng(2).integers(0, 128, (2, 12)).astype(np.int32))
        adapted = model(ids).asnumpy()
        merge_lora(model)
        merged = snapshot(model.trainable_params())
        assert set(merged) == set(base) and not np.array_equal(merged["layers.1.feed_forward.experts.w3"],
                                                                 base["layers.1.feed_forward.experts.w3"])
        plain = build_model(MOE)
        load_into(plain.trainable_params(), merged, "merged")
        np.testing.assert_allclose(plain(ids).asnumpy(), adapted, rtol=1e-5, atol=1e-5)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
