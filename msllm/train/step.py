"""The one compiled train step: forward, backward, loss scaling, clip, AdamW, LR schedule.

A Cell rather than an `ms.jit` function: in GRAPH_MODE the whole construct compiles to
one graph with weights and optimizer state as graph Parameters updated in place. In
PYNATIVE_MODE the same Cell runs eagerly for debugging.

One call consumes `accum_steps` micro-batches stacked along the batch axis. The micro-batch
loop is unrolled in the graph (compile time grows with accum_steps), each micro-batch made
to wait for the previous one's gradients so only one set of activations is alive at a time.
Under data parallel the gradients are summed over the ranks before the norm (msllm.parallel.dp).
A step whose gradients are not finite (fp16 overflow, or a NaN/Inf in any precision) leaves
weights and optimizer untouched; with a loss scaler the scale is lowered instead.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import amp, nn, ops

from msllm.grad_norm import global_norm, hyper_map
from msllm.models.layers import CausalLMLoss, HeadCrossEntropy, MaskedCausalLMLoss, fits_whole
from msllm.models.decoder import mtp_targets
from msllm.models.moe import routing_losses


def fused_head(model, fused: bool):
    """msllm.kernels.FusedHead for the model's output head when the CPU kernels are on (`fused`), else
    None: the kernel reduces hidden states to (logsumexp, label logit) without [tokens, vocab] logits."""
    if not fused:
        return None
    from msllm import kernels
    return kernels.FusedHead(weight_grad=model.head_weight().requires_grad) if kernels.has_sgemm() else None


class LossCell(nn.Cell):
    """tokens [b, s+1] -> scale * mean next-token loss of model(tokens[:, :-1]) against tokens[:, 1:].

    The model gives the final-normed hidden states (model.features). Logits that fit
    layers.HEAD_CHUNK_BYTES, or any without a fused head, come from the model's own output projection
    (model.project: its `output` Cell or tied lm_matmul, which layouts shard and hooks see) and the
    cross-entropy. `fused` (the CPU kernels are on): larger ones go through msllm.kernels.FusedHead,
    which reduces hidden states and model.head_weight() to each row's (logsumexp, label logit) without
    holding [tokens, vocab] (docs/big-vocab.md).

    Packed SFT samples add mask [b, s] (1 where the label is a response token), segments and
    positions [b, s] (msllm.data.sft); the mean is then over the masked-in labels. With rows
    (msllm.data.loader.head_rows: C flat positions, every one with a loss among them, the rest padded
    with positions without), only those C positions' hidden states go through the head; a step
    graph is compiled per capacity C.

    Under context parallel the model computes only this rank's tokens (model.local_tokens): the
    labels and mask are cut alike, and a masked mean divides by the cp group's mean count, so that
    the ranks' losses average to the loss of the whole sequence (msllm.parallel.cp).

    A model whose layers report statistics (MoE layers' routing loads) has a component that adds
    their losses (msllm.models.moe.routing_losses); the cell then also returns the statistics.

    Multi-token prediction (model.mtp_loss_weight > 0, msllm.models.mtp): each depth's states go through the
    same head against the tokens further ahead, and the loss adds the weight x the mean of the depths' losses
    (DeepSeek-V3's lambda / D x their sum); the cell then also returns the depths' losses [D] (after the
    routing statistics of a MoE model)."""

    def __init__(self, model, fused: bool = False):
        super().__init__(auto_prefix=False)
        self.model = model
        self.head = fused_head(model, fused)
        self.loss, self.masked_loss, self.head_loss = CausalLMLoss(), MaskedCausalLMLoss(), HeadCrossEntropy()
        self.extra = routing_losses(model.cfg)
        self.mtp_weight = model.cfg.mtp_loss_weight if model.cfg.trains_mtp else 0.0
        self.has_stats = self.extra is not None or self.mtp_weight > 0

    def next_token_loss(self, h, labels, mask=None, count=None):
        """The (masked) mean cross-entropy of the head's logits of states h [N, hidden] against labels [N]."""
        if self.head is None or fits_whole(h.shape[0], self.model.cfg.vocab_size):
            logits = self.model.project(h)
            return self.loss(logits, labels) if mask is None else self.masked_loss(logits, labels, mask, count)
        lse, target = self.head(h, self.model.head_weight(), labels)
        return self.head_loss(lse, target, mask, count)

    def construct(self, tokens, scale, mask=None, segments=None, positions=None, rows=None):
        labels = self.model.local_tokens(tokens[:, 1:]).reshape(-1)
        h, loads = self.model.features(tokens[:, :-1], segments, positions)
        states = h
        count, loss_mask = None, None  # mask [b, s] stays as given: the MTP depths read it
        if mask is not None:
            loss_mask = self.model.local_tokens(mask).reshape(-1)
            count = self.model.sequence_mean(ops.stop_gradient(ops.sum(loss_mask)))
            if rows is not None and rows.size < labels.size:  # only the positions with a loss reach the head
                rows = rows.reshape(-1)
                h, labels, loss_mask = ops.gather(h, rows, 0), ops.gather(labels, rows, 0), ops.gather(loss_mask, rows, 0)
        loss = self.next_token_loss(h, labels, loss_mask, count)
        stats = ()
        if self.extra is not None:
            loss = self.extra.add_to(loss, loads)
            stats += (self.extra.stats(loads),)
        if self.mtp_weight > 0:
            depth_losses = ()
            for i, ahead in enumerate(self.model.predict_ahead(states, tokens, segments, positions)):
                depth_losses += (self.next_token_loss(ahead, *mtp_targets(tokens, i + 1, mask, segments)),)
            depth_losses = ops.stack(depth_losses)
            loss = loss + self.mtp_weight * ops.mean(depth_losses)
            stats += (ops.stop_gradient(depth_losses),)
        if not self.has_stats:
            return loss * scale
        return (loss * scale,) + stats


def _times(coef, x):
    return x * coef


def make_loss_scaler(initial_scale: float, window: int):
    scaler = amp.DynamicLossScaler(scale_value=initial_scale, scale_factor=2, scale_window=window)
    scaler.scale_value.name, scaler.counter.name = "loss_scale.value", "loss_scale.counter"
    return scaler


class TrainStep(nn.Cell):
    """tokens [accum_steps * b, s+1] (and for SFT mask, segments, positions [accum_steps * b, s], and
    optionally the loss rows [accum_steps * b, C / b]: msllm.data.loader.head_rows)
    -> (loss, grad_norm before clipping, lr, finite, loss_scale), and for a loss cell with statistics
    (LossCell.has_stats: a MoE model's routing loads [moe layers, 4, E], then an MTP model's depth losses
    [D]) those of this rank's tokens, averaged over micro-batches. `after_update(stats, finite, lr)`: a
    Cell the model's components run once the optimizer has updated (msllm.models.moe.bias_balance), or None.
    `stats_reducer(stats, after)`: under data parallel, the Cell that averages the loss cell's first statistic
    over the ranks when it is a mean over each rank's samples (msllm.parallel.dp.RankMean; DPO's and GRPO's
    metrics), or None: this rank's own."""

    def __init__(self, model, optimizer, grad_clip: float, accum_steps: int = 1, loss_scaler=None,
                 grad_reducer=None, world: int = 1, after_update=None, loss_cell=None, stats_reducer=None):
        super().__init__(auto_prefix=False)
        if optimizer.fused:  # msllm.kernels are on (CPU): the gradient norm uses them too
            from msllm import kernels
            self.sum_of_squares = kernels.sum_of_squares_op()
        else:
            self.sum_of_squares = None
        # another objective's loss cell (msllm.train.dpo.DPOLoss, grpo.GRPOLoss): same signature, has_stats, an
        # optional `reference` Cell whose output, computed first without a gradient, is its last input
        self.loss_cell = LossCell(model, optimizer.fused) if loss_cell is None else loss_cell
        self.reference = getattr(self.loss_cell, "reference", None)
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        self.accum_steps = accum_steps
        self.loss_scaler = loss_scaler
        self.grad_reducer = grad_reducer  # data parallel: sums gradients and loss over the ranks
        # expert parallel: the reducer knows which gradients are this rank's alone (msllm.parallel.ep)
        self.sharded = hasattr(grad_reducer, "norm")
        self.world = world
        self.after_update = after_update
        self.stats_reducer = stats_reducer
        # The statistics a loss cell also returns take no gradient (has_aux).
        self.value_and_grad = ops.value_and_grad(self.loss_cell, None, optimizer.params, has_aux=self.loss_cell.has_stats)

    def state_parameters(self):
        """Step state beyond the optimizer's: the loss scaler, when there is one."""
        if self.loss_scaler is None:
            return []
        return [self.loss_scaler.scale_value, self.loss_scaler.counter]

    def inputs(self, tokens, sft, start, micro):
        """The loss cell's inputs after (tokens, scale) for one micro-batch: its rows of the other
        columns, and the reference's output on them when the loss cell has one."""
        rest = [x[start:start + micro] for x in sft]  # noqa: GL106 (one slice per input column, a few)
        if self.reference is None:
            return rest
        return rest + [self.reference(tokens, *rest)]

    def construct(self, tokens, *sft):
        scale = ops.ones((), ms.float32) if self.loss_scaler is None else self.loss_scaler.scale_value * 1.0
        micro = tokens.shape[0] // self.accum_steps
        loss, grads = self.value_and_grad(tokens[:micro], scale, *self.inputs(tokens[:micro], sft, 0, micro))
        for i in range(1, self.accum_steps):
            chunk = ops.depend(tokens[i * micro:(i + 1) * micro], grads)
            more_loss, more_grads = self.value_and_grad(chunk, scale, *self.inputs(chunk, sft, i * micro, micro))
            loss = hyper_map(ops.add, loss, more_loss) if self.loss_cell.has_stats else loss + more_loss
            grads = hyper_map(ops.add, grads, more_grads)
        # the statistics, summed like the loss: the loss cell's outputs after the loss
        loss, stats = (loss[0], loss[1:]) if self.loss_cell.has_stats else (loss, None)
        if self.grad_reducer is not None:
            grads, loss = self.grad_reducer(grads, loss)
        # Gradients are summed over micro-batches and ranks and loss-scaled until here.
        inv = 1.0 / (scale * self.accum_steps * self.world)

        # One read of the raw gradients gives the norm; a NaN/Inf anywhere makes it non-finite,
        # so no separate all-finite pass is needed. Unscaling and clipping are one coefficient
        # the optimizer applies as it reads the gradients.
        if self.sharded:
            norm = self.grad_reducer.norm(grads, self.sum_of_squares) * inv
        else:
            norm = global_norm(grads, self.sum_of_squares) * inv
        finite = ops.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.adjust(finite)
        coef = inv
        if self.grad_clip > 0:
            coef = coef * ops.minimum(self.grad_clip / (norm + 1e-6), 1.0)
        if not (self.grad_clip > 0 or self.loss_scaler is not None or self.accum_steps * self.world > 1):
            coef = None  # nothing to multiply by
        if finite:  # noqa: GL101 (a run-time branch on purpose: a non-finite step skips the update)
            lr = self.optimizer(grads, coef)
        else:
            lr = ops.zeros((), ms.float32)
        if stats is not None:
            stats = hyper_map(ops.partial(_times, 1.0 / self.accum_steps), stats)
            if self.stats_reducer is not None:  # after the gradients' all-reduce: one order on every rank
                stats = (self.stats_reducer(stats[0], loss),) + stats[1:]
            if self.after_update is not None:  # a MoE model's: its routing loads come first
                self.after_update(stats[0], finite, lr)
            return (loss * inv, norm, lr, finite, scale) + stats
        return loss * inv, norm, lr, finite, scale


class EvalStep(nn.Cell):
    """The loss of a batch (under context parallel: every rank of the cp group runs it, each gets the
    whole sequence's loss); of an MTP model, the next-token loss alone (without the depths' term)."""

    def __init__(self, model, fused: bool = False, loss_cell=None):
        super().__init__(auto_prefix=False)
        self.loss_cell = LossCell(model, fused) if loss_cell is None else loss_cell
        self.reference = getattr(self.loss_cell, "reference", None)
        self.mtp_weight = getattr(self.loss_cell, "mtp_weight", 0.0)

    def construct(self, tokens, *sft):
        if self.reference is not None:
            sft = sft + (self.reference(tokens, *sft),)
        out = self.loss_cell(tokens, 1.0, *sft)
        loss = out[0] if self.loss_cell.has_stats else out
        if self.mtp_weight > 0:  # its last output: the depths' losses
            loss = loss - self.mtp_weight * ops.mean(out[-1])
        return self.loss_cell.model.sequence_mean(loss)
