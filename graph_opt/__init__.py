"""Deployment: MindIR / ONNX export (export.py), the ONNX graph builder and clean-up passes,
and the inference engines generate runs on (runtime.py)."""
