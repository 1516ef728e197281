"""Ascend: the layout table (msllm/layout/table.py) applied through MindSpore 2.10's
semi-auto parallel, and the Ascend execution profile checked against the config.

    specialise(model, cfg, flash)                # FlashAttentionScore per layer, shardable norm cores,
                                                 # op layouts, pipeline stages
    use_vocab_parallel_loss(causal_lm_loss, cfg) # the loss reduces across vocab shards
    loss_net = micro_batches(loss_cell, cfg)     # Pipeline / GradAccumulation over parallel.micro_batches
    net = parallel_wrapper(train_step, cfg, strategy_file(run_dir, rank))

Generated here, executed only on Ascend (none was available to this project: tools/dryrun_ascend.sh
compiles it with MindSpore's simulation for users with CANN). On a stand-alone CPU graph
Primitive.shard and pipeline_stage are accepted and ignored, which is how the tests check what
this module produces. FlashAttentionScore does not run on CPU at all: its Cells are built and
inspected there, never called.
"""
from __future__ import annotations

import fnmatch
import shutil
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Layout, Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from msllm.config import Config
from msllm.layout import table as L
from msllm.layout.check import check_execution
from msllm.models.layers import AdditiveMask, HeadNorm, RMSNorm, SoftmaxAttention, offset_scale
from msllm.models.moe import GroupedCapacityDispatch
from msllm.rules import COMPRESSED_MASK

# semi_auto: every primitive the table names carries its layout; MindSpore derives the weights'
# slices from them and inserts the collectives.
PARALLEL_MODE = "semi_auto"


class RMSNormCore(nn.Cell):
    """x [N, h] fp32, weight [h] -> x * rsqrt(mean(x^2) + eps) * (offset + weight), each step its own primitive
    so sequence parallel can cut the rows (layouts._NORM_OPS). Same maths as llama.RMSNormCore."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.offset = offset
        self.eps = Tensor(np.full((1, 1), eps, np.float32))
        self.square, self.mean, self.add = ops.Square(), ops.ReduceMean(keep_dims=True), ops.Add()
        self.rsqrt, self.scale, self.weigh = ops.Rsqrt(), ops.Mul(), ops.Mul()

    def construct(self, x, weight):
        return self.weigh(self.scale(x, self.rsqrt(self.add(self.mean(self.square(x), -1), self.eps))),
                          offset_scale(weight, self.offset))


class HeadRMSNormCore(RMSNormCore):
    """RMSNormCore over each head: x [N, heads, d] (HeadNorm.heads_axis), heads cut as the q or k
    projection's columns are (layouts._HEAD_NORM_OPS), so each rank normalises its own heads."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__(dim, eps, offset)
        self.eps = Tensor(np.full((1, 1, 1), eps, np.float32))


