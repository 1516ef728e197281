"""Phi-3 (Phi3ForCausalLM): Llama's maths with q, k, v stored as one qkv_proj and gate, up as one
gate_up_proj. msllm keeps them separate (the same wq / wk / wv / w1 / w3 as every family, so LoRA
targets, layouts and kernels are shared); the table joins and splits them. Not mapped to MindFormers."""
from interop.table import Concat, Row, Table

PHI3 = Table(
    before=[
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", None),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "model.layers.{i}."},
    per_layer=[
        #   msllm                                                                  shape             Hugging Face
        Row("attention_norm.weight",                                               "hidden",          "input_layernorm.weight", None),
        Row(Concat(0, "attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
            "q+kv+kv, hidden", "self_attn.qkv_proj.weight", None),
        Row("attention.wo.weight",                                                 "hidden, q",       "self_attn.o_proj.weight", None),
        Row("ffn_norm.weight",                                                     "hidden",          "post_attention_layernorm.weight", None),
        Row(Concat(0, "feed_forward.w1.weight", "feed_forward.w3.weight"),
            "ffn+ffn, hidden", "mlp.gate_up_proj.weight", None),
        Row("feed_forward.w2.weight",                                              "hidden, ffn",     "mlp.down_proj.weight", None),
    ],
    after=[
        Row("norm.weight",               "hidden",        "model.norm.weight", None),
        Row("output.weight",             "vocab, hidden", "lm_head.weight",    None, when="untied"),
    ],
    ignore={"hf": ["lm_head.weight"]},
)

SPEC = {}
