"""Mixture-of-experts families: Qwen3-MoE (Qwen3ForCausalLM's attention, q/k norms) and Mixtral
(Mistral's attention). Hugging Face stores one tensor per expert; msllm stacks a layer's experts
into one [E, ...] tensor per projection (Stacked). A layer is MoE or dense by the model's
mlp_types (Qwen3-MoE's mlp_only_layers / decoder_sparse_step).

MindFormers 1.9 trains Qwen3-MoE as TrainingQwen3MoeForCausalLM (mcore; read from the parameters it
builds and its own HF converter, ExpertsConvertOp): Qwen3's mcore attention rows, the router as
mlp.router.weight [E, h], and each layer's experts as two grouped-GEMM matrices: mlp.experts.weight1
[E * h, 2f] (expert e's [gate; up] transposed, gate columns first: not alternated like the dense
linear_fc1) and mlp.experts.weight2 [E * f, h] (expert e's down transposed). It builds every layer as
MoE (mlp_only_layers and decoder_sparse_step are ignored there) and no shared experts."""
from interop.maps.llama import LLAMA
from interop.maps.qwen3 import QWEN3, QWEN3_MINDFORMERS, QWEN3_MINDFORMERS_ATTENTION, to_hf as qwen3_to_hf
import torch

from interop.table import Concat, GroupedTransposed, Row, Stacked

_DENSE = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def _moe_rows(block: str, gate: str, down: str, up: str) -> list[Row]:
    """The router and stacked experts under the HF module `block` (per expert names with {e})."""
    return [
        #   msllm                          shape                              Hugging Face                        MindFormers
        Row("feed_forward.router.weight",  "experts, hidden",                 f"{block}.gate.weight",              None, when="moe"),
        Row("feed_forward.experts.w1",     "experts, expert_ffn, hidden",     Stacked(f"{block}.experts.{{e}}.{gate}.weight"), None, when="moe"),
        Row("feed_forward.experts.w2",     "experts, hidden, expert_ffn",     Stacked(f"{block}.experts.{{e}}.{down}.weight"), None, when="moe"),
        Row("feed_forward.experts.w3",     "experts, expert_ffn, hidden",     Stacked(f"{block}.experts.{{e}}.{up}.weight"), None, when="moe"),
    ]


def with_moe(table, moe_rows):
    per_layer = [row._replace(mindformers=None, when="dense") if row.msllm in _DENSE else row._replace(mindformers=None)
                 for row in table.per_layer]
    return table._replace(per_layer=per_layer + moe_rows,
                          before=[r._replace(mindformers=None) for r in table.before],
                          after=[r._replace(mindformers=None) for r in table.after])


QWEN3_MOE_ROWS = _moe_rows("mlp", "gate_proj", "down_proj", "up_proj")
QWEN3_MOE = with_moe(QWEN3, QWEN3_MOE_ROWS)
MIXTRAL = with_moe(LLAMA, _moe_rows("block_sparse_moe", "w1", "w2", "w3"))

_router, _gate, _down, _up = QWEN3_MOE_ROWS
QWEN3_MOE_MINDFORMERS = QWEN3_MINDFORMERS._replace(
    per_layer=QWEN3_MINDFORMERS_ATTENTION + [
        _router._replace(mindformers="mlp.router.weight"),
        Row(Concat(1, _gate.msllm, _up.msllm), "experts, expert_ffn+expert_ffn, hidden", Concat(1, _gate.hf, _up.hf),
            GroupedTransposed("mlp.experts.weight1"), when="moe"),
        _down._replace(mindformers=GroupedTransposed("mlp.experts.weight2")),
    ],
    # A MindFormers training checkpoint also holds each router's aux-loss running expert load.
    ignore={**QWEN3_MINDFORMERS.ignore,
            "mindformers": QWEN3_MINDFORMERS.ignore["mindformers"] + ["decoder.layers.*.mlp.router.fi_accu"]},
)


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """The experts, top-k, their size, renormalisation, and which layers are MoE (Qwen3-MoE: not in
    mlp_only_layers and every decoder_sparse_step-th; Mixtral: all), read from Qwen3-MoE's or
    Mixtral's config.json (num_experts / num_local_experts)."""
    experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
    if not experts:
        return
    if hf.get("router_jitter_noise"):
        refuse("router_jitter_noise", "msllm routes without noise (0)")
    top_k = hf.get("num_experts_per_tok", 2)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        refuse("num_experts_per_tok", f"must be in [1, {experts}] (the experts), got {top_k!r}")
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    kinds = ["dense" if i in dense or (i + 1) % step else "moe" for i in range(fields["num_layers"])]
    fields.update(num_experts=experts, experts_per_token=top_k, moe_ffn_size=hf.get("moe_intermediate_size") or 0,
                  norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                  # transformers adds the load-balancing loss only with output_router_logits on
                  router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0) if hf.get("output_router_logits") else 0.0,
                  mlp_types=None if set(kinds) == {"moe"} else kinds)


