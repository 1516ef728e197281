"""Laying a run out over devices, as pure Python (nothing here imports MindSpore, so `msllm plan` is
instant): the placement table of every parameter and primitive (table.py), the layout checker
(check.py) and the planner (plan.py). msllm.backends.ascend turns the table into shard strategies;
msllm.parallel is the MindSpore runtime of the CPU layouts (dp, ZeRO-1, cp, ep).
"""
