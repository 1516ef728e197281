"""The experts' matmul in C++ (grouped_matmul.cc): each run of adjacent blocks of one expert as one GEMM."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn

from msllm.kernels.op import differentiable
from msllm.models.layers import cast


class GroupedMatmul(nn.Cell):
    """xs [B, n, in] @ w[ids]^T -> [B, n, out]: block i of rows times expert ids[i]'s weights (w [E, out,
    in]), each run of adjacent blocks of one expert as one GEMM that reads the expert's weights once,
    forward and backward (grouped_matmul.cc); see msllm.models.moe.GatheredMatmul. Runs in fp32."""

    def __init__(self):
        super().__init__()
        self.matmul = differentiable("GroupedMatmul", "x w ids", lambda x, w, ids: [x[0], x[1], w[1]],
                                     constant="ids")

    def construct(self, xs, w, ids):
        return cast(self.matmul(cast(xs, ms.float32), cast(w, ms.float32), ids.astype(ms.int32)), xs.dtype)
