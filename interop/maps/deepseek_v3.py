"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (msllm/models/mixers/mla.py), dense MLPs in
the first first_k_dense_replace layers, then MoE layers with DeepSeek's grouped sigmoid router, its
expert bias (e_score_correction_bias, a buffer in transformers, saved with the weights) and shared
experts. Hugging Face stores one tensor per expert; msllm stacks them (Stacked).

MindFormers 1.9 trains DeepSeek-V3 as TrainingDeepseekV3ForCausalLM (mcore, MLASelfAttentionConcatenated;
read from the parameters it builds): the query and KV down-projections as one self_attention.linear_qkv
[q_rank + kv_rank + rope, h] (q_a_proj then kv_a_proj_with_mqa; q_proj in its place without q_lora_rank),
q_layernorm, linear_qb (q_b_proj), k_layernorm (the KV latent's norm), linear_kvb (kv_b_proj), linear_proj;
dense and shared-expert linear_fc1 with gate and up rows alternated (as its Qwen3), the router as
mlp.router.weight with the expert bias mlp.router.expert_bias, and the routed experts as Qwen3-MoE's grouped
weight1 / weight2. Its MLA always takes the RoPE dims de-interleaved (transformers' rope_interleave).

Multi-token prediction (num_nextn_predict_layers, msllm.models.mtp): Hugging Face checkpoints hold depth k as
layer num_hidden_layers + k (DeepSeek-V3's model.layers.61): a decoder layer's tensors beside enorm, hnorm,
eh_proj, shared_head.norm and copies of the shared embedding and head (embed_tokens, shared_head.head), which
msllm writes back and reads once. MindFormers (Megatron-Core's MultiTokenPredictionLayer) names depth k
mtp.layers.k.{enorm, hnorm, eh_proj, final_layernorm} and its block transformer_layer, with no copies."""
import math

from interop.maps.moe import QWEN3_MOE_MINDFORMERS, _moe_rows
from interop.maps.qwen3 import QWEN3_MINDFORMERS
from interop.table import Concat, Interleaved, Row, Table

_ATTENTION = [
    #   msllm                      shape                Hugging Face                              MindFormers
    Row("attention.wq_a.weight",   "q_rank, hidden",    "self_attn.q_a_proj.weight",              None, when="q_lora"),
    Row("attention.q_norm.weight", "q_rank",            "self_attn.q_a_layernorm.weight",         None, when="q_lora"),
    Row("attention.wq_b.weight",   "q, q_rank",         "self_attn.q_b_proj.weight",              None, when="q_lora"),
    Row("attention.wq.weight",     "q, hidden",         "self_attn.q_proj.weight",                None, when="no_q_lora"),
    Row("attention.wkv_a.weight",  "kv_a, hidden",      "self_attn.kv_a_proj_with_mqa.weight",    None),
    Row("attention.kv_norm.weight", "kv_rank",          "self_attn.kv_a_layernorm.weight",        None),
    Row("attention.wkv_b.weight",  "kv_b, kv_rank",     "self_attn.kv_b_proj.weight",             None),
    Row("attention.wo.weight",     "hidden, o",         "self_attn.o_proj.weight",                None),
]

DEEPSEEK_V3 = Table(
    before=[
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", None),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "model.layers.{i}."},
    per_layer=[
        Row("attention_norm.weight",   "hidden",      "input_layernorm.weight",          None),
        *_ATTENTION,
        Row("ffn_norm.weight",         "hidden",      "post_attention_layernorm.weight", None),
        Row("feed_forward.w1.weight",  "ffn, hidden", "mlp.gate_proj.weight",            None, when="dense"),
        Row("feed_forward.w2.weight",  "hidden, ffn", "mlp.down_proj.weight",            None, when="dense"),
        Row("feed_forward.w3.weight",  "ffn, hidden", "mlp.up_proj.weight",              None, when="dense"),
        *_moe_rows("mlp", "gate_proj", "down_proj", "up_proj"),
        Row("feed_forward.router.expert_bias",      "experts",            "mlp.gate.e_score_correction_bias",      None, when="moe"),
        Row("feed_forward.shared.w1.weight",        "shared_ffn, hidden", "mlp.shared_experts.gate_proj.weight",  None, when="shared"),
        Row("feed_forward.shared.w2.weight",        "hidden, shared_ffn", "mlp.shared_experts.down_proj.weight",  None, when="shared"),
        Row("feed_forward.shared.w3.weight",        "shared_ffn, hidden", "mlp.shared_experts.up_proj.weight",    None, when="shared"),
    ],
    after=[
        Row("norm.weight",   "hidden",        "model.norm.weight", None),
        Row("output.weight", "vocab, hidden", "lm_head.weight",    None, when="untied"),
    ],
    # A checkpoint whose config.json keeps num_nextn_predict_layers but not the MTP layer (one transformers
    # saved: it drops the layer) is read without MTP (interop.layouts); the layer of DeepSeek-V3's shape then
    # is ignored, as transformers ignores it on load (_keys_to_ignore_on_load_unexpected).
    ignore={"hf": ["lm_head.weight", "model.layers.61.*"]},
    mtp=[
        #   msllm                   shape            Hugging Face                MindFormers 1.9 (mcore)
        Row("enorm.weight",         "hidden",        "enorm.weight",             "enorm.weight"),
        Row("hnorm.weight",         "hidden",        "hnorm.weight",             "hnorm.weight"),
        Row("eh_proj.weight",       "hidden, hidden+hidden", "eh_proj.weight",   "eh_proj.weight"),
        Row("norm.weight",          "hidden",        "shared_head.norm.weight",  "final_layernorm.weight"),
    ],
    # the HF layer's copies of the shared embedding and head
    mtp_copies=[
        Row("tok_embeddings.weight", "vocab, hidden", "embed_tokens.weight",     None),
        Row("output.weight",        "vocab, hidden", "shared_head.head.weight",  None, when="untied"),
    ],
    mtp_prefix={"msllm": "mtp.{k}.", "hf": "model.layers.{n}.", "mindformers": "mtp.layers.{k}."},
    mtp_layer_prefix={"msllm": "mtp.{k}.layer.", "hf": "model.layers.{n}.", "mindformers": "mtp.layers.{k}.transformer_layer."},
)

# What the family computes beyond its config.json (interop/hf_config.py reads the sizes and MLA ranks,
# from_hf the experts and groups).
SPEC = {"attention": "mla", "router": "sigmoid_grouped"}

_DENSE_FC1, _DENSE_FC2 = QWEN3_MINDFORMERS.per_layer[-2:]
DEEPSEEK_V3_MINDFORMERS = QWEN3_MINDFORMERS._replace(
    per_layer=[
        #   msllm                       shape            Hugging Face                       MindFormers 1.9 (mcore)
        Row("attention_norm.weight",    "hidden",        "input_layernorm.weight",          "input_layernorm.weight"),
        Row(Concat(0, "attention.wq_a.weight", "attention.wkv_a.weight"), "q_rank+kv_a, hidden",
            Concat(0, "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
            "self_attention.linear_qkv.weight", when="q_lora"),
        Row(Concat(0, "attention.wq.weight", "attention.wkv_a.weight"), "q+kv_a, hidden",
            Concat(0, "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
            "self_attention.linear_qkv.weight", when="no_q_lora"),
        Row("attention.q_norm.weight",  "q_rank",        "self_attn.q_a_layernorm.weight",  "self_attention.q_layernorm.weight", when="q_lora"),
        Row("attention.wq_b.weight",    "q, q_rank",     "self_attn.q_b_proj.weight",       "self_attention.linear_qb.weight", when="q_lora"),
        Row("attention.kv_norm.weight", "kv_rank",       "self_attn.kv_a_layernorm.weight", "self_attention.k_layernorm.weight"),
        Row("attention.wkv_b.weight",   "kv_b, kv_rank", "self_attn.kv_b_proj.weight",      "self_attention.linear_kvb.weight"),
        Row("attention.wo.weight",      "hidden, o",     "self_attn.o_proj.weight",         "self_attention.linear_proj.weight"),
        Row("ffn_norm.weight",          "hidden",        "post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
        _DENSE_FC1._replace(when="dense"), _DENSE_FC2._replace(when="dense"),
        *QWEN3_MOE_MINDFORMERS.per_layer[-3:],  # router, grouped experts weight1 / weight2
        Row("feed_forward.router.expert_bias", "experts", "mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", when="moe"),
        Row(Concat(0, "feed_forward.shared.w1.weight", "feed_forward.shared.w3.weight"), "shared_ffn+shared_ffn, hidden",
            Concat(0, "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
            Interleaved("mlp.shared_experts.linear_fc1.weight", "shared_ffn"), when="shared"),
        Row("feed_forward.shared.w2.weight", "hidden, shared_ffn", "mlp.shared_experts.down_proj.weight",
            "mlp.shared_experts.linear_fc2.weight", when="shared"),
    ],
    mtp=DEEPSEEK_V3.mtp, mtp_copies=DEEPSEEK_V3.mtp_copies, mtp_prefix=DEEPSEEK_V3.mtp_prefix,
    mtp_layer_prefix=DEEPSEEK_V3.mtp_layer_prefix,
    # A MindFormers training checkpoint also holds each router's running expert load and aux-loss counter
    # (the MTP blocks' too), and, with mtp_num_layers, an MTP block a model read without MTP leaves aside.
    ignore={**DEEPSEEK_V3.ignore,
            "mindformers": QWEN3_MOE_MINDFORMERS.ignore["mindformers"] + ["decoder.layers.*.mlp.router.expert_load",
                                                                          "mtp.*"]},
)


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """The router and MoE layers, read as DeepseekV3TopkRouter and DeepseekV3DecoderLayer use them:
    from first_k_dense_replace on, with its groups, scaling and shared experts."""
    def count(key, default):
        value = hf.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            refuse(key, f"must be an integer >= 0, got {value!r}")
        return value

    experts, top_k = count("n_routed_experts", 0), count("num_experts_per_tok", 8)
    groups, topk_groups = count("n_group", 1) or 1, count("topk_group", 1) or 1
    if experts % groups or experts // groups < 2:
        refuse("n_group", f"must divide n_routed_experts ({experts}) into groups of at least 2 (each group is "
                          "scored by its best two)")
    if not 1 <= topk_groups <= groups:
        refuse("topk_group", f"must be in [1, n_group ({groups})], got {topk_groups!r}")
    if not 1 <= top_k <= topk_groups * experts // groups:
        refuse("num_experts_per_tok", f"must be in [1, {topk_groups * experts // groups}] (the experts of "
                                      f"topk_group groups), got {top_k!r}")
    scaling = hf.get("routed_scaling_factor", 1.0)
    if not (isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and math.isfinite(scaling)) or scaling <= 0:
        refuse("routed_scaling_factor", f"must be a number > 0, got {scaling!r}")
    layers = fields["num_layers"]
    dense = min(count("first_k_dense_replace", 0), layers)
    kinds = ["dense"] * dense + ["moe"] * (layers - dense)
    fields.update(num_experts=experts, experts_per_token=top_k, moe_ffn_size=count("moe_intermediate_size", 0),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", True)), expert_groups=groups,
                  topk_groups=topk_groups, routed_scaling=float(scaling), shared_experts=count("n_shared_experts", 0),
                  # transformers' DeepSeek-V3 adds no load-balancing loss
                  router_aux_loss_coef=0.0, mlp_types=None if dense == 0 else kinds,
                  # transformers 5 also spells it num_mtp_layers; a checkpoint without the layers is read
                  # without them (interop.layouts)
                  mtp_depths=count("num_nextn_predict_layers", hf.get("num_mtp_layers") or 0))


def to_hf(m, hf: dict) -> None:
    hf["num_nextn_predict_layers"] = m.mtp_depths
    if m.num_experts:
        dense = m.mlp_kinds().index("moe") if "moe" in m.mlp_kinds() else m.num_layers
        hf.update(num_experts_per_tok=m.experts_per_token, norm_topk_prob=m.norm_topk_prob, n_routed_experts=m.num_experts,
                  moe_intermediate_size=m.moe_ffn_size or m.ffn_size, n_group=m.expert_groups, topk_group=m.topk_groups,
                  routed_scaling_factor=m.routed_scaling, n_shared_experts=m.shared_experts, first_k_dense_replace=dense)
