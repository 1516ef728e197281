"""Tiny random Hugging Face models, one per supported family, saved the way users bring them."""
import json
from pathlib import Path

import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Glm4MoeConfig,
                          Glm4MoeForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, GptOssConfig, GptOssForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          Olmo3Config, Olmo3ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
                          Qwen3NextConfig, Qwen3NextForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

SMALL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64)
CASES = {
    "llama2_mha": (LlamaForCausalLM, LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4,
                                                 intermediate_size=96, rms_norm_eps=1e-5)),
    "llama3_gqa_rope_scaling": (LlamaForCausalLM, LlamaConfig(
        **SMALL, num_attention_heads=8, num_key_value_heads=2, intermediate_size=112, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    # window 8 < the 16+ tokens the tests feed: the sliding window really hides keys
    "mistral_window": (MistralForCausalLM, MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                                                         intermediate_size=96, sliding_window=8, head_dim=16)),
    "qwen2_bias_tied": (Qwen2ForCausalLM, Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                                                      intermediate_size=96, tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads 16, per-head q/k norms, tied
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                            intermediate_size=96, tie_word_embeddings=True)),
    # sliding / full layers with their own RoPE bases, (1 + w) sandwich norms, GeGLU, scaled embeddings
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, intermediate_size=96, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    # fused qkv_proj and gate_up_proj
    "phi3": (Phi3ForCausalLM, Phi3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    # 4 experts, top 2 without renormalising, layer 0 dense (mlp_only_layers)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0])),
    # 4 experts, top 2 renormalised, every layer MoE
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                                                  intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    # MLA (low-rank q, latent kv, interleaved RoPE part; q/k heads 12 + 8, value heads 10), layer 0 dense,
    # then 8 experts in 2 groups (top 2 from the best group, sigmoid scores, expert bias), 1 shared expert
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, routed_scaling_factor=2.5)),
    # Kimi K2 is a DeepseekV3ForCausalLM: its values scaled down (384 experts -> 32, top 8, one group so no
    # grouped top-k, routed_scaling 2.827, YaRN x32 with its beta_fast / beta_slow 1)
    "kimi_k2": (DeepseekV3ForCausalLM, DeepseekV3Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=32, n_group=1,
        topk_group=1, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, routed_scaling_factor=2.827,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 50000.0})),
    # GLM-4.5 MoE: q/k/v biases, per-head q/k norms, RoPE on the leading half of each 16-feature head, layer 0
    # dense, then DeepSeek-V3's router (8 experts in 2 groups, top 2 from the best group, expert bias, scaled)
    # and a shared expert
    "glm4_moe": (Glm4MoeForCausalLM, Glm4MoeConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
        use_qk_norm=True, routed_scaling_factor=2.5)),
    # NoPE every 2nd layer (no_rope_layers [1, 0, 1]), the NoPE layer sliding (window 8), tied; token ids in the vocabulary
    "smollm3": (SmolLM3ForCausalLM, SmolLM3Config(
        **{**SMALL, "num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # norms after attention and MLP only, q/k norms over the whole projection (OLMo 2); OLMo 3 also with its
    # default layer_types (3 sliding layers, window 8, then a full one)
    "olmo2": (Olmo2ForCausalLM, Olmo2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "olmo3": (Olmo3ForCausalLM, Olmo3Config(**{**SMALL, "num_hidden_layers": 4}, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=96, sliding_window=8,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # sinks, q/k/v/o biases, sliding (window 8) / full, YaRN; 4 experts top 2 with a router bias, biased
    # experts stored as one gate_up_proj with alternating columns, clamped SwiGLU (limit 0.1: clamps often)
    "gpt_oss": (GptOssForCausalLM, GptOssConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
    # hybrid: 3 Gated DeltaNet layers (2 key heads of 16 serving 4 value heads of 8, conv of 4 taps) then a
    # gated full-attention layer (q_proj with per-head gates, q/k norms, RoPE on 4 of the head's 16 features)
    "qwen3_5": (Qwen3_5ForCausalLM, Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8)),
    # the same hybrid layers, every MLP 4 experts (top 2, renormalised) and a gated shared expert of 48
    "qwen3_5_moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8)),
    # the hybrid with key-head-grouped in_proj_qkvz / in_proj_ba, 4 experts (top 2) and a gated shared expert,
    # layer 1 dense (mlp_only_layers)
    "qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, max_position_embeddings=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)),
}


def build(case: str, seed: int = 0, **changes):
    """A random model whose norms and biases are not at their init values (ones / zeros), so a
    swapped norm or a dropped bias changes the output. `changes` override config keys."""
    cls, cfg = CASES[case]
    if changes:
        cfg = type(cfg)(**{**cfg.to_dict(), **changes})
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("A_log"):
                # Gated DeltaNet decay rates in [0.5, 2] (transformers draws up to 16): a head decaying by e^-20 per
                # token has an A_log gradient of ~1e-7 from terms ~1e3 x larger, which torch's own fp32 misses
                # its fp64 value by 3e-4 of (measured), beyond the gates that compare the two sides
                p.copy_(torch.empty_like(p).uniform_(0.5, 2.0).log())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's expert bias: it changes which experts route
                b.add_(torch.randn_like(b) * 0.1)
    return model


def save_bin(model, folder: Path, shards: int = 1) -> Path:
    """pytorch_model.bin (or N shards + index), as older transformers wrote them."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    names, weight_map = list(state), {}
    for k in range(shards):
        file = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[k::shards]}
        torch.save(part, folder / file)
        weight_map.update({n: file for n in part})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tokenizer(folder: Path, texts: list[str], vocab_size: int = 300, chat_template: str | None = CHATML) -> Path:
    """A byte-level BPE tokenizer.json of at most vocab_size tokens, with tokenizer_config.json
    naming its EOS and (optionally) a ChatML chat template: what an HF model dir carries."""
    from msllm.data.tokenizer import EOS, train_tokenizer

    tok = train_tokenizer(texts, vocab_size - 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": EOS, **({"chat_template": chat_template} if chat_template else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"
