"""Qwen3.5 dense text (Qwen3_5ForCausalLM, model_type qwen3_5_text): a hybrid of Gated DeltaNet
layers (layer_types "linear_attention", three in four by default) and gated full-attention layers
(q_proj twice as wide: each head's query then its sigmoid output gate; q/k norms; RoPE on the first
quarter of each head, partial_rotary_factor), every (1 + w) RMSNorm but the linear layers' gated
output norm. Not in MindFormers 1.9.

Its multi-token-prediction tensors (mtp.*, which transformers ignores) are not mapped: a checkpoint
carrying them is refused as holding unexpected tensors, never silently cut."""
from interop.table import Concat, Interleaved, Row, Table

QWEN3_5 = Table(
    before=[
        #   msllm                    shape            Hugging Face                 MindFormers
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", None),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "model.layers.{i}."},
    per_layer=[
        Row("attention_norm.weight",   "hidden",  "input_layernorm.weight", None),
        # full-attention layers: q_proj holds, head after head, the head's query rows then its gate rows
        Row(Concat(0, "attention.wq.weight", "attention.wg.weight"), "q+q, hidden",
            Interleaved("self_attn.q_proj.weight", "heads"), None, when="attention"),
        Row("attention.wk.weight",     "kv, hidden", "self_attn.k_proj.weight", None, when="attention"),
        Row("attention.wv.weight",     "kv, hidden", "self_attn.v_proj.weight", None, when="attention"),
        Row("attention.wo.weight",     "hidden, q",  "self_attn.o_proj.weight", None, when="attention"),
        Row("attention.q_norm.weight", "head",       "self_attn.q_norm.weight", None, when="attention"),
        Row("attention.k_norm.weight", "head",       "self_attn.k_norm.weight", None, when="attention"),
        # Gated DeltaNet layers
        Row(Concat(0, "attention.wq.weight", "attention.wk.weight", "attention.wv.weight"), "lin_k+lin_k+lin_v, hidden",
            "linear_attn.in_proj_qkv.weight", None, when="linear"),
        Row("attention.wz.weight",     "lin_v, hidden",    "linear_attn.in_proj_z.weight",   None, when="linear"),
        Row("attention.wb.weight",     "lin_heads, hidden", "linear_attn.in_proj_b.weight",  None, when="linear"),
        Row("attention.wa.weight",     "lin_heads, hidden", "linear_attn.in_proj_a.weight",  None, when="linear"),
        Row(Concat(0, "attention.conv_q.weight", "attention.conv_k.weight", "attention.conv_v.weight"),
            "lin_k+lin_k+lin_v, one, conv_kernel", "linear_attn.conv1d.weight", None, when="linear"),
        Row("attention.dt_bias",       "lin_heads",        "linear_attn.dt_bias",            None, when="linear"),
        Row("attention.A_log",         "lin_heads",        "linear_attn.A_log",              None, when="linear"),
        Row("attention.norm.weight",   "lin_head_v",       "linear_attn.norm.weight",        None, when="linear"),
        Row("attention.wo.weight",     "hidden, lin_v",    "linear_attn.out_proj.weight",    None, when="linear"),
        Row("ffn_norm.weight",         "hidden",      "post_attention_layernorm.weight", None),
        Row("feed_forward.w1.weight",  "ffn, hidden", "mlp.gate_proj.weight",            None),
        Row("feed_forward.w2.weight",  "hidden, ffn", "mlp.down_proj.weight",            None),
        Row("feed_forward.w3.weight",  "ffn, hidden", "mlp.up_proj.weight",              None),
    ],
    after=[
        Row("norm.weight",   "hidden",        "model.norm.weight", None),
        Row("output.weight", "vocab, hidden", "lm_head.weight",    None, when="untied"),
    ],
    ignore={"hf": ["lm_head.weight"]},
)

# What the family computes beyond its config.json (which gives the layer types, the linear layers'
# sizes and the rotary fraction).
SPEC = {"qk_norm": True, "norm_offset": 1.0, "attn_output_gate": True}

LINEAR_KEYS = {"linear_num_key_heads": "linear_num_key_heads", "linear_num_value_heads": "linear_num_value_heads",
               "linear_key_head_dim": "linear_key_head_dim", "linear_value_head_dim": "linear_value_head_dim",
               "linear_conv_kernel": "linear_conv_kernel_dim"}


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """The Gated DeltaNet sizes: positive integers, value heads a multiple of key heads (each key head
    serves a run of them)."""
    for field, key in LINEAR_KEYS.items():
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            refuse(key, f"must be a positive integer, got {value!r}")
        fields[field] = value
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        refuse("linear_num_value_heads", f"must be a multiple of linear_num_key_heads ({fields['linear_num_key_heads']})")


def to_hf(m, hf: dict) -> None:
    hf.update({key: getattr(m, field) for field, key in LINEAR_KEYS.items()})
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": m.rope_theta,
                             "partial_rotary_factor": m.rope_fraction}
    hf.pop("rope_theta", None)
    hf["layer_types"] = ["linear_attention" if kind == "linear" else "full_attention" for kind in m.layer_kinds()]
