"""Deployment: MindIR / ONNX export (export.py), the ONNX graph builder and clean-up passes,
and the inference engines generate runs on (runtime.py)."""

from msllm.errors import UserError


class ExportError(UserError, RuntimeError):
    """A bad export request or a failed verification. str() is the one-line message."""
