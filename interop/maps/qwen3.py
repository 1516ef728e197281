"""Qwen3 (Qwen3ForCausalLM): Llama's tensors plus a per-head RMSNorm on q and k before RoPE, with
head_dim set apart from hidden / heads (Qwen3-0.6B: hidden 1024, 16 heads of 128).
MindFormers trains Qwen3 in its mcore layout (fused linear_qkv); msllm does not map it."""
from interop.maps.llama import LLAMA
from interop.table import Row

QWEN3 = LLAMA._replace(
    per_layer=[row._replace(mindformers=None) for row in LLAMA.per_layer] + [
        #   msllm                      shape     Hugging Face              MindFormers
        Row("attention.q_norm.weight", "head",   "self_attn.q_norm.weight", None),
        Row("attention.k_norm.weight", "head",   "self_attn.k_norm.weight", None),
    ],
    before=[row._replace(mindformers=None) for row in LLAMA.before],
    after=[row._replace(mindformers=None) for row in LLAMA.after],
)

# What the family computes, beyond what its config.json says (interop/hf_config.py reads the rest).
SPEC = {"qk_norm": True}
