"""Laying a run out over devices: the layout checker (check.py) and the planner (plan.py).

Pure Python + numpy: nothing here imports MindSpore, so `msllm plan` is instant.
"""
