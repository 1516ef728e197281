"""The one seam where a plain model is specialised: for its device, for memory, for a layout.

    model = build_model(cfg.model)            # plain maths (msllm/models/llama.py)
    plan = specialise(model, cfg)             # CPU formulations / fused kernels, block graph, recompute
    model = specialise(model, cfg, training=False)   # the same weights, ready for generation

Everything device-specific is decided here from the config and applied to the built model; the
model never learns which device it is on, and the train step never changes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from msllm.config import Config


@dataclass(frozen=True)
class Specialisation:
    device: str
    fused_kernels: bool   # msllm.kernels: in the train step (the optimizer and norm use them too); in
                          # inference the few-rows linear of decode steps
    shared_blocks: bool   # every layer calls one compiled block graph
    recompute: str


# From this depth `auto` shares the block graph on CPU: below it inlined and shared compile
# alike, and shared steps are slightly slower (benchmarks/ has the figures).
SHARED_BLOCK_GRAPH_MIN_LAYERS = 16


def shares_block_graph(cfg: Config) -> bool:
    """train.block_graph: shared / inlined as asked; auto: shared on CPU from
    SHARED_BLOCK_GRAPH_MIN_LAYERS layers without recompute (MindSpore 2.10 does not recompute
    inside the shared graph). Other backends keep the blocks inlined under auto."""
    t = cfg.train
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


def plan(cfg: Config, training: bool = True) -> Specialisation:
    from msllm import kernels

    t = cfg.train
    fused = t.device == "cpu" and kernels.enabled(t.fused_kernels)
    return Specialisation(t.device, fused, training and shares_block_graph(cfg), t.recompute if training else "none")


def specialise(model, cfg: Config, training: bool = True) -> Specialisation:
    """Apply the configured specialisations to `model` in place; returns what was applied."""
    spec = plan(cfg, training)
    if training:
        apply_recompute(model, spec.recompute)
    if spec.device == "cpu":
        from msllm.backends import cpu
        cpu.specialise(model, fused=spec.fused_kernels, share_blocks=spec.shared_blocks, training=training)
    elif spec.device == "ascend" and training:  # generated and checked here; executed only on Ascend
        from msllm.backends import ascend
        ascend.specialise(model, cfg)
    return spec
