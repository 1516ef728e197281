"""gpt-oss (GptOssForCausalLM): grouped-query attention with biases on q, k, v and o and a learned
sink logit per head (self_attn.sinks), sliding-window and full layers alternating (layer_types), YaRN;
every MLP routed: a router with a bias whose top k logits are softmaxed (msllm's softmax router with
renormalised top k: the same weights), experts with biases and gpt-oss's clamped SwiGLU, stored as
one gate_up_proj [E, h, 2f] whose columns alternate gate and up, and down_proj [E, f, h].
Not mapped to MindFormers. The published checkpoints store the experts in MXFP4 (*_blocks / *_scales), which
interop/formats/mxfp4.py dequantizes on read into the full-precision tensors this table names."""
from interop.maps import moe
from interop.table import Alternated, Concat, ExpertsTransposed, Row, Table

_ATTENTION = [
    Row(f"attention.w{p}.{kind}", ("q" if p in "qo" else "kv") + (", hidden" if kind == "weight" else ""),
        f"self_attn.{p}_proj.{kind}", None)
    for p in "qkv" for kind in ("weight", "bias")
]

GPT_OSS = Table(
    before=[
        #   msllm                    shape            Hugging Face                 MindFormers
        Row("tok_embeddings.weight", "vocab, hidden", "model.embed_tokens.weight", None),
    ],
    layer_prefix={"msllm": "layers.{i}.", "hf": "model.layers.{i}.", "mindformers": "model.layers.{i}."},
    per_layer=[
        Row("attention_norm.weight",     "hidden",        "input_layernorm.weight",          None),
        *_ATTENTION,
        Row("attention.wo.weight",       "hidden, q",     "self_attn.o_proj.weight",         None),
        Row("attention.wo.bias",         "hidden",        "self_attn.o_proj.bias",           None),
        Row("attention.core.sinks",      "heads",         "self_attn.sinks",                 None),
        Row("ffn_norm.weight",           "hidden",        "post_attention_layernorm.weight", None),
        Row("feed_forward.router.weight", "experts, hidden", "mlp.router.weight",            None),
        Row("feed_forward.router.bias",  "experts",       "mlp.router.bias",                 None),
        Row(Concat(1, "feed_forward.experts.w1", "feed_forward.experts.w3"), "experts, expert_ffn+expert_ffn, hidden",
            Alternated("mlp.experts.gate_up_proj"), None),
        Row(Concat(1, "feed_forward.experts.b1.bias", "feed_forward.experts.b3.bias"), "experts, expert_ffn+expert_ffn",
            Alternated("mlp.experts.gate_up_proj_bias"), None),
        Row("feed_forward.experts.w2",   "experts, hidden, expert_ffn",
            ExpertsTransposed("mlp.experts.down_proj"), None),
        Row("feed_forward.experts.b2.bias", "experts, hidden", "mlp.experts.down_proj_bias", None),
    ],
    after=[
        Row("norm.weight",               "hidden",        "model.norm.weight", None),
        Row("output.weight",             "vocab, hidden", "lm_head.weight",    None, when="untied"),
    ],
    ignore={"hf": ["lm_head.weight"]},
)

SPEC = {"qkv_bias": True, "o_bias": True, "attention_sinks": True, "router_bias": True, "experts_bias": True,
        "mlp": "swiglu_clamped"}


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """Its experts (their size is intermediate_size), top k (softmax over the top k logits: renormalised), and
    the clamped SwiGLU's alpha and limit."""
    if not hf.get("attention_bias", True):
        refuse("attention_bias", "false: msllm builds gpt-oss with q/k/v/o biases (true)")
    if hf.get("num_local_experts") is None:
        refuse("num_local_experts", "missing")
    moe.from_hf({**hf, "norm_topk_prob": True, "moe_intermediate_size": hf.get("intermediate_size")}, fields, refuse)
    for key in ("swiglu_alpha", "swiglu_limit"):
        value = hf.get(key, {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}[key])
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            refuse(key, f"must be a number > 0, got {value!r}")
        fields[key] = float(value)


def to_hf(m, hf: dict) -> None:
    moe.routing_to_hf(m, hf)
    hf.pop("norm_topk_prob", None)  # gpt-oss always softmaxes its top k logits
    hf.update(num_local_experts=m.num_experts, swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit,
              attention_bias=True)
