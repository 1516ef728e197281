"""msllm plan: every valid layout of a config on N devices, its per-device memory, per-step
communication and estimated step time, ranked; the best printed as `--set` overrides for `msllm train`.

Analytic (pure Python, instant). The model, per device, for the busiest pipeline stage:

  weights, gradients, optimizer states   bytes per parameter the device holds (from the layout
                                         table): fp32 4 + 4 + 8 (Adam m, v); fp16/bf16 2 + 2 + 12
                                         (fp32 master, m, v), the ZeRO paper's mixed-precision
                                         accounting, 16 bytes either way. optimizer_shard (ZeRO-1)
                                         splits the optimizer states over dp: 4 + 12 / dp (a
                                         device's E / ep experts' over dp / ep, the ranks
                                         holding the same experts).
  activations                            per layer and micro-batch, counted as Korthikanti et al.
                                         ("Reducing Activation Recomputation in Large Transformer
                                         Models", 2022) count GPT's, for this Llama (see
                                         layer_activations); times the layers on the stage, times the
                                         micro-batches in flight (1F1B: pp - stage), plus the one
                                         layer rebuilt in backward under recompute, plus fp32 logits
                                         on the last stage. The attention core is the one
                                         train.attention resolves to on the device (uses_flash).
  communication                          ring all-reduce sends 2 (g-1)/g of the buffer per device:
                                         DP gradients once per step (fp32: MindSpore's
                                         gradient_fp32_sync), TP 4 all-reduces per layer and
                                         micro-batch (2 forward, 2 backward; sequence parallel's
                                         all-gather + reduce-scatter move the same bytes), PP one
                                         activation forward and one gradient back per micro-batch,
                                         CP on CPU (msllm.parallel.cp) the whole sequence's K and
                                         V summed over the cp group per layer, forward and again
                                         backward (again forward under full recompute); on Ascend
                                         (ring attention) each K/V chunk passed around the ring
                                         forward, again backward with its dK / dV: 3 (cp-1)/cp of
                                         the sequence's K/V per layer (4 under full recompute).
  context parallel                       a device computes seq / cp tokens of each sequence: the
                                         activations and FLOPs above count those, plus the K and V
                                         every layer keeps (CPU: the whole sequence's; ring: its own
                                         chunk's); gradients are all-reduced over dp x cp.
  step time                              (micro_batches + pp - 1) x the slowest stage's micro-batch
                                         (matmul FLOPs at a fraction of peak, plus its TP and PP
                                         transfers; no overlap assumed) + the DP all-reduce + the
                                         optimizer's pass over its states at HBM bandwidth.

Links: tp ranks are adjacent (one node while tp <= devices per node), dp next, pp outermost.
Micro-batch size does not change matmul efficiency here, and kernels' workspaces and memory
fragmentation are left to USABLE.
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
import typing
from dataclasses import dataclass

from msllm.config import GATED_DELTA_CHUNK, Config, ParallelConfig
from msllm.errors import UserError
from msllm.layout import table as L
from msllm.rules import GROUPED_BLOCK_ROWS, packed_samples, resolves_to_flash
from msllm.layout.check import check_execution, check_parallel, global_batch_of, layout_problem

BUCKET_BYTES = 32 << 20  # data parallel sends gradients in buckets of at most this (msllm.parallel.dp)

GB = 2 ** 30  # "GB" here is 2^30 bytes, as device tools report memory
USABLE = 0.9  # of device memory a plan may fill: the rest for the runtime, workspaces, fragmentation


class PlanError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float   # dense matmul FLOP/s in the training dtype
    memory: float       # bytes
    hbm: float          # memory bandwidth, bytes/s
    intra: float        # link bandwidth per device inside a node, bytes/s
    inter: float        # per device across nodes, bytes/s
    per_node: int
    efficiency: float   # fraction of peak_flops the matmuls are assumed to reach
    runtime: float = 0.0  # bytes a process holds before any model (counted only where USABLE does not cover it)
    host: bool = False    # a device is one host process: count what MindSpore's CPU step holds (cpu_workspace)
    backend: str = "ascend"  # the train.device whose attention core the plan counts (uses_flash)
    flash_stats: int = 4     # bytes per head and query row a flash core keeps for backward (layer_activations)


# Vendor datasheet figures (16-bit dense), not measured here; cpu is this project's 2-core CI
# machine (the fp32 GEMM rate torch reaches, as train.peak_flops' default), one process per host.
DEVICES = {
    "910b": Device("910b", 2.8e14, 64 * GB, 1.6e12, 1.96e11, 2.5e10, 8, 0.5, flash_stats=64),  # HCCS; 200 Gb/s RoCE
    "h100": Device("h100", 9.89e14, 80 * GB, 3.35e12, 4.5e11, 5.0e10, 8, 0.5, backend="gpu"),  # NVLink 4; 400 Gb/s IB
    # runtime: the RSS of a process that imported MindSpore 2.10, set the CPU context and compiled and
    # ran a trivial graph (Python, MindSpore's libraries, its runtime and thread pools); measured by
    # tools/bench_plan_memory.py, the same alone and as an msrun worker.
    "cpu": Device("cpu", 3.8e11, 16 * GB, 2.0e10, 5.0e9, 5.0e9, 1, 1.0, runtime=0.5 * GB, host=True, backend="cpu"),
}
STATE_BYTES = {"fp32": (4, 4, 8), "fp16": (2, 2, 12), "bf16": (2, 2, 12)}  # weights, grads, optimizer per parameter
RECOMPUTE = ("none", "selective", "full")


def parse_bytes(text: str) -> float:
    """'64GB', '80GiB', '16000MB', '1.5TB', or a number of GB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise PlanError(f"--device-mem: expected a size like 64GB, got {text!r}")
    unit = (match.group(2) or "G")[0].upper()
    size = float(match.group(1)) * 2 ** (10 * "KMGT".index(unit) + 10)
    if size <= 0:
        raise PlanError(f"--device-mem: must be more than 0, got {text!r}")
    return size


