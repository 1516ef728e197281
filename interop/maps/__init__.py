"""One tensor table per model family, by Hugging Face architecture name."""
from interop.maps.llama import LLAMA, QWEN2

FAMILIES = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,   # same tensors; sliding window is a config matter (hf_config.py)
    "Qwen2ForCausalLM": QWEN2,
}
