from msllm.models.llama import CausalLMLoss, Llama, build_model

__all__ = ["Llama", "CausalLMLoss", "build_model"]
