"""Llama 2 / Llama 3 / Mistral and Qwen2: msllm <-> Hugging Face <-> MindFormers tensor names.

All three layouts store linear weights [out, in] and q/k in the same rotate-half RoPE order,
so every row is a rename (see interop/table.py for concat / transpose rules).
"""
from interop.table import Row, Table

L = "layers.{i}"
HF = "model.layers.{i}"
MF = "model.layers.{i}"

LLAMA = Table(
    before=[
        #   msllm                           shape            Hugging Face                       MindFormers
        Row("tok_embeddings.weight",        "vocab, hidden", "model.embed_tokens.weight",       "model.tok_embeddings.embedding_weight"),
    ],
    per_layer=[
        Row(f"{L}.attention_norm.weight",   "hidden",        f"{HF}.input_layernorm.weight",    f"{MF}.attention_norm.weight"),
        Row(f"{L}.attention.wq.weight",     "q, hidden",     f"{HF}.self_attn.q_proj.weight",   f"{MF}.attention.wq.weight"),
        Row(f"{L}.attention.wk.weight",     "kv, hidden",    f"{HF}.self_attn.k_proj.weight",   f"{MF}.attention.wk.weight"),
        Row(f"{L}.attention.wv.weight",     "kv, hidden",    f"{HF}.self_attn.v_proj.weight",   f"{MF}.attention.wv.weight"),
        Row(f"{L}.attention.wo.weight",     "hidden, q",     f"{HF}.self_attn.o_proj.weight",   f"{MF}.attention.wo.weight"),
        Row(f"{L}.ffn_norm.weight",         "hidden",        f"{HF}.post_attention_layernorm.weight", f"{MF}.ffn_norm.weight"),
        Row(f"{L}.feed_forward.w1.weight",  "ffn, hidden",   f"{HF}.mlp.gate_proj.weight",      f"{MF}.feed_forward.w1.weight"),
        Row(f"{L}.feed_forward.w2.weight",  "hidden, ffn",   f"{HF}.mlp.down_proj.weight",      f"{MF}.feed_forward.w2.weight"),
        Row(f"{L}.feed_forward.w3.weight",  "ffn, hidden",   f"{HF}.mlp.up_proj.weight",        f"{MF}.feed_forward.w3.weight"),
    ],
    after=[
        Row("norm.weight",                  "hidden",        "model.norm.weight",               "model.norm_out.weight"),
        Row("output.weight",                "vocab, hidden", "lm_head.weight",                  "lm_head.weight", when="untied"),
    ],
    ignore={
        # Old HF checkpoints carry the RoPE buffer; tied ones may still carry lm_head.
        "hf": ["model.layers.*.self_attn.rotary_emb.inv_freq", "lm_head.weight"],
        # MindFormers training checkpoints also hold optimizer moments and counters.
        "mindformers": ["adam_m.*", "adam_v.*", "epoch_num", "step_num", "global_step", "loss_scale",
                        "scale_sense", "current_iterator_step", "last_overflow_iterator_step"],
    },
)

QWEN2 = LLAMA._replace(per_layer=LLAMA.per_layer + [
    Row(f"{L}.attention.wq.bias",       "q",             f"{HF}.self_attn.q_proj.bias",     f"{MF}.attention.wq.bias"),
    Row(f"{L}.attention.wk.bias",       "kv",            f"{HF}.self_attn.k_proj.bias",     f"{MF}.attention.wk.bias"),
    Row(f"{L}.attention.wv.bias",       "kv",            f"{HF}.self_attn.v_proj.bias",     f"{MF}.attention.wv.bias"),
])
