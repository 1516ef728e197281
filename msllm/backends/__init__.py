"""The one seam where a plain model is specialised: for its device, for memory, for a layout.

    model = build_model(cfg.model)            # plain maths (msllm/models/)
    plan = specialise(model, cfg)             # LoRA, CPU formulations / fused kernels, block graph, recompute,
                                              # context parallel
    model = specialise(model, cfg, training=False)   # the same weights, ready for generation

Everything device-specific is decided here from the config and applied to the built model; the
model never learns which device it is on, and the train step never changes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from msllm.config import Config, ConfigError
from msllm.rules import SOFTMAX_INSTEAD, ascend_flash_problem, packed_samples, resolves_to_flash, shares_block_graph


@dataclass(frozen=True)
class Specialisation:
    device: str
    fused_kernels: bool   # msllm.kernels: in the train step (the optimizer and norm use them too); in
                          # inference the few-rows linear of decode steps
    shared_blocks: bool   # every layer calls one compiled block graph
    recompute: str
    lora_rank: int        # > 0: base weights frozen, adapters on lora.targets (msllm/lora.py)
    packed: bool          # SFT rows: per-sample positions and attention masks as inputs
    flash: bool           # attention by blocks of keys (train.attention): CPU's kernel over visibility
                          # indices, Ascend's FlashAttentionScore
    cp: int = 1           # context parallel: each sequence split over this many ranks (msllm/parallel/cp.py)
    ep: int = 1           # expert parallel: each MoE layer's experts split over this many ranks (msllm/parallel/ep.py)


def apply_recompute(model, mode: str) -> None:
    """Trade compute for memory: activations of the marked Cells are recomputed in backward.
    full: every transformer block. selective: the attention core (scores and probabilities, the
    largest activations per FLOP) and the SwiGLU MLP."""
    for block in model.blocks():
        if mode == "full":
            block.recompute()
        elif mode == "selective":
            if hasattr(block.attention, "core"):  # a Gated DeltaNet layer has none: its mixer is kept whole
                block.attention.core.recompute()
            block.feed_forward.recompute()


def apply_dispatch(model, factor: float, dropless: str) -> None:
    """How MoE layers train. train.moe_capacity_factor > 0: each expert computes at most that many times
    its even share of the routed choices (msllm.models.moe.CapacityDispatch), dropping the rest. Else
    dropless, train.moe_dropless: `blocks` groups the choices by expert (BlockDispatch, about the routed
    FLOPs), `every` runs every token through every expert (EveryExpert). Generation and export keep
    EveryExpert: the reference maths, no gathers."""
    from msllm.models.moe import BlockDispatch, CapacityDispatch

    for block in model.blocks():
        if not block.routed:
            continue
        experts = block.feed_forward.num_experts
        if factor > 0:
            block.feed_forward.dispatch = CapacityDispatch(experts, factor)
        elif dropless == "blocks":
            block.feed_forward.dispatch = BlockDispatch(experts)


def apply_sequence_rows(model, rows: int) -> None:
    """The tokens of each sequence the MoE layers compute DeepSeek-V3's sequence-wise balance loss over
    (msllm.models.moe.MoE.sequence_rows); 0: not computed (generation, export). The MTP depths' blocks alike:
    they share the layers' compiled block graph (their own losses are not added)."""
    for block in model.blocks():
        if block.routed:
            block.feed_forward.sequence_rows = rows


def uses_flash(cfg: Config, fused: bool, training: bool) -> bool:
    """Whether the attention core is a flash one (resolves_to_flash at data.seq_len; CPU inference takes it
    with the fused kernels unless train.attention is softmax: its decode step is faster at any context).
    A flash core asked for and unavailable is one line: train.attention: flash without the fused CPU
    kernels, or what FlashAttentionScore cannot take. Ascend is specialised for training only, so its
    inference keeps the softmax core."""
    t = cfg.train
    packed = training and packed_samples(cfg)
    if t.attention == "flash" and t.device == "ascend":
        problem = ascend_flash_problem(cfg, packed)
        if problem is not None:
            raise ConfigError("<config>", "train.attention", problem[1] + SOFTMAX_INSTEAD)
    if t.attention == "flash" and t.device == "cpu" and not fused:
        from msllm.kernels import KernelBuildError
        raise KernelBuildError("train.attention: flash needs the fused CPU kernels (g++); "
                               "set train.attention: softmax")
    if t.device == "ascend" and not training:
        return False
    if t.device == "cpu" and not training:  # a decode step's query rows read their keys in one kernel pass
        return fused and t.attention != "softmax"
    return resolves_to_flash(cfg, t.device, fused, cfg.data.seq_len, packed)


def plan(cfg: Config, training: bool = True) -> Specialisation:
    from msllm import kernels

    t = cfg.train
    fused = t.device == "cpu" and kernels.enabled(t.fused_kernels)
    return Specialisation(t.device, fused, training and shares_block_graph(cfg), t.recompute if training else "none",
                          cfg.lora.rank, training and packed_samples(cfg), uses_flash(cfg, fused, training),
                          cfg.parallel.cp if training else 1, cfg.parallel.ep if training else 1)


def specialise(model, cfg: Config, training: bool = True) -> Specialisation:
    """Apply the configured specialisations to `model` in place; returns what was applied."""
    spec = plan(cfg, training)
    if spec.lora_rank > 0:
        from msllm.lora import apply_lora
        apply_lora(model, cfg.lora, cfg.train.seed)
    if training:
        apply_recompute(model, spec.recompute)
        apply_dispatch(model, cfg.train.moe_capacity_factor, cfg.train.moe_dropless)
    # training with the sequence-wise balance loss: MoE layers report it over sequences of data.seq_len tokens
    apply_sequence_rows(model, cfg.data.seq_len if training and cfg.model.router_seq_aux_loss_coef > 0 else 0)
    if spec.device == "cpu":
        from msllm.backends import cpu
        cpu.specialise(model, fused=spec.fused_kernels, share_blocks=spec.shared_blocks, training=training,
                       flash=spec.flash)
    elif spec.device == "ascend" and training:  # generated and checked here; executed only on Ascend
        from msllm.backends import ascend
        ascend.specialise(model, cfg, flash=spec.flash, packed=spec.packed)
    elif spec.device == "ascend":  # generation decodes through the cache's own mask (rings included)
        from msllm.backends import ascend
        ascend.use_portable_attention(model)
    if spec.device == "cpu":  # sequences split over the cp group, experts over the ep group (training)
        from msllm.parallel import cp, ep
        cp.specialise(model, cfg, training)
        ep.specialise(model, cfg, training)
    return spec


def uses_parallel_wrapper(cfg: Config) -> bool:
    """Whether the step runs under the Ascend backend's AutoParallel wrapper (a layout over > 1 device)."""
    p = cfg.parallel
    return cfg.train.device == "ascend" and p.dp * p.tp * p.pp > 1


def save_with_checkpoint(cfg: Config, run_dir: Path, checkpoint_dir: Path, rank: int) -> list[Path]:
    """Write what this backend adds to every checkpoint into `checkpoint_dir` (before its manifest):
    under the parallel wrapper, the rank's strategy file, without which sharded weights cannot be
    re-sliced. Returns the files written."""
    if not uses_parallel_wrapper(cfg):
        return []
    from msllm.backends import ascend
    return [ascend.save_strategy_with_checkpoint(run_dir, checkpoint_dir, rank)]
