"""The family tables describe the msllm model exactly, and the concat / transpose rules invert."""
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from interop import maps
from interop.convert import convert
from interop.maps.llama import LLAMA
from interop.table import Concat, Row, Transposed, entries
from msllm.config import ModelConfig
from msllm.layout.table import param_entry, param_shapes
from msllm.models.decoder import Llama
from tests.hf_models import build

GQA = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48, max_seq_len=16)


@pytest.mark.parametrize("arch", list(maps.FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_table_lists_every_model_parameter_with_its_shape(arch, tied):
    family = maps.FAMILIES[arch]
    experts = dict(num_experts=4, moe_ffn_size=24, mlp_types=["dense", "moe"]) if family.moe else {}
    if family.spec.get("experts_bias"):  # gpt-oss: every layer MoE (its checkpoints hold no dense MLP)
        experts["mlp_types"] = None
    if family.spec.get("attention") == "mla":  # DeepSeek-V3: MLA sizes (the tied case with one q projection), MTP
        experts.update(num_kv_heads=4, q_lora_rank=0 if tied else 8, kv_lora_rank=8, qk_nope_head_dim=6,
                       qk_rope_head_dim=4, v_head_dim=5, expert_groups=2, shared_experts=1, mtp_depths=2)
    m = dataclasses.replace(GQA, tie_embeddings=tied, **family.spec, **experts)
    table = {name: shape for e in entries(maps.FAMILIES[arch].table, m) for name, shape in e.stored["msllm"].shapes(e).items()}
    model = {p.name: tuple(p.shape) for p in Llama(m).trainable_params()}
    assert table == model
    # what checkpoints are checked against, and every parameter has a placement (msllm plan)
    assert list(param_shapes(m).items()) == list(model.items())
    assert all(param_entry(name) for name in model)


def fused(table):
    """What msllm's table would become if it fused QKV and gate/up: only rows change.
    MindFormers' column also stores wo transposed, to exercise that rule."""
    rows = [r for r in table.per_layer if not r.msllm.endswith(("wq.weight", "wk.weight", "wv.weight",
                                                                 "w1.weight", "w3.weight", "wo.weight"))]
    rows += [
        Row("attention.wqkv.weight", "q+kv+kv, hidden", Concat(0, *(f"self_attn.{p}_proj.weight" for p in "qkv")),
            Concat(0, *(f"attention.w{p}.weight" for p in "qkv"))),
        Row("feed_forward.w13.weight", "ffn+ffn, hidden", Concat(0, "mlp.gate_proj.weight", "mlp.up_proj.weight"),
            Concat(0, "feed_forward.w1.weight", "feed_forward.w3.weight")),
        Row("attention.wo.weight", "hidden, q", "self_attn.o_proj.weight", Transposed("attention.wo.weight")),
    ]
    return table._replace(per_layer=rows)


def test_fused_table_concats_splits_and_transposes_bitwise(tmp_path, monkeypatch):
    monkeypatch.setitem(maps.FAMILIES, "LlamaForCausalLM", maps.FAMILIES["LlamaForCausalLM"]._replace(table=fused(LLAMA)))
    hf = build("llama3_gqa_rope_scaling")
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "fused", progress=False)
    convert(tmp_path / "fused", tmp_path / "mf", to="mindformers", mf_format="safetensors", progress=False)
    convert(tmp_path / "mf", tmp_path / "back", to="hf", progress=False)

    src = {k: v for k, v in hf.state_dict().items()}
    ours, mf = load_file(tmp_path / "fused" / "model.safetensors"), load_file(tmp_path / "mf" / "model.safetensors")
    a = "model.layers.1.self_attn"
    assert torch.equal(ours["layers.1.attention.wqkv.weight"],
                       torch.cat([src[f"{a}.q_proj.weight"], src[f"{a}.k_proj.weight"], src[f"{a}.v_proj.weight"]]))
    assert "layers.1.attention.wq.weight" not in ours
    assert torch.equal(mf["model.layers.1.attention.wo.weight"], src[f"{a}.o_proj.weight"].T)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == src.keys()
    assert all(torch.equal(back[k], src[k]) for k in src)


def test_concat_parts_must_match_the_shape_terms():
    bad = LLAMA._replace(per_layer=[Row("x", "q+kv, hidden", Concat(0, "a", "b", "c"), "x")])
    with pytest.raises(ValueError, match="joins 3 parts but dim 0 of 'q\\+kv, hidden' has 2 terms"):
        entries(bad, GQA)


def test_hf_config_names_no_architecture():
    """A family's own config keys live in its map's from_hf / to_hf hooks, not in branches of hf_config.py."""
    from tests.conftest import REPO

    source = (REPO / "interop" / "hf_config.py").read_text()
    assert [arch for arch in maps.FAMILIES if arch in source] == []
