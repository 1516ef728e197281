"""CPU specialisation of a built Decoder: formulations MindSpore's CPU backend runs fast, the fused
C++ kernels (msllm.kernels), pre-broadcast tables and block-graph sharing. Same maths as the
plain model (msllm/models/); docs/cpu-backend.md says why each one is faster.

Only parameter-free Cells are swapped (norm cores, rope, softmax-attention, activation), so the
weights stay where they are and a model can be re-specialised for inference after training.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from msllm import kernels
from msllm.models import decoder, layers, moe

from msllm.rules import BLOCK_ROWS, GROUPED_BLOCK_ROWS
from msllm.models.layers import cast, offset_scale, split_heads
from msllm.models.mixers import attention
from msllm.models.mixers.gated_deltanet import ChunkedGatedDeltaRule, GatedDeltaNet, ShiftedTaps
from msllm.models.mixers.mla import MLA


class RMSNormCore(layers.RMSNormCore):
    """The norm with two skinny MatMuls, so every element-wise op is same-shape: the row sum of
    squares is (x*x) @ ones and the per-element scale is rsqrt(..) @ weight, an outer product.
    The CPU kernels run a broadcasting multiply ([N, h] * [N, 1]) several times slower than a
    same-shape one."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__(dim, eps, offset)
        self.inv_dim = 1.0 / dim
        self.ones = Tensor(np.ones((dim, 1), np.float32))
        self.matmul = ops.MatMul()

    def construct(self, x, weight):
        inv_rms = ops.rsqrt(self.matmul(x * x, self.ones) * self.inv_dim + self.eps)  # [N, 1]
        return x * self.matmul(inv_rms, offset_scale(weight, self.offset).reshape(1, self.dim))  # scale [N, h]


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R = concat(-x[half:], x[:half]): HF's rotate_half as a signed permutation."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


class Rope(layers.Rope):
    """Rotate-half as one small MatMul with a signed permutation (exact in any float dtype),
    instead of slice + negate + concat and their gradients."""

    def __init__(self, head_dim: int):
        super().__init__(head_dim)
        self.rotate = Tensor(rotate_half_matrix(head_dim))
        self.matmul = ops.MatMul()

    def construct(self, x, cos, sin):
        x = split_heads(x, self.head_dim, cos.shape[-2])
        rotated = self.matmul(x.reshape(-1, self.head_dim), cast(self.rotate, x.dtype)).reshape(x.shape)
        return x * cos + rotated * sin


class VisibilityIndices(nn.Cell):
    """Decoder.attention_mask for a flash core: the visibility indices as they are, no [s, t] mask."""

    def construct(self, visibility, b: int):
        return visibility


