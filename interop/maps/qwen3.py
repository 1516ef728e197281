"""Qwen3 (Qwen3ForCausalLM): Llama's tensors plus a per-head RMSNorm on q and k before RoPE, with
head_dim set apart from hidden / heads (Qwen3-0.6B: hidden 1024, 16 heads of 128).

MindFormers 1.9 trains Qwen3 in its mcore layout (TrainingQwen3ForCausalLM, read from its parameters
and its own HF converter): q, k, v fused as linear_qkv with each KV head's group [q heads, k, v]
in turn, gate and up fused as linear_fc1 alternating row by row. QWEN3_MINDFORMERS joins those;
QWEN3 keeps every projection apart (the names LoRA and PEFT adapters use)."""
from interop.maps.llama import LLAMA
from interop.table import Concat, Interleaved, Row, Table

QWEN3 = LLAMA._replace(
    per_layer=[row._replace(mindformers=None) for row in LLAMA.per_layer] + [
        #   msllm                      shape     Hugging Face              MindFormers
        Row("attention.q_norm.weight", "head",   "self_attn.q_norm.weight", None),
        Row("attention.k_norm.weight", "head",   "self_attn.k_norm.weight", None),
    ],
    before=[row._replace(mindformers=None) for row in LLAMA.before],
    after=[row._replace(mindformers=None) for row in LLAMA.after],
)

# A layer's rows up to its MLP, which MindFormers' Qwen3-MoE shares (interop/maps/moe.py).
QWEN3_MINDFORMERS_ATTENTION = [
    #   msllm                      shape        Hugging Face               MindFormers 1.9 (mcore)
    Row("attention_norm.weight",   "hidden",    "input_layernorm.weight",  "input_layernorm.weight"),
    Row(Concat(0, "attention.wq.weight", "attention.wk.weight", "attention.wv.weight"), "q+kv+kv, hidden",
        Concat(0, "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        Interleaved("self_attention.linear_qkv.weight", "kv_heads")),
    Row("attention.wo.weight",     "hidden, q", "self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    Row("attention.q_norm.weight", "head",      "self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    Row("attention.k_norm.weight", "head",      "self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    Row("ffn_norm.weight",         "hidden",    "post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
]

QWEN3_MINDFORMERS = Table(
    before=[
        #   msllm                    shape            Hugging Face                 MindFormers 1.9 (mcore)
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "decoder.layers.{i}."},
    per_layer=QWEN3_MINDFORMERS_ATTENTION + [
        Row(Concat(0, "feed_forward.w1.weight", "feed_forward.w3.weight"), "ffn+ffn, hidden",
            Concat(0, "mlp.gate_proj.weight", "mlp.up_proj.weight"), Interleaved("mlp.linear_fc1.weight", "ffn")),
        Row("feed_forward.w2.weight",  "hidden, ffn", "mlp.down_proj.weight",  "mlp.linear_fc2.weight"),
    ],
    after=[
        Row("norm.weight",   "hidden",        "model.norm.weight", "decoder.final_layernorm.weight"),
        Row("output.weight", "vocab, hidden", "lm_head.weight",    "output_layer.weight", when="untied"),
    ],
    ignore=LLAMA.ignore,
)

# What the family computes, beyond what its config.json says (interop/hf_config.py reads the rest).
SPEC = {"qk_norm": True}


def to_hf(m, hf: dict) -> None:
    """Qwen2's and Qwen3's config.json switch the window on and off (use_sliding_window)."""
    hf["use_sliding_window"] = bool(m.sliding_window)
