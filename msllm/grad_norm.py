"""The global norm of a tuple of gradients, in graph-friendly form: the train step clips by it and
expert parallel (msllm.parallel.ep) sums the squares of the gradients each rank holds alone."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops


def sum_of_squares(g):
    squares = ops.square(g.astype(ms.float32))
    if g.ndim > 1:
        # MindSpore's CPU reduce-to-scalar kernel is slower than a last-axis reduce followed by
        # a reduce of the much smaller rest.
        squares = ops.sum(squares, -1)
    return ops.sum(squares)


# Per-parameter work goes through HyperMap, not Python loops / generators over the gradient
# tuple, which unroll into many more graph nodes and compile far slower.
hyper_map = ops.HyperMap()


def sum_squares(grads, sum_of_squares_op=None):
    """The sum of squares of all gradients; the fused kernel takes them all in one call."""
    if sum_of_squares_op is None:
        return ops.addn(hyper_map(sum_of_squares, grads))
    return sum_of_squares_op(*grads).reshape(())


def global_norm(grads, sum_of_squares_op=None):
    return ops.sqrt(sum_squares(grads, sum_of_squares_op))
