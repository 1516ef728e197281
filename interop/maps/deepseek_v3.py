"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (msllm/models/mla.py), dense MLPs in
the first first_k_dense_replace layers, then MoE layers with DeepSeek's grouped sigmoid router, its
expert bias (e_score_correction_bias, a buffer in transformers, saved with the weights) and shared
experts. Hugging Face stores one tensor per expert; msllm stacks them (Stacked). Not mapped to MindFormers."""
from interop.maps.moe import _moe_rows
from interop.table import Row, Table

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
    # DeepSeek-V3's checkpoints carry its multi-token-prediction layer after the 61 layers, which
    # transformers ignores on load (_keys_to_ignore_on_load_unexpected), as does msllm.
    ignore={"hf": ["lm_head.weight", "model.layers.61.*"]},
)

# What the family computes beyond its config.json (interop/hf_config.py reads the sizes, ranks, groups).
SPEC = {"attention": "mla", "router": "sigmoid_grouped"}
