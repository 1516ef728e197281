"""The one compiled train step: forward, backward, global-norm clip, AdamW, LR schedule.

A Cell rather than an `ms.jit` function: in GRAPH_MODE the whole construct compiles to
one graph with weights and optimizer state as graph Parameters updated in place. In
PYNATIVE_MODE the same Cell runs eagerly for debugging.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from msllm.models.llama import CausalLMLoss


class LossCell(nn.Cell):
    """tokens [b, s+1] -> mean next-token loss of model(tokens[:, :-1]) against tokens[:, 1:]."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model
        self.loss = CausalLMLoss()

    def construct(self, tokens):
        return self.loss(self.model(tokens[:, :-1]), tokens[:, 1:])


def global_norm(grads):
    return ops.sqrt(sum(ops.sum(ops.square(g.astype(ms.float32))) for g in grads))


class TrainStep(nn.Cell):
    """tokens -> (loss, grad_norm before clipping, lr used)."""

    def __init__(self, model, optimizer, grad_clip: float):
        super().__init__(auto_prefix=False)
        self.loss_cell = LossCell(model)
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        self.value_and_grad = ops.value_and_grad(self.loss_cell, None, optimizer.params)

    def construct(self, tokens):
        loss, grads = self.value_and_grad(tokens)
        norm = global_norm(grads)
        if self.grad_clip > 0:
            scale = ops.minimum(self.grad_clip / (norm + 1e-6), 1.0)
            grads = tuple(g * scale for g in grads)
        lr = self.optimizer(grads)
        return loss, norm, lr


class EvalStep(nn.Cell):
    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.loss_cell = LossCell(model)

    def construct(self, tokens):
        return self.loss_cell(tokens)