def specialise(model: decoder.Decoder, *, fused: bool, share_blocks: bool, training: bool,
               flash: bool = False) -> None:
    """Swap the CPU formulations into `model` in place.

    fused: msllm.kernels' one-pass C++ ops (they take fixed shapes and, except the norm, fp32
    activations). Training uses all of them; inference (fp32) the norm, rope, SwiGLU and softmax
    ones (fewer kernel launches per decode step), the few-rows linear of decode steps (a layer's
    projections of one input in one kernel), the
    KV-cache write, the gated delta rule with its causal conv, a Gated DeltaNet layer's whole
    decode-step recurrence as one kernel, with the flash core an attention layer's RoPE, cache write and
    core over caches written in place as one kernel, a cached forward's rope tables and visibility as one, a
    block's attention residual add with the MLP's pre-norm as one, and a decode step's SwiGLU with w2 as one.
    share_blocks: every layer calls one compiled block graph (training only; export needs the
    blocks inlined). Tables are pre-broadcast for training without the fused rope / softmax,
    which read the [s, d] and [s, t] tables per row, or a row's own [1, s, d] and [1, s, t] ones
    where positions and masks differ per row (packed samples, DPO branches).
    flash: the attention core is msllm.kernels.FlashAttention (SinkFlashAttention with sinks; needs the
    kernels), which reads the visibility indices: no [s, t] mask, score or probability tensor, training or
    inference.
    """
    fp32 = model.compute_dtype == ms.float32
    decode_kernels = fused and fp32 and not training
    fused = fused and training
    fused_fp32 = fused and fp32
    fused_tables = fused_fp32
    grouped_kernel = fused_fp32 and kernels.has_sgemm()
    if decode_kernels:  # one-token decode steps: a matmul of a few rows reads each weight once
        model.lm_matmul = kernels.LinearFewRows()
    for cell in [cell for _, cell in model.cells_and_names()]:
        if isinstance(getattr(cell, "project", None), layers.Projections):  # a layer's projections of one input
            cell.project = kernels.ProjectionsFewRows() if decode_kernels else layers.Projections()
        if isinstance(cell, layers.RMSNorm):  # normalises in fp32 whatever the compute dtype
            cell.core = (kernels.FusedRMSNormCore(cell.eps, cell.offset) if fused or decode_kernels
                         else RMSNormCore(cell.dim, cell.eps, cell.offset))
        elif isinstance(cell, (attention.Attention, MLA)):
            rope = cell.rope  # layers.Rope, or what an earlier specialise swapped in: each tells head_dim and rope_dim
            if fused_tables or decode_kernels:
                cell.rope = kernels.FusedRope(rope.head_dim, rope.rope_dim)
            else:  # the rotation matrix turns whole heads: a partial RoPE keeps the portable Cell
                cell.rope = (Rope(rope.head_dim) if rope.rope_dim == rope.head_dim
                             else layers.Rope(rope.head_dim, rope.rope_dim))
            if decode_kernels and isinstance(cell, attention.Attention):  # the kernel's keys and values are one size,
                cell.cache_write = kernels.FusedCacheWrite()                  # MLA's latents and rope keys are not
            if isinstance(cell, attention.Attention):  # a cached step's rope, cache write and flash core: one kernel
                heads = (cell.num_heads, cell.num_kv_heads, cell.head_dim)
                one_kernel = decode_kernels and flash and not isinstance(cell.core, layers.SinkAttentionCore)
                cell.attend = kernels.CachedAttend(*heads, cell.core.scale) if one_kernel else layers.Attend(*heads)
        elif isinstance(cell, layers.AttentionCore):
            n, kv = cell.softmax_attention.num_heads, cell.softmax_attention.num_kv_heads
            sinks = isinstance(cell, layers.SinkAttentionCore)
            if flash:
                cell.softmax_attention = (kernels.SinkFlashAttention if sinks else kernels.FlashAttention)(n, kv)
            elif sinks:
                cell.softmax_attention = (kernels.FusedSinkSoftmaxAttention(n, kv) if fused_tables or decode_kernels
                                          else layers.SinkSoftmaxAttention(n, kv))
            else:
                cell.softmax_attention = (kernels.FusedSoftmaxAttention(n, kv) if fused_tables or decode_kernels
                                          else kernels.SoftmaxAttention(n, kv))
        elif isinstance(cell, (layers.FeedForward, moe.Experts)):
            geglu = cell.activation == "geglu_tanh"
            if cell.activation == "swiglu_clamped":  # alpha and limit as the activation in place holds them
                clamped = kernels.FusedClampedSwiGLU if fused_fp32 or decode_kernels else layers.ClampedSwiGLU
                cell.act = clamped(cell.act.alpha, cell.act.limit)
            elif fused_fp32 or decode_kernels:
                cell.act = kernels.FusedGeGLU() if geglu else kernels.FusedSwiGLU()
            else:
                cell.act = layers.GeGLU() if geglu else layers.SwiGLU()
            if isinstance(cell, layers.FeedForward):  # a decode step's SwiGLU and w2: one kernel
                cell.down = kernels.SwiGLUFewRows() if decode_kernels else layers.ActivatedLinear()
            if isinstance(cell, moe.Experts):  # BlockDispatch's blocks: each expert's weights read once
                cell.grouped = kernels.GroupedMatmul() if grouped_kernel else moe.GatheredMatmul()
        elif isinstance(cell, GatedDeltaNet):  # the rule runs in fp32 whatever the compute dtype
            chunk = cell.rule.chunk
            cell.rule = (kernels.GatedDeltaRule(chunk, training) if fused or decode_kernels
                         else ChunkedGatedDeltaRule(chunk, cell.value_heads_per_key))
            for conv in (cell.conv_q, cell.conv_k, cell.conv_v):
                conv.core = kernels.FusedCausalConv() if fused or decode_kernels else ShiftedTaps()
            cell.gate = kernels.FusedSwiGLU() if fused or decode_kernels else layers.SwiGLU()  # fp32 in the mixer
            cell.decode_step = kernels.GatedDeltaStep() if decode_kernels else None  # one kernel, not ~30
        elif isinstance(cell, moe.BlockDispatch):  # the kernel needs no big blocks: it gathers no weights
            cell.block = GROUPED_BLOCK_ROWS if grouped_kernel else BLOCK_ROWS
        elif isinstance(cell, layers.Linear) and decode_kernels:
            cell.matmul = kernels.LinearFewRows()
    model.cached_tables = kernels.FusedCacheTables() if decode_kernels else layers.CacheTables()
    model.broadcast_tables = training and not fused_tables
    if flash:
        model.attention_mask = VisibilityIndices()
    else:
        model.attention_mask = layers.AdditiveMask(model.cfg.num_heads, model.cfg.num_kv_heads)
        model.attention_mask.broadcast = model.broadcast_tables
        model.attention_mask.broadcast_rows = not (fused_tables or decode_kernels)  # the fused softmax reads rows
    for block in model.blocks():
        block.no_inline = share_blocks and training
        block.residual_norm = kernels.FusedResidualNorm() if decode_kernels else layers.ResidualNorm()
