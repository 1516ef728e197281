"""The one seam where a plain model is specialised: for its device, for memory, for a layout.

    model = build_model(cfg.model)            # plain maths (msllm/models/llama.py)
    plan = specialise(model, cfg)             # LoRA, CPU formulations / fused kernels, block graph, recompute,
                                              # context parallel
    model = specialise(model, cfg, training=False)   # the same weights, ready for generation

Everything device-specific is decided here from the config and applied to the built model; the
model never learns which device it is on, and the train step never changes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from msllm.config import Config


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


# From this many tokens `train.attention: auto` takes the flash core on CPU: below it the fused
# softmax core over [s, t] scores is as fast (benchmarks/ has the figures) and fits in memory.
FLASH_MIN_SEQ = 1024

# From this depth `auto` shares the block graph on CPU: below it inlined and shared compile
# alike, and shared steps are slightly slower (benchmarks/ has the figures).
SHARED_BLOCK_GRAPH_MIN_LAYERS = 16


def shares_block_graph(cfg: Config) -> bool:
    """train.block_graph: shared / inlined as asked; auto: shared on CPU from
    SHARED_BLOCK_GRAPH_MIN_LAYERS layers without recompute (MindSpore 2.10 does not recompute
    inside the shared graph). Other backends keep the blocks inlined under auto."""
    t = cfg.train
    if len(set(cfg.model.mlp_kinds())) > 1:  # dense and MoE blocks are different graphs
        return False
    if t.block_graph != "auto":
        return t.block_graph == "shared"
    return t.device == "cpu" and cfg.model.num_layers >= SHARED_BLOCK_GRAPH_MIN_LAYERS and t.recompute == "none"


def apply_recompute(model, mode: str) -> None:
    """Trade compute for memory: activations of the marked Cells are recomputed in backward.
    full: every transformer block. selective: the attention core (scores and probabilities, the
    largest activations per FLOP) and the SwiGLU MLP."""
    for block in model.layers:
        if mode == "full":
            block.recompute()
        elif mode == "selective":
            block.attention.core.recompute()
            block.feed_forward.recompute()


def apply_dispatch(model, factor: float, dropless: str) -> None:
    """How MoE layers train. train.moe_capacity_factor > 0: each expert computes at most that many times
    its even share of the routed choices (msllm.models.moe.CapacityDispatch), dropping the rest. Else
    dropless, train.moe_dropless: `blocks` groups the choices by expert (BlockDispatch, about the routed
    FLOPs), `every` runs every token through every expert (EveryExpert). Generation and export keep
    EveryExpert: the reference maths, no gathers."""
    from msllm.models.moe import BlockDispatch, CapacityDispatch

    for block in model.layers:
        if not block.routed:
            continue
        experts = block.feed_forward.num_experts
        if factor > 0:
            block.feed_forward.dispatch = CapacityDispatch(experts, factor)
        elif dropless == "blocks":
            block.feed_forward.dispatch = BlockDispatch(experts)


def packed_samples(cfg: Config) -> bool:
    """SFT data (a .jsonl file, or a shard made from one), or pretraining windows with
    data.document_attention: samples packed into windows, each attending only to itself, so the
    step takes per-sample positions and masks."""
    from msllm.data.sft import is_sft

    return cfg.data.document_attention or is_sft(cfg.data.path)


# What a refusal of train.attention: flash on Ascend tells the user to do instead.
SOFTMAX_INSTEAD = "; set train.attention: softmax (or auto)"


def ascend_flash_problem(cfg: Config, packed: bool) -> tuple[str, str] | None:
    """(key, one-line reason; callers add the remedy, SOFTMAX_INSTEAD) when Ascend's FlashAttentionScore
    cannot take this config's attention, else None: it takes fp16 / bf16 only and head sizes that are multiples of 16 up to 512. Packed
    samples (`packed`: SFT rows, data.document_attention) take its TND layout, causal per sample, which
    msllm builds without sliding windows (MindFormers' TND form is causal only too)."""
    d = cfg.model.head_size
    if cfg.train.precision == "fp32":
        key, why = "train.precision", "takes fp16 / bf16 only (train.precision: fp32)"
    elif d % 16 or d > 512:
        key, why = "model.head_dim", f"takes head sizes that are multiples of 16 up to 512 (this model's: {d})"
    elif packed and "sliding" in cfg.model.layer_kinds():
        key = "data.document_attention" if cfg.data.document_attention else "data.path"
        why = (f"takes packed samples ({key}) causal per sample in its TND layout, which msllm does not build "
               f"with sliding-window layers (model.sliding_window {cfg.model.sliding_window})")
    else:
        return None
    return key, f"flash on Ascend is FlashAttentionScore, which {why}"


def resolves_to_flash(cfg: Config, device: str, fused: bool, seq: int, packed: bool) -> bool:
    """train.attention as `device` resolves it (pure: no kernel is built). softmax: never. CPU: flash,
    or auto from FLASH_MIN_SEQ tokens (`seq`), with the fused kernels. Ascend: flash and auto alike
    take FlashAttentionScore when it can (ascend_flash_problem), as Ascend LLM training does. Other
    devices have no flash core."""
    t = cfg.train
    if t.attention == "softmax" or cfg.model.mla:  # no flash core takes MLA's value heads (uses_flash)
        return False
    if device == "ascend":
        return ascend_flash_problem(cfg, packed) is None
    if device != "cpu":
        return False
    return fused and (t.attention == "flash" or seq >= FLASH_MIN_SEQ)


def uses_flash(cfg: Config, fused: bool, training: bool) -> bool:
    """Whether the attention core is a flash one (resolves_to_flash; training reads data.seq_len,
    inference the model's context). A flash core asked for and unavailable is one line:
    train.attention: flash without the fused CPU kernels, or what FlashAttentionScore cannot take.
    Ascend is specialised for training only, so its inference keeps the softmax core."""
    t = cfg.train
    packed = training and packed_samples(cfg)
    if t.attention == "flash" and t.device == "ascend":
        problem = ascend_flash_problem(cfg, packed)
        if problem is not None:
            from msllm.config import ConfigError
            raise ConfigError("<config>", "train.attention", problem[1] + SOFTMAX_INSTEAD)
    if t.attention == "flash" and cfg.model.mla:  # the flash cores take q/k and value heads of one size
        from msllm.config import ConfigError
        raise ConfigError("<config>", "train.attention", "flash is not built for MLA (model.attention mla), whose "
                          "value heads differ from its q/k heads; set train.attention: softmax (or auto)")
    if t.attention == "flash" and t.device == "cpu" and not fused:
        from msllm.kernels import KernelBuildError
        raise KernelBuildError("train.attention: flash needs the fused CPU kernels (g++); "
                               "set train.attention: softmax")
    if t.device == "ascend" and not training:
        return False
    seq = cfg.data.seq_len if training else cfg.model.max_seq_len
    return resolves_to_flash(cfg, t.device, fused, seq, packed)


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
    if spec.device == "cpu":
        from msllm.backends import cpu
        cpu.specialise(model, fused=spec.fused_kernels, share_blocks=spec.shared_blocks, training=training,
                       per_sample_tables=spec.packed, flash=spec.flash)
    elif spec.device == "ascend" and training:  # generated and checked here; executed only on Ascend
        from msllm.backends import ascend
        ascend.specialise(model, cfg, flash=spec.flash, packed=spec.packed)
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
