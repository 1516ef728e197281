"""Mixture of experts: a router and stacked experts, in place of a layer's dense MLP.

The router scores each token against every expert (softmax in fp32), keeps the top k and, if the
family says so, renormalises those k weights to sum to one (Mixtral always, Qwen3-MoE with
norm_topk_prob). Expert weights are stacked, w1 / w3 [E, f, h] and w2 [E, h, f], so one batched
matmul serves all experts per projection.

Every token runs through every expert, and the outputs are summed with the routing weights, which
are 0 for the experts a token was not routed to: dropless, static in shape, and exactly the sum
transformers computes (the extra terms are zeros), at E / k times the MLP FLOPs of a grouped
dispatch. It is the plain maths the faster formulations are checked against.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

from msllm.config import ModelConfig
from msllm.models.llama import ACTIVATIONS, cast


class Router(nn.Cell):
    """x [N, h] -> (weights [N, k] fp32, experts [N, k] int32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.renormalise = cfg.experts_per_token, cfg.norm_topk_prob
        self.weight = Parameter(initializer("zeros", (cfg.num_experts, cfg.hidden_size), ms.float32), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)

    def construct(self, x):
        probs = self.softmax(cast(self.matmul(x, cast(self.weight, x.dtype)), ms.float32))
        weights, experts = self.topk(probs, self.k)
        if self.renormalise:
            weights = weights / ops.sum(weights, -1, keepdim=True)
        return weights, experts


class Experts(nn.Cell):
    """E gated MLPs: x [N, h], combine [N, E] (each token's weight per expert) -> [N, h]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, f, h = cfg.num_experts, cfg.moe_ffn_size or cfg.ffn_size, cfg.hidden_size
        self.num_experts = e
        self.w1 = Parameter(initializer("zeros", (e, f, h), ms.float32), name="w1")   # gate
        self.w2 = Parameter(initializer("zeros", (e, h, f), ms.float32), name="w2")   # down
        self.w3 = Parameter(initializer("zeros", (e, f, h), ms.float32), name="w3")   # up
        self.matmul = ops.BatchMatMul(transpose_b=True)
        self.act = ACTIVATIONS[cfg.mlp]()

    def construct(self, x, combine):
        n, h = x.shape
        xs = ops.broadcast_to(x.reshape(1, n, h), (self.num_experts, n, h))
        hidden = self.act(self.matmul(xs, cast(self.w1, x.dtype)), self.matmul(xs, cast(self.w3, x.dtype)))
        out = self.matmul(hidden, cast(self.w2, x.dtype))                                # [E, N, h]
        return ops.sum(out * cast(combine, x.dtype).transpose(1, 0).reshape(self.num_experts, n, 1), 0)


class MoE(nn.Cell):
    """A layer's MLP as routed experts; x [N, h] -> [N, h], like FeedForward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def construct(self, x):
        weights, chosen = self.router(x)
        combine = ops.sum(ops.one_hot(chosen, self.num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
                          * weights.reshape(weights.shape + (1,)), 1)                    # [N, E]
        return self.experts(x, combine)
