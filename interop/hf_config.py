"""Hugging Face config.json <-> msllm ModelConfig.

Supported: the architectures of interop.maps.FAMILIES (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3
text, Phi-3, Qwen3-MoE, Mixtral, DeepSeek-V3 (and Kimi K2, which is one), GLM-4.5 MoE, SmolLM3, OLMo 2 and 3,
gpt-oss, Qwen3.5, Qwen3.5-MoE and
Qwen3-Next). The sizes, RoPE, sliding window and layer types are read from the config keys every family
shares (MLA's ranks when the family's spec attends with MLA); what an architecture implies beyond them
is its family spec, and the keys only it has (experts, derived scales, NoPE layers, linear-attention
layers) its family's
from_hf / to_hf hooks in interop/maps/<family>.py. A config asking for
something msllm does not compute (another activation, o_proj or MLP biases, another rope type,
logit soft-capping) is refused, naming the key, rather than converted into a
model that computes something else.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from interop import InteropError, read_json
from interop.maps import FAMILIES
from msllm.config import ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL, ModelConfig, yarn_mscale

MODEL_TYPES = {arch: family.model_type for arch, family in FAMILIES.items()}
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
MXFP4 = "mxfp4"  # the one quantization_config.quant_method read (interop/formats/mxfp4.py dequantizes it)


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
    """For checkpoints that never came from HF: the family whose spec computes what `m` computes
    (Phi-3 computes Llama's maths, so a model is never given its fused layout by default)."""
    def matches(family) -> bool:
        spec = {**dict(qkv_bias=False, qk_norm=False, qk_norm_scope="head", norm_offset=0.0, sandwich_norm=False,
                       pre_norm=True, mlp="swiglu", attention="gqa", router="softmax", o_bias=False,
                       attention_sinks=False, router_bias=False, experts_bias=False, attn_output_gate=False),
                **family.spec}
        return (family.moe == (m.num_experts > 0) and (family.nope_layers or "none" not in m.position_kinds())
                and all(getattr(m, key) == value for key, value in spec.items()))

    arch = next((arch for arch, family in FAMILIES.items() if matches(family)), None)
    if arch is None:
        raise InteropError("no Hugging Face architecture computes this model (its q/k norm, norm offset, sandwich "
                           "norms, MLP, qkv bias and layers without RoPE match no family of interop/maps)")
    return arch


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
        refuse(key, "per-layer-type rope parameters are read only as full_attention and sliding_attention")
    return _rope_params(hf, params, key, refuse)


def _rope_per_layer_type(hf: dict, refuse) -> tuple[float, dict | None, float]:
    """(theta, scaling, local theta) where rope_parameters holds one dict per layer type (Gemma 3);
    local theta 0 when there is none. Sliding layers take an unscaled RoPE in msllm."""
    params = hf.get("rope_parameters")
    if not (isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values())):
        return (*_rope(hf, refuse), 0.0)
    odd = sorted(set(params) - set(LAYER_TYPES))
    if odd:
        refuse("rope_parameters", f"unknown layer types {odd}; msllm reads {', '.join(LAYER_TYPES)}")
    theta, scaling = _rope_params(hf, params.get("full_attention", {}), "rope_parameters.full_attention", refuse)
    local = params.get("sliding_attention")
    if local is None:
        return theta, scaling, 0.0
    local_theta, local_scaling = _rope_params(hf, local, "rope_parameters.sliding_attention", refuse)
    if local_scaling:
        refuse("rope_parameters.sliding_attention", "msllm computes sliding layers with an unscaled RoPE (default)")
    return theta, scaling, local_theta


