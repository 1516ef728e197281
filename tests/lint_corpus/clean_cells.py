"""Cells that compile to one static graph: msllm lint must report nothing here.
tests/test_lint.py also runs them in GRAPH_MODE to show they are valid graph code."""
import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops


def cast(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


def sum_of_squares(g):
    squares = ops.square(g)
    if g.ndim > 1:
        squares = ops.sum(squares, -1)
    return ops.sum(squares)


class ShapeArithmetic(nn.Cell):
    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(2)

    def construct(self, x):
        b, d = x.shape
        if x.ndim != 2 or d % self.heads:
            return x
        y = x.reshape(b, self.heads, d // self.heads) * self.scale
        return y.reshape(x.shape[:-1] + (d,))


class StaticLoops(nn.Cell):
    def __init__(self, depth=3):
        super().__init__()
        self.depth = depth
        self.layers = nn.CellList([nn.Dense(4, 4) for _ in range(depth)])

    def construct(self, x):
        outs = ()
        for layer in self.layers:
            x = layer(x)
            outs += (x,)
        for i in range(1, self.depth):
            x = x + outs[i] * i
        return ops.stack([o.sum() for o in outs]).sum() + x.sum()


class Flags(nn.Cell):
    def __init__(self, use_bias=True, mode="relu"):
        super().__init__()
        self.flag = use_bias
        self.mode = mode
        self.bias = Parameter(Tensor(np.ones(4, np.float32)), name="bias") if use_bias else None
        self.count = Parameter(Tensor(np.zeros((), np.float32)), name="count")
        self.hyper_map = ops.HyperMap()

    def construct(self, x, mask=None, scale=1.0, training=False):
        if self.flag:
            x = x + self.bias
        if self.bias is not None and mask is not None:
            x = x * mask
        if self.mode == "relu":
            x = ops.relu(x)
        if training:
            x = x * 0.5
        self.count = self.count + 1  # a Parameter: an in-place Assign in the graph
        norms = self.hyper_map(sum_of_squares, (x, x * scale))
        return cast(ops.select(x > 0, x, -x), ms.float32) + norms[0] + len(x.shape)


class PrintsNothing(nn.Cell):
    def construct(self, x):
        n = max(x.shape[0], 1)
        return ops.where(x.sum() > 0, x / n, x)
