"""The experts' matmul in C++ (grouped_matmul.cc): each run of adjacent blocks of one expert as one GEMM (with
gpt-oss's expert biases, inside it)."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn

from msllm.kernels.op import differentiable
from msllm.models.layers import cast


class GroupedMatmul(nn.Cell):
    """xs [B, n, in] @ w[ids]^T (+ bias[ids], bias [E, out]) -> [B, n, out]: block i of rows times expert ids[i]'s
    weights (w [E, out, in]), each run of adjacent blocks of one expert as one GEMM that reads the expert's
    weights once, forward and backward (grouped_matmul.cc); the bias is the GEMM's starting value and its
    gradient a sum in the weight-gradient pass. See msllm.models.moe.GatheredMatmul. Runs in fp32."""

    def __init__(self):
        super().__init__()
        self.matmul = differentiable("GroupedMatmul", "x w ids", lambda x, w, ids: [x[0], x[1], w[1]],
                                     constant="ids")
        self.biased = differentiable("GroupedMatmulBias", "x w ids b", lambda x, w, ids, b: [x[0], x[1], w[1]],
                                     constant="ids")

    def construct(self, xs, w, ids, bias=None):
        x32, w32, ids32 = cast(xs, ms.float32), cast(w, ms.float32), ids.astype(ms.int32)
        if bias is None:
            return cast(self.matmul(x32, w32, ids32), xs.dtype)
        return cast(self.biased(x32, w32, ids32, cast(bias, ms.float32)), xs.dtype)
