"""Mixture of experts: a router and stacked experts, in place of a layer's dense MLP.

The router scores each token against every expert (softmax in fp32), keeps the top k and, if the
family says so, renormalises those k weights to sum to one (Mixtral always, Qwen3-MoE with
norm_topk_prob); DeepSeek-V3's router (GroupedSigmoidRouter) scores with sigmoids and picks within
the best groups of experts, and its layers add shared experts every token runs. Expert weights are stacked, w1 / w3 [E, f, h] and w2 [E, h, f], so one batched
matmul serves all experts per projection.

A dispatcher decides which rows the experts compute: every token (EveryExpert: dropless, the
reference maths) or at most a capacity of each expert's choices (CapacityDispatch, for training).
"""
from __future__ import annotations

import math

import mindspore as ms
from mindspore import Parameter, ParameterTuple, nn, ops
from mindspore.common.initializer import initializer

from msllm.config import ModelConfig
from msllm.rules import BLOCK_ROWS
from msllm.models.layers import FeedForward, Linear, activation, cast


def z_loss(logits):
    """The router z-loss of ST-MoE (Zoph et al., 2022): the mean over tokens of log(sum(exp(logits)))^2,
    which keeps the router's logits small (logits [N, E] fp32 -> a scalar)."""
    top = ops.stop_gradient(ops.max(logits, -1, keepdims=True)[0])
    lse = ops.log(ops.sum(ops.exp(logits - top), -1)) + top.reshape(-1)
    return ops.mean(lse * lse)


def sequence_balance(picked, probs, rows: int, k: int):
    """DeepSeek-V3's complementary sequence-wise balance loss of one MoE layer (its report, eqs. 17-20): for each
    sequence of `rows` tokens, sum_e f_e * P_e with f_e = E / (k rows) x the tokens choosing expert e and P_e the
    mean of its normalised router scores (probs, each token's summing to one), averaged over the sequences.
    picked [N, E]: 1 where a token chose the expert; only P carries a gradient."""
    e = picked.shape[-1]
    f = ops.stop_gradient(ops.mean(picked.reshape(-1, rows, e), 1)) * (e / k)                   # [sequences, E]
    return ops.mean(ops.sum(f * ops.mean(probs.reshape(-1, rows, e), 1), -1))


