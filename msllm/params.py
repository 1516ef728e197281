"""Every parameter of the decoder (msllm.models.decoder) with its shape, from its ModelConfig alone:
the one inventory that the layout table places (msllm.layout), checkpoints are checked against and
ModelConfig.num_params counts. The bottom layer: it imports nothing from msllm (msllm.config imports it)."""


def param_shapes(m: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """Every parameter of the decoder built from `m` with its shape, in the model's order (no MindSpore needed)."""
    h = m.hidden_size
    kinds = list(zip(m.mlp_kinds(), m.mixer_kinds()))
    layers = {kind: layer_shapes(m, *kind) for kind in set(kinds)}
    shapes = {"tok_embeddings.weight": (m.vocab_size, h)}
    for i, kind in enumerate(kinds):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layers[kind].items()})
    shapes["norm.weight"] = (h,)
    if not m.tie_embeddings:
        shapes["output.weight"] = (m.vocab_size, h)
    if m.mtp_depths:
        depth = mtp_shapes(m)
        for k in range(m.mtp_depths):
            shapes.update({f"mtp.{k}.{name}": shape for name, shape in depth.items()})
    return shapes


def mtp_shapes(m: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """One multi-token-prediction depth's parameters (names under mtp.K., msllm.models.mtp): the norms of the
    embedding and hidden inputs, their joint projection, a block built like the last layer, its final norm."""
    h = m.hidden_size
    shapes = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h)}
    shapes.update({f"layer.{name}": shape for name, shape in layer_shapes(m, *m.mtp_layer_kind()).items()})
    shapes["norm.weight"] = (h,)
    return shapes


def layer_shapes(m: "ModelConfig", kind: str, mixer: str = "") -> dict[str, tuple[int, ...]]:
    """A decoder layer's parameters (names under layers.N.) when its MLP is `kind`, "dense" or "moe"
    (m.mlp_kinds()), and its token mixer `mixer` (m.mixer_kinds(); "": the model's attention): every
    layer of a kind holds the same."""
    h, d = m.hidden_size, m.head_size
    q, kv = m.num_heads * d, m.num_kv_heads * d
    shapes = {"attention_norm.weight": (h,)} if m.pre_norm else {}
    if mixer == "gated_deltanet":
        shapes.update({f"attention.{k}": v for k, v in gated_deltanet_shapes(m).items()})
    elif m.mla:
        shapes.update({f"attention.{k}": v for k, v in mla_shapes(m).items()})
    else:
        for name, out in (("wq", q), ("wk", kv), ("wv", kv)):
            shapes[f"attention.{name}.weight"] = (out, h)
            if m.qkv_bias:
                shapes[f"attention.{name}.bias"] = (out,)
        if m.attn_output_gate:
            shapes["attention.wg.weight"] = (q, h)
        shapes["attention.wo.weight"] = (h, q)
        if m.o_bias:
            shapes["attention.wo.bias"] = (h,)
        if m.qk_norm:  # MLA has no q / k norms of this kind (its q_norm is the q latent's)
            per_head = m.qk_norm_scope == "head"
            shapes["attention.q_norm.weight"] = (d,) if per_head else (q,)
            shapes["attention.k_norm.weight"] = (d,) if per_head else (kv,)
        if m.attention_sinks:
            shapes["attention.core.sinks"] = (m.num_heads,)
    if m.sandwich_norm:
        shapes["attention_out_norm.weight"] = (h,)
    if m.pre_norm:
        shapes["ffn_norm.weight"] = (h,)
    if kind == "moe":
        e, f = m.num_experts, m.moe_ffn_size or m.ffn_size
        shapes["feed_forward.router.weight"] = (e, h)
        if m.router_bias:
            shapes["feed_forward.router.bias"] = (e,)
        if m.router == "sigmoid_grouped":
            shapes["feed_forward.router.expert_bias"] = (e,)
        shapes["feed_forward.experts.w1"] = (e, f, h)
        shapes["feed_forward.experts.w2"] = (e, h, f)
        shapes["feed_forward.experts.w3"] = (e, f, h)
        if m.experts_bias:
            shapes.update({"feed_forward.experts.b1.bias": (e, f), "feed_forward.experts.b2.bias": (e, h),
                           "feed_forward.experts.b3.bias": (e, f)})
        if m.shared_experts:
            g = m.shared_size
            shapes.update({"feed_forward.shared.w1.weight": (g, h), "feed_forward.shared.w2.weight": (h, g),
                           "feed_forward.shared.w3.weight": (g, h)})
            if m.shared_gate:
                shapes["feed_forward.shared_gate.weight"] = (1, h)
    else:
        shapes["feed_forward.w1.weight"] = (m.ffn_size, h)
        shapes["feed_forward.w2.weight"] = (h, m.ffn_size)
        shapes["feed_forward.w3.weight"] = (m.ffn_size, h)
    if m.sandwich_norm:
        shapes["ffn_out_norm.weight"] = (h,)
    return shapes


def mla_shapes(m: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """An MLA layer's parameters (msllm/models/mixers/mla.py), in its order."""
    h, n, q = m.hidden_size, m.num_heads, m.num_heads * m.head_size
    r, c = m.q_lora_rank, m.kv_lora_rank
    shapes = ({"wq_a.weight": (r, h), "q_norm.weight": (r,), "wq_b.weight": (q, r)} if r else {"wq.weight": (q, h)})
    shapes.update({"wkv_a.weight": (c + m.qk_rope_head_dim, h), "kv_norm.weight": (c,),
                   "wkv_b.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), c), "wo.weight": (h, n * m.v_head_dim)})
    return shapes


def gated_deltanet_shapes(m: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's parameters (msllm/models/mixers/gated_deltanet.py), in its order."""
    h, nv = m.hidden_size, m.linear_num_value_heads
    key, value = m.linear_num_key_heads * m.linear_key_head_dim, nv * m.linear_value_head_dim
    kernel = m.linear_conv_kernel
    return {"wq.weight": (key, h), "wk.weight": (key, h), "wv.weight": (value, h), "wz.weight": (value, h), "wb.weight": (nv, h),
            "wa.weight": (nv, h), "conv_q.weight": (key, 1, kernel), "conv_k.weight": (key, 1, kernel),
            "conv_v.weight": (value, 1, kernel), "dt_bias": (nv,), "A_log": (nv,),
            "norm.weight": (m.linear_value_head_dim,), "wo.weight": (h, value)}
