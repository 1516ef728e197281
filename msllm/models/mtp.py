"""Multi-token prediction (DeepSeek-V3 report §2.2; GLM-4.5 has the same module): depth k predicts the token
k + 1 ahead of each position from depth k-1's states and the embedding of the token k ahead, keeping the
causal chain. The decoder holds the depths (`Decoder.mtp`) and runs them (`Decoder.predict_ahead`); the
train step adds their losses (msllm.train.step.LossCell). Embedding and output head are the model's own.

The embedding comes first in the joint projection, as the checkpoints' eh_proj holds it (Megatron-Core and
MindFormers concatenate [enorm(embedding), hnorm(states)]); a depth's output is normed once, and that normed
state both goes through the shared head and feeds the next depth, as Megatron-Core chains them.
"""
from __future__ import annotations

from mindspore import nn, ops

from msllm.config import ModelConfig
from msllm.models.layers import Linear, RMSNorm


class MTPDepth(nn.Cell):
    """One depth: states h [N, hidden] (depth k-1's, final-normed) and embeddings [N, hidden] of the tokens k
    ahead -> this depth's final-normed states [N, hidden]. `block`: a decoder Block built like the model's last
    layer (its mixer and MLP kinds), which the decoder passes in (this module does not build blocks)."""

    def __init__(self, cfg: ModelConfig, block: nn.Cell):
        super().__init__()
        h, eps, offset = cfg.hidden_size, cfg.norm_eps, cfg.norm_offset
        self.enorm = RMSNorm(h, eps, offset)
        self.hnorm = RMSNorm(h, eps, offset)
        self.eh_proj = Linear(2 * h, h)
        self.layer = block
        self.norm = RMSNorm(h, eps, offset)

    def construct(self, h, embedded, cos, sin, mask):
        x = self.eh_proj(ops.concat((self.enorm(embedded), self.hnorm(h)), -1))
        return self.norm(self.layer(x, cos, sin, mask)[0])