# ---- memory ----------------------------------------------------------------------------------------

def layer_activations(m, sh: L.Sharding, batch: int, seq: int, act_bytes: int, recompute: str, flash: bool,
                      flash_stats: int = 4, cp: int = 1, moe: "MoECost | None" = None, ring: bool = False,
                      linear: bool = False, kernels: bool = False) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch of `batch` sequences, on one device.
    Under context parallel the device holds seq / cp tokens of each sequence, and every key and
    value of it (kv_local d e x cp more per token: the exchanged K/V the attention core keeps) or,
    as ring attention (`ring`), its own chunk's only (the others pass through).

    Per token (t = tp, sp = t under sequence parallel else 1, e = act_bytes, a = heads):
      norms       4h e / sp      the layer input, the mid residual and the two norm outputs
      attention   (2h/t + 2 kv_local d) e   q and the output projection's input; k and v
      mlp         3f e / t       gate, up and their SwiGLU product
      scores      4 a s / t      fp32 softmax probabilities (msllm keeps the softmax in fp32);
                                 a flash-attention core keeps its row statistics instead,
                                 flash_stats a / t: 4 for a log-sum-exp (msllm's CPU kernel), 64 for
                                 FlashAttentionScore's softmax_max and softmax_sum ([b, n, s, 8] fp32)
    A MoE layer (moe given) keeps instead of the MLP term what MoECost.activations counts; an MLA layer
    its q, its per-head keys and values and its latent instead of q and k, v; a Gated DeltaNet layer (`linear`)
    what linear_activations counts / t instead of attention and no scores (`kernels`: as the CPU's C++ kernels
    keep it, else as the graph form does).
    none = all four; selective (msllm's: attention core and MLP recomputed) = norms + attention;
    full = the layer input, h e / sp. Korthikanti et al.'s GPT count differs in its terms (dropout
    masks, GeLU MLP, fp16 softmax) but not in the structure: with sequence parallel every term is / t,
    full recompute keeps only the input, and flash attention or selective recompute drop the s^2 term.
    """
    h, d, t = m.hidden_size, m.head_size, sh.tp
    sp = t if sh.sequence_parallel else 1
    tokens = batch * seq / cp
    kv_local = m.num_kv_heads // sh.tp_kv
    if recompute == "full":
        return tokens * h * act_bytes / sp
    norms = 4 * h * act_bytes / sp
    attention = (2 * h / t + 2 * kv_local * d * (1 if ring else cp)) * act_bytes
    if m.mla:  # the layer input to wq, q and the up-projected keys and values of the device's heads, the
        # latent and rope key (whole on every tp rank)
        attention = (h + m.num_heads / t * (2 * d + m.v_head_dim) + m.kv_lora_rank + m.qk_rope_head_dim) * act_bytes
    if linear:  # every tensor of it is per head, its heads cut over tp
        attention = linear_activations(m, seq, act_bytes, kernels) / t
    if recompute == "selective":
        return tokens * (norms + attention)
    mlp = 3 * m.ffn_size * act_bytes / t if moe is None else moe.activations(act_bytes)
    scores = 0.0 if linear else m.num_heads / t * (flash_stats if flash else 4 * seq)
    return tokens * (norms + attention + mlp + scores)


def linear_activations(m, seq: int, act_bytes: int, kernels: bool = False, chunk: int = GATED_DELTA_CHUNK) -> float:
    """Bytes per token a Gated DeltaNet layer keeps for backward beyond its input (the norms' term); e =
    act_bytes, n value heads of d_k, d_v, n_k key heads, C = 2 n_k d_k + n d_v conv channels, K conv taps,
    chunks of c tokens; the rule runs in fp32 whatever the compute dtype.

    kernels (CPU training, train.fused_kernels auto: msllm.kernels' conv, rule, norm and gate, whose backwards
    read their inputs and recompute the rest; tests/test_plan.py counts them off the layer):
      conv inputs   4 C                  the q, k and v projections in fp32
      rule inputs   4 (2 n_k d_k + n (d_v + 2))  q and k (one per key head), v, the decay and beta
      states        4 n d_k d_v / c      the state entering each chunk (the rule's backward restarts there)
      decay, beta   4 x 3 n              sigmoid's output, softplus's input and output (graph ops)
      output        4 x 3 n d_v + e n d_v the norm's input, its output and z (the gate's), the gated output
    graph form (Ascend, and CPU with the kernels off: autodiff of msllm.models.mixers.gated_deltanet):
      projections  ((K + 2) C + 2 n d_v + 2n) e  each conv tap's shifted copy of its input, the conv's output and
                                          its SiLU; z; beta's and the decay's inputs
      rule inputs  4 n (8 d_k + 4 d_v + 2)  q and k (one per value head) before and after their L2 norm, k beta,
                                          w, q and k scaled by the decays; v, v beta, u, v'; the decay and beta
      chunk        4 n (2 + 2 log2 c) c    its [c, c] per head: decays, (k beta) k^T and q k^T, the
                                          inverse and the powers of its series
      state        4 n d_k d_v / c         the recurrent state entering each chunk
      output       n d_v (8 + e)           the rule's output, normed, gated
    Selective recompute keeps it all (it recomputes attention cores; this layer has none)."""
    n, dk, dv = m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    c = min(chunk, seq)
    conv = 2 * m.linear_num_key_heads * dk + n * dv
    state = 4 * n * dk * dv / c
    if kernels:
        rule = 4 * (2 * m.linear_num_key_heads * dk + n * (dv + 2))
        return 4 * conv + rule + state + 4 * 3 * n + (4 * 3 + act_bytes) * n * dv
    projections = ((m.linear_conv_kernel + 2) * conv + 2 * n * dv + 2 * n) * act_bytes
    rule = 4 * n * (8 * dk + 4 * dv + 2 + (2 + 2 * math.ceil(math.log2(c))) * c) + state
    return projections + rule + n * dv * (8 + act_bytes)


@dataclass(frozen=True)
class MoECost:
    """What one MoE layer costs per token on a device, beyond attention and norms.

    rows      expert rows computed per token: factor x k under a capacity (train.moe_capacity_factor),
              else BlockDispatch's blocks (the routed k and its padding), or with train.moe_dropless
              every, E (EveryExpert: every token through every expert)
    masks     GroupedCapacityDispatch's one-hot masks (Ascend with a capacity): [G, n, E*C] fp32 for the
              dispatch, the routing weights and one being built, 3 x 4 x factor x k x n bytes per token
              for groups of n tokens (layouts.dispatch_groups)
    The layer keeps per token: its rows in and out (2h each) and the gate, up and product of each
    (3 f_moe), the router's fp32 scores and probabilities (2 x 4 E), the shared experts' MLP, the masks."""
    hidden: int
    expert_ffn: int
    experts: int
    rows: float
    shared_ffn: int
    mask_bytes: float

    @staticmethod
    def of(cfg: Config, tokens_per_rank: int, dev: "Device") -> "MoECost | None":
        m, t = cfg.model, cfg.train
        if not m.num_experts:
            return None
        f = m.moe_ffn_size or m.ffn_size
        factor = t.moe_capacity_factor
        if factor > 0:
            rows = factor * m.experts_per_token
        elif t.moe_dropless == "blocks":  # BlockDispatch: at most ceil(N k / block) + E blocks of rows (CPU kernel's)
            block = GROUPED_BLOCK_ROWS
            rows = (-(-tokens_per_rank * m.experts_per_token // block) + m.num_experts) * block / tokens_per_rank
        else:
            rows = float(m.num_experts)
        masks = 0.0
        if factor > 0 and dev.backend == "ascend":
            n = tokens_per_rank * cfg.parallel.dp // L.dispatch_groups(cfg.parallel.dp, tokens_per_rank)
            masks = 3 * 4 * factor * m.experts_per_token * n
        return MoECost(m.hidden_size, f, m.num_experts, rows, m.shared_experts * f, masks)

    def activations(self, act_bytes: int) -> float:
        return (self.rows * (2 * self.hidden + 3 * self.expert_ffn) + 3 * self.shared_ffn) * act_bytes \
            + 2 * 4 * self.experts + self.mask_bytes

    def matmul_params(self) -> float:
        """Parameters a token's MoE MLP multiplies by: its rows through an expert, the shared experts, the router."""
        return self.rows * 3 * self.hidden * self.expert_ffn + 3 * self.hidden * self.shared_ffn + self.experts * self.hidden


# What data parallel adds to a CPU worker beyond one process (msllm.parallel.dp, .zero), fitted to
# tools/bench_plan_memory.py's W1 and W2 peaks (benchmarks/2026-11-23-plan-vs-rss-cpu.md), not yet
# derived op by op: the all-reduced gradients beside the raw ones (DP_GRAD_COPIES fp32 copies of the
# parameters), a fixed COLLECTIVE_BUCKETS x the 32 MiB bucket for the collectives' buffers, and for
# ZeRO-1 its update's temporaries and all-gathered weights (ZERO1_COPIES more copies).
DP_GRAD_COPIES = 1
COLLECTIVE_BUCKETS = 10
ZERO1_COPIES = 3


def cpu_workspace(m, sh: L.Sharding, p: ParallelConfig, batch: int, seq: int, act_bytes: int, layers: int,
                  params: int, last_stage: bool, flash: bool) -> float:
    """Bytes MindSpore's CPU step holds at its peak beyond layer_activations and the 16 bytes per
    parameter (counted from msllm's CPU formulations, per device):
      per layer    (3h/t + kv_local d) e per token: q three times (the projection and the rotated q,
                   which the fused RoPE's backward keeps, and the scaled q), k twice, the attention
                   output twice (as the core returns it and transposed for the output projection),
                   where layer_activations counts each once
      backward     one layer's score gradients dP and dS at once, 2 x 4 a s / t per token (fp32; not
                   with flash attention), and the loss's fp32 logits gradient beside the logits
      data parallel  DP_GRAD_COPIES (ZeRO-1: + ZERO1_COPIES) fp32 copies of the parameters held,
                   and COLLECTIVE_BUCKETS gradient buckets (over dp x cp)
      context parallel  seq / cp tokens per sequence, and one layer's K/V exchange at a time: the
                   placed buffer and its sum, 2 x 2 kv_local d e per token of the whole sequence
    """
    h, d, t = m.hidden_size, m.head_size, sh.tp
    tokens = batch * seq / p.cp
    exchange = 2 * 2 * batch * seq * m.num_kv_heads // sh.tp_kv * d * act_bytes if p.cp > 1 else 0.0
    kept = layers * tokens * (3 * h / t + m.num_kv_heads // sh.tp_kv * d) * act_bytes
    scores = 0 if flash else 2 * 4 * m.num_heads / t * seq * tokens
    logits = 4 * tokens * m.vocab_size / (t if sh.vocab_split else 1) if last_stage else 0.0
    if p.dp * p.cp == 1:
        return kept + scores + logits
    copies = DP_GRAD_COPIES + (ZERO1_COPIES if p.optimizer_shard else 0)
    return kept + scores + logits + exchange + copies * 4 * params + COLLECTIVE_BUCKETS * BUCKET_BYTES


def stage_parameters(m, sh: L.Sharding, experts: bool = False) -> list[int]:
    """Parameters one device holds on each pipeline stage, from the layout table (experts: only the
    experts' stacked weights, which are replicated over dp / ep ranks, not dp)."""
    counts = [0] * sh.pp
    for name, shape in L.param_shapes(m).items():
        layout, placement = L.param_entry(name)
        if experts and placement != "expert parallel":
            continue
        counts[L.stage_of(name, m.num_layers, sh.pp)] += math.prod(L.shard_shape(shape, layout, sh))
    return counts


def with_layout(cfg: Config, p: ParallelConfig, recompute: str | None = None, global_batch: int | None = None,
                seq_len: int | None = None) -> Config:
    """A copy of cfg laid out as p (the global batch as batch_size per replica x accum 1 x dp, so the
    layout's micro_batches cut each replica's batch)."""
    train = cfg.train
    if global_batch is not None:
        train = dataclasses.replace(train, batch_size=global_batch // p.dp, accum_steps=1)
    if recompute is not None:
        train = dataclasses.replace(train, recompute=recompute)
    data = cfg.data if seq_len is None else dataclasses.replace(cfg.data, seq_len=seq_len)
    return dataclasses.replace(cfg, parallel=p, train=train, data=data)


def uses_flash(cfg: Config, dev: Device, seq: int | None = None) -> bool:
    """Whether the planned step runs a flash attention core: train.attention as the device's backend
    resolves it (msllm.rules.resolves_to_flash) at `seq` tokens (default data.seq_len). Ascend
    (910b): auto and flash alike, when FlashAttentionScore takes the config (fp16 / bf16, head
    sizes multiples of 16, no packed samples); softmax never. CPU: as train.attention: auto picks there."""
    seq = cfg.data.seq_len if seq is None else seq
    return resolves_to_flash(cfg, dev.backend, cfg.train.fused_kernels != "off", seq, packed_samples(cfg))


def ring_attention(cp: int, dev: Device) -> bool:
    """Context parallel as FlashAttentionScore's ring attention (Ascend); on CPU it is
    msllm.parallel.cp's exchange of the whole sequence's K/V."""
    return cp > 1 and dev.backend == "ascend"


def estimate(cfg: Config, layout: ParallelConfig | None = None, device: str | Device = "910b",
             flash: bool | None = None, params_per_stage=None) -> dict:
    """Per-device memory (bytes), per-step communication (bytes sent per device) and time (s) of
    cfg laid out as `layout` (default cfg.parallel) with cfg.train.recompute, for the busiest
    pipeline stage; flash: count a flash attention core's activations (None: uses_flash). Keys:
    runtime, weights, grads, optimizer, activations, workspace, total, stage, params,
    optimizer_by_zero1, activations_by_recompute[(recompute, flash)], comm, time, bubble,
    tokens_per_s_per_device, mfu."""
    if layout is not None:
        cfg = dataclasses.replace(cfg, parallel=layout)
    dev = DEVICES[device] if isinstance(device, str) else device
    if flash is None:
        flash = uses_flash(cfg, dev)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    sh = L.sharding(m, p)
    seq, batch = cfg.data.seq_len, global_batch_of(cfg)
    micro = batch // (p.dp * p.micro_batches)  # sequences per micro-batch per replica
    wb, gb, ob = STATE_BYTES[t.precision]
    e = 4 if t.precision == "fp32" else 2
    counts, expert_counts = params_per_stage or (stage_parameters(m, sh), stage_parameters(m, sh, experts=True))
    layers = L.stage_layer_counts(m.num_layers, p.pp)
    tokens = micro * seq / p.cp  # computed on one device
    ring_cp = ring_attention(p.cp, dev)
    moe = MoECost.of(cfg, int(micro * seq), dev)
    kinds = m.mlp_kinds()
    firsts = L.stage_offsets(m.num_layers, p.pp)
    stage_kinds = [kinds[first:first + n] for first, n in zip(firsts, layers)]
    # each layer's (mixer, MLP) kinds: ("linear" for a Gated DeltaNet layer, else attention; "dense" / "moe")
    stage_layers = [list(zip(m.layer_kinds(), kinds))[first:first + n] for first, n in zip(firsts, layers)]
    linear_kernels = dev.backend == "cpu" and t.fused_kernels != "off"  # the CPU's C++ Gated DeltaNet kernels

    def activations(stage: int, recompute: str, with_flash: bool) -> float:
        in_flight = min(p.pp - stage, p.micro_batches)
        kept, rebuilt = 0.0, 0.0
        for mixer, kind in set(stage_layers[stage]):
            cost, linear = moe if kind == "moe" else None, mixer == "linear"
            per_layer = layer_activations(m, sh, micro, seq, e, recompute, with_flash, dev.flash_stats, p.cp, cost,
                                          ring_cp, linear, linear_kernels)
            full_layer = layer_activations(m, sh, micro, seq, e, "none", with_flash, dev.flash_stats, p.cp, cost,
                                           ring_cp, linear, linear_kernels)
            kept += stage_layers[stage].count((mixer, kind)) * per_layer
            rebuilt = max(rebuilt, full_layer - per_layer)  # one layer's dropped activations, rebuilt in its backward
        logits = 2 * 4 * tokens * m.vocab_size / (p.tp if sh.vocab_split else 1) if stage == p.pp - 1 else 0.0
        return kept * in_flight + rebuilt + logits

    def updated(stage: int, shard: bool = p.optimizer_shard) -> float:
        """Parameters whose Adam states a device holds and updates: ZeRO-1 splits them over the ranks
        holding the same weights, dp (a device's E / ep experts: over dp / ep, the edp group)."""
        if not shard:
            return counts[stage]
        return (counts[stage] - expert_counts[stage]) / p.dp + expert_counts[stage] / (p.dp // sh.ep)

    def optimizer(stage: int, shard: bool = p.optimizer_shard) -> float:
        return updated(stage, shard) * ob

    stages = []
    for k in range(p.pp):
        n = counts[k]
        mem = {"runtime": dev.runtime, "weights": n * wb, "grads": n * gb, "optimizer": optimizer(k),
               "activations": activations(k, t.recompute, flash),
               "workspace": cpu_workspace(m, sh, p, micro, seq, e, layers[k], n, k == p.pp - 1, flash)
               if dev.host else 0.0}
        mem["total"] = sum(mem.values())
        stages.append(mem)
    busiest = max(range(p.pp), key=lambda k: stages[k]["total"])

    # communication and time
    def bandwidth(span: int) -> float:  # a group spanning `span` consecutive ranks
        return dev.intra if span <= dev.per_node else dev.inter

    ring = lambda g: 2 * (g - 1) / g  # noqa: E731  all-reduce bytes sent per device, per buffer byte
    h = m.hidden_size
    tp_allreduces = [4 * n_layers + (2 * n_layers if t.recompute == "full" else 0) for n_layers in layers]
    if sh.vocab_split:  # embedding forward, LM-head input gradient
        tp_allreduces[0] += 1
        tp_allreduces[-1] += 1
    tp_bytes = [k * ring(p.tp) * tokens * h * e for k in tp_allreduces]   # per micro-batch
    pp_bytes = 2 * tokens * h * e / (p.tp if sh.sequence_parallel else 1) if p.pp > 1 else 0.0
    grad_ranks = p.dp * p.cp  # gradients are summed over every replica and every cp rank
    dense_grads = max(c - x for c, x in zip(counts, expert_counts))
    dp_bytes = ring(grad_ranks) * dense_grads * 4 if grad_ranks > 1 else 0.0
    expert_ranks = grad_ranks // sh.ep  # an expert's gradients are summed over the ranks holding it
    dp_bytes += ring(expert_ranks) * max(expert_counts) * 4 if expert_ranks > 1 else 0.0
    # Expert parallel moves each MoE layer's rows twice forward (to the experts and back) and twice
    # backward (again forward under full recompute): on Ascend an AllToAll of the rows a device
    # routes (tokens x rows x h, (ep-1)/ep of it leaving), on CPU msllm.parallel.ep's all-gather by
    # AllReduce of the ep group's tokens, then of its outputs ([ep x tokens, h] each).
    moe_layers = [ks.count("moe") for ks in stage_kinds]
    ep_moves = 4 + (2 if t.recompute == "full" else 0)
    if sh.ep > 1 and dev.host:
        ep_per_layer = ep_moves * ring(sh.ep) * sh.ep * tokens * h * e
    elif sh.ep > 1:
        ep_per_layer = ep_moves * (sh.ep - 1) / sh.ep * tokens * moe.rows * h * e
    else:
        ep_per_layer = 0.0
    ep_bytes = [n * ep_per_layer for n in moe_layers]
    # K and V of the whole sequence, [2, micro, kv_local, seq, d]: on CPU summed over the cp group per
    # layer (AllReduce); on Ascend the ring passes every other chunk through each device, forward, and
    # backward again with the chunks' dK / dV
    kv_buffer = 2 * micro * seq * m.num_kv_heads // sh.tp_kv * m.head_size * e
    if ring_cp:
        per_layer_cp = (3 + (1 if t.recompute == "full" else 0)) * (p.cp - 1) / p.cp * kv_buffer
    else:
        per_layer_cp = (2 + (1 if t.recompute == "full" else 0)) * ring(p.cp) * kv_buffer
    cp_bytes = [n * per_layer_cp for n in layers] if p.cp > 1 else [0.0] * p.pp

    # matmul parameters per layer and token: a MoE layer's as MoECost counts them (not cut by tp: the
    # experts are whole on each tp rank), a dense layer's all (cut by tp)
    f_moe = m.moe_ffn_size or m.ffn_size
    moe_mlps = kinds.count("moe") * (3 * h * f_moe * (m.num_experts + m.shared_experts) + m.num_experts * h)
    moe_params = moe.matmul_params() if moe else 0.0
    # attention, norms and dense MLPs, averaged over the layers
    layer_params = (m.num_params() - moe_mlps - m.vocab_size * h * (1 if m.tie_embeddings else 2) - h) / m.num_layers
    extra = {"none": 0.0, "selective": 6 * h * m.ffn_size, "full": 2 * layer_params}
    moe_flops = 6 * moe_params * (1 + {"none": 0.0, "selective": 1 / 3, "full": 1 / 3}[t.recompute])
    # a layer's mixing core per token: attention's scores (4 h s forward, twice that backward), a Gated DeltaNet
    # layer's chunked rule (3 x its forward); recompute reruns attention's forward, the rule's under full only
    rule = m.linear_rule_flops(seq) if m.hybrid else 0.0
    linear_layers = [[mixer for mixer, _ in ks].count("linear") for ks in stage_layers]

    def core_flops(k: int) -> float:
        attention, linear = layers[k] - linear_layers[k], linear_layers[k]
        again = {"none": 0.0, "selective": 4 * h * seq * attention, "full": 4 * h * seq * attention + rule * linear}
        return 12 * h * seq * attention + 3 * rule * linear + again[t.recompute]

    rate = dev.peak_flops * dev.efficiency
    stage_time = []
    for k in range(p.pp):
        flops = tokens * (layers[k] * (6 * layer_params + extra[t.recompute]) + core_flops(k))
        if k == p.pp - 1:
            flops += tokens * 6 * m.vocab_size * h
        experts = tokens * moe_layers[k] * moe_flops
        stage_time.append(flops / p.tp / rate + experts / rate + tp_bytes[k] / bandwidth(p.tp)
                          + cp_bytes[k] / bandwidth(p.cp * p.tp) + ep_bytes[k] / bandwidth(sh.ep * p.tp))
    pp_time = pp_bytes / bandwidth(p.dp * p.tp * p.pp) if p.pp > 1 else 0.0
    micro_time = max(stage_time) + pp_time
    slots = p.micro_batches + p.pp - 1
    optimizer_params = max(updated(k) for k in range(p.pp))
    time = {"compute": p.micro_batches * micro_time, "bubble": (p.pp - 1) * micro_time,
            "dp": dp_bytes / bandwidth(grad_ranks * p.tp) if grad_ranks > 1 else 0.0,
            "optimizer": optimizer_params * (2 * wb + gb + 2 * ob) / dev.hbm}
    time["step"] = sum(time.values())
    devices = p.dp * p.cp * p.tp * p.pp
    tokens_per_step = batch * seq
    return {
        **stages[busiest], "stage": busiest, "params": counts[busiest],
        "optimizer_by_zero1": {False: optimizer(busiest, False), True: optimizer(busiest, True)},
        "activations_by_recompute": {(r, f): activations(busiest, r, f) for r in RECOMPUTE for f in (False, True)},
        "comm": {"dp": dp_bytes, "tp": p.micro_batches * max(tp_bytes), "pp": p.micro_batches * pp_bytes,
                 "cp": p.micro_batches * max(cp_bytes), "ep": p.micro_batches * max(ep_bytes)},
        "time": time, "bubble": (p.pp - 1) / slots,
        "tokens_per_s_per_device": tokens_per_step / time["step"] / devices,
        "mfu": m.flops_per_token(seq) * tokens_per_step / time["step"] / (devices * dev.peak_flops),
    }


# ---- search ----------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Candidate:
    cfg: Config          # the config laid out (parallel section, train.recompute, global batch)
    est: dict

    @property
    def key(self):
        p = self.cfg.parallel
        return (self.est["time"]["step"], p.micro_batches, RECOMPUTE.index(self.cfg.train.recompute), p.pp, p.tp, p.ep)


def candidates(cfg: Config, devices: int, global_batch: int, seq_len: int, device: Device, flash: bool):
    """Every valid layout of `devices` (each passes the checker) with every recompute mode, estimated.
    Context parallel stays the config's parallel.cp (a choice of sequence split, not searched); expert
    parallel (ep) is searched over the divisors of dp that divide a MoE model's experts."""
    cp, m = cfg.parallel.cp, cfg.model
    if devices % cp:
        return
    for tp in divisors(devices // cp):
        for pp in divisors(devices // (cp * tp)):
            dp = devices // (cp * tp * pp)
            if global_batch % dp:
                continue
            for ep in [k for k in divisors(dp) if m.num_experts % k == 0] if m.num_experts else [1]:
                cache = None
                for micro in divisors(global_batch // dp):
                    if pp > 1 and micro < pp:
                        continue
                    p = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batches=micro, optimizer_shard=dp > 1,
                                       sequence_parallel=tp > 1 and seq_len % tp == 0, vocab_parallel=True)
                    laid = with_layout(cfg, p, global_batch=global_batch, seq_len=seq_len)
                    if layout_problem(laid, devices) is not None:
                        continue
                    if cache is None:
                        sh = L.sharding(m, p)
                        cache = (stage_parameters(m, sh), stage_parameters(m, sh, experts=True))
                    for recompute in RECOMPUTE:
                        laid_r = with_layout(laid, p, recompute=recompute)
                        yield Candidate(laid_r, estimate(laid_r, None, device, flash, cache))


def plan(cfg: Config, devices: int, device: Device, memory: float, global_batch: int, seq_len: int,
         flash: bool | None = None) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting candidates best first, all valid candidates); flash: None, as uses_flash resolves it."""
    if flash is None:
        flash = uses_flash(cfg, device, seq_len)
    every = list(candidates(cfg, devices, global_batch, seq_len, device, flash))
    fits = sorted((c for c in every if c.est["total"] <= USABLE * memory), key=lambda c: c.key)
    return fits, every


def smallest_fit(cfg, devices, device, memory, global_batch, seq_len, flash) -> int | None:
    """The fewest devices (among multiples of `devices` and powers of two up to 64x) where a layout fits."""
    tried = sorted({devices * k for k in range(2, 65)} | {2 ** i for i in range(20) if 2 ** i > devices})
    for n in tried:
        if n > 64 * devices:
            break
        if any(c.est["total"] <= USABLE * memory for c in candidates(cfg, n, global_batch, seq_len, device, flash)):
            return n
    return None


# ---- output ----------------------------------------------------------------------------------------

def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def describe(c: Candidate) -> str:
    p = c.cfg.parallel
    recompute = {"none": "no", "selective": "selective", "full": "full"}[c.cfg.train.recompute]
    micro = f"{p.micro_batches} micro-batch" + ("es" if p.micro_batches > 1 else "")
    cp = f" x cp {p.cp}" if p.cp > 1 else ""
    ep = f" (ep {p.ep} within dp)" if p.ep > 1 else ""
    return f"dp {p.dp} x tp {p.tp} x pp {p.pp}{cp}{ep}, {micro}, {recompute} recompute"


def table(rows: list[Candidate]) -> list[str]:
    """One line per layout; a cp column and the K/V exchange's bytes when the layouts split sequences."""
    split = any(c.cfg.parallel.cp > 1 for c in rows)
    experts = any(c.cfg.model.num_experts for c in rows)
    kinds = ("dp", "tp", "pp") + (("cp",) if split else ()) + (("ep",) if experts else ())
    comm_head = f"comm {'/'.join(kinds)} GB"
    head = (f"{'dp':>3} {'tp':>3} {'pp':>3}{' cp' if split else ''}{' ep' if experts else ''} {'micro':>5} {'zero1':>5} {'sp':>3} "
            f"{'recompute':>9} {'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6} "
            f"{comm_head:>17} {'bubble':>6} {'step s':>7} {'tok/s/dev':>9} {'MFU':>4}")
    lines = [head]
    for c in rows:
        p, e = c.cfg.parallel, c.est
        comm = "/".join(f"{e['comm'][k] / GB:.1f}" for k in kinds)
        cp = f" {p.cp:>2}" if split else ""
        cp += f" {p.ep:>2}" if experts else ""
        lines.append(
            f"{p.dp:>3} {p.tp:>3} {p.pp:>3}{cp} {p.micro_batches:>5} {'y' if p.optimizer_shard else '-':>5} "
            f"{'y' if p.sequence_parallel else '-':>3} {c.cfg.train.recompute:>9} "
            f"{_gb(e['weights']):>7} {_gb(e['grads']):>6} {_gb(e['optimizer']):>6} {_gb(e['activations']):>6} "
            f"{_gb(e['total']):>6} {comm:>17} {e['bubble']:>6.0%} {e['time']['step']:>7.2f} "
            f"{e['tokens_per_s_per_device']:>9.0f} {e['mfu']:>4.0%}")
    return lines


def overrides(c: Candidate, cfg: Config, given: typing.Sequence[str] = ()) -> list[str]:
    """The best layout as `--set` overrides for `msllm train --config <the planned config>`: the plan's
    own --set first (what it planned includes them) unless the layout sets the same key, then the
    layout and the train keys it assumes. Overrides rather than a YAML block: a block appended to
    the config repeats its train: section, which the loader rightly refuses."""
    p = c.cfg.parallel
    keys = ("dp", "tp", "pp", "micro_batches", "optimizer_shard", "sequence_parallel", "vocab_parallel")
    if p.cp > 1:
        keys = keys + ("cp",)
    if c.cfg.model.num_experts:
        keys = keys + ("ep",)
    sets = [f"parallel.{k}={str(getattr(p, k)).lower()}" for k in keys]
    sets += [f"train.batch_size={c.cfg.train.batch_size}", "train.accum_steps=1", f"train.recompute={c.cfg.train.recompute}"]
    if c.cfg.data.seq_len != cfg.data.seq_len:
        sets.append(f"data.seq_len={c.cfg.data.seq_len}")
    planned = {s.split("=", 1)[0] for s in sets}
    kept = [s for s in given if s.split("=", 1)[0].strip() not in planned]
    return kept + sets


def context_parallel_note(cfg: Config, seq: int, est: dict, device: str) -> str:
    """'; context parallel ...' for a layout that splits sequences, else ''."""
    cp = cfg.parallel.cp
    if cp == 1:
        return ""
    kept = ("its chunk's K/V, passing the others around the ring" if ring_attention(cp, DEVICES[device])
            else "the whole sequence's K/V, exchanging it")
    return (f"; context parallel {cp}: each device computes {seq // cp} of every {seq} tokens and keeps {kept}: "
            f"{est['comm']['cp'] / GB:.2f} GB per step "
            f"({est['comm']['cp'] / GB / max(est['time']['step'], 1e-12):.1f} GB/s at the estimated step time)")


def run(cfg: Config, source: str, devices: int, device: str, memory: float | None = None,
        global_batch: int | None = None, seq_len: int | None = None, check: bool = False, top: int = 10,
        out=print, err=print, given: typing.Sequence[str] = ()) -> int:
    """msllm plan: 0 = printed a plan (or --check passed), 1 = nothing fits; bad input raises (exit 2).
    `given`: the --set overrides cfg was loaded with (repeated in the printed overrides). The
    attention core counted is the one train.attention resolves to on the device (uses_flash)."""
    if device not in DEVICES:
        raise PlanError(f"--device: one of {', '.join(DEVICES)}, got {device!r}")
    dev = DEVICES[device]
    memory = dev.memory if memory is None else memory
    seq = cfg.data.seq_len if seq_len is None else seq_len
    if devices < 1:
        raise PlanError("--devices: must be >= 1")
    if not 1 < seq <= cfg.model.max_seq_len:
        raise PlanError(f"--seq-len: must be in 2..model.max_seq_len ({cfg.model.max_seq_len}), got {seq}")
    if global_batch is not None and global_batch < 1:
        raise PlanError("--global-batch: must be >= 1")
    batch = global_batch_of(cfg) if global_batch is None else global_batch
    mem_text = f"{memory / GB:.0f} GB"
    flash = uses_flash(cfg, dev, seq)

    if check:
        laid = with_layout(cfg, cfg.parallel, global_batch=global_batch, seq_len=seq_len)
        check_parallel(laid, devices, source)
        check_execution(laid, source)
        c = Candidate(laid, estimate(laid, None, dev, flash))
        e = c.est
        fits = e["total"] <= USABLE * memory
        line = (f"msllm plan: {source}: {describe(c)} is valid on {devices} devices; per device "
                f"{_gb(e['total'])} GB (weights {_gb(e['weights'])}, grads {_gb(e['grads'])}, optimizer "
                f"{_gb(e['optimizer'])}, activations {_gb(e['activations'])}), est. {e['time']['step']:.2f} s/step"
                + context_parallel_note(laid, seq, e, device))
        if fits:
            out(line + f"; fits {devices} x {device} ({mem_text})")
            return 0
        err(line + f"; does not fit {USABLE:.0%} of {mem_text}")
        return 1

    fits, every = plan(cfg, devices, dev, memory, batch, seq, flash)
    if not every:
        trial = with_layout(cfg, ParallelConfig(dp=devices), global_batch=batch, seq_len=seq)
        key, message = layout_problem(trial, devices) or ("parallel", "no layout passes the checker")
        raise PlanError(f"no valid layout of {source} on {devices} devices (e.g. dp {devices}: {key}: {message})")
    if not fits:
        least = min(every, key=lambda c: c.est["total"])
        more = smallest_fit(cfg, devices, dev, memory, batch, seq, flash)
        more_text = f"; {more} devices of {mem_text} would fit" if more else ""
        err(f"msllm plan: nothing fits {devices} x {device} ({mem_text}, {USABLE:.0%} usable): the smallest layout "
            f"({describe(least)}) needs {least.est['total'] / USABLE / GB:.1f} GB per device{more_text}")
        return 1

    best_per_mesh = {}
    for c in fits:
        best_per_mesh.setdefault((c.cfg.parallel.dp, c.cfg.parallel.tp, c.cfg.parallel.pp, c.cfg.parallel.ep), c)
    shown = list(best_per_mesh.values())[:top]
    best = fits[0]
    out(f"msllm plan: {source}: {cfg.model.num_params() / 1e9:.2f}B parameters, seq {seq}, global batch {batch}, "
        f"{cfg.train.precision}, on {devices} x {device} ({mem_text} each, plans use up to {USABLE:.0%}; GB = 2^30 B)")
    out(f"{len(every) // len(RECOMPUTE)} valid layouts x {len(RECOMPUTE)} recompute modes, {len(fits)} of them fit; "
        f"the best per dp x tp x pp by estimated step time{' (flash attention)' if flash else ''}:")
    for line in table(shown):
        out(line)
    if cfg.parallel.cp > 1:
        out(context_parallel_note(best.cfg, seq, best.est, device).lstrip("; "))
    acts = best.est["activations_by_recompute"]
    out("activations per device of the best, none / selective / full recompute: "
        + " / ".join(_gb(acts[r, False]) for r in RECOMPUTE) + " GB without flash attention, "
        + " / ".join(_gb(acts[r, True]) for r in RECOMPUTE) + " GB with")
    out(f"# best: {describe(best)}: est. {best.est['time']['step']:.2f} s/step, "
        f"{_gb(best.est['total'])} of {mem_text} per device")
    out(f"# as --set overrides: append them to `msllm train --config {shlex.quote(source)}` (or to the train command "
        f"after `msllm launch ... --`):")
    out(" ".join(f"--set {shlex.quote(s)}" for s in overrides(best, cfg, given)))
    return 0