def _rope_params(hf: dict, params: dict, key: str, refuse) -> tuple[float, dict | None]:
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not _is_number(theta) or theta <= 0:
        refuse("rope_theta", f"must be a number > 0, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "longrope":
        refuse(key, "rope type 'longrope' (Phi-3 128K) is not supported; the 4K Phi-3 configs use the default RoPE")
    if kind == "default":
        return float(theta), None
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        refuse(key, f"rope type {kind!r} is not supported (default, {', '.join(ROPE_SCALING_KEYS)})")
    if kind in ("llama3", "yarn"):
        params = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **params}
    # Only the keys this type reads: transformers ignores (with a warning) the others, so do we.
    reads = ROPE_SCALING_KEYS[kind] + ROPE_SCALING_OPTIONAL.get(kind, ())
    return float(theta), {"type": kind, **{k: params[k] for k in reads if k in params and params[k] is not None}}


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
    family = FAMILIES[arch]
    act_key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    if hf.get(act_key, family.activation) != family.activation:
        refuse(act_key, f"{hf[act_key]!r} is not supported for {arch} ({family.activation})")
    for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if hf.get(key) and not (key == "attention_bias" and (family.spec.get("o_bias") or family.attention_bias_qkv)):
            refuse(key, "msllm has no o_proj or MLP biases" if key != "use_bidirectional_attention"
                   else "msllm computes causal attention")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            refuse(key, "logit soft-capping is not supported (null)")
    quantization = hf.get("quantization_config") or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else type(quantization).__name__
    if quantization and method != MXFP4:
        refuse("quantization_config", f"{method!r}: msllm reads full-precision weights, and MXFP4 ones (*_blocks / "
               f"*_scales, dequantized on read); dequantize the checkpoint first")
    hidden, heads = count("hidden_size"), count("num_attention_heads")
    mla = _mla(hf, heads, count, refuse) if family.spec.get("attention") == "mla" else {}
    # MLA's config.json says head_dim for its RoPE part (qk_rope_head_dim), read by _mla
    head_dim = count("head_dim", 0) if hf.get("head_dim") is not None and not mla else 0
    if not head_dim and hidden % heads:
        refuse("num_attention_heads", f"must divide hidden_size ({hidden}) when head_dim is not given")
    theta, scaling, local_theta = _rope_per_layer_type(hf, refuse)
    fraction = _rope_fraction(hf, head_dim or (hidden // heads), family.partial_rope, refuse)
    eps = hf.get("rms_norm_eps", 1e-6)
    if not _is_number(eps) or eps <= 0:
        refuse("rms_norm_eps", f"must be a number > 0, got {eps!r}")
    context = count("max_position_embeddings", 2048)
    layers = count("num_hidden_layers")
    window, layer_types = _windows(hf, layers, refuse)
    spec = dict(family.spec)
    if mla:  # DeepSeek's scores scale by 1/sqrt(nope + rope), and by mscale_all_dim's YaRN scale squared
        spec.update(attn_scale=_mla_scale(hf, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]))
    fields = dict(
        vocab_size=count("vocab_size"), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=count("num_key_value_heads", heads),
        # a model whose every MLP is MoE may have no dense size (Qwen3.5-MoE): its experts' then
        ffn_size=count("intermediate_size", hf.get("moe_intermediate_size") if family.moe else None),
        head_dim=0 if head_dim == hidden // heads and not hidden % heads else head_dim,
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(eps),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or context, sliding_window=window, layer_types=layer_types,
        pad_token_id=_pad_token(hf, refuse), rope_local_theta=local_theta if window else 0.0, rope_fraction=fraction,
        **mla, **spec)
    family.from_hf(hf, fields, refuse)  # what only this family's keys say: its experts, derived scales
    return ModelConfig(**fields)


def _rope_fraction(hf: dict, head: int, partial: bool, refuse) -> float:
    """partial_rotary_factor (in rope_parameters or at the top level): the leading fraction of each head
    RoPE rotates, as int(head * fraction) features; 1.0 when absent. Only a family whose attention
    rotates part of the head (`partial`) takes another value."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction is None or fraction == 1:
        return 1.0
    if not partial:
        refuse("partial_rotary_factor", f"{fraction!r}: this architecture rotates the whole head (1.0)")
    if not _is_number(fraction) or not 0 < fraction <= 1 or int(head * fraction) % 2 or int(head * fraction) == 0:
        refuse("partial_rotary_factor", f"{fraction!r}: must be in (0, 1] and rotate an even number of the "
                                        f"head's {head} features")
    return float(fraction)


def _mla(hf: dict, heads: int, count, refuse) -> dict:
    """DeepSeek-V3's attention sizes. transformers expands every head's keys from the latent, so it
    computes only with as many KV heads as heads."""
    if hf.get("num_key_value_heads", heads) != heads:
        refuse("num_key_value_heads", f"must equal num_attention_heads ({heads}): MLA expands keys per head")
    q_rank = hf.get("q_lora_rank")
    if not (q_rank is None or isinstance(q_rank, int) and not isinstance(q_rank, bool) and q_rank > 0):
        refuse("q_lora_rank", f"must be a positive integer or null, got {q_rank!r}")
    return {"q_lora_rank": q_rank or 0, "kv_lora_rank": count("kv_lora_rank"),
            "qk_nope_head_dim": count("qk_nope_head_dim"), "qk_rope_head_dim": count("qk_rope_head_dim"),
            "v_head_dim": count("v_head_dim"), "rope_interleave": bool(hf.get("rope_interleave", True))}


def _mla_scale(hf: dict, qk_head_dim: int) -> float:
    """DeepseekV3Attention.scaling (yarn_apply_mscale): qk_head_dim^-0.5, times mscale(factor,
    mscale_all_dim)^2 when the RoPE is scaled and mscale_all_dim is set; 0 (msllm's 1/sqrt(head)) otherwise."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default" or not params.get("mscale_all_dim"):
        return 0.0
    return qk_head_dim ** -0.5 * yarn_mscale(float(params["factor"]), params["mscale_all_dim"]) ** 2


def _pad_token(hf: dict, refuse) -> int:
    """The embedding's padding_idx as transformers builds it (pad_token_id, inside the vocabulary); -1: none."""
    pad = hf.get("pad_token_id")
    if pad is None:
        return -1
    if not isinstance(pad, int) or isinstance(pad, bool):
        refuse("pad_token_id", f"must be an integer or null, got {pad!r}")
    return pad if 0 <= pad < hf.get("vocab_size", 0) else -1


def _windows(hf: dict, layers: int, refuse) -> tuple[int, list | None]:
    """(sliding_window, layer_types) as transformers applies them: `layer_types` names each layer's
    attention; without it, every layer slides when a window is set (Mistral, Phi-3) and
    use_sliding_window (Qwen2/3) allows it."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        refuse("sliding_window", f"must be a positive integer or null, got {window!r}")
    named = hf.get("layer_types")
    if named is None:
        return (window or 0), None
    if not isinstance(named, list) or len(named) != layers or not all(t in LAYER_TYPES for t in named):
        refuse("layer_types", f"expected {layers} of {', '.join(LAYER_TYPES)}, got {named!r}")
    kinds = [LAYER_TYPES[t] for t in named]
    if "sliding" not in kinds:
        return 0, kinds if "linear" in kinds else None
    if not window:
        refuse("sliding_window", "layer_types has sliding layers but no window is set")
    return window, None if set(kinds) == {"sliding"} else kinds


def to_hf_config(m: ModelConfig, arch: str, dtype: str, base: dict | None = None) -> dict:
    """config.json for `m`. `base` (the config a checkpoint was converted from) is returned with
    only the dtype updated when it still describes the same model, which keeps token ids etc."""
    if base is not None:
        same = dataclasses.replace(to_model_config(base, "<base>"), max_seq_len=m.max_seq_len)
        if not m.mtp_depths:  # read without the MTP layers its config counts (interop.layouts): still that model
            same = dataclasses.replace(same, mtp_depths=0)
        if same == m:
            keys = [k for k in ("dtype", "torch_dtype") if k in base] or ["torch_dtype"]  # transformers 5, 4
            return {**base, **dict.fromkeys(keys, dtype)}
    family = FAMILIES[arch]
    hf = {"architectures": [arch], "model_type": family.model_type, "vocab_size": m.vocab_size,
          "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers,
          "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_size,
          "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
          "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype,
          family.activation_key: family.activation,
          "sliding_window": m.sliding_window or None, "pad_token_id": None if m.pad_token_id < 0 else m.pad_token_id}
    if m.rope_fraction != 1.0:
        hf["partial_rotary_factor"] = m.rope_fraction
    if m.rope_scaling:
        scaling = dict(m.rope_scaling)
        hf["rope_scaling"] = {"rope_type": scaling.pop("type", scaling.pop("rope_type", None)), **scaling}
    if m.layer_types is not None or (m.sliding_window and family.writes_layer_types):
        hf["layer_types"] = [f"{kind}_attention" for kind in m.layer_kinds()]
    if m.mla:
        hf.update(head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                  qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  rope_interleave=m.rope_interleave)
    family.to_hf(m, hf)  # the keys only this family has: its experts, Qwen's use_sliding_window, Gemma's RoPE
    return hf
