"""The msllm Llama computes what Hugging Face's does (logits, fp32, PYNATIVE)."""
import mindspore as ms
import numpy as np
import pytest
import torch
from mindspore import ops
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from interop.convert import msllm_parameters
from interop.formats import DictReader
from interop.maps import FAMILIES
from interop.table import entries
from msllm import checkpoint, device
from msllm.config import ModelConfig
from msllm.models.decoder import Llama, build_model
from msllm.models.mixers.attention import Attention
from msllm.models.layers import rope_inv_freq
from tests.numerics import REORDER_RTOL


def msllm_name(hf_name: str) -> str:
    """HF parameter name -> msllm name, from the interop table (Qwen2's: Llama's plus biases)."""
    rows = entries(FAMILIES["Qwen2ForCausalLM"].table, ModelConfig(num_layers=8, qkv_bias=True))
    return {e.stored["hf"].name: e.name for e in rows}[hf_name]


def copy_hf_weights(hf, model):
    """Through the interop family table, the same mapping `msllm convert` uses."""
    rows = entries(FAMILIES[type(hf).__name__].table, model.cfg)
    state = {name: t.detach() for name, t in hf.state_dict().items()}
    arrays = {name: t.numpy() for name, t in msllm_parameters(rows, "hf", DictReader(state))}
    checkpoint.load_into(model.trainable_params(), arrays, type(hf).__name__)