class VocabParallelCrossEntropy(nn.Cell):
    """Mean cross-entropy of logits [N, vocab] cut over vocab (layouts.LOSS_OPS): the row max, the
    sum of exponentials and the target logit are reduced across shards, never the logits gathered.
    Drop-in for SparseSoftmaxCrossEntropyWithLogits (whose class axis MindSpore cannot split)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.row_max, self.row_sum, self.target_sum = ops.ReduceMax(True), ops.ReduceSum(True), ops.ReduceSum(True)
        self.shift, self.minus, self.exp, self.log = ops.Sub(), ops.Sub(), ops.Exp(), ops.Log()
        self.one_hot, self.pick, self.mean = ops.OneHot(), ops.Mul(), ops.ReduceMean()
        self.on, self.off = Tensor(np.float32(1.0)), Tensor(np.float32(0.0))

    def construct(self, logits, labels):
        shifted = self.shift(logits, ops.stop_gradient(self.row_max(logits, -1)))  # softmax is shift-invariant
        log_z = self.log(self.row_sum(self.exp(shifted), -1))
        target = self.target_sum(self.pick(shifted, self.one_hot(labels, self.vocab_size, self.on, self.off)), -1)
        return self.mean(self.minus(log_z, target))


# ---- FlashAttentionScore -------------------------------------------------------------------------

SPARSE_CAUSAL, SPARSE_BAND = 2, 4   # FlashAttentionScore's leftUpCausal and band sparse modes
RING_SPARSE_MODE = 0                # ring attention's: the pass builds each ring step's mask
PACKED_SPARSE_MODE = 3              # rightDownCausal, per sample of the TND layout (MindFormers' choice for it)
UNBOUNDED = 2**31 - 1               # pre_tokens / next_tokens without a limit (the primitive's default)


def flash_form(window: int) -> tuple[int, int, int]:
    """(sparse_mode, pre_tokens, next_tokens) of FlashAttentionScore for an attention kind's window
    (msllm.models.llama.visibility): 0, causal: sparse mode 2 (the lower triangle from the top
    left; pre/next tokens unused). w > 0, causal within the last w keys: band mode 4, query i sees
    keys i - pre_tokens .. i + next_tokens, so pre_tokens = w - 1 and next_tokens = 0. Both read
    the compressed [2048, 2048] mask. Training runs s = t, where the top-left and bottom-right
    corners MindSpore counts the modes from coincide."""
    if window:
        return SPARSE_BAND, window - 1, 0
    return SPARSE_CAUSAL, UNBOUNDED, 0


def compressed_causal_mask() -> np.ndarray:
    """[2048, 2048] uint8, 1 above the diagonal (masked): the table sparse modes 2 / 3 / 4 read."""
    return np.triu(np.ones((COMPRESSED_MASK, COMPRESSED_MASK), np.uint8), 1)


class CompressedCausalMask(nn.Cell):
    """Decoder.attention_mask for FlashAttentionScore: every attention kind gets the one compressed
    causal mask; no [s, t] mask is built. Causal order and the window are each layer's sparse mode
    (flash_form, fixed when specialising). Packed samples take SampleEnds instead."""

    def __init__(self):
        super().__init__()
        self.table = Tensor(compressed_causal_mask())

    def construct(self, visibility, b: int):
        return self.table


class SampleEnds(CompressedCausalMask):
    """Decoder.attention_mask for packed samples on FlashAttentionScore's TND layout: (the compressed
    causal mask, ends [b * t] int64), where the row's samples end. A row's samples are its runs of
    equal key segment; ends lists, for each row, the slot after each sample's last token, then t
    for the rest of the row's t entries (empty samples: a row holds at most t samples), offset by
    the rows before it in the same data-parallel shard: `rows_per_shard` = sequences per replica
    and micro-batch. Each rank's slice of ends (cut over dp with its rows) is then what the kernel
    reads as actual_seq_qlen / actual_seq_kvlen of its own rows: MindSpore rebases these only when
    the sequence itself is cut, not the batch (flash_attention_score_info.cc), and MindFormers feeds
    its TND layout per-rank offsets the same way."""

    def __init__(self, rows_per_shard: int):
        super().__init__()
        self.rows_per_shard = rows_per_shard

    def construct(self, visibility, b: int):
        _, _, segments, _ = visibility                                                  # [b, t]
        t = segments.shape[-1]
        ends_here = ops.concat((segments[:, :-1] != segments[:, 1:], ops.ones((b, 1), ms.bool_)), 1).astype(ms.int32)
        ended_before = ops.cumsum(ends_here, 1) - ends_here                             # samples ended before each slot
        sample = ops.broadcast_to(ops.arange(0, t, dtype=ms.int32).reshape(1, t), (b, t))
        ends = ops.searchsorted(ended_before, sample, right=True)                       # [b, t] int64
        offset = (ops.arange(0, b, dtype=ms.int64) % self.rows_per_shard) * t
        return self.table, (ends + offset.reshape(b, 1)).reshape(-1)


class FlashAttention(nn.Cell):
    """(out, softmax_max) = FlashAttentionScore(q, k, v): the same call as llama.SoftmaxAttention,
    whose place it takes. q [b, nh, s, d] already scaled (scale_value 1.0), k / v [b, nkv, t, d] in
    fp16 / bf16 (the primitive takes nothing else), mask: CompressedCausalMask's table. BNSD layout;
    GQA is native (nkv divides nh), so K/V are not repeated, except kv_copies > 1: a layout with
    fewer KV heads than tp (tp_rep = kv_copies) repeats each KV head so that K/V heads are cut
    exactly as the query heads (layouts.OPS, repeat_kv). `window`: the layer's sliding window
    (0: none), a compile-time sparse mode (flash_form).

    ring (context parallel): MindSpore's ring attention, whose parallel pass passes K/V chunks around
    the cp group and builds each step's causal mask itself; it takes sparse mode 0 and no mask (the
    form MindSpore's own ring tests compile). Causal only: the checker refuses windows under cp.

    packed (packed samples): the primitive in its TND layout (`varlen`, CANN's variable-length form):
    q, k, v as [b*s, heads, d] rows, causal within each sample (sparse mode 3 per sample), the samples
    delimited by SampleEnds' ends (mask = (table, ends)). Causal only: the checker refuses windows.

    value_pad > 0 (MLA, value heads smaller than q/k heads): the primitive takes one head size for q, k and
    v, so V gets value_pad zero features (pad_v, a Concat) and the output's last value_pad features, which
    are those zeros' weighted sums, are sliced off (value_part): out = P [V, 0] = [P V, 0]."""

    def __init__(self, num_heads: int, num_kv_heads: int, window: int = 0, kv_copies: int = 1, ring: bool = False,
                 packed: bool = False, value_pad: int = 0):
        super().__init__()
        self.value_pad = value_pad
        if value_pad:
            self.pad_v, self.value_part = ops.Concat(-1), ops.StridedSlice()
        self.num_heads, self.num_kv_heads, self.window, self.kv_copies = num_heads, num_kv_heads, window, kv_copies
        self.ring, self.packed = ring, packed
        if packed:
            self.varlen = FlashAttentionScore(head_num=num_heads, keep_prob=1.0, scale_value=1.0,
                                              input_layout="TND", sparse_mode=PACKED_SPARSE_MODE)
        else:
            sparse_mode, pre_tokens, next_tokens = (RING_SPARSE_MODE, UNBOUNDED, UNBOUNDED) if ring else \
                flash_form(window)
            self.flash = FlashAttentionScore(head_num=num_heads, keep_prob=1.0, scale_value=1.0, pre_tokens=pre_tokens,
                                             next_tokens=next_tokens, input_layout="BNSD", sparse_mode=sparse_mode)
            if ring:
                self.flash.add_prim_attr("enable_ring_attention", True)
                self.flash.add_prim_attr("enable_ra_send_recv", True)  # K/V pass by Send / Receive, as MindFormers
        if kv_copies > 1:
            self.repeat_kv = ops.Mul()
            self.copies = Tensor(np.ones((1, 1, kv_copies, 1, 1), np.float32))

    def repeat(self, x):
        b, n, t, d = x.shape
        copies = self.repeat_kv(x.reshape(b, n, 1, t, d), self.copies.astype(x.dtype))  # [b, n, kv_copies, t, d]
        return copies.reshape(b, n * self.kv_copies, t, d)

    def construct(self, q, k, v, mask):
        if not self.value_pad:
            return self.attend(q, k, v, mask)
        zeros = ops.zeros(v.shape[:-1] + (self.value_pad,), v.dtype)
        out, softmax_max = self.attend(q, k, self.pad_v((v, zeros)), mask)
        b, n, s, d = out.shape
        return self.value_part(out, (0, 0, 0, 0), (b, n, s, d - self.value_pad), (1, 1, 1, 1)), softmax_max

    def attend(self, q, k, v, mask):
        if self.kv_copies > 1:
            k, v = self.repeat(k), self.repeat(v)
        if self.packed:
            return self.samples(q, k, v, mask)
        if self.ring:
            mask = None
        softmax_max, _, _, out = self.flash(q, k, v, None, None, None, mask, None, None, None)
        return out, softmax_max

    def samples(self, q, k, v, mask):
        """Packed samples: BNSD -> TND rows, the variable-length call, and back."""
        table, ends = mask
        b, n, s, d = q.shape
        rows = lambda x: x.transpose(0, 2, 1, 3).reshape(b * s, x.shape[1], d)  # noqa: E731
        softmax_max, _, _, out = self.varlen(rows(q), rows(k), rows(v), None, None, None, table, None, ends, ends)
        return out.reshape(b, s, n, d).transpose(0, 2, 1, 3), softmax_max


def use_flash_attention(model, cfg: Config, packed: bool = False) -> int:
    """Swap every layer's attention core for FlashAttention with that layer's window (ring attention
    under context parallel; the TND form for packed samples; MLA's value heads zero-padded to its q/k
    heads), and the model's attention_mask for the compressed causal mask (with packed samples, and their
    ends). Returns the layers swapped."""
    m, p = cfg.model, cfg.parallel
    sh = L.sharding(m, p)
    for i, block in enumerate(model.layers):
        core = block.attention.core.softmax_attention
        window = model.windows[model.layer_kind[i]]
        block.attention.core.softmax_attention = FlashAttention(core.num_heads, core.num_kv_heads, window, sh.tp_rep,
                                                                ring=sh.cp > 1, packed=packed,
                                                                value_pad=m.head_size - m.value_size)
    model.attention_mask = SampleEnds(cfg.train.batch_size // p.micro_batches) if packed else CompressedCausalMask()
    return len(model.layers)


def use_portable_attention(model) -> int:
    """Generation with a model use_flash_attention specialised for training (the end-of-run sample): every
    FlashAttention core back to the portable softmax core, and the decoder's additive mask back. The flash
    forms take one whole sequence from slot 0 (a band, the compressed causal mask, packed ends); a decode
    step's [s, t] mask is none of them: slots not written yet, left padding, and a sliding layer's ring
    read in slot order (Decoder.ring_slots). Returns the layers swapped back."""
    swapped = 0
    for block in model.layers:
        core = block.attention.core
        if isinstance(core.softmax_attention, FlashAttention):
            flash = core.softmax_attention
            core.softmax_attention = SoftmaxAttention(flash.num_heads, flash.num_kv_heads)
            swapped += 1
    if swapped:
        model.attention_mask = AdditiveMask(model.cfg.num_heads, model.cfg.num_kv_heads)
    return swapped


# ---- layouts -------------------------------------------------------------------------------------

def mesh(sh: L.Sharding, flat: bool = False) -> Layout:
    """The device mesh (dp, tp_kv, tp_rep) (with expert parallel (dp / ep, ep, tp_kv, tp_rep), with
    context parallel (dp, cp, tp_kv, tp_rep)), or for `flat` ops (dp, [cp,] tp): the same ranks in the
    same order."""
    return Layout(sh.flat_mesh, sh.flat_axes) if flat else Layout(sh.mesh, sh.mesh_axes)


def ms_layout(device_mesh: Layout, sh: L.Sharding, layout: tuple, flat: bool = False):
    """A table layout as a MindSpore tensor layout: per dim "None", one mesh axis, or a tuple of them."""
    dims = sh.dims(layout, flat)
    return device_mesh(*["None" if not axes else axes[0] if len(axes) == 1 else axes for axes in dims])


def _shard(prim, sh, op: L.Op):
    device_mesh = mesh(sh, op.flat)
    ins = tuple(ms_layout(device_mesh, sh, layout, op.flat) for layout in op.inputs)
    out = None
    if op.out is not None and sh.sequence_parallel:
        out = tuple(ms_layout(device_mesh, sh, layout, op.flat) for layout in op.out)
    prim.shard(ins, out)


def apply_layout(model, cfg: Config, flash: bool = False, packed: bool = False) -> dict[str, int]:
    """Set every table op's layout on `model`'s primitives (the attention core's rows: the softmax
    core's, or with `flash` FlashAttentionScore's, in its TND form with `packed`) and, with pp > 1,
    each Cell's pipeline_stage.
    Returns {op path: primitives set}; a required op the model lacks is an error (the table and
    the model disagree). The norm rows need use_shardable_norms first (specialise)."""
    m, p = cfg.model, cfg.parallel
    sh = L.sharding(m, p)
    cells = dict(model.cells_and_names())
    applied = {}
    for op in L.ops_for(m, sh.core(flash, packed)):
        found = [cells[name] for name in cells
                 if fnmatch.fnmatchcase(name, op.cell) and getattr(cells[name], op.prim, None) is not None]
        if not found and not op.optional:
            raise KeyError(f"{op.path}: the model has no such primitive; msllm/layout/table.py is out of date")
        for cell in found:
            _shard(getattr(cell, op.prim), sh, op)
        applied[op.path] = len(found)
    if p.pp > 1:
        for name, stage in L.stage_cells(m, p.pp).items():
            cells[name].pipeline_stage = stage
    return applied


def use_shardable_norms(model) -> int:
    """Swap each RMSNorm's core for RMSNormCore above (parameter-free, same maths); q / k norms
    normalise their [rows, heads, d] view with HeadRMSNormCore, so the heads axis can be cut."""
    norms = [cell for _, cell in model.cells_and_names() if isinstance(cell, RMSNorm)]
    for norm in norms:
        if isinstance(norm, HeadNorm):
            norm.heads_axis, norm.core = True, HeadRMSNormCore(norm.dim, norm.eps, norm.offset)
        else:
            norm.core = RMSNormCore(norm.dim, norm.eps, norm.offset)
    return len(norms)


def use_vocab_parallel_loss(loss, cfg: Config) -> bool:
    """Give a CausalLMLoss the vocab-parallel cross-entropy when the layout cuts the vocab."""
    sh = L.sharding(cfg.model, cfg.parallel)
    if not sh.vocab_split:
        return False
    loss.cross_entropy = VocabParallelCrossEntropy(cfg.model.vocab_size)
    for op in L.LOSS_OPS:
        _shard(getattr(loss.cross_entropy, op.prim), sh, op)
    return True


def use_expert_dispatch(model, cfg: Config) -> int:
    """With train.moe_capacity_factor, each MoE layer dispatches in GShard's one-hot form, one token
    group per data-parallel rank (msllm.models.moe.GroupedCapacityDispatch), whose primitives the
    table's MoE rows cut: under parallel.ep the experts' rows move between the ep group's ranks by the
    AllToAll semi-auto parallel inserts. Without a capacity the layer stays dropless (EveryExpert), its
    experts whole on every rank (the checker refuses ep then)."""
    factor, p = cfg.train.moe_capacity_factor, cfg.parallel
    if factor <= 0:
        return 0
    groups = L.dispatch_groups(p.dp, cfg.train.batch_size // p.micro_batches * cfg.data.seq_len)
    routed = [block.feed_forward for block in model.layers if block.routed]
    for moe in routed:
        moe.dispatch = GroupedCapacityDispatch(moe.num_experts, factor, groups)
    return len(routed)


def specialise(model, cfg: Config, flash: bool = False, packed: bool = False) -> dict[str, int]:
    """Everything Ascend changes on a built Decoder for a layout (the seam in msllm.backends calls it,
    with flash = msllm.backends.uses_flash: train.attention as Ascend resolves it, and packed: the
    samples are packed, msllm.rules.packed_samples)."""
    execution_profile(cfg)
    if flash:
        use_flash_attention(model, cfg, packed)
    use_shardable_norms(model)
    use_expert_dispatch(model, cfg)
    return apply_layout(model, cfg, flash, packed)


def micro_batches(loss_net, cfg: Config):
    """The loss network cut into parallel.micro_batches: pipelined over stages with pp > 1, else
    accumulated. MindSpore's train step then reduces gradients with pipeline_grad_reducer."""
    from mindspore.parallel.nn import GradAccumulation, Pipeline

    p = cfg.parallel
    if p.pp > 1:
        return Pipeline(loss_net, p.micro_batches)
    if p.micro_batches > 1:
        return GradAccumulation(loss_net, p.micro_batches)
    return loss_net


def pipeline_grad_reducer(parameters, cfg: Config):
    """Pipeline parallel's gradient accumulation and reduction for the train step (None without)."""
    if cfg.parallel.pp == 1:
        return None
    from mindspore.parallel.nn import PipelineGradReducer

    return PipelineGradReducer(parameters, opt_shard=cfg.parallel.optimizer_shard)


def parallel_wrapper(net, cfg: Config, strategy_path: str | None = None):
    """Wrap the outermost train Cell in AutoParallel as the config's parallel section says."""
    from mindspore.parallel.auto_parallel import AutoParallel

    p = cfg.parallel
    wrapped = AutoParallel(net, PARALLEL_MODE)
    # The step's one input, tokens [b, s+1]: cut over dp; the tp ranks of a replica read the same rows.
    wrapped.dataset_strategy(((p.dp, 1),))
    if p.optimizer_shard:
        wrapped.hsdp(optimizer_level="level1")  # weights' fp32 copy and Adam states split over dp
    if p.pp > 1:
        wrapped.pipeline(stages=p.pp, scheduler="1f1b")
    if strategy_path is not None:
        wrapped.save_param_strategy_file(strategy_path)
    return wrapped


def strategy_file(run_dir: str | Path, rank: int) -> Path:
    """Where AutoParallel writes this rank's parameter strategy at compile time."""
    return Path(run_dir) / "strategy" / f"rank_{rank}.ckpt"


def save_strategy_with_checkpoint(run_dir: str | Path, checkpoint_dir: str | Path, rank: int) -> Path:
    """Copy this rank's strategy file into a checkpoint: sharded weights are unreadable without it
    (resuming under another layout re-slices them with it)."""
    src = strategy_file(run_dir, rank)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no strategy file; was the train step compiled under AutoParallel?")
    dst = Path(checkpoint_dir) / src.name.replace("rank_", "strategy_rank_")
    shutil.copyfile(src, dst)
    return dst


# ---- execution profile ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ExecutionProfile:
    """How the compiled step runs on Ascend.

    jit_level O2 sinks the whole graph to the device (fastest; static shapes only), O1 runs it
    kernel by kernel with fusion, O0 without. sink_size > 0 feeds the step from the device-side data
    queue (mindspore.data_sink) and returns to the host every sink_size steps."""
    jit_level: str
    sink_size: int

    def context(self) -> dict:
        return {"jit_config": {"jit_level": self.jit_level}}

    def sink(self, step_fn, dataset):
        """The step driven by the device-side data queue, or the step itself without a sink."""
        if self.sink_size == 0:
            return step_fn
        import mindspore as ms

        return ms.data_sink(step_fn, dataset, sink_size=self.sink_size,
                            jit_config=ms.JitConfig(jit_level=self.jit_level))


def execution_profile(cfg: Config, source: str = "<config>") -> ExecutionProfile:
    """The profile, after its constraints are checked against the config (msllm.layout.check)."""
    check_execution(cfg, source)
    return ExecutionProfile(cfg.train.jit_level, cfg.parallel.sink_size)
