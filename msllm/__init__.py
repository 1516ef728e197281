"""msllm: MindSpore-native static-graph LLM training with PyTorch interop."""
__version__ = "0.1.0"
