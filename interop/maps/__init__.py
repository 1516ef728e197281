"""The model families msllm converts, by Hugging Face architecture name: each is a family spec
(what its Cells compute, as ModelConfig fields) beside its tensor table (interop/maps/<family>.py).
Adding a family: a table, a SPEC, a line here, and a tiny random model in tests/hf_models.py."""
from typing import NamedTuple

from interop.maps import deepseek_v3, gemma3, moe, phi3, qwen3
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


FAMILIES = {
    "LlamaForCausalLM": Family(LLAMA, "llama", {}),
    "MistralForCausalLM": Family(LLAMA, "mistral", {}),   # same tensors; its sliding window comes from config.json
    "Qwen2ForCausalLM": Family(QWEN2, "qwen2", {"qkv_bias": True}),
    "Qwen3ForCausalLM": Family(qwen3.QWEN3, "qwen3", qwen3.SPEC, mindformers=qwen3.QWEN3_MINDFORMERS),
    "Gemma3ForCausalLM": Family(gemma3.GEMMA3, "gemma3_text", gemma3.SPEC, "gelu_pytorch_tanh"),
    "Phi3ForCausalLM": Family(phi3.PHI3, "phi3", phi3.SPEC),
    "Qwen3MoeForCausalLM": Family(moe.QWEN3_MOE, "qwen3_moe", qwen3.SPEC, moe=True, mindformers=moe.QWEN3_MOE_MINDFORMERS),
    "MixtralForCausalLM": Family(moe.MIXTRAL, "mixtral", {}, moe=True),
    "DeepseekV3ForCausalLM": Family(deepseek_v3.DEEPSEEK_V3, "deepseek_v3", deepseek_v3.SPEC, moe=True,
                                    mindformers=deepseek_v3.DEEPSEEK_V3_MINDFORMERS),
}


def table_for(arch: str, *layouts: str) -> Table:
    """The table a conversion between `layouts` reads: the MindFormers one when either end is MindFormers."""
    family = FAMILIES[arch]
    return family.mindformers if family.mindformers and "mindformers" in layouts else family.table
