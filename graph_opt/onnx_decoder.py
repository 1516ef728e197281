"""The ONNX graphs of an msllm model, written op by op from its config and weights.

A static trace would bake batch and sequence lengths into Reshape nodes, so the graphs are
built directly (onnx_ir) and mirror msllm/models/decoder.py line for line, reading the same family
spec (ModelConfig):
  * the residual stream is kept as rows [batch*seq, hidden], so every linear is one
    Gemm(x, W, b, transB=1) on the checkpoint's own [out, in] weight, under its msllm name;
  * rotate-half RoPE computed from the token positions and the inverse frequencies (llama3 /
    linear / YaRN scaling included), one set per attention kind (full, or sliding with its window
    and RoPE base): no [max_seq_len, d] table, so a 128K context costs nothing until used;
  * grouped KV heads folded into the row axis as in AttentionCore; fp32 RMSNorm and softmax;
    q/k norms, (offset + w) norms, sandwich norms, GeGLU, attention sinks and the embedding scale as the
    spec says;
  * MLA (msllm/models/mixers/mla.py) with its latent cache, DeepSeek-V3's grouped sigmoid router and
    shared experts (msllm/models/moe.py);
  * partial RoPE and gated attention (Qwen3.5), and Gated DeltaNet layers (graph_opt/onnx_deltanet.py),
    whose recurrent states and conv windows are two more caches after the keys and values.
Two graphs, both with dynamic batch, sequence and cache length:
  model    input_ids [b, s] -> logits [b, s, vocab]
  cached   input_ids [b, s], past_<name> for each of ModelConfig.caches (keys, values [layers, b, kv_heads,
           max_len, head_dim]; sliding layers' ring_keys, ring_values of min(max_len, window) slots; a
           hybrid's states, windows), start [1], pad [b] -> logits [b, vocab] of the last token and
           present_<name> of each (slots start .. start+s-1 written), as msllm.inference.CachedForward:
           prefill, and decode with s = 1. One session serves both, so the weights (and onnxruntime's
           packed copies of them) are held once; a graph with s fixed at 1 decodes no faster.
Simple constants are emitted where they are used (one Constant node each, Casts even when
they are no-ops, like msllm's astype); graph_opt.onnx_passes folds and deduplicates them.
Every weight given must be used: a parameter the graph does not compute is refused.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from graph_opt.onnx_deltanet import gated_deltanet
from msllm.config import CACHE_NAMES, ModelConfig
from msllm.models.decoder import attention_kinds
from msllm.models.layers import rope_attention_factor, rope_inv_freq
from msllm.models.mixers.mla import LATENT_NORM_EPS

OPSET = 17
IR_VERSION = 8
GRAPHS = ("model", "cached")
DTYPES = {"fp32": (np.float32, ir.DataType.FLOAT), "fp16": (np.float16, ir.DataType.FLOAT16)}
MASKED = -1e9  # the additive mask value msllm uses

# Per layer, relative to "layers.{i}.": the msllm parameters of each role (norms may be absent).
NORMS = ("attention_norm", "attention_out_norm", "ffn_norm", "ffn_out_norm", "attention.q_norm", "attention.k_norm",
         "attention.kv_norm", "attention.norm")
LINEARS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2",
           "q_a": "attention.wq_a", "q_b": "attention.wq_b", "kv_a": "attention.wkv_a", "kv_b": "attention.wkv_b",
           "shared_gate": "feed_forward.shared.w1", "shared_up": "feed_forward.shared.w3",
           "shared_down": "feed_forward.shared.w2", "output_gate": "attention.wg",
           "z": "attention.wz", "beta": "attention.wb", "decay": "attention.wa",
           "shared_output_gate": "feed_forward.shared_gate"}
EMBED, FINAL_NORM, HEAD = "tok_embeddings.weight", "norm.weight", "output.weight"


def layer_weights(weights: dict[str, np.ndarray], i: int) -> dict[str, tuple[str, np.ndarray] | None]:
    """Role -> (name, array) for layer i; a missing norm or bias is None."""
    def named(name):
        return (name, weights[name]) if name in weights else None

    out = {norm: named(f"layers.{i}.{norm}.weight") for norm in NORMS}
    out["sinks"] = named(f"layers.{i}.attention.core.sinks")
    out.update({part: named(f"layers.{i}.attention.{part}")
                for part in ("conv_q.weight", "conv_k.weight", "conv_v.weight", "dt_bias", "A_log")})
    out["router"] = named(f"layers.{i}.feed_forward.router.weight")
    out["router_bias"] = named(f"layers.{i}.feed_forward.router.expert_bias")
    out["router_logit_bias"] = named(f"layers.{i}.feed_forward.router.bias")
    out.update({f"experts.{w}": named(f"layers.{i}.feed_forward.experts.{w}") for w in ("w1", "w2", "w3")})
    out.update({f"experts.{b}": named(f"layers.{i}.feed_forward.experts.{b}.bias") for b in ("b1", "b2", "b3")})
    for role, name in LINEARS.items():
        out[role], out[role + "_bias"] = named(f"layers.{i}.{name}.weight"), named(f"layers.{i}.{name}.bias")
    return out


class LlamaGraph:
    """Records the nodes and initializers of one graph on an onnx_ir tape."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], dtype: str):
        self.cfg, self.weights = cfg, weights
        self.kinds, self.layer_kind = attention_kinds(cfg)
        self.np_dtype, self.dtype = DTYPES[dtype]
        self.tape = ir.tape.Tape()
        self.initializers: dict[str, ir.Value] = {}

    # -- emitting ------------------------------------------------------------------------
    def op(self, op_type: str, *inputs, **attributes) -> ir.Value:
        return self.tape.op(op_type, list(inputs), attributes=attributes or None)

    def const(self, value, dtype=np.int64) -> ir.Value:
        return self.op("Constant", value=ir.tensor(np.asarray(value, dtype)))

    def param(self, named: tuple[str, np.ndarray] | None, fp32: bool = False) -> ir.Value | None:
        """A weight as an initializer in the export dtype (norm weights stay fp32), created once per name."""
        if named is None:
            return None
        name, array = named
        if name not in self.initializers:
            array = array.astype(np.float32 if fp32 else self.np_dtype, copy=False)
            self.initializers[name] = self.tape.initializer(ir.tensor(array, name=name))
        return self.initializers[name]

    def shape(self, *dims) -> ir.Value:
        """A 1-D shape from ints and 1-element int64 values (e.g. the runtime sequence length)."""
        parts = [self.const([d]) if isinstance(d, int) else d for d in dims]
        return self.op("Concat", *parts, axis=0)

    # -- layers ----------------------------------------------------------------------------
    def linear(self, x, weight, bias=None) -> ir.Value:
        return self.op("Gemm", x, self.param(weight), *([self.param(bias)] if bias else []), transB=1)

    def rms_norm(self, x, weight, latent: bool = False, plain: bool = False) -> ir.Value:
        """Over the last axis, scaled by (norm_offset + weight); x unchanged when the norm is absent.
        latent: MLA's latent norms (eps LATENT_NORM_EPS, no offset). plain: no offset, and the result
        left in fp32 (a Gated DeltaNet layer's output norm)."""
        if weight is None:
            return x
        x = self.op("Cast", x, to=ir.DataType.FLOAT)
        mean_square = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
        eps = self.const(LATENT_NORM_EPS if latent else self.cfg.norm_eps, np.float32)
        x = self.op("Div", x, self.op("Sqrt", self.op("Add", mean_square, eps)))
        scale = self.param(weight, fp32=True)
        if self.cfg.norm_offset and not (latent or plain):
            scale = self.op("Add", scale, self.const(self.cfg.norm_offset, np.float32))
        return self.op("Cast", self.op("Mul", x, scale), to=ir.DataType.FLOAT if plain else self.dtype)

    def heads(self, rows, n, seq, d: int = 0) -> ir.Value:
        """[b*s, n*d] -> [b, n, s, d] (d: the head size unless given)."""
        split = self.op("Reshape", rows, self.shape(-1, seq, n, d or self.cfg.head_size))
        return self.op("Transpose", split, perm=[0, 2, 1, 3])

    def part(self, x, start: int, end: int) -> ir.Value:
        """x[..., start:end]."""
        return self.op("Slice", x, self.const([start]), self.const([end]), self.const([-1]))

    def rope(self, x, cos, sin, width: int = 0) -> ir.Value:
        """Rotate-half RoPE on the first rope_dim features of each head of `width` (0: rope_dim, all of
        them); the others pass unchanged (partial RoPE)."""
        d = self.cfg.rope_dim
        rotary = self.part(x, 0, d) if width > d else x
        first, second = self.part(rotary, 0, d // 2), self.part(rotary, d // 2, d)
        rotated = self.op("Concat", self.op("Neg", second), first, axis=-1)
        rotary = self.op("Add", self.op("Mul", rotary, cos), self.op("Mul", rotated, sin))
        return self.op("Concat", rotary, self.part(x, d, width), axis=-1) if width > d else rotary

    def normed_heads(self, projection, norm, n: int, seq) -> ir.Value:
        """A q or k projection as heads [b, n, s, d], its norm (if any) over each head or over the whole
        projection (qk_norm_scope)."""
        if self.cfg.qk_norm_scope == "projection":
            return self.heads(self.rms_norm(projection, norm), n, seq)
        return self.rms_norm(self.heads(projection, n, seq), norm)

    def softmax(self, scores, sinks) -> ir.Value:
        """Softmax over the rows of scores [b, nkv, rep*s, t]; with sinks [nh], each head's sink logit joins
        its rows as one more column (no value), dropped after the softmax."""
        if sinks is None:
            return self.op("Softmax", scores, axis=-1)
        nkv = self.cfg.num_kv_heads
        column = self.part(scores, 0, 1)                                   # [b, nkv, rep*s, 1]
        by_head = self.op("Reshape", column, self.shape(0, nkv, self.cfg.num_heads // nkv, -1, 1))
        per_head = self.op("Reshape", self.param(sinks, fp32=True), self.shape(1, nkv, -1, 1, 1))
        sink = self.op("Reshape", self.op("Expand", per_head, self.op("Shape", by_head)), self.op("Shape", column))
        probs = self.op("Softmax", self.op("Concat", scores, sink, axis=-1), axis=-1)
        return self.part(probs, 0, -1)

    def attention(self, x, w, seq, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        q = self.normed_heads(self.linear(x, w["q"], w["q_bias"]), w["attention.q_norm"], nh, seq)
        k = self.normed_heads(self.linear(x, w["k"], w["k_bias"]), w["attention.k_norm"], nkv, seq)
        q, k = self.rope(q, cos, sin, d), self.rope(k, cos, sin, d)
        v = self.heads(self.linear(x, w["v"], w["v_bias"]), nkv, seq)
        if cache_k is not None:  # the new tokens' slots take the new keys and values
            source, fresh = write
            k = self.op("Where", fresh, self.op("Gather", k, source, axis=2), cache_k)
            v = self.op("Where", fresh, self.op("Gather", v, source, axis=2), cache_v)
        # The nh/nkv query heads sharing a KV head become rows: [b, nkv, rep*s, d].
        q = self.op("Reshape", q, self.shape(0, nkv, -1, d))
        scores = self.op("MatMul", q, self.op("Transpose", k, perm=[0, 1, 3, 2]))
        scale = cfg.attn_scale or 1.0 / math.sqrt(d)
        scores = self.op("Mul", self.op("Cast", scores, to=ir.DataType.FLOAT), self.const(scale, np.float32))
        probs = self.softmax(self.op("Add", scores, mask), w["sinks"])
        out = self.op("MatMul", self.op("Cast", probs, to=self.dtype), v)
        out = self.op("Transpose", self.op("Reshape", out, self.shape(0, nh, -1, d)), perm=[0, 2, 1, 3])
        out = self.op("Reshape", out, self.shape(-1, nh * d))
        if w["output_gate"] is not None:  # gated attention: each feature x sigmoid(its gate)
            out = self.op("Mul", out, self.op("Sigmoid", self.linear(x, w["output_gate"])))
        return self.linear(out, w["o"], w["o_bias"]), k, v

    def rope_order(self, x, n: int) -> ir.Value:
        """MLA's rope parts [N, n, r] (or [N, r], n = 1) -> [N, n*r], neighbour pairs to evens then odds
        when rope_interleave (mla.Deinterleave)."""
        r = self.cfg.qk_rope_head_dim
        if self.cfg.rope_interleave:
            x = self.op("Transpose", self.op("Reshape", x, self.shape(-1, n, r // 2, 2)), perm=[0, 1, 3, 2])
        return self.op("Reshape", x, self.shape(-1, n * r))

    def mla(self, x, w, seq, cos, sin, mask, cache_k=None, cache_v=None, write=None):
        """As msllm.models.mixers.mla.MLA: -> (out, latents [b, 1, t, kv_lora_rank], rope keys [b, 1, t, rope])."""
        cfg = self.cfg
        n, nope, r, dv, rank, qk = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                    cfg.kv_lora_rank, cfg.head_size)
        if cfg.q_lora_rank:
            q = self.linear(self.rms_norm(self.linear(x, w["q_a"]), w["attention.q_norm"], latent=True), w["q_b"])
        else:
            q = self.linear(x, w["q"])
        q = self.op("Reshape", q, self.shape(-1, n, qk))
        q_nope = self.heads(self.op("Reshape", self.part(q, 0, nope), self.shape(-1, n * nope)), n, seq, nope)
        q_rot = self.rope(self.heads(self.rope_order(self.part(q, nope, qk), n), n, seq, r), cos, sin)
        kv = self.linear(x, w["kv_a"])
        latent = self.heads(self.rms_norm(self.part(kv, 0, rank), w["attention.kv_norm"], latent=True), 1, seq, rank)
        k_rot = self.rope(self.heads(self.rope_order(self.part(kv, rank, rank + r), 1), 1, seq, r), cos, sin)
        if cache_k is not None:  # the new tokens' slots take the new latents and rope keys
            source, fresh = write
            latent = self.op("Where", fresh, self.op("Gather", latent, source, axis=2), cache_k)
            k_rot = self.op("Where", fresh, self.op("Gather", k_rot, source, axis=2), cache_v)
        t = self.op("Shape", latent, start=2, end=3)
        expanded = self.linear(self.op("Reshape", latent, self.shape(-1, rank)), w["kv_b"])
        expanded = self.heads(expanded, n, t, nope + dv)                                      # [b, n, t, nope + v]
        k = self.op("Concat", self.part(expanded, 0, nope), self.op("Expand", k_rot, self.const([1, n, 1, 1])), axis=-1)
        q = self.op("Concat", q_nope, q_rot, axis=-1)
        scores = self.op("MatMul", q, self.op("Transpose", k, perm=[0, 1, 3, 2]))
        scale = cfg.attn_scale or 1.0 / math.sqrt(qk)
        scores = self.op("Mul", self.op("Cast", scores, to=ir.DataType.FLOAT), self.const(scale, np.float32))
        probs = self.op("Softmax", self.op("Add", scores, mask), axis=-1)
        out = self.op("MatMul", self.op("Cast", probs, to=self.dtype), self.part(expanded, nope, nope + dv))
        out = self.op("Reshape", self.op("Transpose", out, perm=[0, 2, 1, 3]), self.shape(-1, n * dv))
        return self.linear(out, w["o"]), latent, k_rot

    def activation(self, gate, up) -> ir.Value:
        if self.cfg.mlp == "geglu_tanh":  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
            cube = self.op("Mul", self.op("Mul", gate, gate), gate)
            inner = self.op("Mul", self.const(math.sqrt(2.0 / math.pi), self.np_dtype),
                            self.op("Add", gate, self.op("Mul", self.const(0.044715, self.np_dtype), cube)))
            half = self.op("Mul", self.const(0.5, self.np_dtype), gate)
            act = self.op("Mul", half, self.op("Add", self.const(1.0, self.np_dtype), self.op("Tanh", inner)))
        elif self.cfg.mlp == "swiglu_clamped":  # gpt-oss: gate <= limit, |up| <= limit, g sigmoid(alpha g) (up + 1)
            limit = self.cfg.swiglu_limit
            gate = self.op("Min", gate, self.const(limit, self.np_dtype))
            up = self.op("Clip", up, self.const(-limit, self.np_dtype), self.const(limit, self.np_dtype))
            alpha = self.const(self.cfg.swiglu_alpha, self.np_dtype)
            act = self.op("Mul", gate, self.op("Sigmoid", self.op("Mul", gate, alpha)))
            return self.op("Mul", act, self.op("Add", up, self.const(1.0, self.np_dtype)))
        else:
            act = self.op("Mul", gate, self.op("Sigmoid", gate))
        return self.op("Mul", act, up)

    def feed_forward(self, x, w) -> ir.Value:
        if w["router"] is not None:
            return self.experts(x, w)
        hidden = self.activation(self.linear(x, w["gate"], w["gate_bias"]), self.linear(x, w["up"], w["up_bias"]))
        return self.linear(hidden, w["down"], w["down_bias"])

    def top_k(self, x, k: int):
        return self.tape.op_multi_out("TopK", [x, self.const([k])], num_outputs=2,
                                      attributes={"axis": -1, "largest": 1, "sorted": 1})

    def grouped_sigmoid_route(self, x, w):
        """As moe.GroupedSigmoidRouter: (weights [N, k] fp32, experts [N, k])."""
        cfg = self.cfg
        per_group = cfg.num_experts // cfg.expert_groups
        scores = self.op("Sigmoid", self.op("Gemm", self.op("Cast", x, to=ir.DataType.FLOAT),
                                            self.param(w["router"], fp32=True), transB=1))
        biased = self.op("Add", scores, self.param(w["router_bias"], fp32=True))
        best_two = self.top_k(self.op("Reshape", biased, self.shape(-1, per_group)), 2)[0]
        group_scores = self.op("Reshape", self.op("ReduceSum", best_two, self.const([-1]), keepdims=0),
                               self.shape(-1, cfg.expert_groups))
        groups = self.op("OneHot", self.top_k(group_scores, cfg.topk_groups)[1], self.const([cfg.expert_groups]),
                         self.const([0.0, 1.0], np.float32), axis=-1)
        chosen_groups = self.op("ReduceSum", groups, self.const([1]), keepdims=0)                 # [N, G]
        allowed = self.op("Expand", self.op("Unsqueeze", chosen_groups, self.const([-1])), self.const([1, 1, per_group]))
        allowed = self.op("Greater", self.op("Reshape", allowed, self.shape(-1, cfg.num_experts)), self.const(0.0, np.float32))
        chosen = self.top_k(self.op("Where", allowed, biased, self.const(-1e30, np.float32)), cfg.experts_per_token)[1]
        weights = self.op("GatherElements", scores, chosen, axis=1)
        if cfg.norm_topk_prob:
            total = self.op("Add", self.op("ReduceSum", weights, self.const([-1]), keepdims=1), self.const(1e-20, np.float32))
            weights = self.op("Div", weights, total)
        return self.op("Mul", weights, self.const(cfg.routed_scaling, np.float32)), chosen

    def experts(self, x, w) -> ir.Value:
        """As msllm.models.moe: top-k routing (fp32; softmax, or DeepSeek-V3's grouped sigmoid), every expert
        on every token, outputs summed with the routing weights (0 for experts not chosen), plus the shared
        experts. x [N, h] -> [N, h]."""
        cfg = self.cfg
        if cfg.router == "sigmoid_grouped":
            weights, chosen = self.grouped_sigmoid_route(x, w)
        else:
            logits = self.op("Cast", self.linear(x, w["router"]), to=ir.DataType.FLOAT)
            if w["router_logit_bias"] is not None:  # gpt-oss
                logits = self.op("Add", logits, self.param(w["router_logit_bias"], fp32=True))
            probs = self.op("Softmax", logits, axis=-1)
            weights, chosen = self.top_k(probs, cfg.experts_per_token)
            if cfg.norm_topk_prob:
                weights = self.op("Div", weights, self.op("ReduceSum", weights, self.const([-1]), keepdims=1))
        one_hot = self.op("OneHot", chosen, self.const([cfg.num_experts]), self.const([0.0, 1.0], np.float32), axis=-1)
        combine = self.op("ReduceSum", self.op("Mul", one_hot, self.op("Unsqueeze", weights, self.const([-1]))),
                          self.const([1]), keepdims=0)                                         # [N, E]
        xs = self.op("Unsqueeze", x, self.const([0]))                                          # [1, N, h]

        def batched(value, weight, bias):  # [E or 1, N, in] @ W[E, out, in]^T (+ bias [E, out]: gpt-oss)
            out = self.op("MatMul", value, self.op("Transpose", self.param(weight), perm=[0, 2, 1]))
            return out if bias is None else self.op("Add", out, self.op("Unsqueeze", self.param(bias), self.const([1])))

        hidden = self.activation(batched(xs, w["experts.w1"], w["experts.b1"]),
                                 batched(xs, w["experts.w3"], w["experts.b3"]))
        out = batched(hidden, w["experts.w2"], w["experts.b2"])                                # [E, N, h]
        scale = self.op("Unsqueeze", self.op("Cast", self.op("Transpose", combine, perm=[1, 0]), to=self.dtype),
                        self.const([-1]))                                                      # [E, N, 1]
        routed = self.op("ReduceSum", self.op("Mul", out, scale), self.const([0]), keepdims=0)
        if w["shared_gate"] is None:
            return routed
        shared = self.activation(self.linear(x, w["shared_gate"]), self.linear(x, w["shared_up"]))
        shared = self.linear(shared, w["shared_down"])
        if w["shared_output_gate"] is not None:  # Qwen3.5-MoE / Qwen3-Next: x sigmoid(a scalar of x) per token
            shared = self.op("Mul", shared, self.op("Sigmoid", self.linear(x, w["shared_output_gate"])))
        return self.op("Add", routed, shared)

    def window(self, visible, query_slots, key_slots, window: int):
        """visible, and within the last `window` slots of its query when window > 0."""
        if not window:
            return visible
        near = self.op("Less", self.op("Sub", query_slots, key_slots), self.const(window))
        return self.op("And", visible, near)

    def rope_at(self, kind: int, positions) -> tuple[ir.Value, ir.Value]:
        """cos, sin [.., d] of attention kind `kind` at int64 positions [..], as Decoder.rope_at: the
        angle position * inv_freq rounded to fp32, then its cosine and sine."""
        _, theta, scaling = self.kinds[kind]
        name = "rope_inv_freq" + (f"_{kind}" if kind else "")
        inv_freq = self.param((name, rope_inv_freq(self.cfg.rope_dim, theta, scaling)), fp32=True)
        position = self.op("Unsqueeze", self.op("Cast", positions, to=ir.DataType.FLOAT), self.const([-1]))
        freqs = self.op("Mul", position, inv_freq)
        angles = self.op("Concat", freqs, freqs, axis=-1)
        factor = rope_attention_factor(scaling)  # YaRN scales cos and sin
        tables = []
        for fn in ("Cos", "Sin"):
            table = self.op(fn, angles)
            if factor != 1.0:
                table = self.op("Mul", table, self.const(factor, np.float32))
            tables.append(self.op("Cast", table, to=self.dtype))
        return tables[0], tables[1]

    def causal_mask(self, positions, total, window: int) -> ir.Value:
        """[s, t] additive mask, tiled to the folded rows [rep*s, t]: key j is visible from query i
        when j <= i (and i - j < window)."""
        key_positions = self.op("Unsqueeze", self.op("Range", self.const(0), total, self.const(1)), self.const([0]))
        query_positions = self.op("Unsqueeze", positions, self.const([1]))
        visible = self.window(self.op("LessOrEqual", key_positions, query_positions), query_positions,
                              key_positions, window)
        mask = self.op("Where", visible, self.const(0.0, np.float32), self.const(MASKED, np.float32))
        return self.op("Tile", mask, self.const([self.cfg.num_heads // self.cfg.num_kv_heads, 1]))

    def cache_tables(self, seq, length, start, pad, kind: int, first=None):
        """As Decoder.cache_tables: rope rows at each row's positions [b, 1, s, d], the mask over the `length`
        cached keys [b, 1, rep*s, t] (key j holds slot first + j, first None: 0; visible from new slot i when
        pad <= first + j <= i, within the window), and where the new tokens go among them (source [t],
        fresh [t, 1]): at index start - first."""
        first_slot = self.op("Squeeze", start)
        new_slots = self.op("Range", first_slot, self.op("Add", first_slot, self.op("Squeeze", seq)), self.const(1))
        positions = self.op("Max", self.op("Sub", self.op("Unsqueeze", new_slots, self.const([0])),
                                           self.op("Unsqueeze", pad, self.const([1]))), self.const(0))  # [b, s]
        cos, sin = (self.op("Unsqueeze", table, self.const([1])) for table in self.rope_at(kind, positions))
        slots = self.op("Range", self.const(0), length, self.const(1))                # key indices [t]
        at = start
        if first is not None:  # in key indices
            new_slots, at = self.op("Sub", new_slots, first), self.op("Sub", start, first)
        key_slots = self.op("Unsqueeze", slots, self.const([0, 1]))  # [1, 1, t]
        query_slots = self.op("Unsqueeze", new_slots, self.const([0, 2]))  # [1, s, 1]
        visible = self.window(self.op("LessOrEqual", key_slots, query_slots), query_slots, key_slots,
                              self.kinds[kind][0])
        held = key_slots if first is None else self.op("Add", key_slots, first)  # the slot each key holds
        visible = self.op("And", visible,
                          self.op("GreaterOrEqual", held, self.op("Unsqueeze", pad, self.const([1, 2]))))
        mask = self.op("Where", visible, self.const(0.0, np.float32), self.const(MASKED, np.float32))  # [b, s, t]
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        mask = self.op("Unsqueeze", self.op("Tile", mask, self.const([1, rep, 1])), self.const([1]))
        fresh = self.op("And", self.op("GreaterOrEqual", slots, at), self.op("Less", slots, self.op("Add", at, seq)))
        source = self.op("Clip", self.op("Sub", slots, self.op("Squeeze", at)), self.const(0),
                         self.op("Sub", self.op("Squeeze", seq), self.const(1)))
        return cos, sin, mask, (source, self.op("Unsqueeze", fresh, self.const([1])))

    def ring_slots(self, seq, ring, start) -> tuple[ir.Value, ir.Value, ir.Value]:
        """As Decoder.ring_slots, for a ring cache `ring` [layers, b, kv, r, d]: (r [1], unroll [r + s], keep [r])."""
        r = self.op("Shape", ring, start=3, end=4)
        indices = self.op("Range", self.const(0), self.op("Squeeze", r), self.const(1))
        unroll = self.op("Concat", self.op("Mod", self.op("Add", indices, start), r),
                         self.op("ConstantOfShape", seq, value=ir.tensor(np.zeros(1, np.int64))), axis=0)
        keep = self.op("Add", seq, self.op("Mod", self.op("Sub", self.op("Sub", indices, start), seq), r))
        return r, unroll, keep

    def real_tokens(self, seq, start, pad) -> ir.Value:
        """As Decoder.real_tokens, as rows [b*s, 1] in the compute dtype: 1 for a token, 0 for left padding."""
        first = self.op("Squeeze", start)
        new_slots = self.op("Range", first, self.op("Add", first, self.op("Squeeze", seq)), self.const(1))
        real = self.op("GreaterOrEqual", self.op("Unsqueeze", new_slots, self.const([0])),
                       self.op("Unsqueeze", pad, self.const([1])))
        return self.op("Reshape", self.op("Cast", real, to=self.dtype), self.shape(-1, 1))

    def zeros(self, batch, *dims) -> ir.Value:
        """fp32 zeros [batch, *dims] (batch: a 1-element int64 value)."""
        return self.op("ConstantOfShape", self.shape(batch, *dims), value=ir.tensor(np.zeros(1, np.float32)))

    def forward(self, input_ids, caches: dict | None = None, start=None, pad=None):
        """Without caches: logits [b, s, vocab] fp32. With them (ModelConfig.caches by name): logits [b, vocab]
        of the last token, and the caches with the new tokens written: keys / values at the new slots, a
        ring's at their slots % its length, a hybrid's recurrent states and conv windows after the new
        tokens. Returns (logits, [caches in ModelConfig.caches' order])."""
        cfg = self.cfg
        seq = self.op("Shape", input_ids, start=1, end=2)  # [1]
        layer_kinds = cfg.layer_kinds()
        write = ring = None
        if caches is not None and "ring_keys" in caches:  # the sliding layers' ring, unrolled around the new tokens
            ring = self.ring_slots(seq, caches["ring_keys"], start)
        tables = []  # (cos, sin, mask) per attention kind
        for kind, (window, _, _) in enumerate(self.kinds):
            if caches is None:
                positions = self.op("Range", self.const(0), self.op("Squeeze", seq), self.const(1))
                cos, sin = self.rope_at(kind, positions)
                tables.append((cos, sin, self.causal_mask(positions, self.op("Squeeze", seq), window)))
            elif window:
                r, _, _ = ring
                length = self.op("Squeeze", self.op("Add", r, seq))
                cos, sin, mask, ring_write = self.cache_tables(seq, length, start, pad, kind, self.op("Sub", start, r))
                tables.append((cos, sin, mask))
            else:
                length = self.op("Gather", self.op("Shape", caches["keys"]), self.const(3)) if "keys" in caches \
                    else self.op("Squeeze", seq)
                cos, sin, mask, write = self.cache_tables(seq, length, start, pad, kind)
                tables.append((cos, sin, mask))
        real = self.real_tokens(seq, start, pad) if caches is not None and cfg.hybrid else None
        batch = self.op("Shape", input_ids, start=0, end=1)

        embed = (EMBED, self.weights[EMBED])
        x = self.op("Reshape", self.op("Gather", self.param(embed), input_ids), self.shape(-1, cfg.hidden_size))
        if cfg.embed_scale != 1.0:
            x = self.op("Mul", x, self.const(cfg.embed_scale, self.np_dtype))
        present = {name: [] for name in cfg.cache_names()}  # each a list of [1, ...] per layer
        for i in range(cfg.num_layers):
            w = layer_weights(self.weights, i)
            kind = layer_kinds[i]
            names = CACHE_NAMES[kind]
            slot = self.const(layer_kinds[:i].count(kind))  # the layer's index among its kind's caches
            normed = self.rms_norm(x, w["attention_norm"])
            if kind == "linear":
                if caches is None:  # the model graph: every row starts from a zero state and window
                    state, window = (self.zeros(batch, *cfg.caches(1, 1)[name][2:]) for name in names)
                else:
                    state, window = (self.op("Cast", self.op("Gather", caches[name], slot), to=ir.DataType.FLOAT)
                                     for name in names)
                out, *new = gated_deltanet(self, normed, w, seq, state, window, real, i)
                new = [self.op("Cast", c, to=self.dtype) for c in new]
            else:
                cos, sin, mask = tables[self.layer_kind[i]]
                attention = self.mla if cfg.mla else self.attention
                if caches is None:
                    out, *new = attention(normed, w, seq, cos, sin, mask)
                elif kind == "sliding":  # the ring unrolled, written, attended, and its last slots kept
                    _, unroll, keep = ring
                    cache_k, cache_v = (self.op("Gather", self.op("Gather", caches[name], slot), unroll, axis=2)
                                        for name in names)
                    out, *new = attention(normed, w, seq, cos, sin, mask, cache_k, cache_v, ring_write)
                    new = [self.op("Gather", c, keep, axis=2) for c in new]
                else:
                    cache_k, cache_v = (self.op("Gather", caches[name], slot) for name in names)
                    out, *new = attention(normed, w, seq, cos, sin, mask, cache_k, cache_v, write)
            if caches is not None:
                for name, value in zip(names, new):
                    present[name].append(self.op("Unsqueeze", value, self.const([0])))
            x = self.op("Add", x, self.rms_norm(out, w["attention_out_norm"]))
            x = self.op("Add", x, self.rms_norm(self.feed_forward(self.rms_norm(x, w["ffn_norm"]), w), w["ffn_out_norm"]))
        if caches is not None:  # logits only where the next token is read
            last = self.op("Sub", self.op("Squeeze", seq), self.const(1))
            x = self.op("Gather", self.op("Reshape", x, self.shape(-1, seq, cfg.hidden_size)), last, axis=1)
        # Tied: the embedding table is the output projection (Gemm transB reads it in place).
        head = (HEAD, self.weights[HEAD]) if HEAD in self.weights else embed
        logits = self.linear(self.rms_norm(x, (FINAL_NORM, self.weights[FINAL_NORM])), head)
        if caches is None:
            logits = self.op("Reshape", logits, self.shape(-1, seq, cfg.vocab_size))
        logits = self.op("Cast", logits, to=ir.DataType.FLOAT)
        return logits, [self.op("Concat", *layers, axis=0) for layers in present.values() if layers]


def build_graph(cfg: ModelConfig, weights: dict[str, np.ndarray], kind: str, dtype: str = "fp32") -> ir.Model:
    """One of GRAPHS as an onnx_ir Model; weights are msllm parameter arrays by name (fp32)."""
    g = LlamaGraph(cfg, weights, dtype)
    cache_shapes = {name: list(shape) for name, shape in cfg.caches("batch", "max_len").items()}
    input_ids = ir.val("input_ids", ir.DataType.INT64, ["batch", "sequence"])
    inputs = [input_ids]
    if kind == "model":
        logits, present = g.forward(input_ids)
    else:
        caches = {name: ir.val(f"past_{name}", g.dtype, shape) for name, shape in cache_shapes.items()}
        start, pad = ir.val("start", ir.DataType.INT64, [1]), ir.val("pad", ir.DataType.INT64, ["batch"])
        inputs += [*caches.values(), start, pad]
        logits, present = g.forward(input_ids, caches, start, pad)
    unused = sorted(set(g.weights) - set(g.initializers))
    if unused:  # a parameter the graph does not compute: refuse rather than export another model
        raise ValueError(f"the ONNX builder does not use {unused}")
    logits.name, logits.dtype = "logits", ir.DataType.FLOAT
    logits.shape = ir.Shape(["batch", "sequence", cfg.vocab_size] if kind == "model" else ["batch", cfg.vocab_size])
    outputs = [logits]
    if kind != "model":
        for value, (name, shape) in zip(present, cache_shapes.items()):
            value.name, value.dtype, value.shape = f"present_{name}", g.dtype, ir.Shape(shape)
            outputs.append(value)
    graph = ir.Graph(inputs, outputs, nodes=g.tape.nodes, initializers=g.tape.initializers,
                     opset_imports={"": OPSET}, name=f"msllm_llama_{kind}")
    return ir.Model(graph, ir_version=IR_VERSION, producer_name="msllm")
