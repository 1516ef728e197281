"""The model families msllm converts, by Hugging Face architecture name: each is a family spec
(what its Cells compute, as ModelConfig fields) beside its tensor table (interop/maps/<family>.py).
Each family's module also holds its config translation beyond the keys every family shares
(interop/hf_config.py reads and writes those): `from_hf` / `to_hf` hooks for its own keys.
Adding a family: a table, a SPEC, a line here, and a tiny random model in tests/hf_models.py."""
from typing import Callable, NamedTuple

from interop.maps import (deepseek_v3, gemma3, glm4_moe, gpt_oss, moe, olmo, phi3, qwen3, qwen3_5, qwen3_5_moe,
                          qwen3_next, smollm3)
from interop.maps.llama import LLAMA, QWEN2
from interop.table import Table


class Family(NamedTuple):
    table: Table
    model_type: str         # config.json's model_type
    spec: dict              # ModelConfig fields the architecture implies (its config.json has the rest)
    activation: str = "silu"  # the hidden_act / hidden_activation its MLP computes
    moe: bool = False       # its MLPs are routed experts (config.json says how many and where)
    # The table conversions to or from MindFormers use when MindFormers joins tensors `table` keeps
    # apart (its mcore layouts); `table` names each projection alone, as LoRA and PEFT need.
    mindformers: Table | None = None
    activation_key: str = "hidden_act"  # the config.json key naming its activation (Gemma 3: hidden_activation)
    # Its config.json lists layer_types when every layer slides (Mistral's and Phi-3's slide by sliding_window alone).
    writes_layer_types: bool = True
    # from_hf(hf, fields, refuse): sets the ModelConfig `fields` its own config.json keys give (experts, derived
    # scales); to_hf(m, hf): adds those keys to the config.json `hf` of model `m`.
    from_hf: Callable[[dict, dict, Callable], None] = lambda hf, fields, refuse: None
    to_hf: Callable[[object, dict], None] = lambda m, hf: None
    # Its config.json can mark layers that attend without RoPE (model.position_types).
    nope_layers: bool = False
    partial_rope: bool = False  # its attention rotates the leading partial_rotary_factor of each head
    # config.json's attention_bias puts biases on q, k and v only (GLM-4.5; its from_hf reads it), not also on
    # o_proj as Llama's convention has it
    attention_bias_qkv: bool = False


FAMILIES = {
    "LlamaForCausalLM": Family(LLAMA, "llama", {}),
    # same tensors; its sliding window comes from config.json
    "MistralForCausalLM": Family(LLAMA, "mistral", {}, writes_layer_types=False),
    "Qwen2ForCausalLM": Family(QWEN2, "qwen2", {"qkv_bias": True}, to_hf=qwen3.to_hf),
    "Qwen3ForCausalLM": Family(qwen3.QWEN3, "qwen3", qwen3.SPEC, mindformers=qwen3.QWEN3_MINDFORMERS, to_hf=qwen3.to_hf),
    "Gemma3ForCausalLM": Family(gemma3.GEMMA3, "gemma3_text", gemma3.SPEC, "gelu_pytorch_tanh",
                                activation_key="hidden_activation", from_hf=gemma3.from_hf, to_hf=gemma3.to_hf),
    "Phi3ForCausalLM": Family(phi3.PHI3, "phi3", phi3.SPEC, writes_layer_types=False),
    "Qwen3MoeForCausalLM": Family(moe.QWEN3_MOE, "qwen3_moe", qwen3.SPEC, moe=True, mindformers=moe.QWEN3_MOE_MINDFORMERS,
                                  from_hf=moe.from_hf, to_hf=moe.qwen3_moe_to_hf),
    "MixtralForCausalLM": Family(moe.MIXTRAL, "mixtral", {}, moe=True, from_hf=moe.from_hf, to_hf=moe.mixtral_to_hf),
    "DeepseekV3ForCausalLM": Family(deepseek_v3.DEEPSEEK_V3, "deepseek_v3", deepseek_v3.SPEC, moe=True,
                                    mindformers=deepseek_v3.DEEPSEEK_V3_MINDFORMERS,
                                    from_hf=deepseek_v3.from_hf, to_hf=deepseek_v3.to_hf),
    "Glm4MoeForCausalLM": Family(glm4_moe.GLM4_MOE, "glm4_moe", glm4_moe.SPEC, moe=True, from_hf=glm4_moe.from_hf,
                                 to_hf=glm4_moe.to_hf, partial_rope=True, attention_bias_qkv=True),
    "SmolLM3ForCausalLM": Family(smollm3.SMOLLM3, "smollm3", {}, from_hf=smollm3.from_hf, to_hf=smollm3.to_hf,
                                 nope_layers=True),
    # OLMo 3 first: msllm models that norm like OLMo are written as OLMo 3, which also holds sliding layers
    "Olmo3ForCausalLM": Family(olmo.OLMO, "olmo3", olmo.SPEC, to_hf=gemma3.rope_per_layer_type),
    "Olmo2ForCausalLM": Family(olmo.OLMO, "olmo2", olmo.SPEC, writes_layer_types=False),
    "GptOssForCausalLM": Family(gpt_oss.GPT_OSS, "gpt_oss", gpt_oss.SPEC, moe=True, from_hf=gpt_oss.from_hf,
                                to_hf=gpt_oss.to_hf),
    "Qwen3_5ForCausalLM": Family(qwen3_5.QWEN3_5, "qwen3_5_text", qwen3_5.SPEC, from_hf=qwen3_5.from_hf,
                                 to_hf=qwen3_5.to_hf, partial_rope=True),
    "Qwen3_5MoeForCausalLM": Family(qwen3_5_moe.QWEN3_5_MOE, "qwen3_5_moe_text", qwen3_5_moe.SPEC, moe=True,
                                    from_hf=qwen3_5_moe.from_hf, to_hf=qwen3_5_moe.to_hf, partial_rope=True),
    "Qwen3NextForCausalLM": Family(qwen3_next.QWEN3_NEXT, "qwen3_next", qwen3_next.SPEC, moe=True,
                                   from_hf=qwen3_next.from_hf, to_hf=qwen3_next.to_hf, partial_rope=True),
}


def table_for(arch: str, *layouts: str) -> Table:
    """The table a conversion between `layouts` reads: the MindFormers one when either end is MindFormers."""
    family = FAMILIES[arch]
    return family.mindformers if family.mindformers and "mindformers" in layouts else family.table
