"""CPU specialisation of a built Llama: formulations MindSpore's CPU backend runs fast, the fused
C++ kernels (msllm.kernels), pre-broadcast tables and block-graph sharing. Same maths as the
plain model in msllm/models/llama.py; docs/cpu-backend.md says why each one is faster.

Only parameter-free Cells are swapped (norm cores, rope, softmax-attention, activation), so the
weights stay where they are and a model can be re-specialised for inference after training.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from msllm.models import llama, moe
from msllm.models.layouts import BLOCK_ROWS, GROUPED_BLOCK_ROWS
from msllm.models.llama import cast, split_heads
from msllm.models.mla import MLA


class RMSNormCore(llama.RMSNormCore):
    """The norm with two skinny MatMuls, so every element-wise op is same-shape: the row sum of
    squares is (x*x) @ ones and the per-element scale is rsqrt(..) @ weight, an outer product.
    The CPU kernels run a broadcasting multiply ([N, h] * [N, 1]) several times slower than a
    same-shape one."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.inv_dim = 1.0 / dim
        self.ones = Tensor(np.ones((dim, 1), np.float32))
        self.matmul = ops.MatMul()

    def construct(self, x, weight):
        inv_rms = ops.rsqrt(self.matmul(x * x, self.ones) * self.inv_dim + self.eps)  # [N, 1]
        return x * self.matmul(inv_rms, weight.reshape(1, self.dim))                  # scale [N, h]


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R = concat(-x[half:], x[:half]): HF's rotate_half as a signed permutation."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


class Rope(llama.Rope):
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


class SoftmaxAttention(llama.SoftmaxAttention):
    """The attention core with a hand-written backward.

    Autodiff differentiates the softmax on the [.., s, t] probabilities (a multiply, a row sum, a
    subtract and a multiply over the whole score matrix). This backward uses
    rowsum(dP * P) = rowsum(dO * O), a row sum over head_dim instead of over t (as FlashAttention
    does), and folds the subtraction into the dP matmul.
    """

    def __init__(self, num_heads: int, num_kv_heads: int):
        super().__init__(num_heads, num_kv_heads)
        self.pt_x = ops.BatchMatMul(transpose_a=True)  # dv = P^T dO, dk = dS^T q

    def scores_grad(self, p, do, o, v):
        """dS = P * (dP - delta), delta = rowsum(dO * O); p [b, nkv, rows, t], do/o [b, nkv, rows, d]."""
        delta = ops.sum(cast(do, ms.float32) * cast(o, ms.float32), -1, keepdim=True)
        # dP - delta as one matmul, [dO, delta] @ [v, -1]^T: a broadcast subtract over the
        # [.., rows, t] matrix costs more than a same-shape element-wise op on CPU.
        minus_one = ops.full(v.shape[:-1] + (1,), -1.0, dtype=v.dtype)
        dp = self.qk(ops.concat((do, cast(delta, do.dtype)), -1), ops.concat((v, minus_one), -1))
        return p * cast(dp, ms.float32)

    def bprop(self, q, k, v, mask, out, dout):
        o, probs = out
        b, _, s, d = q.shape
        t, dv = k.shape[2], v.shape[-1]  # value heads may differ from q/k heads (MLA)
        rows = self.rep * s
        do = dout[0].reshape(b, self.num_kv_heads, rows, dv)
        p = probs.reshape(b, self.num_kv_heads, rows, t)
        dv = self.pt_x(cast(p, v.dtype), do)
        ds = cast(self.scores_grad(p, do, o.reshape(b, self.num_kv_heads, rows, -1), v), q.dtype)
        dq = self.pv(ds, k).reshape(q.shape)
        dk = self.pt_x(ds, q.reshape(b, self.num_kv_heads, rows, d))
        return dq, dk, dv, ops.zeros_like(mask)


class VisibilityIndices(nn.Cell):
    """Llama.attention_mask for a flash core: the visibility indices as they are, no [s, t] mask."""

    def construct(self, visibility, b: int):
        return visibility


