"""Attention sinks (gpt-oss): a learned logit per head in every softmax row, with no value. The attention
mixer with model.attention_sinks against transformers' GptOssAttention (forward and every gradient), the
cached decode path of a compiled model against its own full forward, and the one-line refusal on Ascend,
whose FlashAttentionScore takes no sinks (the CPU flash kernel does: tests/test_flash_attention.py)."""
import os

import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import nn, ops
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from msllm import device
from msllm.config import ModelConfig
from msllm.models.decoder import build_model
from msllm.models.mixers.attention import Attention
from tests.numerics import REORDER_RTOL

SIZES = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48, max_seq_len=16)


def test_attention_with_sinks_computes_and_differentiates_as_gpt_oss():
    """One layer's attention, GQA 4/2, causal over 10 tokens: output and the gradients of x, the
    projections and the sinks equal GptOssAttention's (eager) within REORDER_RTOL of each tensor's scale.
    Large sinks (N(0, 2)) take most of some rows, so a core without them is far off."""
    hf_cfg = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          attention_bias=False, num_hidden_layers=1, layer_types=["full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = GptOssAttention(hf_cfg, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * (2.0 if p.ndim == 1 else 0.3))
    s, h = 10, 32
    x = torch.randn(1, s, h, requires_grad=True)
    positions = torch.arange(s)[None]
    cos, sin = GptOssRotaryEmbedding(hf_cfg)(x, positions)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    out, _ = theirs(x, (cos, sin), mask)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()

    device.setup("cpu", "pynative")
    cfg = ModelConfig(**{**SIZES, "num_layers": 1, "head_dim": 8, "rope_theta": hf_cfg.rope_parameters["rope_theta"]},
                      attention_sinks=True)
    ours = Attention(cfg)
    names = {"wq.weight": "q_proj.weight", "wk.weight": "k_proj.weight", "wv.weight": "v_proj.weight",
             "wo.weight": "o_proj.weight", "core.sinks": "sinks"}
    hf_params = dict(theirs.named_parameters())
    for name, p in ours.parameters_and_names():
        p.set_data(ms.Tensor(hf_params[names[name]].detach().numpy()))
    angles = np.concatenate([positions[0].numpy()[:, None] * rope_freqs(cfg)] * 2, -1).astype(np.float32)
    ms_cos, ms_sin = ms.Tensor(np.cos(angles)), ms.Tensor(np.sin(angles))
    ms_mask = ms.Tensor(np.triu(np.full((s, s), -1e9, np.float32), 1))

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attention = ours

        def construct(self, x, weight):
            return (self.attention(x, ms_cos, ms_sin, ms_mask)[0] * weight).sum()

    loss = Loss()
    params = loss.trainable_params()
    grad = ops.GradOperation(get_all=True, get_by_list=True)(loss, params)
    ms_x, ms_weight = ms.Tensor(x.detach().numpy()[0]), ms.Tensor(weight.numpy()[0])
    got = loss.attention(ms_x, ms_cos, ms_sin, ms_mask)[0].asnumpy()
    want = out.detach().numpy()[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=REORDER_RTOL * np.abs(want).max())
    (dx, _), dparams = grad(ms_x, ms_weight)
    np.testing.assert_allclose(dx.asnumpy(), x.grad.numpy()[0], rtol=0, atol=REORDER_RTOL * x.grad.abs().max().item())
    for p, g in zip(params, dparams):
        hf_grad = hf_params[names[p.name.split("attention.", 1)[1]]].grad.numpy()
        np.testing.assert_allclose(g.asnumpy(), hf_grad, rtol=0, atol=REORDER_RTOL * np.abs(hf_grad).max(), err_msg=p.name)
    without = Attention(ModelConfig(**{**SIZES, "num_layers": 1, "head_dim": 8, "rope_theta": cfg.rope_theta}))
    for p in without.trainable_params():
        p.set_data(dict(ours.parameters_and_names())[p.name.split("attention.", 1)[-1]].data)
    assert np.abs(without(ms_x, ms_cos, ms_sin, ms_mask)[0].asnumpy() - want).max() > 0.1 * np.abs(want).max()
    assert [p.name.split("attention.", 1)[1] for p in params][-1] == "core.sinks"  # its gradient was compared


def rope_freqs(cfg: ModelConfig) -> np.ndarray:
    from msllm.models.layers import rope_inv_freq

    return rope_inv_freq(cfg.head_size, cfg.rope_theta, None)


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): the suite's gpt-oss "
                    "greedy test (tests/test_families.py) decodes with sinks through the cache")