class Router(nn.Cell):
    """x [N, h] -> (weights [N, k] fp32, experts [N, k] int32, probabilities [N, E] fp32, z-loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.renormalise = cfg.experts_per_token, cfg.norm_topk_prob
        self.weight = Parameter(initializer("zeros", (cfg.num_experts, cfg.hidden_size), ms.float32), name="weight")
        # gpt-oss: a learned bias on the logits (without: a constant 0, no parameter)
        self.bias = (Parameter(initializer("zeros", (cfg.num_experts,), ms.float32), name="bias") if cfg.router_bias
                     else ms.Tensor(0.0, ms.float32))
        self.matmul = ops.MatMul(transpose_b=True)
        self.softmax = ops.Softmax(-1)
        self.topk = ops.TopK(sorted=True)

    def construct(self, x):
        logits = cast(self.matmul(x, cast(self.weight, x.dtype)), ms.float32) + self.bias
        probs = self.softmax(logits)
        weights, experts = self.topk(probs, self.k)
        if self.renormalise:
            weights = weights / ops.sum(weights, -1, keepdim=True)
        return weights, experts, probs, z_loss(logits)


class GroupedSigmoidRouter(nn.Cell):
    """DeepSeek-V3's router, x [N, h] -> (weights [N, k] fp32, experts [N, k] int32, scores [N, E] fp32, z-loss).

    Scores are sigmoid(x W^T) in fp32. Which experts: the experts are split into `expert_groups` groups,
    each group scored by the sum of its two best biased scores (score + expert_bias), and a token takes its
    top k biased scores within its `topk_groups` best groups. The weights are the unbiased scores of those
    k, renormalised when norm_topk_prob, times routed_scaling. expert_bias (transformers'
    e_score_correction_bias, set by DeepSeek's aux-loss-free balancing between steps) only steers the
    choice and takes no gradient. The scores returned for the load statistics are normalised to sum to one
    per token (DeepSeek-V3's sequence-wise balance loss reads them so)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.num_experts
        self.num_experts, self.k, self.renormalise = e, cfg.experts_per_token, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling
        self.groups, self.topk_groups = cfg.expert_groups, cfg.topk_groups
        self.weight = Parameter(initializer("zeros", (e, cfg.hidden_size), ms.float32), name="weight")
        # A Parameter, so checkpoints and conversion carry it like every weight (they read the trainable
        # ones). stop_gradient below makes its gradient exactly zero, and AdamW neither decays a 1-D
        # parameter nor moves one whose gradient is always zero, so training leaves it bit-identical.
        self.expert_bias = Parameter(initializer("zeros", (e,), ms.float32), name="expert_bias")
        self.matmul = ops.MatMul(transpose_b=True)
        self.sigmoid = ops.Sigmoid()
        self.topk = ops.TopK(sorted=True)

    def construct(self, x):
        logits = self.matmul(cast(x, ms.float32), self.weight)
        scores = self.sigmoid(logits)                                                          # [N, E]
        biased = scores + ops.stop_gradient(self.expert_bias)
        per_group = biased.reshape(-1, self.num_experts // self.groups)                      # [N*G, E/G]
        group_scores = ops.sum(self.topk(per_group, 2)[0], -1).reshape(-1, self.groups)        # [N, G]
        best = self.topk(group_scores, self.topk_groups)[1]
        chosen_groups = ops.sum(ops.one_hot(best, self.groups, ops.ones((), ms.float32), ops.zeros((), ms.float32)), 1)
        allowed = ops.broadcast_to(chosen_groups.reshape(-1, 1), per_group.shape).reshape(biased.shape) > 0
        experts = self.topk(ops.select(allowed, biased, ops.full(biased.shape, -1e30, dtype=ms.float32)), self.k)[1]
        weights = ops.gather_elements(scores, 1, experts)
        if self.renormalise:
            weights = weights / (ops.sum(weights, -1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts, scores / ops.sum(scores, -1, keepdim=True), z_loss(logits)


ROUTERS = {"softmax": Router, "sigmoid_grouped": GroupedSigmoidRouter}


class Experts(nn.Cell):
    """E gated MLPs side by side: xs [E, n, h] (expert e's n input rows) -> [E, n, h]; or, given ids [B],
    xs [B, n, h] where batch b holds rows of expert ids[b] (BlockDispatch)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, f, h = cfg.num_experts, cfg.moe_ffn_size or cfg.ffn_size, cfg.hidden_size
        self.w1 = Parameter(initializer("zeros", (e, f, h), ms.float32), name="w1")   # gate
        self.w2 = Parameter(initializer("zeros", (e, h, f), ms.float32), name="w2")   # down
        self.w3 = Parameter(initializer("zeros", (e, f, h), ms.float32), name="w3")   # up
        self.matmul = ops.BatchMatMul(transpose_b=True)
        self.grouped = GatheredMatmul()
        self.activation = cfg.mlp
        self.act = activation(cfg)
        # gpt-oss: biases per expert on gate, down and up (none: the projections alone)
        self.b1, self.b2, self.b3 = ((StackedBias(e, f), StackedBias(e, h), StackedBias(e, f)) if cfg.experts_bias
                                     else (NoBias(), NoBias(), NoBias()))

    def construct(self, xs, ids=None):
        return self.compute(xs, self.w1, self.w2, self.w3, ids)

    def compute(self, xs, w1, w2, w3, ids=None):
        """The experts' maths with weights w1, w2, w3 (their own, or LoRA-adapted: msllm.lora.LoRAExperts),
        each batch of xs with the expert ids names (None: batch e is expert e)."""
        if ids is not None:  # the grouped matmul adds each block's expert bias itself
            hidden = self.act(self.grouped(xs, w1, ids, self.b1.bias), self.grouped(xs, w3, ids, self.b3.bias))
            return self.grouped(hidden, w2, ids, self.b2.bias)
        hidden = self.act(self.b1(self.matmul(xs, cast(w1, xs.dtype))), self.b3(self.matmul(xs, cast(w3, xs.dtype))))
        return self.b2(self.matmul(hidden, cast(w2, xs.dtype)))


class StackedBias(nn.Cell):
    """Each expert's bias [E, width] added to its rows ys [E, n, width]; BlockDispatch's blocks take `bias` into
    their grouped matmul (GatheredMatmul)."""

    def __init__(self, experts: int, width: int):
        super().__init__()
        self.bias = Parameter(initializer("zeros", (experts, width), ms.float32), name="bias")

    def construct(self, ys):
        return ys + cast(self.bias, ys.dtype).reshape(self.bias.shape[0], 1, -1)


class NoBias(nn.Cell):
    bias = None

    def construct(self, ys):
        return ys


class GatheredMatmul(nn.Cell):
    """xs [B, n, in] @ w[ids]^T (+ bias[ids], bias [E, out]) -> [B, n, out]: block i of rows times expert ids[i]'s
    weights (w [E, out, in]), with each block's weights gathered: the portable form. On CPU the backend swaps in
    msllm.kernels.GroupedMatmul, which reads each expert's weights once and scatters no weight-sized
    gradient per block."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.BatchMatMul(transpose_b=True)

    def construct(self, xs, w, ids, bias=None):
        ys = self.matmul(xs, cast(ops.gather(w, ids, 0), xs.dtype))
        if bias is None:
            return ys
        return ys + cast(ops.gather(bias, ids, 0), ys.dtype).reshape(ids.shape[0], 1, -1)


def choices(chosen, num_experts: int):
    """The top-k choices [N, k] as one-hot rows [N, k, E] (fp32)."""
    return ops.one_hot(chosen, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))


def capacity(factor: float, n: int, k: int, num_experts: int) -> int:
    """Rows each expert takes of n tokens' k choices at a capacity factor (at most n)."""
    return min(n, math.ceil(factor * n * k / num_experts))


def rank_at_expert(picked, axis: int = 0):
    """Each choice's rank among its expert's choices, in order along `axis` (picked: one-hot rows, fp32)."""
    return ops.sum((ops.cumsum(picked, axis) - picked) * picked, -1)


def gather_rows(x, slot, k: int, rows: int):
    """[rows, h]: at each row the token of x [N, h] whose choice's slot [N k] it is, zeros where no
    choice landed; a slot of `rows` (or more) is a spare, discarded."""
    n, h = x.shape
    token = ops.arange(0, n * k, dtype=ms.int32) // k
    # which token fills each row (+1 so that 0 marks an empty row; the spare row sums junk)
    filler = ops.scatter_nd(slot.reshape(-1, 1), token + 1, (rows + 1,))[:rows] - 1
    filler = ops.select(filler < 0, ops.full(filler.shape, n, dtype=ms.int32), filler)  # empty: the zero row n
    return ops.gather(ops.concat((x, ops.zeros((1, h), x.dtype)), 0), filler, 0)


def sum_choices(ys, slot, weights, k: int, spare: bool = True):
    """[N, h]: each token's k choices' rows of ys ([..., h], flat by slot) times their weights, summed;
    spare: a slot past ys's rows reads zeros (a dropped choice)."""
    h = ys.shape[-1]
    ys = ys.reshape(-1, h)
    if spare:
        ys = ops.concat((ys, ops.zeros((1, h), ys.dtype)), 0)
    per_choice = ops.gather(ys, slot, 0) * cast(weights, ys.dtype).reshape(-1, 1)          # [N k, h]
    return ops.sum(per_choice.reshape(-1, k, h), 1)


class Dispatch(nn.Cell):
    """What a dispatcher is: dispatch(x [N, h], weights [N, k], chosen [N, k]) -> (rows, route) for
    Experts, combine(expert outputs, route) -> (out [N, h], dropped [E]), and block_ids(route): which
    expert each batch of rows is for (None: batch e is expert e)."""

    def block_ids(self, route):
        return None


class EveryExpert(Dispatch):
    """Dropless dispatch: every token to every expert, the outputs summed with the routing weights
    (0 for the experts a token was not routed to). Static in shape and exactly the sum transformers
    computes, at E / k times the FLOPs of the routed choices: the reference formulation, and what
    generation and export use.

    dispatch(x [N, h], weights, chosen [N, k]) -> (rows [E, n, h] for Experts, route);
    combine(expert outputs [E, n, h], route) -> (out [N, h], dropped [E]: share of the choices dropped)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def dispatch(self, x, weights, chosen):
        n, h = x.shape
        combine = ops.sum(choices(chosen, self.num_experts) * weights.reshape(weights.shape + (1,)), 1)  # [N, E]
        return ops.broadcast_to(x.reshape(1, n, h), (self.num_experts, n, h)), combine

    def combine(self, ys, combine):
        out = ops.sum(ys * cast(combine, ys.dtype).transpose(1, 0).reshape(self.num_experts, -1, 1), 0)
        return out, ops.zeros((self.num_experts,), ms.float32)


class CapacityDispatch(Dispatch):
    """Each expert takes at most C = ceil(factor * N * k / E) of the N tokens' k choices, in token
    order (GShard, Switch): rows [E, C, h], so the experts compute factor x the routed choices
    instead of every token. Choices beyond an expert's C are dropped: the token keeps its other
    choices (and the residual stream), and the drop is counted in the layer's load. A training
    formulation (train.moe_capacity_factor, applied by msllm.backends); N must be static."""

    def __init__(self, num_experts: int, factor: float):
        super().__init__()
        self.num_experts, self.factor = num_experts, factor

    def dispatch(self, x, weights, chosen):
        n, h = x.shape
        e, k = self.num_experts, chosen.shape[1]
        c = capacity(self.factor, n, k, e)
        picked = choices(chosen, e).reshape(n * k, e)
        place = rank_at_expert(picked).astype(ms.int32)
        kept = place < c
        slot = ops.select(kept, chosen.reshape(-1) * c + place, ops.full(kept.shape, e * c, dtype=ms.int32))  # e*c: spare
        rows = gather_rows(x, slot, k, e * c).reshape(e, c, h)
        dropped = ops.sum(picked * (1.0 - kept.astype(ms.float32)).reshape(-1, 1), 0) / n
        return rows, (slot, weights.reshape(-1) * kept.astype(ms.float32), dropped, k)

    def combine(self, ys, route):
        slot, weights, dropped, k = route
        return sum_choices(ys, slot, weights, k), dropped


class GroupedCapacityDispatch(Dispatch):
    """CapacityDispatch computed per group of tokens, in one-hot matmuls (GShard's form): the N tokens
    are `groups` groups of n = N / groups (under semi-auto parallel, the batch shards of the data-parallel
    ranks), each expert takes at most C = ceil(factor * n * k / E) choices of each group, and rows
    [E, groups * C, h] hold expert e's rows group by group. Every step is a primitive the layout table
    cuts (layouts: the MoE rows): dispatch_rows and combine_rows batch over groups, to_experts and
    from_experts turn [groups, E, ...] into [E, groups, ...] and back, so under expert parallel the rows
    move from the ranks holding the tokens to the ranks holding the experts (the AlltoAll semi-auto
    parallel inserts). With groups = 1 it is CapacityDispatch (same choices, same drops). The one-hot
    masks are [groups, n, E * C], n x factor x k x n per group: what GShard pays for static shapes,
    bounded by keeping groups small (msllm.layout.table.dispatch_groups)."""

    def __init__(self, num_experts: int, factor: float, groups: int):
        super().__init__()
        self.num_experts, self.factor, self.groups = num_experts, factor, groups
        self.dispatch_rows = ops.BatchMatMul(transpose_a=True)  # mask^T [G, E*C, n] x x [G, n, h]
        self.combine_rows = ops.BatchMatMul()                    # weights [G, n, E*C] x rows [G, E*C, h]
        self.to_experts = ops.Transpose()
        self.from_experts = ops.Transpose()

    def dispatch(self, x, weights, chosen):
        h, (n_all, k), e, g = x.shape[-1], chosen.shape, self.num_experts, self.groups
        n = n_all // g
        c = capacity(self.factor, n, k, e)
        picked = choices(chosen, e).reshape(g, n * k, e)
        place = rank_at_expert(picked, 1)                                                # [G, n*k]
        kept = (place < c).astype(ms.float32)
        slot = (chosen.reshape(g, n, k) * c + place.astype(ms.int32).reshape(g, n, k))  # row of each choice
        kept_weight = (kept.reshape(g, n, k) * weights.reshape(g, n, k))
        one, zero = ops.ones((), ms.float32), ops.zeros((), ms.float32)
        mask, route = 0, 0
        for j in range(k):  # one choice at a time: [G, n, E*C] masks, never [G, n, k, E*C]
            at = ops.one_hot(slot[:, :, j], e * c, one, zero)
            mask = mask + at * kept.reshape(g, n, k)[:, :, j:j + 1]                        # 0 / 1
            route = route + at * kept_weight[:, :, j:j + 1]                               # the routing weights
        rows = self.dispatch_rows(cast(mask, x.dtype), x.reshape(g, n, h))               # [G, E*C, h]
        rows = self.to_experts(rows.reshape(g, e, c, h), (1, 0, 2, 3)).reshape(e, g * c, h)
        dropped = ops.sum(picked * (1.0 - kept).reshape(g, n * k, 1), (0, 1)) / n_all
        return rows, (route, dropped)

    def combine(self, ys, route):
        weights, dropped = route
        g, e, h = self.groups, self.num_experts, ys.shape[-1]
        c = ys.shape[1] // g
        ys = self.from_experts(ys.reshape(e, g, c, h), (1, 0, 2, 3)).reshape(g, e * c, h)
        out = self.combine_rows(cast(weights, ys.dtype), ys)                             # [G, n, h]
        return out.reshape(-1, h), dropped


class BlockDispatch(Dispatch):
    """Dropless at (about) the routed FLOPs: the N x k choices grouped by expert, each expert's group
    padded to whole blocks of `block` rows, and one batched matmul over the blocks per projection,
    each block with its expert's weights (Experts with block_ids). The shapes are static: at most
    ceil(N k / block) + E blocks, so the padding costs at most E blocks of rows beyond the choices.
    Same sums as EveryExpert, in another order; a training formulation (applied by msllm.backends)."""

    def __init__(self, num_experts: int, block: int = BLOCK_ROWS):
        super().__init__()
        self.num_experts, self.block = num_experts, block

    def dispatch(self, x, weights, chosen):
        (n, h), k, e, b = x.shape, chosen.shape[1], self.num_experts, self.block
        blocks = -(-n * k // b) + e
        picked = choices(chosen, e).reshape(n * k, e)
        per_expert = ((ops.sum(picked, 0).astype(ms.int32) + b - 1) // b)                # blocks of each expert
        ends = ops.cumsum(per_expert, 0)
        slot = ops.gather(ends - per_expert, chosen.reshape(-1), 0) * b + rank_at_expert(picked).astype(ms.int32)
        rows = gather_rows(x, slot, k, blocks * b).reshape(blocks, b, h)
        # block i is expert j's while ends[j - 1] <= i < ends[j]; blocks past the last are empty (any expert)
        index = ops.arange(0, blocks, dtype=ms.int32).reshape(-1, 1)
        ids = ops.minimum(ops.sum((ends.reshape(1, -1) <= index).astype(ms.int32), 1), e - 1)
        return rows, (slot, weights.reshape(-1), k, ids)

    def block_ids(self, route):
        return route[3]

    def combine(self, ys, route):
        slot, weights, k, _ = route
        return sum_choices(ys, slot, weights, k, spare=False), ops.zeros((self.num_experts,), ms.float32)


class MoE(nn.Cell):
    """A layer's MLP as routed experts (plus, with shared_experts, one gated MLP every token runs:
    DeepSeek's shared experts, Qwen3.5-MoE's with a sigmoid gate on its output); x [N, h] -> (out [N, h], load [4, E]).

    load: the layer's routing statistics, what the load-balancing loss and the load metrics read
    (balance_loss, routing_metrics): row 0 each expert's share of the N tokens' top-k choices (the
    row sums to k), row 1 the mean router probability of each expert, row 2 the share of the choices
    dropped at each expert (0 but under a capacity factor), row 3 the router's z-loss (z_loss; every
    entry the same), and when `sequence_rows` is set (training with model.router_seq_aux_loss_coef: the
    tokens of each sequence, msllm.backends) row 4 the sequence-wise balance loss (sequence_balance; every
    entry the same). `dispatch` (EveryExpert, or
    CapacityDispatch for training) decides which rows the experts compute."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.k = cfg.num_experts, cfg.experts_per_token
        self.sequence_rows = 0  # tokens per sequence when the load reports the sequence-wise balance loss
        self.router = ROUTERS[cfg.router](cfg)
        self.experts = Experts(cfg)
        self.dispatch = EveryExpert(cfg.num_experts)
        self.shared = FeedForward(cfg, cfg.shared_size) if cfg.shared_size else None
        # Qwen3.5-MoE / Qwen3-Next: the shared MLP's output x sigmoid(shared_gate x), one scalar per token
        self.shared_gate = Linear(cfg.hidden_size, 1) if cfg.shared_size and cfg.shared_gate else None

    def construct(self, x):
        weights, chosen, probs, z = self.router(x)
        rows, route = self.dispatch.dispatch(x, weights, chosen)
        out, dropped = self.dispatch.combine(self.experts(rows, self.dispatch.block_ids(route)), route)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * ops.sigmoid(self.shared_gate(x))
            out = out + shared
        picked = ops.sum(choices(chosen, self.num_experts), 1)                                   # [N, E]
        rows = (ops.stop_gradient(ops.mean(picked, 0)), ops.mean(probs, 0), ops.stop_gradient(dropped),
                ops.broadcast_to(z.reshape(1), (self.num_experts,)))
        if self.sequence_rows:
            seq = sequence_balance(picked, probs, self.sequence_rows, self.k)
            rows += (ops.broadcast_to(seq.reshape(1), (self.num_experts,)),)
        return out, ops.stack(rows)


def balance_loss(loads):
    """The auxiliary load-balancing loss of Switch Transformer as transformers computes it over a model's
    MoE layers: E * sum_e f_e * p_e, where f_e is expert e's share of the top-k choices and p_e its mean
    router probability, each averaged over the layers first (transformers concatenates the layers'
    tokens). loads: one [4, E] per MoE layer (MoE's load). Only p carries a gradient."""
    mean = ops.mean(ops.stack(loads), 0)                                                     # [4, E]
    return mean.shape[-1] * ops.sum(mean[0] * mean[1])


def router_z_loss(loads):
    """The MoE layers' z-losses (MoE's load row 3), averaged over the layers."""
    return ops.mean(ops.stack(loads)[:, 3, 0])


class RoutingLosses(nn.Cell):
    """What a MoE model's routers add to its training loss, from its MoE layers' loads (one [4, E] each):
    router_aux_loss_coef x the load-balancing loss, as transformers adds it, router_z_loss_coef x
    the router z-loss, and router_seq_aux_loss_coef x each layer's sequence-wise balance loss (load row 4),
    summed over the layers as DeepSeek-V3 adds it per layer. `stats(loads)` is what the step reports of
    them (no gradient)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.aux_coef, self.z_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.seq_coef = cfg.router_seq_aux_loss_coef

    def add_to(self, loss, loads):
        if self.aux_coef > 0:
            loss = loss + self.aux_coef * balance_loss(loads)
        if self.z_coef > 0:
            loss = loss + self.z_coef * router_z_loss(loads)
        if self.seq_coef > 0:
            loss = loss + self.seq_coef * ops.sum(ops.stack(loads)[:, 4, 0])
        return loss

    def stats(self, loads):
        return ops.stop_gradient(ops.stack(loads))


def routing_losses(cfg: ModelConfig) -> RoutingLosses | None:
    """The routing losses of a model with MoE layers; None for a dense one (its step has no loads)."""
    return RoutingLosses(cfg) if "moe" in cfg.mlp_kinds() else None


class BiasBalance(nn.Cell):
    """DeepSeek-V3's aux-loss-free balance, after each optimizer update: every expert's routing bias
    moves by `rate` toward even load, up for an expert that took fewer than the mean share of this
    step's choices (over all ranks), down for one that took more (no gradient). A skipped step moves
    nothing."""

    def __init__(self, biases: list, rate: float, world: int):
        super().__init__(auto_prefix=False)  # the biases keep the names the model gave them
        self.expert_biases = ParameterTuple(biases)
        self.rate, self.world = rate, world
        self.all_reduce = ops.AllReduce() if world > 1 else None  # every rank moves the biases alike

    def construct(self, loads, finite, after):
        """loads [moe layers, 4, E] (the step's, averaged over micro-batches); `after`: a value of the
        update, so the biases move once the optimizer has read them."""
        shares = loads[:, 0]
        if self.all_reduce is not None:
            shares = self.all_reduce(shares) / self.world
        move = ops.sign(ops.mean(shares, -1, keep_dims=True) - shares) * (self.rate * finite.astype(ms.float32))
        move = ops.depend(move, after)
        for i in range(len(self.expert_biases)):
            ops.assign_add(self.expert_biases[i], move[i])
        return move


def bias_balance(model, rate: float, world: int) -> BiasBalance | None:
    """The bias balance of a model whose routers have a routing bias (GroupedSigmoidRouter), when
    train.moe_bias_update_rate > 0; else None."""
    routers = [block.feed_forward.router for block in model.layers if block.routed]
    biases = [router.expert_bias for router in routers if isinstance(router, GroupedSigmoidRouter)]
    return BiasBalance(biases, rate, world) if rate > 0 and biases else None


def routing_metrics(loads) -> dict:
    """What a step's routing loads (numpy [moe layers, 4, E], the train step's last output) say:
    each MoE layer's busiest expert over the mean (1.0: perfectly even; E / k: every token to the
    same k experts), the worst layer's, the share of all choices dropped by a capacity, and the
    load-balancing loss they give (balance_loss)."""
    shares = loads[:, 0]
    per_layer = [round(float(x), 4) for x in shares.max(-1) / shares.mean(-1)]
    mean = loads.mean(0)
    return {"expert_load": per_layer, "expert_load_max": max(per_layer),
            "dropped": round(float(loads[:, 2].sum() / loads[:, 0].sum()), 6),
            "aux_loss": float(loads.shape[-1] * (mean[0] * mean[1]).sum()), "router_z": float(loads[:, 3, 0].mean()),
            **({"seq_aux_loss": float(loads[:, 4, 0].sum())} if loads.shape[1] > 4 else {})}
