"""Gemma 3 text (Gemma3ForCausalLM): q/k norms, four norms per layer (pre and post attention, pre
and post MLP: "sandwich"), every norm scaling by (1 + w), GeGLU-tanh MLP, embeddings scaled by
sqrt(hidden), scores scaled by query_pre_attn_scalar^-0.5, and sliding-window layers with their
own RoPE base between full ones (layer_types). Not mapped to MindFormers."""
from interop.table import Row, Table

GEMMA3 = Table(
    before=[
        #   msllm                    shape            Hugging Face                 MindFormers
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", None),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "model.layers.{i}."},
    per_layer=[
        Row("attention_norm.weight",     "hidden",      "input_layernorm.weight",           None),
        Row("attention.wq.weight",       "q, hidden",   "self_attn.q_proj.weight",          None),
        Row("attention.wk.weight",       "kv, hidden",  "self_attn.k_proj.weight",          None),
        Row("attention.wv.weight",       "kv, hidden",  "self_attn.v_proj.weight",          None),
        Row("attention.wo.weight",       "hidden, q",   "self_attn.o_proj.weight",          None),
        Row("attention.q_norm.weight",   "head",        "self_attn.q_norm.weight",          None),
        Row("attention.k_norm.weight",   "head",        "self_attn.k_norm.weight",          None),
        Row("attention_out_norm.weight", "hidden",      "post_attention_layernorm.weight",  None),
        Row("ffn_norm.weight",           "hidden",      "pre_feedforward_layernorm.weight", None),
        Row("feed_forward.w1.weight",    "ffn, hidden", "mlp.gate_proj.weight",             None),
        Row("feed_forward.w2.weight",    "hidden, ffn", "mlp.down_proj.weight",             None),
        Row("feed_forward.w3.weight",    "ffn, hidden", "mlp.up_proj.weight",               None),
        Row("ffn_out_norm.weight",       "hidden",      "post_feedforward_layernorm.weight", None),
    ],
    after=[
        Row("norm.weight",               "hidden",        "model.norm.weight",   None),
        Row("output.weight",             "vocab, hidden", "lm_head.weight",      None, when="untied"),
    ],
    ignore={"hf": ["lm_head.weight"]},
)

SPEC = {"qk_norm": True, "norm_offset": 1.0, "sandwich_norm": True, "mlp": "geglu_tanh"}


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """Scales derived from its sizes, as Gemma3TextScaledWordEmbedding and its attention compute them."""
    fields.update(embed_scale=fields["hidden_size"] ** 0.5,
                  attn_scale=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 0) ** -0.5)


def rope_per_layer_type(m, hf: dict) -> None:
    """rope_parameters per layer type: sliding layers unscaled, with their own base (OLMo 3 too)."""
    full = {"rope_type": "default", "rope_theta": m.rope_theta, **(hf.pop("rope_scaling", None) or {})}
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": m.rope_local_theta or m.rope_theta}}


def to_hf(m, hf: dict) -> None:
    """RoPE per layer type and query_pre_attn_scalar."""
    rope_per_layer_type(m, hf)
    scalar = m.attn_scale ** -2 if m.attn_scale else m.head_size
    hf["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar  # an int in HF
