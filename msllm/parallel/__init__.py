"""The MindSpore runtime of the CPU layouts: data parallel (dp.py), ZeRO-1 (zero.py), context and
expert parallel (cp.py, ep.py), launching over msrun (launch.py) and its watchdog. What a layout is,
whether it fits and what it costs is msllm.layout (pure Python).
"""
