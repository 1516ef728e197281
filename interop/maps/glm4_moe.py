"""GLM-4.5 MoE (Glm4MoeForCausalLM, model_type glm4_moe; GLM-4.5 and GLM-4.5-Air): grouped-query attention
with biases on q, k and v (config.json's attention_bias; o_proj has none), optional per-head q/k norms
(use_qk_norm) and rotate-half RoPE on the leading half of each head (partial_rotary_factor, 0.5 when
absent, as Glm4MoeConfig defaults it); dense MLPs in the first first_k_dense_replace layers, then
DeepSeek-V3's MoE: the grouped sigmoid router with its expert bias (e_score_correction_bias), routed
experts one tensor per expert in the files, shared experts (interop/maps/deepseek_v3.py).

Its checkpoints carry a multi-token-prediction layer after the last one (model.layers.46.* in
GLM-4.5-Air, num_nextn_predict_layers 1) with DeepSeek-V3's names (enorm, hnorm, eh_proj, shared_head, the
embedding and head copies): read and written by DeepSeek-V3's MTP rows (msllm.models.mtp). Not in
MindFormers 1.9's training models, so its rows have no MindFormers names."""
from interop.maps import deepseek_v3
from interop.maps.llama import LLAMA, QWEN2
from interop.maps.qwen3 import QWEN3

_ATTENTION = ([row for row in LLAMA.per_layer if row.msllm.startswith("attention.")]
              + [row._replace(when="qkv_bias") for row in QWEN2.per_layer if row.msllm.endswith(".bias")]
              + [row._replace(when="qk_norm") for row in QWEN3.per_layer
                 if row.msllm in ("attention.q_norm.weight", "attention.k_norm.weight")])
_MLP = [row for row in deepseek_v3.DEEPSEEK_V3.per_layer if row.msllm.startswith(("ffn_norm", "feed_forward."))]

_V3 = deepseek_v3.DEEPSEEK_V3
GLM4_MOE = QWEN3._replace(  # its embedding, final norm and head
    per_layer=[row._replace(mindformers=None) for row in [QWEN3.per_layer[0], *_ATTENTION, *_MLP]],
    ignore={"hf": ["lm_head.weight"]},
    mtp=[row._replace(mindformers=None) for row in _V3.mtp], mtp_copies=_V3.mtp_copies,
    mtp_prefix={"msllm": _V3.mtp_prefix["msllm"], "hf": _V3.mtp_prefix["hf"]},
    mtp_layer_prefix={"msllm": _V3.mtp_layer_prefix["msllm"], "hf": _V3.mtp_layer_prefix["hf"]},
)

# What the family computes beyond its config.json; from_hf reads the biases and q/k norms per checkpoint
# (both GLM-4.5 models have the biases, so an msllm model with them and this router is written as GLM-4.5).
SPEC = {"router": "sigmoid_grouped", "qkv_bias": True}


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """DeepSeek-V3's router, experts and dense layers (the same keys), the q/k/v biases, the q/k norms,
    and Glm4MoeConfig's default partial RoPE when config.json names none."""
    deepseek_v3.from_hf(hf, fields, refuse)
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    if "partial_rotary_factor" not in hf and "partial_rotary_factor" not in rope:
        fields["rope_fraction"] = 0.5
    fields.update(qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm", False)))


def to_hf(m, hf: dict) -> None:
    deepseek_v3.to_hf(m, hf)
    hf.update(attention_bias=m.qkv_bias, use_qk_norm=m.qk_norm, partial_rotary_factor=m.rope_fraction)
