"""How the decoder of every family is laid out over devices: one declarative table, beside the model.

Every parameter and every primitive the model's Cells hold gets a layout: one entry per tensor
dim, None (whole on every rank) or the name of a split. The names are resolved for one run by
`Sharding` to axes of the device mesh (dp, tp_kv, tp_rep), so the same table gives

  * MindSpore `Primitive.shard` layouts for AutoParallel "semi_auto" (msllm.backends.ascend),
  * the slice of each weight a rank holds (the sharded-maths oracle in the tests, the planner),
  * pipeline stages by layer (embedding first, final norm and head last).

The table is data, a placement per tensor, so it can move to DTensor-style placements later.

The mesh: tp = tp_kv x tp_rep. tp_kv splits the KV heads; when a model has fewer KV heads than
tp (GQA), each KV head is held by tp_rep = tp / num_kv_heads ranks: those serving the query
heads of its group. Rank order within a stage is (dp, tp_kv, tp_rep), tp innermost, so a tp
group is adjacent devices (one node). Ops marked `flat` are laid out over the flat mesh (dp, tp)
instead: the same ranks in the same order, tp = tp_kv x tp_rep as one axis (Ascend's
FlashAttentionScore maps each dim of its query to one mesh axis).

The attention core has four formulations with their own rows (`Op.cores`): the softmax core's
BatchMatMuls and softmax, Ascend's FlashAttentionScore (msllm.backends.ascend), the same primitive
as ring attention under context parallel, and in its TND layout for packed samples; `ops_for(m,
core)` picks one (`Sharding.core`), the checker checks those a layout can take (`table_ops`).

Context parallel (cp) on Ascend is ring attention: one sequence per data-parallel replica and
micro-batch, its rows cut over (dp, cp), so each rank holds a contiguous chunk of the sequence
through every row-wise op; FlashAttentionScore's q, k and v are cut on the sequence over cp and the
primitive's ring attribute makes MindSpore pass K/V chunks around the cp group (sparse mode 0, no
mask: the pass builds each step's mask on chunks in natural order, all-masked for later chunks). The mesh is then
(dp, cp, tp_kv, tp_rep), the flat mesh (dp, cp, tp).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from msllm.config import ModelConfig, ParallelConfig
from msllm.params import param_shapes  # the parameters PARAMS places (L.param_shapes)
from msllm.rules import COMPRESSED_MASK

CORES = ("softmax", "flash", "ring", "packed")

# Split names, what they split, and over which mesh axes (see Sharding.axes):
#   batch      sequences: rows of the [b*s, h] stream, token ids            dp; dp x cp (cp: one sequence
#                                                                            per replica, a chunk per rank)
#   samples    sequences of the attention core's [b, heads, s, d] inputs     dp
#   seq        the sequence of FlashAttentionScore's q, k, v (ring)          cp
#   tokens     rows entering norms, leaving row-parallel matmuls             batch's; x tp with sequence_parallel
#   heads      query heads (q projection outputs, o projection inputs)       tp
#   kv         key / value heads                                             tp_kv
#   group      query rows of one KV head's group, [b, kv, rep*s, d] view     tp_rep
#   copies     copies of a KV head, one per rank of its group (flash, kv < tp) tp_rep
#   head_rows  rows of the per-head [b*heads*s, d] view (RoPE)               dp x tp (never with cp: see OPS)
#   ffn        MLP hidden features                                           tp
#   vocab      vocabulary rows                                               tp, or nothing (replicated,
#                                                                            data-parallel fallback)
#   experts    a MoE layer's experts, [E, ...]                               ep
#   expert_rows  rows an expert computes, [E, groups x capacity, h]: the     dp / ep (the ep groups)
#              token groups of the other ep groups
#
# Expert parallel (ep) is the inner part of dp: with ep > 1 the mesh is (dp / ep, ep, tp_kv, tp_rep),
# `batch` cuts over (dp, ep), and a rank's data-parallel index i is (i // ep, i % ep): an ep group is
# ep consecutive replicas, as on CPU (msllm.parallel.ep).

# name pattern (layers.N -> layers.*), split per dim, placement
PARAMS = (
    ("tok_embeddings.weight",            ("vocab", None), "vocab parallel"),
    ("layers.*.attention_norm.weight",   (None,),         "replicated"),
    ("layers.*.attention.wq.weight",     ("heads", None), "column"),
    ("layers.*.attention.wq.bias",       ("heads",),      "column"),
    ("layers.*.attention.wk.weight",     ("kv", None),    "column"),
    ("layers.*.attention.wk.bias",       ("kv",),         "column"),
    ("layers.*.attention.wv.weight",     ("kv", None),    "column"),
    ("layers.*.attention.wv.bias",       ("kv",),         "column"),
    ("layers.*.attention.wg.weight",     ("heads", None), "column"),   # gated attention: gates per query head
    ("layers.*.attention.wo.weight",     (None, "heads"), "row"),
    ("layers.*.attention.wo.bias",       (None,),         "replicated"),  # added once, after the row reduction
    ("layers.*.attention.q_norm.weight", (None,),         "replicated"),
    ("layers.*.attention.k_norm.weight", (None,),         "replicated"),
    ("layers.*.attention.core.sinks",    (None,),         "replicated"),  # not laid out on Ascend (config refuses)
    ("layers.*.attention_out_norm.weight", (None,),       "replicated"),
    ("layers.*.ffn_norm.weight",         (None,),         "replicated"),
    ("layers.*.ffn_out_norm.weight",     (None,),         "replicated"),
    # MoE: the router whole on every rank, the stacked experts [E, ...] cut over the ep group
    ("layers.*.feed_forward.router.weight", (None, None),   "replicated"),
    ("layers.*.feed_forward.experts.w*",   ("experts", None, None), "expert parallel"),
    ("layers.*.feed_forward.router.expert_bias", (None,),   "replicated"),
    ("layers.*.feed_forward.router.bias",  (None,),         "replicated"),
    ("layers.*.feed_forward.experts.b*.bias", ("experts", None), "expert parallel"),
    ("layers.*.feed_forward.shared.w*.weight", (None, None), "replicated"),
    ("layers.*.feed_forward.shared_gate.weight", (None, None), "replicated"),
    # MLA (DeepSeek): the down-projections to the q and kv latents (and their norms) whole on every
    # rank, the up-projections to heads cut by heads as wq is (their rows are head after head)
    ("layers.*.attention.wq_a.weight",   (None, None),    "replicated"),
    ("layers.*.attention.wq_b.weight",   ("heads", None), "column"),
    ("layers.*.attention.wkv_a.weight",  (None, None),    "replicated"),
    ("layers.*.attention.wkv_b.weight",  ("heads", None), "column"),
    ("layers.*.attention.kv_norm.weight", (None,),        "replicated"),
    # Gated DeltaNet (linear attention): its heads over tp, everything per head cut with them. Each key head's
    # run of value heads is consecutive, so a contiguous cut of wq / wk (key heads) cuts wv, wz, wb, wa,
    # dt_bias, A_log and the three convs (value heads) at the same head boundaries: a rank runs the rule on
    # its own heads and only wo's row-parallel sum crosses ranks. Its wq / wk / wv / wo take attention's rows
    # above (same names): wk / wv cut by "kv", so a hybrid over tp needs tp to divide the attention
    # layers' KV heads (kv = tp_kv = tp; msllm.layout.check refuses other tp). The gated norm is per
    # feature of a head, shared by all heads: whole.
    ("layers.*.attention.wz.weight",     ("heads", None), "column"),
    ("layers.*.attention.wb.weight",     ("heads", None), "column"),
    ("layers.*.attention.wa.weight",     ("heads", None), "column"),
    ("layers.*.attention.conv_*.weight", ("heads", None, None), "column"),
    ("layers.*.attention.dt_bias",       ("heads",),      "column"),
    ("layers.*.attention.A_log",         ("heads",),      "column"),
    ("layers.*.attention.norm.weight",   (None,),         "replicated"),
    ("layers.*.feed_forward.w1.weight",  ("ffn", None),   "column"),
    ("layers.*.feed_forward.w3.weight",  ("ffn", None),   "column"),
    ("layers.*.feed_forward.w2.weight",  (None, "ffn"),   "row"),
    ("norm.weight",                      (None,),         "replicated"),
    ("output.weight",                    ("vocab", None), "vocab parallel"),
    # multi-token prediction depths (their blocks take the layers' rows: param_entry), whole on every rank
    ("mtp.*.enorm.weight",               (None,),         "replicated"),
    ("mtp.*.hnorm.weight",               (None,),         "replicated"),
    ("mtp.*.eh_proj.weight",             (None, None),    "replicated"),
    ("mtp.*.norm.weight",                (None,),         "replicated"),
)


@dataclass(frozen=True)
class Op:
    """A primitive held by a Cell: `cell` path pattern, `prim` attribute, the layout of each input,
    and `out`: the output layout set only under sequence_parallel (a row-parallel matmul then
    reduce-scatters its partial sums onto tokens instead of all-reducing them)."""
    cell: str
    prim: str
    inputs: tuple
    out: tuple | None = None
    when: str | None = None   # a CONDITIONS key
    optional: bool = False    # held only by some formulations of the Cell (applied when present)
    cores: tuple = CORES      # the attention cores (CORES) whose model holds this row (ops_for)
    flat: bool = False        # laid out over the flat mesh (dp, [cp,] tp), not (dp, [cp,] tp_kv, tp_rep)

    @property
    def path(self) -> str:
        return f"{self.cell}.{self.prim}" if self.cell else self.prim


CONDITIONS = {
    "mha": lambda m: m.num_kv_heads == m.num_heads,
    "gqa": lambda m: m.num_kv_heads != m.num_heads,
    "tied": lambda m: m.tie_embeddings,
    "untied": lambda m: not m.tie_embeddings,
    "pre_norm": lambda m: m.pre_norm,
    "sandwich": lambda m: m.sandwich_norm,
    "qk_norm": lambda m: m.qk_norm and m.qk_norm_scope == "head",
    "qk_norm_projection": lambda m: m.qk_norm and m.qk_norm_scope == "projection",
    "dense_mlp": lambda m: "dense" in m.mlp_kinds(),
    "moe": lambda m: "moe" in m.mlp_kinds(),
    "qkv": lambda m: not m.mla,                     # q, k and v projections of their own
    "q_proj": lambda m: not (m.mla and m.q_lora_rank),
    "mla": lambda m: m.mla,
    "mla_low_rank_q": lambda m: m.mla and m.q_lora_rank > 0,
    "mla_value_pad": lambda m: m.mla and m.v_head_dim < m.head_size,  # FlashAttentionScore: V padded to q/k's size
    "output_gate": lambda m: m.attn_output_gate,
    "linear": lambda m: m.hybrid,                   # Gated DeltaNet layers (their wq / wk / wv / wo: attention's rows)
}

_ROW_OUT = (("tokens", None),)
_ATTN = "layers.*.attention.core.softmax_attention"
_DISPATCH = "layers.*.feed_forward.dispatch"


# RMSNorm cores: Ascend swaps in msllm.backends.ascend.RMSNormCore, whose primitives these are:
# x [N, h] -> x * rsqrt(mean(x^2) + eps) * weight, rows cut by `rows`.
def _norm_ops(cell: str, when: str | None, rows: str = "tokens") -> tuple[Op, ...]:
    return tuple(Op(cell, prim, inputs, when=when) for prim, inputs in (
        ("square", ((rows, None),)),
        ("mean", ((rows, None),)),
        ("add", ((rows, None), (None, None))),           # + eps [1, 1]
        ("rsqrt", ((rows, None),)),
        ("scale", ((rows, None), (rows, None))),
        ("weigh", ((rows, None), (None,))),
    ))


_NORM_OPS = sum((_norm_ops(cell, when) for cell, when in (
    ("layers.*.attention_norm.core", "pre_norm"), ("layers.*.ffn_norm.core", "pre_norm"), ("norm.core", None),
    ("layers.*.attention_out_norm.core", "sandwich"), ("layers.*.ffn_out_norm.core", "sandwich"))), ())
# MLA's latent norms, on rows every tp rank holds whole: their inputs come from the replicated
# down-projections.
_LATENT_NORM_OPS = (_norm_ops("layers.*.attention.q_norm.core", "mla_low_rank_q", "batch")
                    + _norm_ops("layers.*.attention.kv_norm.core", "mla", "batch"))
# q / k norms (HeadNorm.heads_axis, msllm.backends.ascend.HeadRMSNormCore): the projection viewed
# [N, heads, d], its heads cut as the projection's columns are (q: heads, k: kv), so each rank
# normalises the heads it holds: no data moves between the projection, the norm and RoPE.
_HEAD_NORM_OPS = tuple(
    Op(f"layers.*.attention.{which}_norm.core", prim, tuple(tuple(h if dim == "H" else dim for dim in x) for x in inputs),
       when="qk_norm")
    for which, h in (("q", "heads"), ("k", "kv"))
    for prim, inputs in (
        ("square", (("batch", "H", None),)),
        ("mean", (("batch", "H", None),)),
        ("add", (("batch", "H", None), (None, None, None))),   # + eps [1, 1, 1]
        ("rsqrt", (("batch", "H", None),)),
        ("scale", (("batch", "H", None), ("batch", "H", None))),
        ("weigh", (("batch", "H", None), (None,))),
    ))
# q / k norms over the whole projection (OLMo 2/3): the mean runs over every head, so each row's
# features are gathered whole (columns not cut) for the norm, then cut by heads again for RoPE.
_PROJECTION_NORM_OPS = (_norm_ops("layers.*.attention.q_norm.core", "qk_norm_projection", "batch")
                        + _norm_ops("layers.*.attention.k_norm.core", "qk_norm_projection", "batch"))
OPS = _NORM_OPS + _HEAD_NORM_OPS + _LATENT_NORM_OPS + _PROJECTION_NORM_OPS + (
    Op("tok_embeddings", "gather", (("vocab", None), ("batch",))),
    Op("layers.*.attention.wq", "matmul", (("batch", None), ("heads", None)), when="q_proj"),
    Op("layers.*.attention.wg", "matmul", (("batch", None), ("heads", None)), when="output_gate"),
    Op("layers.*.attention.wk", "matmul", (("batch", None), ("kv", None)), when="qkv"),
    Op("layers.*.attention.wv", "matmul", (("batch", None), ("kv", None)), when="qkv"),
    # MLA: latents whole on every rank, expanded to the rank's heads (its keys' shared RoPE part is
    # computed whole from wkv_a's output and broadcast to the heads)
    Op("layers.*.attention.wq_a", "matmul", (("batch", None), (None, None)), when="mla_low_rank_q"),
    Op("layers.*.attention.wq_b", "matmul", (("batch", None), ("heads", None)), when="mla_low_rank_q"),
    Op("layers.*.attention.wkv_a", "matmul", (("batch", None), (None, None)), when="mla"),
    Op("layers.*.attention.wkv_b", "matmul", (("batch", None), ("heads", None)), when="mla"),
    # One primitive rotates q and k (when Rope holds one: the CPU formulation; Ascend's element-wise
    # form has none): rows of the per-head view; k's rows under GQA with kv < tp are resliced to
    # match. Under cp a rank's rows of that view are its heads x its chunk, no one block: not a ring row.
    Op("layers.*.attention.rope", "matmul", (("head_rows", None), (None, None)), optional=True, when="qkv",
       cores=("softmax", "flash")),
    # q is viewed [b, kv, rep*s, d] so one BatchMatMul serves a KV head's group. A hand-written
    # backward (when present) reuses them and adds pt_x (dv, dk), whose contraction over the
    # group's rows is cut by tp_rep: those partial sums are all-reduced.
    Op(_ATTN, "qk", (("samples", "kv", "group", None), ("samples", "kv", None, None)), cores=("softmax",)),
    Op(_ATTN, "pv", (("samples", "kv", "group", None), ("samples", "kv", None, None)), cores=("softmax",)),
    Op(_ATTN, "pt_x", (("samples", "kv", "group", None), ("samples", "kv", "group", None)), optional=True,
       cores=("softmax",)),
    Op(_ATTN, "softmax", (("samples", "heads", None, None),), when="mha", cores=("softmax",)),        # [b, h, s, t]
    Op(_ATTN, "softmax", (("samples", "kv", "group", None, None),), when="gqa", cores=("softmax",)),  # [b, kv, rep, s, t]
    # Ascend's FlashAttentionScore in its place (BNSD): q [b, nh, s, d], k and v [b, kv', s, d], the
    # compressed [2048, 2048] causal mask whole. MindSpore cuts K/V heads exactly as the query heads
    # and never the keys' sequence, so with kv < tp each KV head is first repeated tp_rep times
    # (repeat_kv, a broadcasting Mul by ones: [b, kv, 1, s, d] x [1, 1, tp_rep, 1, 1]), each rank
    # computing only the copy of its own KV head (kv' = kv x tp_rep = tp); the copies' gradients
    # are summed over tp_rep in backward. Batch over dp, heads over tp, one mesh axis per dim (flat).
    # As ring attention (cp > 1) q, k and v are cut on the sequence alike and there is no mask.
    # MLA (one KV head per query head, so no copies): V zero-padded to the q/k head size first (pad_v, a
    # Concat with zeros), the output's padded features sliced off after (value_part), heads cut as q's.
    Op(_ATTN, "repeat_kv", (("samples", "kv", None, "seq", None), (None, None, "copies", None, None)),
       optional=True, cores=("flash", "ring", "packed"), when="qkv"),
    Op(_ATTN, "pad_v", (("samples", "heads", None, None),) * 2, cores=("flash", "packed"), flat=True,
       when="mla_value_pad"),
    Op(_ATTN, "flash", (("samples", "heads", None, None),) * 3 + ((None, None),), cores=("flash",), flat=True),
    Op(_ATTN, "flash", (("samples", "heads", "seq", None),) * 3, cores=("ring",), flat=True, when="qkv"),
    # Packed samples: its TND form (`varlen`), q, k, v as [b*s, heads, d] rows (a replica's rows, cut
    # over dp, are its sequences), the samples' ends [b*s] cut over dp with them (per-shard offsets:
    # msllm.backends.ascend.SampleEnds), the compressed mask whole.
    Op(_ATTN, "varlen", (("samples", "heads", None),) * 3 + ((None, None), ("samples",), ("samples",)),
       cores=("packed",), flat=True),
    Op(_ATTN, "value_part", (("samples", "heads", None, None),), cores=("flash", "packed"), flat=True,
       when="mla_value_pad"),
    Op("layers.*.attention.wo", "matmul", (("batch", "heads"), (None, "heads")), out=_ROW_OUT),
    # Gated DeltaNet: the gate z, beta and decay inputs column-parallel by value head, as wv. The rule itself
    # (conv, chunked matmuls, gated norm) has no rows: every tensor in it is per head, and MindSpore's default
    # strategies apply there.
    Op("layers.*.attention.wz", "matmul", (("batch", None), ("heads", None)), when="linear"),
    Op("layers.*.attention.wb", "matmul", (("batch", None), ("heads", None)), when="linear"),
    Op("layers.*.attention.wa", "matmul", (("batch", None), ("heads", None)), when="linear"),
    Op("layers.*.feed_forward.w1", "matmul", (("batch", None), ("ffn", None)), when="dense_mlp"),
    Op("layers.*.feed_forward.w3", "matmul", (("batch", None), ("ffn", None)), when="dense_mlp"),
    Op("layers.*.feed_forward.act", "sigmoid", (("batch", "ffn"),), when="dense_mlp"),
    Op("layers.*.feed_forward.w2", "matmul", (("batch", "ffn"), (None, "ffn")), out=_ROW_OUT, when="dense_mlp"),
    # MoE layers under expert parallel (msllm.models.moe.GroupedCapacityDispatch, which Ascend swaps in):
    # each data-parallel rank's tokens are one group, dispatched to [G, E*C, h] where they are; the
    # transpose to [E, G, C, h] keeps that cut, and the experts' BatchMatMul wants its rows cut by
    # expert over ep (and by the other ep groups' tokens over dp / ep): the difference is an
    # all-to-all within each ep group, which semi-auto parallel inserts (MindSpore 2.10's AutoParallel
    # redistributes with AllToAll by default). from_experts is the way back, combine_rows local again.
    Op(_DISPATCH, "dispatch_rows", (("batch", None, None), ("batch", None, None)), when="moe", optional=True),
    Op(_DISPATCH, "to_experts", (("batch", None, None, None),), when="moe", optional=True),
    Op("layers.*.feed_forward.experts", "matmul", (("experts", "expert_rows", None), ("experts", None, None)),
       when="moe"),
    Op(_DISPATCH, "from_experts", (("experts", "expert_rows", None, None),), when="moe", optional=True),
    Op(_DISPATCH, "combine_rows", (("batch", None, None), ("batch", None, None)), when="moe", optional=True),
    Op("output", "matmul", (("batch", None), ("vocab", None)), when="untied"),
    Op("", "lm_matmul", (("batch", None), ("vocab", None)), when="tied"),  # logits from the embedding table
)

# The vocab-parallel loss (msllm.backends.ascend.VocabParallelCrossEntropy, its primitives by
# attribute): logits [N, vocab] stay cut over vocab; the row max, the sum of exponentials and the
# target logit are reduced across the shards instead of gathering the logits.
LOSS_OPS = (
    Op("", "row_max", (("batch", "vocab"),)),
    Op("", "shift", (("batch", "vocab"), ("batch", None))),
    Op("", "exp", (("batch", "vocab"),)),
    Op("", "row_sum", (("batch", "vocab"),)),
    Op("", "log", (("batch", None),)),
    Op("", "one_hot", (("batch", "vocab"), (), ())),
    Op("", "pick", (("batch", "vocab"), ("batch", "vocab"))),
    Op("", "target_sum", (("batch", "vocab"),)),
    Op("", "minus", (("batch", None), ("batch", None))),
    Op("", "mean", (("batch", None),)),
)

# Cells whose pipeline stage is set: the embedding on the first stage, norm and head on the last.
FIRST_STAGE, LAST_STAGE = ("tok_embeddings",), ("norm", "output", "mtp")  # mtp: after the head it shares


@dataclass(frozen=True)
class Sharding:
    """A layout resolved for one model: the mesh axis sizes and what each split name maps to."""
    dp: int
    tp: int
    pp: int
    tp_kv: int
    tp_rep: int
    sequence_parallel: bool
    vocab_split: bool
    ep: int = 1
    cp: int = 1

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return (("dp",) + (("ep",) if self.ep > 1 else ()) + (("cp",) if self.cp > 1 else ())
                + ("tp_kv", "tp_rep"))

    @property
    def mesh(self) -> tuple[int, ...]:
        return ((self.dp // self.ep,) + ((self.ep,) if self.ep > 1 else ()) + ((self.cp,) if self.cp > 1 else ())
                + (self.tp_kv, self.tp_rep))

    @property
    def flat_axes(self) -> tuple[str, ...]:
        return ("dp", "cp", "tp") if self.cp > 1 else ("dp", "tp")

    @property
    def flat_mesh(self) -> tuple[int, ...]:
        return (self.dp, self.cp, self.tp) if self.cp > 1 else (self.dp, self.tp)

    def axes(self, name: str | None, flat: bool = False) -> tuple[str, ...]:
        """Mesh axes a split name cuts over; flat: over (dp, [cp,] tp), where only whole-tp splits exist."""
        seq = ("cp",) if self.cp > 1 else ()
        if flat:
            return {None: (), "samples": ("dp",), "heads": ("tp",), "seq": seq}[name]
        tp = ("tp_kv", "tp_rep")
        dp = ("dp", "ep") if self.ep > 1 else ("dp",)
        rows = dp + seq
        return {
            None: (), "batch": rows, "tokens": rows + tp if self.sequence_parallel else rows,
            "samples": dp, "seq": seq, "heads": tp, "kv": ("tp_kv",), "group": ("tp_rep",), "copies": ("tp_rep",),
            "head_rows": dp + tp, "ffn": tp, "vocab": tp if self.vocab_split else (),
            "experts": ("ep",) if self.ep > 1 else (), "expert_rows": ("dp",),
        }[name]

    def ways(self, axes: tuple[str, ...], flat: bool = False) -> int:
        sizes = dict(zip(self.flat_axes, self.flat_mesh)) if flat else {**dict(zip(self.mesh_axes, self.mesh)),
                                                                         "tp": self.tp}
        out = 1
        for a in axes:
            out *= sizes[a]
        return out

    def dims(self, layout: tuple, flat: bool = False) -> tuple[tuple[str, ...], ...]:
        """Split names -> mesh axes per dim."""
        return tuple(self.axes(name, flat) for name in layout)

    def strategy(self, layout: tuple, flat: bool = False) -> tuple[int, ...]:
        """Split names -> how many ways each dim is cut (a MindSpore in_strategy tuple)."""
        return tuple(self.ways(axes, flat) for axes in self.dims(layout, flat))

    @property
    def core_names(self) -> tuple[str, ...]:
        """The attention cores this layout can take: ring attention alone under cp."""
        return ("ring",) if self.cp > 1 else ("softmax", "flash", "packed")

    def core(self, flash: bool, packed: bool = False) -> str:
        """The attention core a model runs under this layout (flash: FlashAttentionScore is used;
        packed: on packed samples)."""
        if not flash:
            return "softmax"
        return "ring" if self.cp > 1 else "packed" if packed else "flash"


def sharding(m: ModelConfig, p: ParallelConfig) -> Sharding:
    """Resolve the table's split names for model `m` under layout `p` (assumed checked)."""
    kv_split = p.tp if m.num_kv_heads % p.tp == 0 else m.num_kv_heads  # GQA: kv < tp groups ranks
    return Sharding(dp=p.dp, tp=p.tp, pp=p.pp, tp_kv=kv_split, tp_rep=p.tp // kv_split,
                    sequence_parallel=p.sequence_parallel and p.tp > 1,
                    vocab_split=p.vocab_parallel and p.tp > 1 and m.vocab_size % p.tp == 0,
                    ep=p.ep if m.num_experts else 1, cp=p.cp)


