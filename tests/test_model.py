"""The msllm Llama computes what Hugging Face's does (logits, fp32, PYNATIVE)."""
import mindspore as ms
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from interop.convert import msllm_parameters
from interop.formats import DictReader
from interop.maps import FAMILIES
from interop.table import entries
from msllm import checkpoint, device
from msllm.config import ModelConfig
from msllm.models.decoder import Llama
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
