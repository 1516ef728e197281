"""Qwen3.5-MoE text (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3.5's hybrid layers
(interop/maps/qwen3_5.py) with every MLP a MoE: top-k of softmax renormalised, and a shared expert of
its own size (shared_expert_intermediate_size) whose output every token adds times a sigmoid gate
(shared_expert_gate, one scalar per token). transformers saves the experts one tensor per expert.
Not in MindFormers 1.9; mtp.* tensors are refused as unexpected (qwen3_5.py)."""
from interop.maps import moe, qwen3_5
from interop.table import Row

SHARED_ROWS = [
    #   msllm                                shape                Hugging Face                          MindFormers
    Row("feed_forward.shared.w1.weight",     "shared_ffn, hidden", "mlp.shared_expert.gate_proj.weight", None, when="shared"),
    Row("feed_forward.shared.w2.weight",     "hidden, shared_ffn", "mlp.shared_expert.down_proj.weight", None, when="shared"),
    Row("feed_forward.shared.w3.weight",     "shared_ffn, hidden", "mlp.shared_expert.up_proj.weight",   None, when="shared"),
    Row("feed_forward.shared_gate.weight",   "one, hidden",        "mlp.shared_expert_gate.weight",      None, when="shared"),
]
QWEN3_5_MOE = moe.with_moe(qwen3_5.QWEN3_5, moe.QWEN3_MOE_ROWS + SHARED_ROWS)

SPEC = {**qwen3_5.SPEC, "shared_gate": True}


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """The linear layers' sizes, the experts (moe.from_hf), and the gated shared expert's size."""
    qwen3_5.from_hf(hf, fields, refuse)
    moe.from_hf(hf, fields, refuse)
    size = hf.get("shared_expert_intermediate_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        refuse("shared_expert_intermediate_size", f"must be an integer >= 0, got {size!r}")
    fields.update(shared_experts=1 if size else 0, shared_ffn_size=size)


def to_hf(m, hf: dict) -> None:
    qwen3_5.to_hf(m, hf)
    moe.routing_to_hf(m, hf)
    hf.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_size or m.ffn_size,
              shared_expert_intermediate_size=m.shared_size)
    hf.pop("intermediate_size", None)  # every layer is MoE: its config has no dense size
    hf.pop("norm_topk_prob", None)     # it always renormalises
