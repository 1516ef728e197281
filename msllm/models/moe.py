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
    """x [N, h] -> (weights [N, k] fp32, experts [N, k] int32, probabilities [N, E] fp32)."""

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
        return weights, experts, probs


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
    """A layer's MLP as routed experts; x [N, h] -> (out [N, h], load [2, E]).

    load: the layer's routing statistics, what the load-balancing loss and the load metrics read
    (msllm.models.moe.balance_loss): row 0 each expert's share of the N tokens' top-k choices (the
    row sums to k), row 1 the mean router probability of each expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def construct(self, x):
        weights, chosen, probs = self.router(x)
        picked = ops.one_hot(chosen, self.num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))  # [N, k, E]
        combine = ops.sum(picked * weights.reshape(weights.shape + (1,)), 1)                         # [N, E]
        load = ops.stack((ops.stop_gradient(ops.mean(ops.sum(picked, 1), 0)), ops.mean(probs, 0)))
        return self.experts(x, combine), load


def balance_loss(loads):
    """The auxiliary load-balancing loss of Switch Transformer as transformers computes it over a model's
    MoE layers: E * sum_e f_e * p_e, where f_e is expert e's share of the top-k choices and p_e its mean
    router probability, each averaged over the layers first (transformers concatenates the layers'
    tokens). loads: one [2, E] per MoE layer (MoE's load). Only p carries a gradient."""
    mean = ops.mean(ops.stack(loads), 0)                                                     # [2, E]
    return mean.shape[-1] * ops.sum(mean[0] * mean[1])


def routing_metrics(loads) -> dict:
    """What a step's routing loads (numpy [moe layers, 2, E], the train step's last output) say:
    each MoE layer's busiest expert over the mean (1.0: perfectly even; E / k: every token to the
    same k experts), the worst layer's, and the load-balancing loss they give (balance_loss)."""
    shares = loads[:, 0]
    per_layer = [round(float(x), 4) for x in shares.max(-1) / shares.mean(-1)]
    mean = loads.mean(0)
    return {"expert_load": per_layer, "expert_load_max": max(per_layer),
            "aux_loss": float(loads.shape[-1] * (mean[0] * mean[1]).sum())}