# ---- parameters ---------------------------------------------------------------------------------

def param_entry(name: str) -> tuple[tuple, str]:
    """(split per dim, placement) of a parameter name, from the table; an MTP depth's block is placed as a
    decoder layer."""
    if name.startswith("mtp.") and ".layer." in name:
        name = "layers.0." + name.split(".layer.", 1)[1]
    for pattern, layout, placement in PARAMS:
        if fnmatch.fnmatchcase(name, pattern):
            return layout, placement
    raise KeyError(f"{name}: no layout in msllm.layout.table.PARAMS")


def shard_shape(shape: tuple[int, ...], layout: tuple, sh: Sharding) -> tuple[int, ...]:
    """The slice of a tensor of `shape` one rank holds."""
    return tuple(n // k for n, k in zip(shape, sh.strategy(layout), strict=True))


def shard_slices(shape: tuple[int, ...], layout: tuple, sh: Sharding, rank: dict[str, int],
                 flat: bool = False) -> tuple[slice, ...]:
    """Index of the slice held by the rank at mesh coordinates `rank` ({"dp": i, "tp_kv": j, "tp_rep": k},
    and "cp": c under context parallel; i the data-parallel index, split into (i // ep, i % ep) when the
    layout has expert parallel).

    A dim split over several axes is cut in their order, the first outermost (MindSpore's
    tensor_map and DTensor agree on this). flat: a layout over (dp, [cp,] tp), where the rank's tp
    coordinate is j x tp_rep + k (the same rank order)."""
    sizes = dict(zip(sh.mesh_axes, sh.mesh))
    if sh.ep > 1 and not flat:
        rank = {**rank, "dp": rank.get("dp", 0) // sh.ep, "ep": rank.get("dp", 0) % sh.ep}
    if flat:
        sizes = dict(zip(sh.flat_axes, sh.flat_mesh))
        rank = {"dp": rank.get("dp", 0), "cp": rank.get("cp", 0),
                "tp": rank.get("tp_kv", 0) * sh.tp_rep + rank.get("tp_rep", 0)}
    out = []
    for n, axes in zip(shape, sh.dims(layout, flat), strict=True):
        chunk, ways = 0, 1
        for a in axes:
            chunk, ways = chunk * sizes[a] + rank.get(a, 0), ways * sizes[a]
        step = n // ways
        out.append(slice(chunk * step, (chunk + 1) * step))
    return tuple(out)


# ---- ops ----------------------------------------------------------------------------------------

def _applies(op: Op, m: ModelConfig) -> bool:
    """A row holds for model m: its condition."""
    return op.when is None or CONDITIONS[op.when](m)


def ops_for(m: ModelConfig, core: str = "softmax") -> list[Op]:
    """The table's rows for model m with one attention core (CORES; Sharding.core picks it)."""
    return [op for op in OPS if _applies(op, m) and core in op.cores]


def table_ops(m: ModelConfig, cores: tuple[str, ...] = ("softmax", "flash")) -> list[Op]:
    """Every row of model m with any of `cores` (what the checker checks: Sharding.core_names)."""
    return [op for op in OPS if _applies(op, m) and any(c in op.cores for c in cores)]


def op_input_shapes(m: ModelConfig, batch: int, seq: int, kv_copies: int = 1, groups: int = 1,
                    capacity_factor: float = 1.0,
                    cores: tuple[str, ...] = ("softmax", "flash")) -> dict[str, list[tuple[int, ...]]]:
    """The shapes each op's inputs have in a micro-batch of `batch` sequences of `seq` tokens
    (the global shapes: semi-auto parallel describes the whole computation, layouts cut it), for the
    rows of `cores`. kv_copies: how many times flash attention repeats each KV head (the layout's tp_rep);
    groups, capacity_factor: the MoE dispatch's token groups (dp) and capacity (GroupedCapacityDispatch)."""
    b, s, h, d, f, v = batch, seq, m.hidden_size, m.head_size, m.ffn_size, m.vocab_size
    nh, kv = m.num_heads, m.num_kv_heads
    n, rep = b * s, nh // kv
    a = "layers.*.attention."
    c = _ATTN + "."
    kv_in = kv * kv_copies
    shapes = {
        "tok_embeddings.gather": [(v, h), (n,)],
        a + "wq.matmul": [(n, h), (nh * d, h)],
        a + "wg.matmul": [(n, h), (nh * d, h)],
        a + "wk.matmul": [(n, h), (kv * d, h)],
        a + "wv.matmul": [(n, h), (kv * d, h)],
        a + "rope.matmul": [(b * nh * s, d), (d, d)],
        c + "qk": [(b, kv, rep * s, d), (b, kv, s, d)],
        c + "pv": [(b, kv, rep * s, s), (b, kv, s, d)],
        c + "pt_x": [(b, kv, rep * s, s), (b, kv, rep * s, d)],
        c + "softmax": [(b, nh, s, s)] if rep == 1 else [(b, kv, rep, s, s)],
        c + "repeat_kv": [(b, kv, 1, s, d), (1, 1, kv_copies, 1, 1)],
        c + "flash": [(b, nh, s, d), (b, kv_in, s, d), (b, kv_in, s, d)] + (
            [] if "ring" in cores else [(COMPRESSED_MASK, COMPRESSED_MASK)]),
        c + "varlen": [(n, nh, d), (n, kv_in, d), (n, kv_in, d), (COMPRESSED_MASK, COMPRESSED_MASK), (n,), (n,)],
        a + "wo.matmul": [(n, nh * d), (h, nh * d)],
        "layers.*.feed_forward.w1.matmul": [(n, h), (f, h)],
        "layers.*.feed_forward.w3.matmul": [(n, h), (f, h)],
        "layers.*.feed_forward.act.sigmoid": [(n, f)],
        "layers.*.feed_forward.w2.matmul": [(n, f), (h, f)],
        "output.matmul": [(n, h), (v, h)],
        "lm_matmul": [(n, h), (v, h)],
    }
    if m.num_experts:
        e, fe, g = m.num_experts, m.moe_ffn_size or f, groups
        c = min(n // g, math.ceil(capacity_factor * (n // g) * m.experts_per_token / e))
        ff = "layers.*.feed_forward."
        shapes.update({
            ff + "dispatch.dispatch_rows": [(g, n // g, e * c), (g, n // g, h)],
            ff + "dispatch.to_experts": [(g, e, c, h)],
            ff + "experts.matmul": [(e, g * c, h), (e, fe, h)],
            ff + "dispatch.from_experts": [(e, g, c, h)],
            ff + "dispatch.combine_rows": [(g, n // g, e * c), (g, e * c, h)],
        })
    if m.hybrid:
        values = m.linear_num_value_heads * m.linear_value_head_dim
        shapes.update({a + "wz.matmul": [(n, h), (values, h)], a + "wb.matmul": [(n, h), (m.linear_num_value_heads, h)],
                       a + "wa.matmul": [(n, h), (m.linear_num_value_heads, h)]})
    if m.mla:
        shapes.update(_mla_input_shapes(m, b, s))
    projection = {"q_norm": nh * d, "k_norm": kv * d} if m.qk_norm and m.qk_norm_scope == "projection" else {}
    for op in _NORM_OPS + _LATENT_NORM_OPS + (_PROJECTION_NORM_OPS if projection else ()):
        width = {"q_norm": m.q_lora_rank, "kv_norm": m.kv_lora_rank, **projection}.get(op.cell.split(".")[-2], h)
        shapes[op.path] = {"square": [(n, width)], "mean": [(n, width)], "add": [(n, 1), (1, 1)], "rsqrt": [(n, 1)],
                           "scale": [(n, width), (n, 1)], "weigh": [(n, width), (width,)]}[op.prim]
    for op in _HEAD_NORM_OPS if m.qk_norm and not projection else ():
        heads = nh if ".q_norm." in op.cell else kv
        shapes[op.path] = {"square": [(n, heads, d)], "mean": [(n, heads, d)], "add": [(n, heads, 1), (1, 1, 1)],
                           "rsqrt": [(n, heads, 1)], "scale": [(n, heads, d), (n, heads, 1)],
                           "weigh": [(n, heads, d), (d,)]}[op.prim]
    return {op.path: shapes[op.path] for op in table_ops(m, cores)}


def _mla_input_shapes(m: ModelConfig, b: int, s: int) -> dict[str, list[tuple[int, ...]]]:
    """An MLA layer's projections and attention core (mla.MLA): q/k heads of nope + rope features,
    value heads of v_head_dim, one KV head per query head."""
    h, nh, n = m.hidden_size, m.num_heads, b * s
    qk, v, r, c = m.head_size, m.v_head_dim, m.q_lora_rank, m.kv_lora_rank
    a, core = "layers.*.attention.", _ATTN + "."
    return {
        a + "wq.matmul": [(n, h), (nh * qk, h)],
        a + "wq_a.matmul": [(n, h), (r, h)],
        a + "wq_b.matmul": [(n, r), (nh * qk, r)],
        a + "wkv_a.matmul": [(n, h), (c + m.qk_rope_head_dim, h)],
        a + "wkv_b.matmul": [(n, c), (nh * (m.qk_nope_head_dim + v), c)],
        a + "wo.matmul": [(n, nh * v), (h, nh * v)],
        core + "qk": [(b, nh, s, qk), (b, nh, s, qk)],
        core + "pv": [(b, nh, s, s), (b, nh, s, v)],
        core + "pt_x": [(b, nh, s, s), (b, nh, s, v)],
        core + "softmax": [(b, nh, s, s)],
        # FlashAttentionScore: V padded to qk features, then the output sliced back to v
        core + "pad_v": [(b, nh, s, v), (b, nh, s, qk - v)],
        core + "flash": [(b, nh, s, qk)] * 3 + [(COMPRESSED_MASK, COMPRESSED_MASK)],
        core + "varlen": [(n, nh, qk)] * 3 + [(COMPRESSED_MASK, COMPRESSED_MASK), (n,), (n,)],
        core + "value_part": [(b, nh, s, qk)],
    }


# Which input dims each matmul contracts: (dim of input 0, dim of input 1). Both must be cut alike.
# Linear and the LM head: x @ W^T; rope: x @ R; the attention BatchMatMuls as named.
_CONTRACTS = {"matmul": (1, 1), "lm_matmul": (1, 1), "qk": (3, 3), "pv": (3, 2), "pt_x": (2, 2),
              "dispatch_rows": (1, 1), "combine_rows": (2, 1)}


def _contraction(op: Op) -> tuple[int, int] | None:
    if op.cell.endswith(".rope"):
        return (1, 0)
    if op.cell.endswith(".experts"):  # rows [E, n, h] x weights [E, out, h]^T
        return (2, 2)
    return _CONTRACTS.get(op.prim)


def _flash_problems(op: Op, sh: Sharding, shapes: list[tuple[int, ...]]) -> list[str]:
    """FlashAttentionScore's own rules (BNSD; MindSpore 2.10's parallel implementation checks them):
    one mesh axis per dim, K and V cut alike, batch and heads of q and K/V cut alike (the KV
    heads exactly as the query heads), and the KV heads a divisor of the query heads. Without cp the
    keys' sequence and the compressed mask are whole; as ring attention (no mask) q, k and v are cut
    on the sequence alike, over the cp axis."""
    q, k, v = (sh.dims(layout, op.flat) for layout in op.inputs[:3])
    out = []
    if any(len(axes) > 1 for axes in q):
        out.append(f"{op.path}: each dim of q may map to one mesh axis only")
    if k != v:
        out.append(f"{op.path}: k and v cut differently")
    if q[:2] != k[:2]:
        out.append(f"{op.path}: batch and heads of q and k/v must be cut alike")
    if sh.cp > 1 and not (len(op.inputs) == 3 and q[2] == k[2] == ("cp",)):
        out.append(f"{op.path}: ring attention cuts q, k and v on the sequence over cp alike, with no mask")
    if sh.cp == 1 and (k[2] or any(sh.dims(op.inputs[3], op.flat))):
        out.append(f"{op.path}: the keys' sequence and the compressed mask are never cut")
    if shapes[0][1] % shapes[1][1]:
        out.append(f"{op.path}: {shapes[1][1]} KV heads do not divide {shapes[0][1]} query heads")
    return out


def _varlen_problems(op: Op, sh: Sharding, shapes: list[tuple[int, ...]]) -> list[str]:
    """FlashAttentionScore's TND rules as msllm uses them: one mesh axis per dim, q, k and v cut alike
    (rows and heads), the samples' ends cut as the rows (each rank reads its own rows' ends, which
    MindSpore does not rebase when only the batch is cut), the compressed mask whole."""
    q, k, v, mask, q_ends, kv_ends = (sh.dims(layout, op.flat) for layout in op.inputs)
    out = []
    if any(len(axes) > 1 for axes in q):
        out.append(f"{op.path}: each dim of q may map to one mesh axis only")
    if not q[:2] == k[:2] == v[:2] or k[2] or v[2] or q[2]:
        out.append(f"{op.path}: q, k and v rows and heads cut alike, their features whole")
    if not q_ends == kv_ends == q[:1]:
        out.append(f"{op.path}: the samples' ends are cut as the rows")
    if any(mask):
        out.append(f"{op.path}: the compressed mask is never cut")
    if shapes[0][1] % shapes[1][1]:
        out.append(f"{op.path}: {shapes[1][1]} KV heads do not divide {shapes[0][1]} query heads")
    return out


# Tokens per MoE dispatch group (about): GroupedCapacityDispatch's one-hot masks grow with their square
DISPATCH_GROUP_TOKENS = 1024


def dispatch_groups(dp: int, tokens_per_rank: int) -> int:
    """How many groups a micro-batch's tokens are dispatched in (GroupedCapacityDispatch): each
    data-parallel rank's tokens, halved while a half still holds DISPATCH_GROUP_TOKENS or more."""
    split = 1
    while tokens_per_rank % (2 * split) == 0 and tokens_per_rank // (2 * split) >= DISPATCH_GROUP_TOKENS:
        split *= 2
    return dp * split


def strategy_problems(m: ModelConfig, sh: Sharding, batch: int, seq: int, capacity_factor: float = 1.0) -> list[str]:
    """Each op's layout against its input shapes (the attention cores the layout can take): rank,
    divisibility, contraction dims cut alike, and FlashAttentionScore's own rules. Under cp the rows
    cut over (dp, cp) are chunks of one sequence only when each replica's micro-batch is one sequence."""
    problems = []
    if sh.cp > 1 and batch != sh.dp:
        problems.append(f"context parallel: each data-parallel replica's micro-batch must be one sequence "
                        f"({batch} sequences over dp {sh.dp}), so that the rows cut over dp x cp are chunks of it")
    groups = dispatch_groups(sh.dp, batch // sh.dp * seq)
    shapes = op_input_shapes(m, batch, seq, sh.tp_rep, groups=groups, capacity_factor=capacity_factor,
                             cores=sh.core_names)
    for op in table_ops(m, sh.core_names):
        ins = shapes[op.path]
        if len(ins) != len(op.inputs):
            problems.append(f"{op.path}: {len(op.inputs)} input layouts for {len(ins)} inputs")
            continue
        for i, (shape, layout) in enumerate(zip(ins, op.inputs)):
            if len(shape) != len(layout):
                problems.append(f"{op.path}: input {i} layout has {len(layout)} dims, the tensor {len(shape)}")
                continue
            for dim, (n, k) in enumerate(zip(shape, sh.strategy(layout, op.flat))):
                if n % k:
                    problems.append(f"{op.path}: input {i} dim {dim} of size {n} cannot be cut {k} ways")
        pair = _contraction(op)
        if pair is not None:
            a, b = sh.dims(op.inputs[0])[pair[0]], sh.dims(op.inputs[1])[pair[1]]
            if a != b:
                problems.append(f"{op.path}: contracted dims cut differently ({a or 'whole'} vs {b or 'whole'})")
        batch_dims = {"qk": 2, "pv": 2, "pt_x": 2, "dispatch_rows": 1, "combine_rows": 1}.get(
            op.prim, 1 if op.cell.endswith(".experts") else 0)
        if batch_dims:  # BatchMatMul: the batch dims ([b, kv]; groups; experts) must be cut alike
            if sh.dims(op.inputs[0])[:batch_dims] != sh.dims(op.inputs[1])[:batch_dims]:
                problems.append(f"{op.path}: batch dims cut differently")
        if op.prim == "flash":
            problems += _flash_problems(op, sh, ins)
        if op.prim == "varlen":
            problems += _varlen_problems(op, sh, ins)
    return problems


def op_strategies(m: ModelConfig, sh: Sharding, flash: bool = False, packed: bool = False) -> dict[str, dict]:
    """{op path: {"in": per-input strategy tuples, "out": output strategies or None}} for model m
    with the softmax attention core, or (flash) FlashAttentionScore (as ring attention under cp, in
    its TND form for `packed` samples)."""
    out = {}
    for op in ops_for(m, sh.core(flash, packed)):
        sp_out = op.out if (op.out is not None and sh.sequence_parallel) else None
        out[op.path] = {"in": tuple(sh.strategy(layout, op.flat) for layout in op.inputs),
                        "out": None if sp_out is None else tuple(sh.strategy(layout) for layout in sp_out)}
    return out


# ---- pipeline stages ----------------------------------------------------------------------------

def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per stage: an even split, the remainder on the first stages (the last also runs the head)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def stage_offsets(num_layers: int, pp: int) -> list[int]:
    """Index of each stage's first layer."""
    counts = stage_layer_counts(num_layers, pp)
    return [sum(counts[:i]) for i in range(pp)]


def stage_of(name: str, num_layers: int, pp: int) -> int:
    """Pipeline stage of a Cell or parameter name."""
    root = name.split(".")[0]
    if root in FIRST_STAGE:
        return 0
    if root in LAST_STAGE:
        return pp - 1
    if root == "layers":
        layer = int(name.split(".")[1])
        offsets = stage_offsets(num_layers, pp)
        return max(i for i, first in enumerate(offsets) if first <= layer)
    raise KeyError(f"{name}: no pipeline stage in msllm.layout.table")


def stage_cells(m: ModelConfig, pp: int) -> dict[str, int]:
    """{Cell name: stage} for every Cell that carries a pipeline_stage."""
    names = list(FIRST_STAGE) + [f"layers.{i}" for i in range(m.num_layers)] + ["norm"]
    if not m.tie_embeddings:
        names.append("output")
    if m.mtp_depths:  # carried (model.mtp_loss_weight 0: not computed) beside the head they would share
        names.append("mtp")
    return {name: stage_of(name, m.num_layers, pp) for name in names}
