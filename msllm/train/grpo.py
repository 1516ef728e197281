"""GRPO's policy loss as a loss cell of the compiled step, and its group advantages (TRL 1.16's GRPOTrainer).

A micro-batch holds n sampled sequences: tokens [n, s+1] (prompt, completion, padding), mask [n, s]
(1 where the label is a completion token), the advantages [n], the log-probs the completions were
sampled with (old_logps [n, s], per label) and, with a KL term, the reference's (ref_logps [n, s]: with
LoRA, the same weights with the adapters off, computed in the step).
Per-token log-probs come through the same head path as the cross-entropy (msllm.train.step.LossCell:
the projection, or the fused head kernel's target - logsumexp), of logits / temperature as TRL scores
them. Per token, with ratio r = exp(logp - old):

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta * r * (exp(ref - logp) - (ref - logp) - 1)

aggregated as TRL's loss_type: grpo (each sequence's mean, then the mean), bnpo (over the
micro-batch's completion tokens), dapo (over the whole batch's, every worker's: with accumulation or
data parallel each micro-batch is given that count), dr_grpo (the sum over n * max_completion); the
step averages the micro-batches' losses over accumulation and workers, as TRL divides by its
accumulation steps and DDP averages the processes' gradients.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from msllm.train.logprobs import TokenLogProbs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# The aux row GRPOLoss returns, in order (TRL's metric names).
METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length")


class ReferenceLogProbs(nn.Cell):
    """The KL term's reference with LoRA: the policy's per-token log-probs with its adapters switched off
    (msllm.lora.AdapterSwitch set to 0, back to 1 once computed), no gradient, no second weight copy.
    The step calls it with the loss cell's inputs and passes its output last (msllm.train.step.TrainStep);
    with `head_rows` the third of them (after mask and advantages) are the rows the head computes."""

    def __init__(self, logps: TokenLogProbs, switch, head_rows: bool = False):
        super().__init__(auto_prefix=False)
        self.logps, self.on, self.head_rows = logps, switch.on, head_rows

    def construct(self, tokens, *inputs):
        rows = inputs[2] if self.head_rows else None
        off = ops.assign(self.on, ops.zeros((), ms.float32))
        ref = ops.stop_gradient(self.logps(ops.depend(tokens, off), rows))
        return ops.depend(ref, ops.assign(self.on, ops.depend(ops.ones((), ms.float32), ref)))


class GRPOLoss(nn.Cell):
    """tokens [n, s+1], scale, mask [n, s], advantages [n](, batch_tokens [n])(, old_logps [n, s])
    (, ref_logps [n, s]) -> (scale * loss, METRICS [5]). batch_tokens (the completion tokens of the whole
    batch, over every worker) come with dapo and accum_steps x world > 1,
    old_logps with grpo.num_iterations > 1 (else the policy's own: it sampled them), ref_logps when
    beta > 0 (with `switch`, the adapters' one, the step computes them). With `head_rows` (train.head_rows
    loss) the first of the optional inputs are rows [n, C/n] (msllm.data.loader.head_rows of the mask):
    only the completion positions go through the head, every log-prob elsewhere is 0."""

    def __init__(self, model, loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
                 beta: float = 0.0, max_completion: int = 0, temperature: float = 1.0, fused: bool = False,
                 switch=None, accum_steps: int = 1, world: int = 1, head_rows: bool = False):
        super().__init__(auto_prefix=False)
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {loss_type!r} not in {LOSS_TYPES}")
        self.logps = TokenLogProbs(model, fused, temperature)
        self.loss_type, self.beta, self.max_completion = loss_type, beta, max_completion
        self.low, self.high = 1.0 - epsilon, 1.0 + (epsilon if epsilon_high is None else epsilon_high)
        self.has_stats = True
        self.stats_are_means = True  # per micro-batch: under data parallel the step averages them over ranks
        # dapo normalises by the whole batch's completion tokens; the step averages its micro-batches' losses
        # (accum_steps on each of world workers)
        self.parts = accum_steps * world
        self.batch_count = loss_type == "dapo" and self.parts > 1
        self.head_rows = head_rows
        if beta != 0.0 and switch is not None:
            self.reference = ReferenceLogProbs(TokenLogProbs(model, fused, temperature), switch, head_rows)

    def construct(self, tokens, scale, mask, advantages, *given):
        rows = None
        if self.head_rows:
            rows, given = given[0], given[1:]
        logps = self.logps(tokens, rows)
        if self.batch_count:  # its first input: every row holds the batch's completion tokens
            given, batch_tokens = given[1:], given[0][0]
        # how many log-prob inputs came (fixed when the graph is compiled) says which they are
        old_logps = ops.stop_gradient(logps) if len(given) == (1 if self.beta != 0.0 else 0) else given[0]
        # log-ratios masked before exp: a position without a loss may hold any log-prob (0 when the head
        # skipped it), and an overflow there would turn its zero weight into NaN
        ratio = ops.exp((logps - old_logps) * mask)
        adv = advantages.reshape(-1, 1)
        per_token = -ops.minimum(ratio * adv, ops.clamp(ratio, self.low, self.high) * adv)
        kl = ops.zeros_like(per_token)
        if self.beta != 0.0:
            delta = (given[-1] - logps) * mask
            kl = (ops.exp(delta) - delta - 1.0) * ratio  # TRL's use_bias_correction_kl (default): the k3
            per_token = per_token + self.beta * kl       # estimate weighted by the ratio, for samples of old
        tokens_per_row = ops.sum(mask, -1)
        count = ops.maximum(ops.sum(mask), 1.0)
        if self.loss_type == "grpo":
            loss = ops.mean(ops.sum(per_token * mask, -1) / ops.maximum(tokens_per_row, 1.0))
        elif self.loss_type == "dr_grpo":
            loss = ops.sum(per_token * mask) / (mask.shape[0] * self.max_completion)
        elif self.batch_count:
            loss = ops.sum(per_token * mask) * self.parts / ops.maximum(batch_tokens, 1.0)
        else:  # bnpo, dapo
            loss = ops.sum(per_token * mask) / count
        ratio, kl = ops.stop_gradient(ratio), ops.stop_gradient(kl)
        low = ops.logical_and(ratio < self.low, adv < 0).astype(ms.float32)
        high = ops.logical_and(ratio > self.high, adv > 0).astype(ms.float32)
        stats = ops.stack([ops.sum(kl * mask) / count, ops.sum(low * mask) / count, ops.sum(high * mask) / count,
                           ops.sum((low + high) * mask) / count, ops.mean(tokens_per_row)])
        return loss * scale, stats


def group_advantages(rewards: np.ndarray, group_size: int, scale_rewards: str = "group") -> np.ndarray:
    """rewards [prompts * group_size] (each prompt's completions together) -> advantages, as TRL:
    r - its group's mean, divided by (std + 1e-4) with the group's (scale_rewards group) or the whole
    batch's (batch) unbiased std, or not divided (none)."""
    r = np.asarray(rewards, np.float64)
    groups = r.reshape(-1, group_size)
    centred = (groups - groups.mean(1, keepdims=True)).reshape(-1)
    if scale_rewards == "none":
        return centred.astype(np.float32)
    if scale_rewards == "group":
        std = np.repeat(groups.std(1, ddof=1) if group_size > 1 else np.zeros(len(groups)), group_size)
    elif scale_rewards == "batch":
        std = np.full(r.shape, r.std(ddof=1) if r.size > 1 else 0.0)
    else:
        raise ValueError(f"scale_rewards {scale_rewards!r} not in group, batch, none")
    return (centred / (std + 1e-4)).astype(np.float32)
