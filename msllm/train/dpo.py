"""Direct preference optimisation as a loss cell of the compiled step (train.objective: dpo).

A micro-batch holds b pairs: tokens [b, 2, s+1] and completion masks [b, 2, s] (chosen first,
msllm.data.preference), or with dpo.share_prompt one row a pair: tokens [b, s+1], mask [b, s] (1 chosen,
2 rejected), segments and positions [b, s], the two completions branching from the prompt computed
once. Each completion's log-probability is summed over its tokens and EOS, as TRL's DPOTrainer does,
through the same head path as the cross-entropy (msllm.train.step.LossCell): the model's projection
while the logits are small, the fused head kernel's (lse, target) otherwise, so no [tokens, vocab]
log-softmax exists when the kernel is on. With train.head_rows loss only the
completion positions go through the head (msllm.data.loader.head_rows), for the policy and the reference.

The reference model's log-probs come either from the data (dpo.precompute_ref: computed once by
precompute_reference with the model as loaded, stored beside the shard), or, with LoRA, from the
same weights with the adapters off (msllm.lora.AdapterSwitch), computed in the step before the
policy's forward and without a gradient: no second copy of the weights.

Losses (TRL 1.16's names): sigmoid, -log sigmoid(beta * margin), with dpo.label_smoothing eps the
conservative form -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m) (TRL's sigmoid before 1.0;
1.16's ignores eps); ipo, (margin per completion token - 1 / (2 beta))^2, the log-ratios divided by
each completion's token count. margin = (chosen - ref chosen) - (rejected - ref rejected).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from msllm.config import ConfigError, DPOConfig
from msllm.data.corpus import DataError
from msllm.data.index import read_index
from msllm.data.loader import head_rows
from msllm.data.preference import REF_INDEX, PairRows
from msllm.parallel import dp
from msllm.train.logprobs import TokenLogProbs

# The metrics row's names (TRL's), in the order DPOLoss returns them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def softplus(x):
    """log(1 + e^x) by log1p and exp (x itself beyond 20, where they agree in fp32): MindSpore 2.10's CPU
    Softplus and Log kernels round an element differently by how a launch splits the elements over threads,
    which a timed search varies over a graph's first ~15 launches, so a step's loss would differ in the last
    bit between a run and its resume. (Not relu(x) + log1p(e^-|x|): its gradient at x = 0, where every DPO
    run starts, is 0.)"""
    return ops.select(x > 20.0, x, ops.log1p(ops.exp(ops.minimum(x, 20.0))))


class PairLogProbs(nn.Cell):
    """A micro-batch's pairs -> their completions' summed log-probs [b, 2] fp32 (chosen, rejected), and
    the completions' masks [b, 2, s]. Two rows a pair: (tokens [b, 2, s+1], mask [b, 2, s][, rows]); one
    (share_prompt): (tokens [b, s+1], mask [b, s], segments, positions [b, s][, rows]). rows: head rows of
    the mask (msllm.data.loader.head_rows)."""

    def __init__(self, model, fused: bool = False, share_prompt: bool = False):
        super().__init__(auto_prefix=False)
        self.tokens = TokenLogProbs(model, fused)
        self.share_prompt = share_prompt

    def construct(self, tokens, mask, *inputs):
        b = tokens.shape[0]
        if self.share_prompt:
            rows = inputs[2] if len(inputs) == 3 else None
            logps = self.tokens(tokens, rows, inputs[0], inputs[1]).reshape(b, 1, -1)
            sides = ops.stack([mask == 1, mask == 2], 1).astype(ms.float32)
        else:
            rows = inputs[0] if len(inputs) == 1 else None
            logps = self.tokens(tokens.reshape(2 * b, -1), rows).reshape(b, 2, -1)
            sides = mask
        return ops.sum(logps * sides, -1), sides


class AdapterOffLogProbs(nn.Cell):
    """The reference log-probs with LoRA: the same model with its adapters switched off (the
    AdapterSwitch's Parameter set to 0, then back to 1 once they are computed), no gradient."""

    def __init__(self, logps: PairLogProbs, switch):
        super().__init__(auto_prefix=False)
        self.logps, self.on = logps, switch.on

    def construct(self, tokens, mask, *inputs):
        off = ops.assign(self.on, ops.zeros((), ms.float32))
        ref = ops.stop_gradient(self.logps(ops.depend(tokens, off), mask, *inputs)[0])
        return ops.depend(ref, ops.assign(self.on, ops.depend(ops.ones((), ms.float32), ref)))


class DPOLoss(nn.Cell):
    """tokens [b, 2, s+1], scale, mask [b, 2, s], ref [b, 2] -> (scale * mean DPO loss over the pairs,
    the metrics [6] of METRICS, means over the pairs). With dpo.share_prompt: tokens [b, s+1], scale,
    mask [b, s], segments, positions [b, s], ref. With train.head_rows loss the data adds the head
    rows (msllm.data.loader.head_rows: the completion positions of the micro-batch): after ref when
    it is data (dpo.precompute_ref), before it when the step computes it (its output comes last)."""

    def __init__(self, model, cfg: DPOConfig, fused: bool = False, switch=None):
        super().__init__(auto_prefix=False)
        if cfg.share_prompt and "linear" in model.cfg.layer_kinds():
            raise ConfigError("the run config", "dpo.share_prompt", "needs attention layers: a linear-attention "
                              "(Gated DeltaNet) layer's state cannot branch from the prompt; set it false")
        if cfg.share_prompt and "sliding" in model.cfg.layer_kinds():
            raise ConfigError("the run config", "dpo.share_prompt", "is not built for sliding-window layers: a "
                              "window counts slots of the row, and the rejected tokens sit further from the prompt "
                              "than their positions say; set it false")
        self.model = model
        self.share_prompt = cfg.share_prompt
        self.logps = PairLogProbs(model, fused, cfg.share_prompt)
        self.loss_type, self.beta, self.smoothing = cfg.loss, cfg.beta, cfg.label_smoothing
        # LoRA without precomputed reference log-probs: the step computes them with the adapters off
        self.reference = (None if cfg.precompute_ref or switch is None
                          else AdapterOffLogProbs(PairLogProbs(model, fused, cfg.share_prompt), switch))
        self.has_stats = True
        self.stats_are_means = True  # over the pairs: under data parallel the step averages them over ranks

    def construct(self, tokens, scale, mask, *rest):
        if self.reference is None:  # ref is data: after the segments and positions, before the rows
            at = 2 if self.share_prompt else 0
            ref, inputs = rest[at], rest[:at] + rest[at + 1:]
        else:
            ref, inputs = rest[-1], rest[:-1]
        logps, sides = self.logps(tokens, mask, *inputs)
        ratios = logps - ref
        if self.loss_type == "ipo":
            scores = ratios / ops.maximum(ops.sum(sides, -1), 1.0)
            losses = ops.square(scores[:, 0] - scores[:, 1] - 0.5 / self.beta)
        else:
            margin = self.beta * (ratios[:, 0] - ratios[:, 1])
            # -log sigmoid(x) = softplus(-x)
            losses = (1.0 - self.smoothing) * softplus(-margin) + self.smoothing * softplus(margin)
        rewards = ops.stop_gradient(self.beta * ratios)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        logps = ops.stop_gradient(logps)
        stats = ops.stack([ops.mean(chosen), ops.mean(rejected), ops.mean((chosen > rejected).astype(ms.float32)),
                           ops.mean(chosen - rejected), ops.mean(logps[:, 0]), ops.mean(logps[:, 1])])
        return ops.mean(losses) * scale, stats


class ReferencePass(nn.Cell):
    """A micro-batch's pairs as PairLogProbs takes them, with their head rows -> the model's summed
    completion log-probs [b, 2]."""

    def __init__(self, model, fused: bool = False, share_prompt: bool = False):
        super().__init__(auto_prefix=False)
        self.logps = PairLogProbs(model, fused, share_prompt)

    def construct(self, tokens, mask, *inputs):
        return self.logps(tokens, mask, *inputs)[0]


def precompute_reference(model, fused: bool, pairs, batch_size: int, rows=None,
                         share_prompt: bool = False) -> np.ndarray:
    """[len(rows), 2] float32: the reference log-probs of the pairs `rows` (indices; all by default) of `pairs`
    (msllm.data.preference.PairRows, without ref), batch_size pairs per compiled call (the last batch padded
    with the first ones), only the completion positions through the head (a graph per capacity bucket)."""
    cell = ReferencePass(model, fused, share_prompt)
    cell.set_train(False)
    rows = range(len(pairs)) if rows is None else rows
    n = len(rows)
    out = np.empty((n, 2), np.float32)
    for start in range(0, n, batch_size):
        idx = [rows[(start + k) % n] for k in range(batch_size)]
        columns = [np.stack(column) for column in zip(*(pairs[i] for i in idx))]  # tokens, mask[, segments, positions]
        got = cell(*map(Tensor, columns), Tensor(head_rows(columns[1], 1))).asnumpy()
        out[start:start + batch_size] = got[:min(batch_size, n - start)]
    return out


def reference_of(model, fused: bool, splits: list, batch_size: int, rank: int = 0, world: int = 1) -> list:
    """precompute_reference of every pair of each split (PairRows), each of `world` data-parallel ranks
    computing a contiguous share of each and all of them gathering the rest in one collective (every
    rank calls it). Every rank's shares have the same sizes (the last one wraps around to the first
    pairs), so the ranks make the same compiled calls."""
    if world == 1:
        return [precompute_reference(model, fused, pairs, batch_size, share_prompt=pairs.share_prompt)
                for pairs in splits]
    shares = []
    for pairs in splits:
        n = len(pairs)
        per = -(-n // world)
        mine = [(rank * per + k) % n for k in range(per)]
        shares.append(precompute_reference(model, fused, pairs, batch_size, mine, pairs.share_prompt))
    everyone = dp.all_gather(np.concatenate(shares))  # [world, the shares' rows, 2]
    out, at = [], 0
    for pairs, share in zip(splits, shares):
        out.append(everyone[:, at:at + len(share)].reshape(-1, 2)[:len(pairs)])
        at += len(share)
    return out


def reference_needed(shard_dir: Path, key: dict, resumed: bool) -> bool:
    """Whether the reference log-probs of the model `key` names are still to be computed beside the
    shard. A resumed run's model is no longer the reference: it must find them."""
    index_path = shard_dir / REF_INDEX
    if index_path.exists() and json.loads(index_path.read_text()) == key:
        return False
    if resumed:
        raise DataError(f"{index_path}: no reference log-probs of this run's starting model (dpo.precompute_ref), "
                        f"and a resumed model is no longer the reference; start the run again without --resume")
    return True


def store_reference(shard_dir: Path, model, fused: bool, batch_size: int, key: dict, log, rank: int = 0,
                    world: int = 1) -> None:
    """dpo.precompute_ref: both splits' reference log-probs computed now with `model` as loaded, shared
    out over the data-parallel ranks (every rank calls it), and written beside the shard ({split}.ref.bin,
    then ref.json naming `key`, the model they came from) by every rank: the same bytes, each file
    replaced whole, and a node that shares no run dir with rank 0 has its own shard."""
    index, splits = read_index(shard_dir), ("train", "val")
    t0 = time.perf_counter()
    pairs = [PairRows(shard_dir, split, index, share_prompt=index.get("share_prompt", False)) for split in splits]
    refs = reference_of(model, fused, pairs, batch_size, rank, world)
    for split, ref in zip(splits, refs):
        tmp = shard_dir / f"{split}.ref.bin.tmp{rank}"
        ref.tofile(tmp)
        os.replace(tmp, shard_dir / f"{split}.ref.bin")
    log(f"reference log-probs of {' and '.join(f'{len(r)} {s}' for r, s in zip(refs, splits))} pairs in "
        f"{time.perf_counter() - t0:.1f}s ({sum(r.nbytes for r in refs):,} bytes beside the shard)")
    tmp = shard_dir / f"{REF_INDEX}.tmp{rank}"
    tmp.write_text(json.dumps(key))
    os.replace(tmp, shard_dir / REF_INDEX)
