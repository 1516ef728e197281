"""Cells msllm lint must flag: each flagged line ends with `# expect: CODE` (tests/test_lint.py
checks that exactly these lines, with these codes, are reported)."""
import pdb

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

HISTORY = []


class TensorIf(nn.Cell):
    def construct(self, x):
        if x.sum() > 0:  # expect: GL101
            return x * 2
        return x


class TensorWhile(nn.Cell):
    def construct(self, x):
        while x.max() < 100:  # expect: GL101
            x = x * 2
        return x


class TensorTernaryAndAssert(nn.Cell):
    def construct(self, x):
        assert ops.isfinite(x).all()  # expect: GL101
        y = x if x.mean() > 0 else -x  # expect: GL101
        return y


class TensorLoopBound(nn.Cell):
    def construct(self, x, n):
        for _ in range(n):  # expect: GL101
            x = x * 2
        return x


class ToPython(nn.Cell):
    def construct(self, x):
        scale = float(x.max())  # expect: GL102
        total = x.sum().item()  # expect: GL102
        host = x.asnumpy()  # expect: GL102
        return x * scale + total + Tensor(host)


class Debugging(nn.Cell):
    def construct(self, x):
        print("x", x)  # expect: GL103
        breakpoint()  # expect: GL103
        pdb.set_trace()  # expect: GL103
        return x


class Counter(nn.Cell):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.seen = []

    def construct(self, x):
        self.calls += 1  # expect: GL104
        self.seen.append(x)  # expect: GL104
        HISTORY.append(x)  # expect: GL104
        self.last = x  # expect: GL104
        return x


class NotGraphBuiltins(nn.Cell):
    def construct(self, x):
        ordered = sorted(x)  # expect: GL105
        if any(x):  # expect: GL101 GL105
            return ordered[0]
        return x


class LoopsOverTensors(nn.Cell):
    def construct(self, x):
        rows = [r * 2 for r in x]  # expect: GL106
        total = x[0] * 0
        for r in x:  # expect: GL106
            total = total + r
        return ops.stack(rows) + total


class Fallible(nn.Cell):
    def construct(self, x):
        try:  # expect: GL107
            return x / x.sum()
        except ZeroDivisionError:
            return x


class UsesGlobal(nn.Cell):
    def construct(self, x):
        global HISTORY  # expect: GL108
        return x


class BuildsInConstruct(nn.Cell):
    def construct(self, x):
        dense = nn.Dense(4, 4)  # expect: GL109
        bias = Parameter(Tensor(np.zeros(4, np.float32)), name="bias")  # expect: GL109 GL110
        return dense(x) + bias


class NumpyInside(nn.Cell):
    def construct(self, x):
        return x * np.sqrt(2.0) + ms.Tensor(np.ones(4))  # expect: GL110


class HelperMethods(nn.Cell):
    """A method construct calls is compiled with what construct passes it."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(4, np.float32)), name="weight")

    def gate(self, x, threshold):
        if x.max() > threshold:  # expect: GL101
            return x
        return x * threshold

    def construct(self, x):
        if self.weight.sum() > 0:  # expect: GL101
            x = x * self.weight
        return self.gate(x, 0.5) + scaled(x)


def scaled(x):
    """A module function construct calls is compiled too."""
    return x * x.max().item()  # expect: GL102


@ms.jit
def jitted(x):
    if x.sum() > 0:  # expect: GL101
        return x
    return -x


class Suppressed(nn.Cell):
    def construct(self, x, ok):
        if ok:  # noqa: GL101 (a deliberate run-time branch)
            return x
        return -x
