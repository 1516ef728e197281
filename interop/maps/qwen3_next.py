"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5's hybrid layers and Qwen3.5-MoE's
experts with a gated shared expert (interop/maps/qwen3_5.py, qwen3_5_moe.py), dense MLPs in the layers
mlp_only_layers / decoder_sparse_step name. Its Gated DeltaNet layers store two fused projections
grouped by key head: in_proj_qkvz holds, key head after key head, that head's query and key rows then
the rows of its value heads' values and gates z; in_proj_ba the same heads' beta then decay inputs
(transformers' fix_query_key_value_ordering), which msllm keeps as wq, wk, wv, wz, wb and wa (table rule
Interleaved over the key heads). Not in MindFormers 1.9; mtp.* tensors are refused as unexpected."""
from interop.maps import moe, qwen3_5, qwen3_5_moe
from interop.table import Concat, Interleaved, Row

_SEPARATE = {"linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
             "linear_attn.in_proj_a.weight"}
_FUSED = [
    Row(Concat(0, "attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wz.weight"),
        "lin_k+lin_k+lin_v+lin_v, hidden", Interleaved("linear_attn.in_proj_qkvz.weight", "lin_k_heads"), None,
        when="linear"),
    Row(Concat(0, "attention.wb.weight", "attention.wa.weight"), "lin_heads+lin_heads, hidden",
        Interleaved("linear_attn.in_proj_ba.weight", "lin_k_heads"), None, when="linear"),
]
_HYBRID = qwen3_5.QWEN3_5._replace(
    per_layer=[row for row in qwen3_5.QWEN3_5.per_layer if row.hf not in _SEPARATE] + _FUSED)
QWEN3_NEXT = moe.with_moe(_HYBRID, moe.QWEN3_MOE_ROWS + qwen3_5_moe.SHARED_ROWS)

SPEC = qwen3_5_moe.SPEC
from_hf = qwen3_5_moe.from_hf


def to_hf(m, hf: dict) -> None:
    """Qwen3.5's keys, the experts with Qwen3-MoE's dense-layer keys, and the shared expert's size."""
    qwen3_5.to_hf(m, hf)
    moe.routing_to_hf(m, hf)
    hf.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_size or m.ffn_size,
              shared_expert_intermediate_size=m.shared_size, decoder_sparse_step=1,
              mlp_only_layers=[i for i, kind in enumerate(m.mlp_kinds()) if kind == "dense"])