def routing_to_hf(m, hf: dict) -> None:
    hf.update(num_experts_per_tok=m.experts_per_token, norm_topk_prob=m.norm_topk_prob,
              output_router_logits=m.router_aux_loss_coef > 0, router_aux_loss_coef=m.router_aux_loss_coef)


def qwen3_moe_to_hf(m, hf: dict) -> None:
    """Qwen3-MoE's experts (its dense layers as mlp_only_layers) and Qwen3's use_sliding_window."""
    if m.num_experts:
        routing_to_hf(m, hf)
        hf.update(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_size or m.ffn_size,
                  decoder_sparse_step=1, mlp_only_layers=[i for i, k in enumerate(m.mlp_kinds()) if k == "dense"])
    qwen3_to_hf(m, hf)


def mixtral_to_hf(m, hf: dict) -> None:
    """Mixtral names its experts num_local_experts and their size intermediate_size (every layer is MoE)."""
    if m.num_experts:
        routing_to_hf(m, hf)
        hf.update(num_local_experts=m.num_experts, intermediate_size=m.moe_ffn_size or m.ffn_size)


# transformers 5 holds a layer's experts in memory as two stacked tensors (mlp.experts.gate_up_proj
# [E, 2f, h], mlp.experts.down_proj [E, h, f]) and converts them to the per-expert names above when
# it saves or loads. verify --train drives the in-memory model, so it converts the same way:
# architecture -> (saved block, gate, up, down names).
SAVED_EXPERTS = {"Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
                 "DeepseekV3ForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "Qwen3_5MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "Qwen3NextForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "Glm4MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj")}


def to_saved(arch: str, tensors: dict) -> dict:
    """In-memory parameter names and tensors -> the names and tensors save_pretrained writes."""
    if arch not in SAVED_EXPERTS:
        return tensors
    block, gate, up, down = SAVED_EXPERTS[arch]
    out = {}
    for name, t in tensors.items():
        layer, _, leaf = name.partition(".mlp.")
        if leaf == "experts.gate_up_proj":
            for e, (g, u) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{layer}.{block}.experts.{e}.{gate}.weight"] = g
                out[f"{layer}.{block}.experts.{e}.{up}.weight"] = u
        elif leaf == "experts.down_proj":
            out.update({f"{layer}.{block}.experts.{e}.{down}.weight": d for e, d in enumerate(t.unbind(0))})
        elif leaf == "gate.weight":
            out[f"{layer}.{block}.gate.weight"] = t
        else:
            out[name] = t
    return out


def from_saved(arch: str, tensors: dict, memory_names: list[str]) -> dict:
    """The inverse of to_saved, for the in-memory parameters `memory_names`."""
    if arch not in SAVED_EXPERTS:
        return tensors
    block, gate, up, down = SAVED_EXPERTS[arch]
    out = {}
    for name in memory_names:
        layer, _, leaf = name.partition(".mlp.")
        experts = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in tensors
                          if k.startswith(f"{layer}.{block}.experts.")})
        if leaf == "experts.gate_up_proj":
            out[name] = torch.stack([torch.cat([tensors[f"{layer}.{block}.experts.{e}.{gate}.weight"],
                                                tensors[f"{layer}.{block}.experts.{e}.{up}.weight"]]) for e in experts])
        elif leaf == "experts.down_proj":
            out[name] = torch.stack([tensors[f"{layer}.{block}.experts.{e}.{down}.weight"] for e in experts])
        elif leaf == "gate.weight":
            out[name] = tensors[f"{layer}.{block}.gate.weight"]
        elif name in tensors:
            out[name] = tensors[name]
    return out
