"""SmolLM3 (SmolLM3ForCausalLM): Llama's tensors and maths (tied embeddings by default), except that
every Nth layer attends without a position encoding (NoPE). config.json's `no_rope_layers` holds one
flag per layer, 1 where the layer rotates q and k and 0 where it does not (built from
`no_rope_layer_interval`, default 4, when absent); msllm reads it as model.position_types. With
`use_sliding_window`, transformers makes the NoPE layers the sliding ones (its `layer_types`).
Not mapped to MindFormers (MindFormers 1.9 has no SmolLM3)."""
from interop.maps import qwen3
from interop.maps.llama import LLAMA


def _without_mindformers(rows):
    return [row._replace(mindformers=None) for row in rows]


SMOLLM3 = LLAMA._replace(before=_without_mindformers(LLAMA.before), per_layer=_without_mindformers(LLAMA.per_layer),
                         after=_without_mindformers(LLAMA.after))


def from_hf(hf: dict, fields: dict, refuse) -> None:
    """model.position_types from no_rope_layers (or its interval), as SmolLM3Config builds them."""
    layers = fields["num_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
        refuse("no_rope_layer_interval", f"must be a positive integer, got {interval!r}")
    flags = hf.get("no_rope_layers")
    if flags is None:
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(flag not in (0, 1) for flag in flags):
        refuse("no_rope_layers", f"expected {layers} flags, 1 (RoPE) or 0 (none), got {flags!r}")
    fields["position_types"] = None if all(flags) else ["rope" if flag else "none" for flag in flags]


def to_hf(m, hf: dict) -> None:
    """no_rope_layers, one flag per layer, and use_sliding_window (as Qwen's)."""
    hf["no_rope_layers"] = [int(kind == "rope") for kind in m.position_kinds()]
    qwen3.to_hf(m, hf)
