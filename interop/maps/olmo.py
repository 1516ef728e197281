"""OLMo 2 (Olmo2ForCausalLM) and OLMo 3 (Olmo3ForCausalLM): Llama's projections and SwiGLU, but each
sublayer's output is normed before it joins the residual stream and its input is not
(post_attention_layernorm, post_feedforward_layernorm: msllm's sandwich norms without the pre norms),
and q and k are RMS-normed over the whole projection (one weight per feature of all heads), before
RoPE. OLMo 3 adds sliding-window layers, three of every four by default (layer_types), whose RoPE
parameters config.json gives per layer type (written as Gemma 3's). Not mapped to MindFormers (MindFormers 1.9 has no OLMo)."""
from interop.maps import gemma3

# Gemma 3's tensors (the same post_attention_layernorm / post_feedforward_layernorm names) without the
# pre norms, the q / k norms one weight per feature of the projection.
_PRE_NORMS = ("attention_norm.weight", "ffn_norm.weight")
_WIDTHS = {"attention.q_norm.weight": "q", "attention.k_norm.weight": "kv"}
OLMO = gemma3.GEMMA3._replace(per_layer=[row._replace(shape=_WIDTHS.get(row.msllm, row.shape))
                                         for row in gemma3.GEMMA3.per_layer if row.msllm not in _PRE_NORMS])

SPEC = {"qk_norm": True, "qk_norm_scope": "projection", "sandwich_norm": True, "pre_norm": False}

