"""AdamW (decoupled weight decay, bias-corrected, as torch.optim.AdamW) and its LR schedule.

Both run inside the compiled train step: the step counter is a Parameter, the learning
rate is computed from it in-graph, and moments live in Parameters so they checkpoint
like weights.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from msllm.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Python reference of the in-graph schedule (1-based step); used in tests and logs."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)))
    if cfg.decay == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class LRSchedule(nn.Cell):
    """Linear warmup, then cosine / linear decay to min_lr (or constant)."""

    def __init__(self, cfg: OptimConfig, total_steps: int):
        super().__init__()
        self.lr, self.min_lr, self.decay = cfg.lr, cfg.min_lr, cfg.decay
        self.warmup = float(cfg.warmup_steps)
        self.decay_steps = float(max(1, total_steps - cfg.warmup_steps))

    def construct(self, step):
        warm = self.lr * step / max(self.warmup, 1.0)
        progress = ops.clamp((step - self.warmup) / self.decay_steps, 0.0, 1.0)
        if self.decay == "cosine":
            decayed = self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + ops.cos(progress * math.pi))
        elif self.decay == "linear":
            decayed = self.lr - (self.lr - self.min_lr) * progress
        else:
            decayed = ops.ones_like(step) * self.lr
        return ops.select(step <= self.warmup, warm, decayed)


def _update(adamw, lr, beta1, beta2, eps, decay_scale, param, m, v, wd, grad):
    return adamw(param, m, v, lr, beta1, beta2, eps, wd * decay_scale, grad)


def decays(name: str, param: Parameter) -> bool:
    """Weight decay on matrices (linear and embedding weights); none on norms and biases."""
    return param.ndim >= 2


class AdamW(nn.Cell):
    """torch.optim.AdamW semantics on MindSpore's fused AdamWeightDecay kernel.

    The kernel has no bias correction: it does w -= lr' * (m / (sqrt(v) + eps') + wd' * w).
    Folding the corrections into its scalar inputs gives the torch update exactly:
        lr' = lr * sqrt(bc2) / bc1,   eps' = eps * sqrt(bc2),   wd' = wd * lr / lr'
    with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t. One fused kernel per parameter instead of a
    dozen element-wise ops is what makes the optimizer cheap on CPU.
    """

    def __init__(self, params, cfg: OptimConfig, total_steps: int):
        super().__init__()
        self.params = ParameterTuple(params)
        self.exp_avg = self.params.clone(prefix="exp_avg", init="zeros")
        self.exp_avg_sq = self.params.clone(prefix="exp_avg_sq", init="zeros")
        self.weight_decay = tuple(Tensor(cfg.weight_decay if decays(p.name, p) else 0.0, ms.float32)
                                  for p in self.params)
        self.beta1, self.beta2, self.eps = cfg.beta1, cfg.beta2, cfg.eps
        self.step = Parameter(Tensor(np.array(0, np.int32)), name="optimizer.step")
        self.schedule = LRSchedule(cfg, total_steps)
        self.adamw = ops.AdamWeightDecay()
        self.hyper_map = ops.HyperMap()  # one graph node over the tuples, cheaper to compile than a Python loop

    def construct(self, grads):
        step = self.step + 1
        ops.assign(self.step, step)
        t = step.astype(ms.float32)
        lr = self.schedule(t)
        bc1 = 1.0 - ops.pow(self.beta1, t)
        sqrt_bc2 = ops.sqrt(1.0 - ops.pow(self.beta2, t))
        kernel_lr = lr * sqrt_bc2 / bc1
        kernel_eps = self.eps * sqrt_bc2
        decay_scale = bc1 / sqrt_bc2
        self.hyper_map(ops.partial(_update, self.adamw, kernel_lr, self.beta1, self.beta2, kernel_eps, decay_scale),
                       self.params, self.exp_avg, self.exp_avg_sq, self.weight_decay, grads)
        return lr

    def state_parameters(self):
        """Everything needed to resume the optimizer exactly."""
        return [self.step, *self.exp_avg, *self.exp_avg_sq]