CASES = {
    "llama3_gqa_rope_scaling": (
        LlamaForCausalLM, LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, intermediate_size=112, max_position_embeddings=64,
                                      rope_theta=500000.0, rms_norm_eps=1e-5,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, ffn_size=112,
                    rope_theta=500000.0, max_seq_len=64,
                    rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2_bias_tied": (
        Qwen2ForCausalLM, Qwen2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
        ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                    rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_seq_len=64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case):
    device.setup("cpu", "pynative")
    cls, hf_cfg, cfg = CASES[case]
    torch.manual_seed(0)
    hf = cls(hf_cfg).eval()
    with torch.no_grad():  # random biases, so the bias path is really exercised
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model = Llama(cfg)
    copy_hf_weights(hf, model)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    out = model(ms.Tensor(ids, ms.int32)).asnumpy()
    assert out.shape == ref.shape
    # fp32 on both sides, torch and MindSpore summing in their own orders: numerics.REORDER_RTOL.
    np.testing.assert_allclose(out, ref, atol=REORDER_RTOL * np.abs(ref).max(), rtol=0)


def test_llama3_scaling_changes_only_long_wavelengths():
    base = rope_inv_freq(64, 500000.0, None)
    scaled = rope_inv_freq(64, 500000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert scaled[0] == base[0]                               # highest frequency untouched
    assert scaled[-1] == pytest.approx(base[-1] / 8.0, rel=1e-6)  # lowest slowed by the factor
    assert np.all(scaled <= base)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_attention_core_backward_matches_torch_autograd(heads, kv_heads):
    """The hand-written attention backward (rowsum(dO*O) form) against torch autograd, MHA and GQA."""
    from mindspore import nn, ops
    from msllm.models.layers import AttentionCore

    device.setup("cpu", "graph")
    b, s, d = 2, 16, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, n, s, d)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    weight = rng.standard_normal((b, heads, s, d)).astype(np.float32)  # a non-uniform upstream gradient
    mask = np.triu(np.full((s, s), -1e9, np.float32), 1)

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.core = AttentionCore(heads, kv_heads, d)

        def construct(self, q, k, v, mask, weight):
            return (self.core(q, k, v, mask) * weight).sum()

    grads = ops.GradOperation(get_all=True)(Loss())(*(ms.Tensor(x) for x in (q, k, v, mask, weight)))

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    rep = heads // kv_heads
    scores = tq @ tk.repeat_interleave(rep, 1).transpose(-1, -2) / d ** 0.5 + torch.tensor(mask)
    ((torch.softmax(scores, -1) @ tv.repeat_interleave(rep, 1)) * torch.tensor(weight)).sum().backward()
    for name, got, want in zip("qkv", grads[:3], (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(got.asnumpy(), want.numpy(), rtol=0, atol=REORDER_RTOL * want.abs().max().item(),
                                   err_msg=name)


# ---- the per-layer mixer seam (docs/architecture.md, "Adding a mixer") ------------------------------

class PositionFreeAttention(Attention):
    """A mixer the library does not have: attention without RoPE (as SmolLM3's no-RoPE layers), written
    as a test would add one: a module of its own, one entry in MIXERS, one kind per layer."""

    def construct(self, x, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        ones, zeros = ops.ones_like(cos), ops.zeros_like(sin)
        return super().construct(x, ones, zeros, mask, cache_k, cache_v, write)


def test_a_new_mixer_plugs_in_per_layer_with_its_cache_and_no_other_change(monkeypatch):
    from msllm.inference import CachedForward
    from msllm.models import mixers

    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_size=48,
                      max_seq_len=16)
    kinds = ["gqa", "no_rope", "gqa"]
    monkeypatch.setitem(mixers.MIXERS, "no_rope", PositionFreeAttention)
    monkeypatch.setattr(ModelConfig, "mixer_kinds", lambda self: list(kinds))
    device.setup("cpu", "pynative")
    model = build_model(cfg, seed=3)
    model.set_train(False)
    assert [type(block.attention).__name__ for block in model.layers] == ["Attention", "PositionFreeAttention", "Attention"]
    monkeypatch.setattr(ModelConfig, "mixer_kinds", lambda self: ["gqa"] * 3)
    plain = build_model(cfg, seed=3)  # the same weights, every layer with RoPE
    plain.set_train(False)
    assert [p.name for p in plain.trainable_params()] == [p.name for p in model.trainable_params()]
    rng = np.random.default_rng(5)  # weights large enough for sharp attention, so positions matter
    for mine, theirs in zip(model.trainable_params(), plain.trainable_params()):
        value = ms.Tensor((rng.normal(0, 0.3, mine.shape) + ("norm" in mine.name)).astype(np.float32))
        mine.set_data(value)
        theirs.set_data(value)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    full = model(ms.Tensor(ids)).asnumpy()
    atol = REORDER_RTOL * np.abs(full).max()
    assert np.abs(full - plain(ms.Tensor(ids)).asnumpy()).max() > 1000 * atol  # the middle layer mixes otherwise
    # prefill 5 tokens, then decode one at a time: the new mixer's cache is written and read like attention's
    forward = CachedForward(model)
    keys, values = (np.zeros(shape, np.float32) for shape in cfg.cache_shapes(2, 16))
    start, pad = np.array([0], np.int32), np.zeros(2, np.int32)
    logits, keys, values = forward(ms.Tensor(ids[:, :5]), ms.Tensor(keys), ms.Tensor(values), ms.Tensor(start), ms.Tensor(pad))
    np.testing.assert_allclose(logits.asnumpy(), full[:, 4], atol=atol)
    for i in range(5, 9):
        logits, keys, values = forward(ms.Tensor(ids[:, i:i + 1]), keys, values, ms.Tensor(np.array([i], np.int32)),
                                       ms.Tensor(pad))
        np.testing.assert_allclose(logits.asnumpy(), full[:, i], atol=atol)
    ms.set_context(mode=ms.GRAPH_MODE)


INVENTORY = {
    "dense": ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                         qkv_bias=True, qk_norm=True, sandwich_norm=True, tie_embeddings=True),
    "moe": ModelConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_size=48,
                       num_experts=4, experts_per_token=2, moe_ffn_size=24, mlp_types=["dense", "moe", "moe"]),
    # qk_norm is ignored by MLA (no per-head q / k norms), so it must add nothing to the inventory either
    "mla": ModelConfig(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=4, ffn_size=48,
                       attention="mla", q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
                       v_head_dim=5, num_experts=4, experts_per_token=3, moe_ffn_size=16, shared_experts=1,
                       router="sigmoid_grouped", expert_groups=2, mlp_types=["dense", "moe", "moe"], qk_norm=True),
}


@pytest.mark.parametrize("kind", list(INVENTORY))
def test_param_inventory_is_the_cells_and_num_params_counts_it(kind):
    """msllm.params lists the Cells' parameters (names, shapes, order); num_params sums them but the expert
    biases (transformers' buffers), active=True counts k of a MoE layer's E stacked experts."""
    from msllm.params import param_shapes

    m = INVENTORY[kind]
    cells = {p.name: tuple(p.shape) for p in Llama(m).trainable_params()}
    assert list(param_shapes(m).items()) == list(cells.items())
    counted = {name: int(np.prod(shape)) for name, shape in cells.items() if not name.endswith("expert_bias")}
    assert m.num_params() == sum(counted.values())
    active = sum(n * m.experts_per_token // m.num_experts if ".experts." in name else n for name, n in counted.items())
    assert m.num_params(active=True) == active
    assert (m.num_params(active=True) < m.num_params()) == (kind != "dense")
