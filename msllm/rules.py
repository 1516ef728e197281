"""Pure facts about devices and data that several layers decide by, each written once: what Ascend's
FlashAttentionScore accepts, when samples are packed, when the CPU backend takes the flash core or
shares the block graph, block sizes of MoE dispatch. Config validation, the layout checker, the
planner and the backends all read them here; nothing here imports MindSpore.
"""
from __future__ import annotations

from msllm.config import Config
from msllm.data.index import is_sft

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
    if len(set(cfg.model.mlp_kinds())) > 1 or cfg.model.hybrid:  # dense and MoE, linear and attention blocks differ
        return False
    if t.block_graph != "auto":
        return t.block_graph == "shared"
    return t.device == "cpu" and cfg.model.num_layers >= SHARED_BLOCK_GRAPH_MIN_LAYERS and t.recompute == "none"


# FlashAttentionScore's optimised causal mask for its sparse modes 2, 3 and 4: always [2048, 2048]
COMPRESSED_MASK = 2048

# Rows per block of BlockDispatch (dropless training). With each block's weights gathered (the portable
# GatheredMatmul) 64 was no faster on CPU than 128: more gathers. The CPU kernel (GroupedMatmul) reads
# each expert's weights once however many blocks it has, so its blocks are small: less padding.
BLOCK_ROWS = 128
GROUPED_BLOCK_ROWS = 32


def packed_samples(cfg: Config) -> bool:
    """SFT data (a .jsonl file, or a shard made from one), or pretraining windows with
    data.document_attention: samples packed into windows, each attending only to itself, so the
    step takes per-sample positions and masks. DPO pairs with dpo.share_prompt too (each row's
    completions branch from its prompt: msllm.data.preference)."""
    return (cfg.data.document_attention or is_sft(cfg.data.path)
            or (cfg.train.objective == "dpo" and cfg.dpo.share_prompt))


# What a refusal of train.attention: flash on Ascend tells the user to do instead.
SOFTMAX_INSTEAD = "; set train.attention: softmax (or auto)"


def ascend_flash_problem(cfg: Config, packed: bool) -> tuple[str, str] | None:
    """(key, one-line reason; callers add the remedy, SOFTMAX_INSTEAD) when Ascend's FlashAttentionScore
    cannot take this config's attention, else None: it takes no sinks, fp16 / bf16 only and head sizes that are multiples
    of 16 up to 512 (MLA: the q/k heads; its smaller value heads are zero-padded to them). Packed
    samples (`packed`: SFT rows, data.document_attention) take its TND layout, causal per sample, which
    msllm builds without sliding windows (MindFormers' TND form is causal only too)."""
    d = cfg.model.head_size
    if cfg.model.attention_sinks:
        key, why = "model.attention_sinks", ("takes no sink logit per head (in MindSpore 2.10 its real_shift adds to "
                                             "the [s, t] scores; a sink is an extra softmax column)")
    elif cfg.train.precision == "fp32":
        key, why = "train.precision", "takes fp16 / bf16 only (train.precision: fp32)"
    elif d % 16 or d > 512:
        key, why = "model.head_dim", f"takes head sizes that are multiples of 16 up to 512 (this model's: {d})"
    elif cfg.model.value_size > d:  # MLA's V is zero-padded up to the q/k head size (msllm.backends.ascend)
        key, why = "model.v_head_dim", (f"takes one head size for q, k and v: msllm pads MLA's value heads up to the "
                                        f"q/k heads ({d}), not q/k up to larger value heads ({cfg.model.value_size})")
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
    if t.attention == "softmax":
        return False
    if device == "ascend":
        return ascend_flash_problem(cfg, packed) is None
    if device != "cpu":
        return False
    return fused and (t.attention == "flash" or seq >= FLASH_MIN_SEQ)
