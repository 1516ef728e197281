"""Do a checkpoint's weights belong to the configured model? Answered from the safetensors header
alone, before anything is built, as config values ("model.hidden_size 32, config 64") rather than
a list of mismatched tensors."""
from __future__ import annotations

from pathlib import Path

from msllm.config import ConfigError, ModelConfig
from msllm.errors import UserError


def stored_shapes(path: Path) -> dict[str, tuple]:
    """name -> shape from a safetensors header."""
    from msllm.safetensors_reader import SafetensorsReader

    return dict(SafetensorsReader(path).shapes)


def implied_config(shapes: dict[str, tuple], hidden_size: int, num_heads: int, head_dim: int,
                   attention_layer: int | None = 0) -> dict:
    """The model.* values msllm's tensor names and shapes imply. num_heads is not visible in them;
    num_kv_heads is, given the configured head_dim, when the hidden size agrees. The attention's values
    (bias, q/k norms, KV heads) are read from layer `attention_layer`, the first attention layer (a
    hybrid's first layers are Gated DeltaNet ones); None: the model has none."""
    implied = {"tie_embeddings": "output.weight" not in shapes,
               "sandwich_norm": "layers.0.ffn_out_norm.weight" in shapes,
               "pre_norm": "layers.0.ffn_norm.weight" in shapes or "layers.0.ffn_out_norm.weight" not in shapes}
    attention = f"layers.{attention_layer}.attention."
    if attention_layer is not None:
        implied.update(qkv_bias=attention + "wq.bias" in shapes, qk_norm=attention + "q_norm.weight" in shapes)
    if "tok_embeddings.weight" in shapes:
        implied["vocab_size"], implied["hidden_size"] = shapes["tok_embeddings.weight"]
    layers = {int(name.split(".")[1]) for name in shapes if name.startswith("layers.")}
    if layers:
        implied["num_layers"] = max(layers) + 1
    if "layers.0.feed_forward.w1.weight" in shapes:
        implied["ffn_size"] = shapes["layers.0.feed_forward.w1.weight"][0]
    if attention_layer is not None and attention + "wk.weight" in shapes and implied.get("hidden_size") == hidden_size:
        implied["num_kv_heads"] = shapes[attention + "wk.weight"][0] // head_dim
    return implied


def check_weights(m: ModelConfig, path: Path, source: str) -> None:
    """Refuse weights of another shape than model `m`, naming the config values that differ."""
    try:
        shapes = stored_shapes(path)
    except (OSError, UserError):
        return  # unreadable: loading it says so
    attention_layer = next((i for i, kind in enumerate(m.layer_kinds()) if kind != "linear"), None)
    differ = [f"model.{key} {value!r} (config: {getattr(m, key)!r})"
              for key, value in implied_config(shapes, m.hidden_size, m.num_heads, m.head_size,
                                               attention_layer).items()
              if getattr(m, key) != value]
    if differ:
        raise ConfigError(source, "model", f"{path.name} holds weights of another model: " + ", ".join(differ)
                          + "; resume with the config that wrote them")
