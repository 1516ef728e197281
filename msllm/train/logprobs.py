"""Per-token log-probabilities of a model's next tokens, through the loss's head path (msllm.train.step.LossCell):
the model's projection while the logits fit layers.HEAD_CHUNK_BYTES, else the fused head kernel's
target - logsumexp, so no [tokens, vocab] log-softmax exists when the kernel is on. DPO sums them over
completions (msllm.train.dpo), GRPO weighs them per token (msllm.train.grpo). Given head rows
(msllm.data.loader.head_rows: the completion positions, padded to a capacity), only those positions'
hidden states go through the head, as the SFT loss does.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from msllm.models.layers import cast, fits_whole
from msllm.train.step import fused_head


class TokenLogProbs(nn.Cell):
    """tokens [n, s+1](, rows [n, C/n], segments, positions [n, s]) -> [n, s] fp32: log p(next token) of
    logits / temperature at every position, or with rows (C distinct flat indices into the n*s positions)
    at those C and 0 elsewhere. Segments and positions: the rows' samples (Decoder.sample_tables)."""

    def __init__(self, model, fused: bool = False, temperature: float = 1.0):
        super().__init__(auto_prefix=False)
        self.model, self.temperature = model, temperature
        self.head = fused_head(model, fused)

    def construct(self, tokens, rows=None, segments=None, positions=None):
        labels = tokens[:, 1:].reshape(-1)
        h, _ = self.model.features(tokens[:, :-1], segments, positions)
        count = labels.shape[0]
        gathered = rows is not None and rows.size < count
        if gathered:  # only the positions with a loss reach the head
            rows = rows.reshape(-1)
            h, labels = ops.gather(h, rows, 0), ops.gather(labels, rows, 0)
        if self.temperature != 1.0:  # (h W^T) / T = (h / T) W^T: the head path stays the same
            h = h / self.temperature
        if self.head is None or fits_whole(h.shape[0], self.model.cfg.vocab_size):
            # fp32 as the cross-entropy's (layers.CausalLMLoss): an fp16 log-softmax would round each log-prob
            # at its full magnitude. LogSoftmax, not logsumexp: MindSpore 2.10's CPU Log kernel rounds by how a
            # launch splits it over threads, which varies over a graph's first launches (a resume would differ)
            logits = cast(self.model.project(h), ms.float32).reshape(labels.shape[0], -1)
            logps = ops.gather_elements(ops.log_softmax(logits, -1), 1, labels.reshape(-1, 1)).reshape(-1)
        else:
            lse, target = self.head(h, self.model.head_weight(), labels)
            logps = target - lse
        if gathered:  # back in place (the rows are distinct: the scatter's gradient is the gather)
            logps = ops.scatter_nd(rows.reshape(-1, 1), logps, (count,))
        return logps.reshape(tokens.shape[0], -1)