def specialise(model: llama.Llama, *, fused: bool, share_blocks: bool, training: bool,
               per_sample_tables: bool = False, flash: bool = False) -> None:
    """Swap the CPU formulations into `model` in place.

    fused: msllm.kernels' one-pass C++ ops (they take fixed shapes and, except the norm, fp32
    activations). Training uses all of them; inference (fp32) the norm, rope, SwiGLU and softmax
    ones (fewer kernel launches per decode step), the few-rows linear of decode steps and the
    KV-cache write.
    share_blocks: every layer calls one compiled block graph (training only; export needs the
    blocks inlined). Tables are pre-broadcast for training without the fused rope / softmax,
    which read the [s, d] and [s, s] tables per row. per_sample_tables (packed SFT samples:
    positions and masks differ per row) keeps the rope and softmax on the CPU formulations, which
    broadcast any table; the fused norm, activation and optimizer still apply.
    flash: the attention core is msllm.kernels.FlashAttention (needs the kernels), which reads the
    visibility indices: no [s, t] mask, score or probability tensor, training or inference.
    """
    fp32 = model.compute_dtype == ms.float32
    decode_kernels = fused and fp32 and not training
    fused = fused and training
    fused_fp32 = fused and fp32
    fused_tables = fused_fp32 and not per_sample_tables
    if fused or decode_kernels or flash:
        from msllm import kernels
    grouped_kernel = fused_fp32 and kernels.has_sgemm()
    if decode_kernels:  # one-token decode steps: a matmul of a few rows reads each weight once
        model.lm_matmul = kernels.LinearFewRows()
    for cell in [cell for _, cell in model.cells_and_names()]:
        if isinstance(cell, llama.RMSNorm):  # normalises in fp32 whatever the compute dtype
            cell.core = (kernels.FusedRMSNormCore(cell.eps) if fused or decode_kernels
                         else RMSNormCore(cell.dim, cell.eps))
        elif isinstance(cell, (llama.Attention, MLA)):
            cell.rope = kernels.FusedRope() if fused_tables or decode_kernels else Rope(cell.rope.head_dim)
            if decode_kernels and isinstance(cell, llama.Attention):  # the kernel's keys and values are one size,
                cell.cache_write = kernels.FusedCacheWrite()                  # MLA's latents and rope keys are not
        elif isinstance(cell, llama.AttentionCore):
            n, kv = cell.softmax_attention.num_heads, cell.softmax_attention.num_kv_heads
            if flash:
                cell.softmax_attention = kernels.FlashAttention(n, kv)
            else:
                cell.softmax_attention = (kernels.FusedSoftmaxAttention(n, kv) if fused_tables or decode_kernels
                                          else SoftmaxAttention(n, kv))
        elif isinstance(cell, (llama.FeedForward, moe.Experts)):
            geglu = cell.activation == "geglu_tanh"
            if fused_fp32 or decode_kernels:
                cell.act = kernels.FusedGeGLU() if geglu else kernels.FusedSwiGLU()
            else:
                cell.act = llama.GeGLU() if geglu else llama.SwiGLU()
            if isinstance(cell, moe.Experts):  # BlockDispatch's blocks: each expert's weights read once
                cell.grouped = kernels.GroupedMatmul() if grouped_kernel else moe.GatheredMatmul()
        elif isinstance(cell, moe.BlockDispatch):  # the kernel needs no big blocks: it gathers no weights
            cell.block = GROUPED_BLOCK_ROWS if grouped_kernel else BLOCK_ROWS
        elif isinstance(cell, llama.Linear) and decode_kernels:
            cell.matmul = kernels.LinearFewRows()
    model.broadcast_tables = training and not fused_tables
    if flash:
        model.attention_mask = VisibilityIndices()
    else:
        model.attention_mask = llama.AdditiveMask(model.cfg.num_heads, model.cfg.num_kv_heads)
        model.attention_mask.broadcast = model.broadcast_tables
    for block in model.layers:
        block.no_inline = share_blocks and training
