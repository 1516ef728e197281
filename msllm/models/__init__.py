"""Model families as MindSpore Cells (llama.py) and their parallel layouts (layouts.py).

The Cells load lazily, so layouts.py (and `msllm plan`) is read without importing MindSpore.
"""
__all__ = ["Llama", "CausalLMLoss", "build_model"]


def __getattr__(name):
    if name in __all__:
        from msllm.models import llama
        return getattr(llama, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
