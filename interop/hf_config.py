"""Hugging Face config.json <-> msllm ModelConfig.

Supported: LlamaForCausalLM (Llama 2; Llama 3 with llama3 or linear rope scaling),
MistralForCausalLM and Qwen2ForCausalLM. A config asking for something msllm does not compute
(another activation, o_proj or MLP biases, head_dim != hidden/heads, another rope type, partial
rotary) is refused, naming the key, rather than converted into a model that computes something else.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from interop import InteropError, read_json
from msllm.config import ROPE_SCALING_KEYS, ModelConfig

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
QKV_BIAS = {"Qwen2ForCausalLM"}
# msllm precomputes RoPE tables and a [max_seq_len, max_seq_len] fp32 causal mask, so HF's 128K
# contexts would cost 64 GB; conversions cap the context here unless told otherwise.
MAX_SEQ_LEN = 8192


def architecture(hf: dict, source: str) -> str:
    named = (hf.get("architectures") or [None])[0]
    arch = named or {t: a for a, t in MODEL_TYPES.items()}.get(hf.get("model_type"))
    if arch not in MODEL_TYPES:
        raise InteropError(f"{source}: unsupported architecture {named or hf.get('model_type')!r}; "
                           f"supported: {', '.join(MODEL_TYPES)}")
    return arch


def check_dir(path: str | Path) -> None:
    """If `path` is a Hugging Face dir, refuse its config.json now: this module imports neither torch
    nor MindSpore, so the CLI answers a config msllm cannot convert before loading them."""
    config = Path(path) / "config.json"
    if config.is_file():
        to_model_config(read_json(config), str(config))


def default_architecture(m: ModelConfig) -> str:
    """For checkpoints that never came from HF: the family that computes what msllm computes."""
    return "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"


def _rope(hf: dict, refuse) -> tuple[float, dict | None]:
    """(theta, msllm rope_scaling), read as transformers reads them
    (modeling_rope_utils.RotaryEmbeddingConfigMixin.convert_rope_params_to_dict, standardize_rope_params):
    a non-empty transformers-4 `rope_scaling` is used instead of transformers-5 `rope_parameters`, not
    merged with it; `rope_theta` in the chosen dict wins over the top-level one; `rope_type` over `type`;
    llama3 defaults `original_max_position_embeddings` to `max_position_embeddings`."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        refuse(key, f"expected an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        refuse(key, "per-layer-type rope parameters are not supported (msllm uses one RoPE for every layer)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not _is_number(theta) or theta <= 0:
        refuse("rope_theta", f"must be a number > 0, got {theta!r}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        refuse("partial_rotary_factor", f"{partial!r}: msllm rotates the whole head (1.0)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        refuse(key, f"rope type {kind!r} is not supported (default, {', '.join(ROPE_SCALING_KEYS)})")
    if kind == "llama3":
        params = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **params}
    # Only the keys this type reads: transformers ignores (with a warning) the others, so do we.
    return float(theta), {"type": kind, **{k: params[k] for k in ROPE_SCALING_KEYS[kind] if k in params}}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def to_model_config(hf: dict, source: str, max_seq_len: int | None = None) -> ModelConfig:
    def refuse(key, why):
        raise InteropError(f"{source}: {key}: {why}")

    def count(key, default=None):
        """A positive integer (sizes, counts); a missing key takes `default`, or is refused without one."""
        value = hf.get(key)
        if value is None:
            if default is None:
                refuse(key, "missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            refuse(key, f"must be a positive integer, got {value!r}")
        return value

    arch = architecture(hf, source)
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{hf['hidden_act']!r} is not supported (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(key, "msllm has no o_proj or MLP biases")
    hidden, heads = count("hidden_size"), count("num_attention_heads")
    if hf.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        refuse("head_dim", f"{hf.get('head_dim')} != hidden_size / num_attention_heads; msllm needs them equal")
    theta, scaling = _rope(hf, refuse)
    eps = hf.get("rms_norm_eps", 1e-6)
    if not _is_number(eps) or eps <= 0:
        refuse("rms_norm_eps", f"must be a number > 0, got {eps!r}")
    context = count("max_position_embeddings", 2048)
    # Sliding-window attention (Mistral, Qwen2 with use_sliding_window) equals full attention up to
    # the window, so capping the context there keeps the converted model exact.
    window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "MistralForCausalLM") else None
    return ModelConfig(
        vocab_size=count("vocab_size"), hidden_size=hidden, num_layers=count("num_hidden_layers"), num_heads=heads,
        num_kv_heads=count("num_key_value_heads", heads), ffn_size=count("intermediate_size"),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(eps),
        qkv_bias=arch in QKV_BIAS, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or min(context, MAX_SEQ_LEN, window or context))


def to_hf_config(m: ModelConfig, arch: str, dtype: str, base: dict | None = None) -> dict:
    """config.json for `m`. `base` (the config a checkpoint was converted from) is returned with
    only the dtype updated when it still describes the same model, which keeps token ids etc."""
    if base is not None:
        same = dataclasses.replace(to_model_config(base, "<base>"), max_seq_len=m.max_seq_len)
        if same == m:
            keys = [k for k in ("dtype", "torch_dtype") if k in base] or ["torch_dtype"]  # transformers 5, 4
            return {**base, **dict.fromkeys(keys, dtype)}
    hf = {"architectures": [arch], "model_type": MODEL_TYPES[arch], "vocab_size": m.vocab_size,
          "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers,
          "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
          "hidden_act": "silu", "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
          "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype}
    if m.rope_scaling:
        scaling = dict(m.rope_scaling)
        hf["rope_scaling"] = {"rope_type": scaling.pop("type", scaling.pop("rope_type", None)), **scaling}
    if arch == "MistralForCausalLM":
        hf["sliding_window"] = None
    if arch == "Qwen2ForCausalLM":
        hf["use_sliding_window"] = False
    return hf
