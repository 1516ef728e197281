"""Llama 2 / Llama 3 / Mistral and Qwen2: msllm <-> Hugging Face <-> MindFormers tensor names.

All three layouts store linear weights [out, in] and q/k in the same rotate-half RoPE order,
so every row is a rename (see interop/table.py for the concat / transpose rules).
"""
from interop.table import Row, Table

LLAMA = Table(
    before=[
        #   msllm                    shape            Hugging Face                  MindFormers
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "model.layers.{i}."},
    per_layer=[
        Row("attention_norm.weight",     "hidden",      "input_layernorm.weight",          "attention_norm.weight"),
        Row("attention.wq.weight",       "q, hidden",   "self_attn.q_proj.weight",         "attention.wq.weight"),
        Row("attention.wk.weight",       "kv, hidden",  "self_attn.k_proj.weight",         "attention.wk.weight"),
        Row("attention.wv.weight",       "kv, hidden",  "self_attn.v_proj.weight",         "attention.wv.weight"),
        Row("attention.wo.weight",       "hidden, q",   "self_attn.o_proj.weight",         "attention.wo.weight"),
        Row("ffn_norm.weight",           "hidden",      "post_attention_layernorm.weight", "ffn_norm.weight"),
        Row("feed_forward.w1.weight",    "ffn, hidden", "mlp.gate_proj.weight",            "feed_forward.w1.weight"),
        Row("feed_forward.w2.weight",    "hidden, ffn", "mlp.down_proj.weight",            "feed_forward.w2.weight"),
        Row("feed_forward.w3.weight",    "ffn, hidden", "mlp.up_proj.weight",              "feed_forward.w3.weight"),
    ],
    after=[
        Row("norm.weight",               "hidden",        "model.norm.weight",   "model.norm_out.weight"),
        Row("output.weight",             "vocab, hidden", "lm_head.weight",      "lm_head.weight", when="untied"),
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
    Row("attention.wq.bias",         "q",           "self_attn.q_proj.bias",           "attention.wq.bias"),
    Row("attention.wk.bias",         "kv",          "self_attn.k_proj.bias",           "attention.wk.bias"),
    Row("attention.wv.bias",         "kv",          "self_attn.v_proj.bias",           "attention.wv.bias"),
])
