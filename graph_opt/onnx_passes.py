"""Post-export ONNX clean-up with onnx's own tooling (onnx_ir passes + the onnxscript optimizer).

shape inference -> constant folding and dead-node removal (onnxscript.optimizer) ->
common-subexpression elimination -> small constants lifted to initializers -> dead-node
removal -> shape inference again, so every intermediate value carries its (symbolic) shape.
Weights are never folded: the optimizer only folds inputs up to `input_size_limit` elements.
"""
from __future__ import annotations

from collections import Counter

import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes import common


def op_counts(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def clean_up(model: ir.Model) -> tuple[Counter, Counter]:
    """Cleans `model` in place; returns its op counts before and after."""
    before = op_counts(model)
    common.ShapeInferencePass()(model)
    onnxscript.optimizer.optimize_ir(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    common.RemoveUnusedNodesPass()(model)
    common.ShapeInferencePass()(model)
    return before, op_counts(model)


def describe(before: Counter, after: Counter) -> str:
    """'265 -> 149 nodes (Cast 15->0, Constant 90->0, ...)': totals and every op type that changed."""
    changed = [f"{op} {before[op]}->{after[op]}" for op in sorted(set(before) | set(after)) if before[op] != after[op]]
    return f"{sum(before.values())} -> {sum(after.values())} nodes" + (f" ({', '.join(changed)})" if changed else "")