def test_cached_decode_with_sinks_equals_the_full_forward():
    """A 2-layer model with sinks, one layer sliding (window 4, its cache a ring of 4 slots), compiled with
    the CPU backend's decode kernels (the fused sink softmax core): prefill 5 tokens then decode 5, each
    step's logits equal to the full forward's at that position."""
    from msllm.backends import specialise
    from msllm.config import Config
    from msllm.inference import CachedForward

    cfg = ModelConfig(**SIZES, attention_sinks=True, sliding_window=4, layer_types=["sliding", "full"])
    device.setup("cpu", "graph")
    model = build_model(cfg, seed=3)
    rng = np.random.default_rng(5)
    for p in model.trainable_params():
        if p.name.endswith("core.sinks"):
            p.set_data(ms.Tensor(rng.normal(0, 2.0, p.shape).astype(np.float32)))
    model.set_train(False)
    ids = rng.integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    full = model(ms.Tensor(ids)).asnumpy()
    specialise(model, Config(model=cfg), training=False)
    assert type(model.layers[0].attention.core.softmax_attention).__name__ == "FusedSinkSoftmaxAttention"
    forward = CachedForward(model)
    caches = [ms.Tensor(np.zeros(shape, np.float32)) for shape in cfg.cache_shapes(2, 16)]
    pad = ms.Tensor(np.zeros(2, np.int32))
    logits, *caches = forward(ms.Tensor(ids[:, :5]), *caches, ms.Tensor(np.array([0], np.int32)), pad)
    atol = REORDER_RTOL * np.abs(full).max()
    np.testing.assert_allclose(logits.asnumpy(), full[:, 4], rtol=0, atol=atol)
    for i in range(5, 10):
        logits, *caches = forward(ms.Tensor(ids[:, i:i + 1]), *caches, ms.Tensor(np.array([i], np.int32)), pad)
        np.testing.assert_allclose(logits.asnumpy(), full[:, i], rtol=0, atol=atol)


def test_sinks_on_ascend_are_refused_in_one_line_and_flash_on_cpu_is_taken(tmp_path):
    """MindSpore 2.10's FlashAttentionScore has no sink input (its real_shift adds to the scores): sinks on
    Ascend are one line naming that, and `auto` there never resolves to it. On CPU train.attention: flash
    with sinks loads (the flash kernel takes them: tests/test_flash_attention.py)."""
    from msllm.config import ConfigError
    from msllm.config_file import load_config
    from msllm.rules import ascend_flash_problem, resolves_to_flash

    path = tmp_path / "c.yaml"
    path.write_text("model:\n  attention_sinks: true\ntrain:\n  device: ascend\n  precision: bf16\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "model.attention_sinks" and "\n" not in str(err.value)
    assert "FlashAttentionScore takes no sink" in str(err.value)
    path.write_text("model:\n  attention_sinks: true\ntrain:\n  attention: flash\n")
    cfg = load_config(path)
    assert ascend_flash_problem(cfg, False)[0] == "model.attention_sinks"
    assert not resolves_to_flash(cfg, "ascend", False, 4096, False) and resolves_to_flash(cfg, "cpu", True, 64, False)


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): ~70 s, beyond CI's budget")
@pytest.mark.parametrize("fmt", ["onnx", "mindir"])
def test_exports_with_sinks_compute_msllms_logits(tmp_path, corpus, fmt):
    """The ONNX graph (written op by op: the sink column joined before the softmax) and MindIR (the Cells
    as compiled) of a model with sinks pass export's own verification against msllm's logits, full and
    cached, within REORDER_RTOL of their scale. By hand: every export verifies itself against msllm (and
    the ONNX builder refuses weights it does not use), so a wrong graph is refused, never written."""
    from graph_opt import export as export_mod
    from graph_opt.export import export
    from tests.test_export import make_run

    cfg = ModelConfig(**{**SIZES, "vocab_size": 384, "max_seq_len": 32}, attention_sinks=True)
    run = make_run(tmp_path / "run", cfg, corpus)
    manifest = export(run, fmt, tmp_path / fmt, log=lambda line: None)
    scale = manifest["tolerance"] / export_mod.TOLERANCE["fp32"]
    assert set(manifest["max_abs_diff"]) and max(manifest["max_abs_diff"].values()) <= REORDER_RTOL * scale
