"""Reading, validating and writing run configs: YAML file <- --set overrides -> msllm.config's typed
sections, checked as a whole (field values, the rules of msllm.rules, the layout checker), every error
one line naming the file (or --set) and the key. Nothing else in msllm parses YAML.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from msllm.config import (CHOICES, LAYER_TYPES, LORA_TARGETS, MAX_SEED, MAX_VOCAB, MLP_TYPES, POSITION_TYPES,
                          ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL, SECTIONS, Config, ConfigError, ModelConfig,
                          OptimConfig)
from msllm.layout.check import check_parallel
from msllm.rules import SOFTMAX_INSTEAD, ascend_flash_problem, packed_samples


def _coerce(value: Any, annotation: str, source: str, key: str) -> Any:
    """Check one YAML value against a dataclass field annotation (given as a string)."""
    optional = annotation.startswith("Optional[")
    base = annotation[len("Optional["):-1] if optional else annotation
    if value is None:
        if optional:
            return None
        raise ConfigError(source, key, f"must not be null (expected {base})")
    if base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "float":
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(source, key, f"must be a finite number, got {value!r}")
            return number
    elif base == "str":
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML 1.1: off / on / no / yes are booleans
            raise ConfigError(source, key, f"expected str, got bool {value!r} (YAML reads off/on/no/yes as "
                                           f"booleans: quote the value)")
    elif base == "dict":
        if isinstance(value, dict):
            return value
    elif base == "list":
        if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                           for v in value):  # names (lora.targets) or numbers (grpo.reward_weights)
            return value
    got = type(value).__name__
    raise ConfigError(source, key, f"expected {base}, got {got} {value!r}")


def _apply(cfg: Config, data: Any, source: str, origins: dict | None = None) -> None:
    """Set the values in `data` (section -> key -> value) on cfg; origins[dotted key] = source."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(source, "<top>", f"expected a mapping of sections ({', '.join(SECTIONS)})")
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(source, str(section), f"unknown section; expected one of {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(source, section, "expected a mapping")
        obj = getattr(cfg, section)
        types = {f.name: f.type for f in dataclasses.fields(obj)}
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if key not in types:
                raise ConfigError(source, dotted, f"unknown key; known keys: {', '.join(types)}")
            setattr(obj, key, _coerce(value, types[key], source, dotted))
            if origins is not None:
                origins.pop(dotted, None)  # re-inserted last: dict order is application order
                origins[dotted] = source


def _needs(source: str, origins: dict | None):
    """need(ok, key, message, *involved): an error is blamed on where the offending value was set:
    the last-applied of the keys involved (--set after the file), or `source` for defaults."""
    order = list(origins or {})

    def need(ok: bool, key: str, message: str, *involved: str):
        if not ok:
            keys = [k for k in (key, *involved) if k in order]
            blamed = origins[max(keys, key=order.index)] if keys else source
            raise ConfigError(blamed, key, message)
    return need


def _check_lora(cfg: Config, need) -> None:
    """The lora section on its own (checked before train.init_from is read, too)."""
    lora, t = cfg.lora, cfg.train
    need(lora.rank >= 0, "lora.rank", "must be >= 0 (0 = off)")
    need(lora.alpha > 0, "lora.alpha", "must be > 0")
    need(0 <= lora.dropout < 1, "lora.dropout", "must be in [0, 1)")
    unknown = [x for x in lora.targets if x not in LORA_TARGETS]
    need(not unknown, "lora.targets", f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(LORA_TARGETS)}")
    need(bool(lora.targets) and len(set(lora.targets)) == len(lora.targets), "lora.targets",
         f"needs distinct names of {', '.join(LORA_TARGETS)}, got {lora.targets!r}")
    need(lora.rank == 0 or t.init_from is not None, "lora.rank",
         "LoRA adapts pretrained weights: set train.init_from (or --init-from)", "train.init_from")
    need(t.lora_from is None or t.init_from is not None, "train.lora_from",
         "a PEFT adapter needs its base model: set train.init_from", "train.init_from")


def _check(cfg: Config, source: str, origins: dict | None = None) -> None:
    """Validate the whole config, blaming each error on where its value was set (_needs)."""
    need = _needs(source, origins)
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "max_seq_len"):
        need(getattr(m, key) > 0, f"model.{key}", "must be > 0")
    need(m.vocab_size <= MAX_VOCAB, "model.vocab_size", f"must be <= {MAX_VOCAB} (token ids are int32)")
    need(m.head_dim >= 0, "model.head_dim", "must be >= 0 (0: hidden_size // num_heads)")
    need(m.head_dim > 0 or m.hidden_size % m.num_heads == 0, "model.num_heads",
         f"must divide model.hidden_size ({m.hidden_size} % {m.num_heads} != 0), or set model.head_dim",
         "model.hidden_size")
    need(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
         f"must divide model.num_heads ({m.num_heads} % {m.num_kv_heads} != 0)", "model.num_heads")
    need(m.mla or m.head_size % 2 == 0, "model.num_heads", f"head_dim {m.head_size} must be even for RoPE",
         "model.hidden_size")
    if m.mla:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(m, key) > 0, f"model.{key}", "must be > 0 with model.attention mla", "model.attention")
        need(m.q_lora_rank >= 0, "model.q_lora_rank", "must be >= 0 (0: one q projection)")
        need(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", "must be even for RoPE")
        need(m.num_kv_heads == m.num_heads, "model.num_kv_heads",
             f"must equal model.num_heads ({m.num_heads}) with mla: every head expands its own keys", "model.attention")
    need(m.pre_norm or m.sandwich_norm, "model.pre_norm",
         "false needs model.sandwich_norm true: a block normalises its sublayers' inputs, outputs or both",
         "model.sandwich_norm")
    need(m.rope_theta > 0, "model.rope_theta", "must be > 0")
    need(m.norm_eps > 0, "model.norm_eps", "must be > 0")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling, need)
    need(m.embed_scale > 0, "model.embed_scale", "must be > 0")
    need(m.attn_scale >= 0, "model.attn_scale", "must be >= 0 (0: 1/sqrt(head_dim))")
    need(m.rope_local_theta >= 0, "model.rope_local_theta", "must be >= 0 (0: model.rope_theta)")
    need(m.sliding_window >= 0, "model.sliding_window", "must be >= 0 (0: no sliding layers)")
    if m.layer_types is not None:
        need(len(m.layer_types) == m.num_layers, "model.layer_types",
             f"needs one entry per layer ({m.num_layers}), got {len(m.layer_types)}", "model.num_layers")
        odd = sorted(set(m.layer_types) - set(LAYER_TYPES))
        need(not odd, "model.layer_types", f"unknown {', '.join(map(repr, odd))}; each is one of {', '.join(LAYER_TYPES)}")
    if m.position_types is not None:
        need(len(m.position_types) == m.num_layers, "model.position_types",
             f"needs one entry per layer ({m.num_layers}), got {len(m.position_types)}", "model.num_layers")
        odd = sorted(set(m.position_types) - set(POSITION_TYPES))
        need(not odd, "model.position_types",
             f"unknown {', '.join(map(repr, odd))}; each is one of {', '.join(POSITION_TYPES)}")
    need(0 < m.rope_fraction <= 1 and m.rope_dim % 2 == 0 and m.rope_dim > 0, "model.rope_fraction",
         f"must be in (0, 1] and rotate an even number of the head's {m.head_size} features (it rotates {m.rope_dim})")
    if m.hybrid:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel"):
            need(getattr(m, key) > 0, f"model.{key}", "must be > 0 with linear layers in model.layer_types",
                 "model.layer_types")
        need(m.linear_num_value_heads % max(m.linear_num_key_heads, 1) == 0, "model.linear_num_value_heads",
             f"must be a multiple of model.linear_num_key_heads ({m.linear_num_key_heads})", "model.linear_num_key_heads")
    need(m.num_experts >= 0 and m.moe_ffn_size >= 0, "model.num_experts", "must be >= 0 (0: dense MLPs)")
    need(m.num_experts == 0 or 1 <= m.experts_per_token <= m.num_experts, "model.experts_per_token",
         f"must be in [1, model.num_experts ({m.num_experts})]", "model.num_experts")
    need(m.expert_groups >= 1 and m.num_experts % m.expert_groups == 0, "model.expert_groups",
         f"must be >= 1 and divide model.num_experts ({m.num_experts})", "model.num_experts")
    need(1 <= m.topk_groups <= m.expert_groups, "model.topk_groups", f"must be in [1, model.expert_groups ({m.expert_groups})]",
         "model.expert_groups")
    need(m.router == "sigmoid_grouped" or m.expert_groups == 1, "model.expert_groups",
         "groups are routed by model.router sigmoid_grouped only", "model.router")
    if m.router == "sigmoid_grouped" and m.num_experts:
        per_group = m.num_experts // m.expert_groups
        need(per_group >= 2, "model.expert_groups", "groups need at least 2 experts (each is scored by its best two)",
             "model.num_experts")
        need(m.experts_per_token <= m.topk_groups * per_group, "model.experts_per_token",
             f"must be <= the experts of model.topk_groups groups ({m.topk_groups * per_group})", "model.topk_groups")
    need(m.routed_scaling > 0, "model.routed_scaling", "must be > 0")
    need(m.shared_experts >= 0, "model.shared_experts", "must be >= 0")
    need(m.shared_ffn_size >= 0, "model.shared_ffn_size", "must be >= 0 (0: model.shared_experts x the experts' size)")
    need(m.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", "must be >= 0 (0: no load-balancing loss)")
    need(m.router_z_loss_coef >= 0, "model.router_z_loss_coef", "must be >= 0 (0: no router z-loss)")
    need(m.router_seq_aux_loss_coef >= 0, "model.router_seq_aux_loss_coef",
         "must be >= 0 (0: no sequence-wise balance loss)")
    if m.router_seq_aux_loss_coef > 0:  # computed over each whole sequence of data.seq_len tokens
        need(cfg.parallel.cp == 1, "parallel.cp", "must be 1 with model.router_seq_aux_loss_coef > 0 (a rank holds "
             "chunks of a sequence, the loss needs it whole)", "model.router_seq_aux_loss_coef")
        need(t.objective == "auto", "train.objective", "dpo and grpo sequences are not data.seq_len long: set "
             "model.router_seq_aux_loss_coef 0", "model.router_seq_aux_loss_coef")
    need(m.mtp_depths >= 0, "model.mtp_depths", "must be >= 0 (0: no multi-token prediction)")
    need(m.mtp_loss_weight >= 0, "model.mtp_loss_weight", "must be >= 0 (0: MTP blocks carried, not trained)")
    need(m.mtp_loss_weight == 0 or 0 < m.mtp_depths < d.seq_len, "model.mtp_loss_weight",
         f"needs model.mtp_depths in [1, data.seq_len - 1] (got {m.mtp_depths}): depth k predicts the token k + 1 ahead",
         "model.mtp_depths")
    need(m.mtp_depths == 0 or cfg.parallel.ep == 1, "parallel.ep", "must be 1 with model.mtp_depths > 0 (expert "
         "parallel does not split the MTP blocks' experts yet)", "model.mtp_depths")
    if m.trains_mtp:  # (with weight 0 the depths are carried, not computed: every layout and objective takes them)
        p = cfg.parallel
        why = {"tp": "the Ascend layout gives the depths' own ops (joint projection, embedding of the tokens ahead, "
                     "second pass through the head) no tensor-parallel strategy",
               "pp": "a depth on the last stage needs the embedding, which the first stage holds, of the tokens ahead",
               "cp": "depth k's tokens ahead of a rank's last positions lie in the next rank's chunk"}
        for key, reason in why.items():
            need(getattr(p, key) == 1, f"parallel.{key}", f"must be 1 with model.mtp_loss_weight > 0 ({reason}); "
                 "or set model.mtp_loss_weight 0 to carry the MTP depths untrained", "model.mtp_loss_weight")
        need(t.objective == "auto", "train.objective", f"{t.objective}'s loss is the sequence log-probability of "
             "completions; MTP's is next-token prediction, which it does not train: set model.mtp_loss_weight 0 "
             "(the depths are carried untrained)", "model.mtp_loss_weight")
    if m.mlp_types is not None:
        need(len(m.mlp_types) == m.num_layers, "model.mlp_types",
             f"needs one entry per layer ({m.num_layers}), got {len(m.mlp_types)}", "model.num_layers")
        odd = sorted(set(m.mlp_types) - set(MLP_TYPES))
        need(not odd, "model.mlp_types", f"unknown {', '.join(map(repr, odd))}; each is one of {', '.join(MLP_TYPES)}")
        need(m.num_experts > 0 or "moe" not in m.mlp_types, "model.num_experts",
             "model.mlp_types has moe layers: set the number of experts (> 0)", "model.mlp_types")
    need(t.block_graph != "shared" or len(set(m.mlp_kinds())) == 1, "train.block_graph",
         "shared needs every block alike; model.mlp_types mixes dense and moe layers", "model.mlp_types")
    need(t.block_graph != "shared" or len(set(m.mixer_kinds())) == 1, "train.block_graph",
         "shared needs every block alike; model.layer_types mixes linear and attention layers", "model.layer_types")
    need(m.sliding_window > 0 or "sliding" not in m.layer_kinds(), "model.sliding_window",
         "model.layer_types has sliding layers: set the window (> 0)", "model.layer_types")
    need(d.seq_len > 1, "data.seq_len", "must be > 1")
    need(d.seq_len <= m.max_seq_len, "data.seq_len", f"must be <= model.max_seq_len ({m.max_seq_len})",
         "model.max_seq_len")
    need(0 < d.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)")
    need(d.max_bytes >= 0, "data.max_bytes", "must be >= 0")
    need(d.glob != "", "data.glob", "must not be empty (e.g. '**/*.py')")
    for key, value in (("data.path", d.path), ("data.tokenizer", d.tokenizer), ("train.run_dir", t.run_dir),
                       ("train.compile_cache", t.compile_cache), ("train.init_from", t.init_from),
                       ("train.lora_from", t.lora_from)):
        need(value is None or value.strip() != "", key, "must not be an empty path" +
             ("" if key == "train.run_dir" else " (null for none)"))
    for key, value in (("data.seed", d.seed), ("train.seed", t.seed)):
        need(0 <= value <= MAX_SEED, key, f"must be in [0, {MAX_SEED}]")
    need(o.lr > 0, "optim.lr", "must be > 0")
    need(0 <= o.min_lr <= o.lr, "optim.min_lr", "must be in [0, optim.lr]", "optim.lr")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    if o.warmup_ratio is not None:
        need(0 <= o.warmup_ratio < 1, "optim.warmup_ratio", f"must be in [0, 1), got {o.warmup_ratio!r}")
        # Both changed from their defaults: which one was meant is a guess, so ask.
        need(o.warmup_steps == OptimConfig.warmup_steps, "optim.warmup_ratio",
             f"set either optim.warmup_ratio or optim.warmup_steps ({o.warmup_steps}), not both",
             "optim.warmup_steps")
    need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    need(0 <= o.beta1 < 1, "optim.beta1", "must be in [0, 1)")
    need(0 <= o.beta2 < 1, "optim.beta2", "must be in [0, 1)")
    need(o.eps > 0, "optim.eps", "must be > 0")
    need(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
    need(t.steps > 0, "train.steps", "must be > 0")
    need(t.batch_size > 0, "train.batch_size", "must be > 0")
    need(t.threads >= 0, "train.threads", "must be >= 0")
    for key in ("log_every", "eval_every", "ckpt_every", "eval_batches", "accum_steps", "loss_scale_window",
                "max_bad_steps", "keep_checkpoints"):
        need(getattr(t, key) > 0, f"train.{key}", "must be > 0")
    need(t.sample_tokens >= 0, "train.sample_tokens", "must be >= 0 (0 skips the sample)")
    need(t.max_restarts >= 0, "train.max_restarts", "must be >= 0 (0: a dead worker ends the job)")
    need(t.hang_timeout_s > 0, "train.hang_timeout_s", "must be > 0 (seconds)")
    need(t.peak_flops > 0, "train.peak_flops", "must be > 0")
    need(t.loss_scale >= 1, "train.loss_scale", "must be >= 1")
    _check_lora(cfg, need)
    if t.objective == "dpo":
        dpo = cfg.dpo
        need(dpo.beta > 0, "dpo.beta", "must be > 0")
        need(0 <= dpo.label_smoothing < 0.5, "dpo.label_smoothing", "must be in [0, 0.5)")
        need(cfg.parallel.cp == 1, "train.objective", "dpo does not run under context parallel (parallel.cp)",
             "parallel.cp")
        need(not dpo.share_prompt or t.device == "cpu", "dpo.share_prompt", "runs on the CPU only (Ascend's packed "
             "attention takes whole samples, not branches of a prompt); set dpo.share_prompt: false", "train.device")
    if t.objective == "grpo":
        g = cfg.grpo
        need(bool(g.reward), "grpo.reward", "needs one or more path.py:function reward functions")
        need(not g.reward_weights or len(g.reward_weights) == len(g.reward), "grpo.reward_weights",
             f"needs one weight per grpo.reward function ({len(g.reward)})", "grpo.reward")
        need(g.group_size >= 2, "grpo.group_size", "must be >= 2 (advantages compare a prompt's completions)")
        need(g.max_new_tokens > 0, "grpo.max_new_tokens", "must be > 0")
        need(g.temperature > 0, "grpo.temperature", "must be > 0")
        need(0 < g.top_p <= 1, "grpo.top_p", "must be in (0, 1]")
        need(g.epsilon > 0, "grpo.epsilon", "must be > 0")
        need(g.beta >= 0, "grpo.beta", "must be >= 0 (0: no KL term, as TRL)")
        need(g.beta == 0 or cfg.lora.rank > 0, "grpo.beta", "a KL term needs a reference model and a full fine-tune "
             "keeps none in the step: train with lora.rank > 0 (the reference is the base with the adapters off) "
             "or set grpo.beta: 0", "lora.rank")
        need(g.num_iterations >= 1, "grpo.num_iterations", "must be >= 1")
        need(t.ckpt_every % g.num_iterations == 0, "train.ckpt_every", f"must be a multiple of grpo.num_iterations "
             f"({g.num_iterations}): a run resumes at the start of a rollout batch", "grpo.num_iterations")
        need(cfg.parallel.cp == 1 and cfg.parallel.ep == 1, "train.objective", "grpo runs on one worker or data "
             "parallel only: its rollout decoder holds the whole model (set parallel.cp and parallel.ep to 1)",
             "parallel.cp", "parallel.ep")
    if cfg.lora.rank > 0:
        kinds = set(m.mlp_kinds())
        idle = [x for x in cfg.lora.targets if x.startswith("experts_") and "moe" not in kinds
                or x in ("gate", "up", "down") and "dense" not in kinds]
        need(not idle, "lora.targets", f"{', '.join(idle)} adapt no layer of this model (its MLPs are "
             f"{' and '.join(sorted(kinds))}); gate / up / down adapt dense MLPs, experts_* MoE experts")
        layers = set(m.layer_kinds())
        idle = [x for x in cfg.lora.targets if x.startswith("linear_") and "linear" not in layers
                or x in ("q", "k", "v", "o") and layers == {"linear"}]
        need(not idle, "lora.targets", f"{', '.join(idle)} adapt no layer of this model: linear_* adapt Gated "
             f"DeltaNet layers (layer_types linear), q / k / v / o attention layers")
        unmatched = [x for x in cfg.lora.targets if m.mla and (x in ("k", "v") or x == "q" and m.q_lora_rank)]
        need(not unmatched, "lora.targets", f"{', '.join(unmatched)} adapt no layer of this model: MLA (model.attention "
             f"mla) has no wk / wv{' / wq (q_lora_rank is set)' if m.q_lora_rank else ''}; o adapts its wo")
    need(not (t.attention == "flash" and t.device == "cpu" and t.fused_kernels == "off"), "train.attention",
         "flash on CPU is a fused kernel; set train.fused_kernels: auto, or train.attention: softmax",
         "train.fused_kernels")
    need(not (m.attention_sinks and t.device == "ascend"), "model.attention_sinks",
         "not built for Ascend: MindSpore 2.10's FlashAttentionScore takes no sink logit per head (its real_shift "
         "adds to the scores, a sink is an extra softmax column) and the sinks have no shard strategy; train on cpu",
         "train.device")
    need(m.swiglu_alpha > 0 and m.swiglu_limit > 0, "model.swiglu_limit", "model.swiglu_alpha and swiglu_limit must be > 0")
    need(not (m.attention_sinks and m.mla), "model.attention_sinks", "are built for model.attention gqa, not mla",
         "model.attention")
    if t.attention == "flash" and t.device == "ascend":
        problem = ascend_flash_problem(cfg, packed_samples(cfg))
        if problem is not None:
            need(False, "train.attention", problem[1] + SOFTMAX_INSTEAD, problem[0])
    need(t.moe_capacity_factor >= 0, "train.moe_capacity_factor", "must be >= 0 (0: dropless)")
    need(t.moe_bias_update_rate >= 0, "train.moe_bias_update_rate", "must be >= 0 (0: off)")
    need(t.moe_bias_update_rate == 0 or (m.router == "sigmoid_grouped" and "moe" in m.mlp_kinds()),
         "train.moe_bias_update_rate", "moves the expert biases of model.router sigmoid_grouped (DeepSeek-V3), "
         "which this model has not; set 0", "model.router")
    need(not (t.block_graph == "shared" and t.recompute != "none"), "train.block_graph",
         "shared cannot recompute (MindSpore 2.10 ignores recompute inside the shared block graph); "
         "use inlined or auto with train.recompute", "train.recompute")
    for dotted, choices in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        need(value in choices, dotted, f"must be one of {', '.join(choices)}, got {value!r}")
    check_parallel(cfg, source=source)


def _check_rope_scaling(scaling: dict, check) -> None:
    key = "model.rope_scaling"

    def need(ok, name, message):
        check(ok, name, message, key)

    kinds = [scaling[k] for k in ("type", "rope_type") if k in scaling]
    need(kinds and all(k == kinds[0] for k in kinds), key, f"needs one type (type or rope_type), got {scaling!r}")
    kind = kinds[0]
    need(isinstance(kind, str) and kind in ROPE_SCALING_KEYS, f"{key}.type",
         f"must be one of {', '.join(ROPE_SCALING_KEYS)}, got {kind!r} (msllm computes no other rope scaling)")
    expected, optional = ROPE_SCALING_KEYS[kind], ROPE_SCALING_OPTIONAL.get(kind, ())
    unknown = sorted(map(str, set(scaling) - {"type", "rope_type", *expected, *optional}))
    need(not unknown, key, f"{kind} takes {', '.join(expected + optional)}; unknown {', '.join(map(str, unknown))}")

    def number(value, low):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low

    for name in expected:
        need(number(scaling.get(name), 1e-300), f"{key}.{name}", f"{kind} needs a finite number > 0, got {scaling.get(name)!r}")
    for name in optional:
        value = scaling.get(name)
        ok = value is None or (isinstance(value, bool) if name == "truncate" else number(value, 0))
        need(ok, f"{key}.{name}", f"must be {'true or false' if name == 'truncate' else 'a finite number >= 0'} or null, "
             f"got {value!r}")
    if kind == "llama3":
        need(scaling["high_freq_factor"] > scaling["low_freq_factor"], f"{key}.high_freq_factor",
             f"must be > low_freq_factor ({scaling['low_freq_factor']}): the band between them is blended")


def parse_override(text: str) -> tuple[str, Any]:
    """'optim.lr=3e-4' -> ('optim.lr', 0.0003). The value is read as YAML, except for text keys
    (run_dir, paths, choices), which take it as written: `train.fused_kernels=off` is "off"."""
    if "=" not in text:
        raise ConfigError("--set", text, "expected SECTION.KEY=VALUE")
    key, raw = (part.strip() for part in text.split("=", 1))
    if key.count(".") != 1:
        raise ConfigError("--set", key, "expected SECTION.KEY=VALUE")
    section, name = key.split(".")
    fields = {f.name: f.type for f in dataclasses.fields(getattr(Config(), section))} if section in SECTIONS else {}
    if fields.get(name) in ("str", "Optional[str]") and raw not in ("null", "~"):
        return key, raw[1:-1] if len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError("--set", key, f"invalid YAML value {raw!r} ({getattr(e, 'problem', e)})") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


@dataclass
class Pretrained:
    """What train.init_from (and train.lora_from) fix in a config: the model, the tokenizer, the adapter."""
    source: str
    model: ModelConfig
    tokenizer: Optional[str]          # the source's tokenizer.json, if it has one
    lora: Optional[dict] = None       # rank, alpha, targets of the adapter train.lora_from holds


# model keys that weigh training losses: set with train.init_from, they win over the source's
TRAINING_WEIGHTS = ("model.mtp_loss_weight", "model.router_seq_aux_loss_coef")


def _adopt(cfg: Config, origins: dict, pretrained: Pretrained) -> None:
    """The model (and adapter) sections become the pretrained ones. A value set in the file or with
    --set that contradicts them is refused, naming both; model.max_seq_len may only shrink the context."""
    def adopt(section: str, theirs: dict, where: str):
        obj = getattr(cfg, section)
        for key, value in theirs.items():
            dotted, mine = f"{section}.{key}", getattr(obj, key)
            if dotted in origins and mine != value:
                if dotted == "model.max_seq_len" and 0 < mine <= value:
                    continue  # a shorter context keeps every weight
                if dotted in TRAINING_WEIGHTS:
                    continue  # how much a loss counts in training, not what the weights compute
                raise ConfigError(origins[dotted], dotted, f"{mine!r} contradicts {value!r} of {where}; leave it unset")
            setattr(obj, key, value)

    adopt("model", dataclasses.asdict(pretrained.model), pretrained.source)
    if pretrained.lora is not None:
        adopt("lora", pretrained.lora, str(cfg.train.lora_from))
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = pretrained.tokenizer


def load_config(path: Optional[str | Path] = None, overrides: typing.Sequence[str] = (),
                pretrained: Optional[typing.Callable[[str, Optional[str]], Pretrained]] = None) -> Config:
    """Defaults <- YAML file <- --set overrides, then validate the whole. With train.init_from set,
    pretrained(init_from, lora_from) describes the source (the CLI reads it through interop)."""
    cfg, origins = Config(), {}
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(source, "<file>", f"cannot read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(source, "<file>", f"not UTF-8 text (byte {e.start})") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark else "<file>"
            raise ConfigError(source, where, f"invalid YAML: {getattr(e, 'problem', e)}") from None
        _apply(cfg, data, source, origins)
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        _apply(cfg, {section: {name: value}}, "--set", origins)
    if pretrained is not None and cfg.train.init_from is not None:
        _check_lora(cfg, _needs(str(path) if path else "<defaults>", origins))  # before the source is read
        _adopt(cfg, origins, pretrained(cfg.train.init_from, cfg.train.lora_from))
    _check(cfg, str(path) if path else "<defaults>", origins)
    return cfg


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    cfg = Config()
    _apply(cfg, data, source)
    _check(cfg, source)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
